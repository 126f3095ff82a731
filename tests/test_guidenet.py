"""The learned networks (``kdeq.maths.guidenet``): the denoiser's guide, the inpainter's mean and the
segmenter's logit mean. Their pilots against an independent network, the kGLM starts equal to the
closed-form models, colour through the opponent basis, exact padded batches, the inpainter's
kernel-ridge correction of its pilot against a dense solve, the segmenter's equilibrium against its
own map, checkpoint checks, and the trainer's pilot phase and second phase. Every test makes its own
images."""

import json
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

from kdeq.cli import main as kdeq_main
from kdeq.maths.conv import conv
from kdeq.maths.filters import gaussian_taps, normalized_convolution
from kdeq.maths.guidenet import GuideNet, inpaint_pilot, opponent, pilot, segment_mean, upscale_pilot
from kdeq.maths.operators import BlurSubsample
from kdeq.maths.psf import bicubic_taps, gaussian_psf
from kdeq.models.checkpoint import Checkpoint, CheckpointError, ModelSpec, load_checkpoint, save_checkpoint
from kdeq.models.initialize import DEFAULT_SPECS, GROWN_SPECS, init_checkpoint, init_tensors
from kdeq.predictors.base import SolverOverride, pad_images
from kdeq.predictors.denoise import Denoiser
from kdeq.predictors.inpaint import Inpainter
from kdeq.predictors.segment import Segmenter, luminance
from kdeq.predictors.super_resolve import SuperResolver, degrade, upsample
from kdeq.registry import TASKS
from kdeq.train.config import TrainConfig
from kdeq.train.data import image_files, load_images, validation_set
from kdeq.train.loop import lr_at, train
from kdeq.train.model import TrainableModel, random_tensors
from kdeq.train.trainings import TRAININGS
from tests.helpers import binary_shapes, central_difference, denoise_batch, dense_operator
from tests.test_train import small_config, smooth_images

SMALL = GuideNet(depth=3, channels=8)


def grown_spec(net: GuideNet = SMALL, name: str = "den-net") -> ModelSpec:
    data = GROWN_SPECS[0].model_dump()
    data.update(name=name)
    data["architecture"]["net"] = net.model_dump()
    return ModelSpec.model_validate(data)


def trained_like(net: GuideNet, seed: int) -> dict[str, torch.Tensor]:
    """Tensors of a network that has moved off its start: every layer, ``a`` and ``β`` non-zero."""
    t = net.random_start(seed)
    gen = torch.Generator().manual_seed(seed + 1)
    for name in t:
        if name.endswith("_bias"):
            t[name] = 0.05 * torch.randn(t[name].shape, generator=gen)
    return t


def reference_network(h: torch.Tensor, t: dict, net: GuideNet) -> torch.Tensor:
    """``N_θ`` on its unshuffled input ``h`` by ``nn`` modules, shuffled back."""
    for i in range(net.depth):
        w = t[f"net_{i}_weight"]
        conv = nn.Conv2d(w.shape[1], w.shape[0], 3, padding=1)
        conv.weight.data.copy_(w)
        conv.bias.data.copy_(t[f"net_{i}_bias"])
        h = conv(h)
        h = torch.relu(h) if i < net.depth - 1 else h
    return nn.PixelShuffle(2)(h)


def reference_pilot(y: torch.Tensor, base: torch.Tensor, sigma: torch.Tensor, t: dict, net: GuideNet):
    """The pilot of one grey image ``(1, 1, H, W)`` with even sides, by ``nn`` modules."""
    h = nn.PixelUnshuffle(2)(y - y.mean())
    h = torch.cat([h, torch.full_like(h[:, :1], float(sigma))], dim=1)
    return base + t["net_skip"] * (y - base) + reference_network(h, t, net)


def test_pilot_matches_an_independent_network() -> None:
    t = trained_like(SMALL, 0)
    gen = torch.Generator().manual_seed(3)
    y, base = torch.rand(1, 1, 20, 26, generator=gen), torch.rand(1, 1, 20, 26, generator=gen)
    sigma = torch.tensor([0.1])
    got = pilot(y, base, sigma, t, SMALL)
    assert torch.allclose(got, reference_pilot(y, base, sigma, t, SMALL), atol=1e-6)


def test_colour_is_denoised_per_opponent_channel() -> None:
    q = opponent(3, torch.float64)
    assert torch.allclose(q @ q.T, torch.eye(3, dtype=torch.float64), atol=1e-12)
    assert torch.allclose(q[0], torch.full((3,), 3**-0.5, dtype=torch.float64))
    t = trained_like(SMALL, 1)
    gen = torch.Generator().manual_seed(4)
    y, base = torch.rand(1, 3, 16, 18, generator=gen), torch.rand(1, 3, 16, 18, generator=gen)
    sigma = torch.tensor([0.08])
    got = pilot(y, base, sigma, t, SMALL)
    qf = q.float()
    parts = [
        reference_pilot(
            torch.einsum("c,bchw->bhw", qf[d], y)[:, None],
            torch.einsum("c,bchw->bhw", qf[d], base)[:, None],
            sigma,
            t,
            SMALL,
        )
        for d in range(3)
    ]
    want = torch.einsum("dc,bdhw->bchw", qf, torch.cat(parts, dim=1))
    assert torch.allclose(got, want, atol=1e-5)


def test_odd_sizes_keep_their_shape_and_each_image_its_own_level() -> None:
    t = trained_like(SMALL, 2)
    y = torch.rand(2, 1, 15, 21)
    out = pilot(y, y, torch.tensor([0.05, 0.2]), t, SMALL)
    assert out.shape == y.shape
    alone = pilot(y[1:], y[1:], torch.tensor([0.2]), t, SMALL)
    assert torch.allclose(out[1:], alone, atol=1e-6)


@pytest.mark.parametrize("channels", [1, 3])
def test_the_kglm_start_is_the_closed_form_denoiser(tmp_path: Path, channels: int) -> None:
    grown, _ = init_checkpoint(grown_spec(), tmp_path)
    plain, _ = init_checkpoint(DEFAULT_SPECS[0], tmp_path)
    x = torch.rand(2, channels, 30, 34, generator=torch.Generator().manual_seed(5))
    a = Denoiser(load_checkpoint(grown)).predict(x, sigma=[15.0, 40.0])
    b = Denoiser(load_checkpoint(plain)).predict(x, sigma=[15.0, 40.0])
    assert torch.allclose(a.output, b.output, atol=1e-5)
    assert torch.equal(a.stats.iterations, b.stats.iterations)
    assert b.pilot is None and a.pilot is not None


def test_a_padded_batch_gives_each_image_its_own_result(tmp_path: Path) -> None:
    spec = grown_spec()
    t = {**init_tensors(spec), **trained_like(SMALL, 6)}
    t["net_mean_mix"] = torch.tensor([0.6])
    directory = tmp_path / "m" / "1"
    save_checkpoint(directory, spec, t)
    model = Denoiser(load_checkpoint(directory))
    gen = torch.Generator().manual_seed(7)
    images = [torch.rand(1, 28, 33, generator=gen), torch.rand(1, 35, 24, generator=gen)]
    batch, sizes = pad_images(images)
    together = model.predict(batch, sigma=[20.0, 35.0], sizes=sizes)
    for k, (im, (h, w)) in enumerate(zip(images, sizes, strict=True)):
        alone = model.predict(im[None], sigma=[20.0, 35.0][k])
        assert torch.allclose(together.output[k, :, :h, :w], alone.output[0], atol=1e-4)
        assert torch.allclose(together.pilot[k, :, :h, :w], alone.pilot[0], atol=1e-5)


def test_checkpoints_name_the_network_tensors(tmp_path: Path) -> None:
    spec = grown_spec()
    t = init_tensors(spec)
    assert set(SMALL.shapes()) <= set(t)
    for broken, why in (
        ({k: v for k, v in t.items() if k != "net_skip"}, "missing \\['net_skip'\\]"),
        ({**t, "net_0_weight": torch.zeros(8, 4, 3, 3)}, "net_0_weight"),
    ):
        with pytest.raises(CheckpointError, match=why):
            save_checkpoint(tmp_path / "bad" / "1", spec, broken)
    # a guided config without a network is written as before it could have one
    assert "net" not in json.loads(DEFAULT_SPECS[0].model_dump_json())["architecture"]


def test_random_and_kglm_starts_differ_where_they_should() -> None:
    start, rand = SMALL.kglm_start(), random_tensors(grown_spec(), 0)
    last = f"net_{SMALL.depth - 1}_weight"
    assert not start[last].any() and rand[last].abs().sum() > 0
    assert float(start["net_skip"]) == float(start["net_mean_mix"]) == 0.0
    assert 0 < float(rand["net_skip"]) < 1 and 0 < float(rand["net_mean_mix"]) < 1
    assert torch.equal(SMALL.kglm_start()["net_0_weight"], start["net_0_weight"])  # seeded


def three_epoch_run(tmp_path: Path, spec: ModelSpec, **changes: object) -> tuple[TrainConfig, Path]:
    """Train ``spec`` for two pilot epochs and one whole-model epoch on smooth images; returns the
    config and the checkpoint folder."""
    folders = (smooth_images(tmp_path / "train", 6, 40, 0), smooth_images(tmp_path / "val", 2, 32, 1))
    spec_file = tmp_path / "spec.json"
    spec_file.write_text(spec.model_dump_json())
    out = tmp_path / "models" / spec.name / "1"
    cfg = small_config(
        folders, out, spec=str(spec_file), epochs=3, pilot_epochs=2, samples_per_epoch=8, lr=1e-2, **changes
    )
    train(cfg)
    return cfg, out


def test_training_runs_a_pilot_phase_then_the_whole_model(tmp_path: Path) -> None:
    cfg, out = three_epoch_run(tmp_path, grown_spec())
    epochs = json.loads((out / "report" / "metrics.json").read_text())["epochs"]
    assert [e["train_iterations"] for e in epochs[1:3]] == [0.0, 0.0]  # the pilot alone: no solve
    assert epochs[3]["train_iterations"] > 0
    # the second phase's schedule starts again at the full step size
    assert epochs[3]["lr"] == pytest.approx(lr_at(cfg, 1, 2))
    assert epochs[2]["lr"] == pytest.approx(lr_at(cfg, 3, 4))
    saved = load_checkpoint(out)
    start = init_tensors(grown_spec())
    assert torch.equal(saved.tensors["spatial"], start["spatial"])  # the kernel stays at its start
    assert torch.equal(saved.tensors["smoothing"], start["smoothing"])
    assert saved.tensors[f"net_{SMALL.depth - 1}_weight"].abs().sum() > 0
    assert saved.config.architecture.net == SMALL


def test_a_resumed_guided_run_equals_an_uninterrupted_one(tmp_path: Path) -> None:
    # frozen tensors (no Adam state) and a second Adam group for the scalar factors
    train_dir = smooth_images(tmp_path / "train", 4, 32, 0)
    val_dir = smooth_images(tmp_path / "val", 1, 24, 1)
    spec_file = tmp_path / "spec.json"
    spec_file.write_text(grown_spec().model_dump_json())

    def cfg(out: Path, **changes: object) -> TrainConfig:
        return small_config(
            (train_dir, val_dir),
            out,
            spec=str(spec_file),
            samples_per_epoch=4,
            batch_size=2,
            patch_size=16,
            lr=1e-2,
            **changes,
        )

    whole, parts = tmp_path / "a" / "den-net" / "1", tmp_path / "b" / "den-net" / "1"
    train(cfg(whole))
    train(cfg(parts, stop_after=1))
    train(cfg(parts, resume=True))
    a = (whole / "train-state" / "state.safetensors").read_bytes()
    assert a == (parts / "train-state" / "state.safetensors").read_bytes()


def test_calibrate_writes_the_best_bandwidth_by_validation(tmp_path: Path) -> None:
    val_dir = smooth_images(tmp_path / "val", 2, 32, 1)
    spec = grown_spec()
    t = {**init_tensors(spec), **trained_like(SMALL, 8)}
    source = tmp_path / "trained" / "den-net" / "1"
    save_checkpoint(source, spec, t)
    (source / "report").mkdir()
    (source / "report" / "metrics.json").write_text("{}")
    out = tmp_path / "models" / "den-net" / "1"
    factors = (0.25, 1.0, 4.0)
    assert (
        kdeq_main(
            [
                "calibrate",
                str(source),
                "--out",
                str(out),
                "--val",
                str(val_dir),
                "--factors",
                ",".join(map(str, factors)),
                "--levels",
                "20,40",
            ]
        )
        == 0
    )
    report = json.loads((out / "report" / "calibration.json").read_text())
    # each factor's score is the mean PSNR of that bandwidth, recomputed here independently
    images = load_images(image_files([val_dir]), 1)
    denoise = TRAININGS["denoise"]
    examples = validation_set(images, denoise, denoise.knobs(), (20.0, 40.0), 0)
    base = load_checkpoint(source)
    for f in factors:
        data = base.config.model_dump()
        data["architecture"]["kernel"]["bandwidth"] *= f
        cfg = type(base.config).model_validate(data)
        model = Denoiser(Checkpoint(cfg, base.tensors, source))
        for level in (20.0, 40.0):
            got = [
                float(
                    -10
                    * torch.log10(
                        (model.predict(e["noisy"][None], sigma=level).output.clamp(0, 1)[0] - e["target"])
                        .square()
                        .mean()
                    )
                )
                for e in examples
                if float(e["level"]) == level
            ]
            assert report["psnr"][f"{f:g}"][f"{level:g}"] == pytest.approx(sum(got) / len(got), abs=1e-4)
    best = max(factors, key=lambda f: sum(report["psnr"][f"{f:g}"].values()))
    saved = load_checkpoint(out)
    assert report["chosen"] == best
    assert saved.config.architecture.kernel.bandwidth == pytest.approx(
        base.config.architecture.kernel.bandwidth * best
    )
    assert saved.config.weights_sha256 == base.config.weights_sha256
    assert (out / "report" / "metrics.json").is_file()
    assert (
        kdeq_main(["calibrate", str(source), "--out", str(out), "--val", str(val_dir), "--factors", "1"]) == 2
    )


def test_gradients_of_the_mean_mixing_and_lambda_match_finite_differences() -> None:
    """β and λ leave the guide alone, so their implicit gradients through the guided solve are the
    loss's whole derivative: checked against central differences."""
    spec = grown_spec()
    t = {**init_tensors(spec), **trained_like(SMALL, 9)}
    t["net_mean_mix"] = torch.tensor([0.4])
    model = TrainableModel(spec, t, torch.device("cpu"))
    gen = torch.Generator().manual_seed(10)
    clean, batch = denoise_batch(gen, 16, 18)
    tight = SolverOverride(tol=1e-7, max_iter=500)
    params = [model.raw["net_mean_mix"], model.log_lam]

    def loss() -> torch.Tensor:
        out, _, _, _ = model(batch, tight)
        return (out - clean).square().mean()

    loss().backward()
    for p in params:
        numeric = central_difference(loss, [(p, torch.ones_like(p))])
        assert p.grad.sum().item() == pytest.approx(numeric, rel=2e-2)


# --- the inpainter's learned mean ----------------------------------------------------------------

SMALL_MASK = GuideNet(depth=3, channels=8, condition="mask")


def inpaint_spec(net: GuideNet = SMALL_MASK, name: str = "inp-net") -> ModelSpec:
    data = GROWN_SPECS[1].model_dump()
    data.update(name=name)
    data["architecture"]["net"] = net.model_dump()
    return ModelSpec.model_validate(data)


def reference_inpaint_pilot(y: torch.Tensor, observed: torch.Tensor, base: torch.Tensor, t: dict):
    """The inpainter's pilot of one grey image ``(1, 1, H, W)`` with even sides, by ``nn`` modules."""
    unshuffle = nn.PixelUnshuffle(2)
    level = (y * observed).sum() / observed.sum()
    h = torch.cat([unshuffle(observed * (y - level)), unshuffle(observed)], dim=1)
    return base + reference_network(h, t, SMALL_MASK)


def test_inpaint_pilot_matches_an_independent_network() -> None:
    t = trained_like(SMALL_MASK, 11)
    gen = torch.Generator().manual_seed(12)
    y, base = torch.rand(1, 1, 18, 22, generator=gen), torch.rand(1, 1, 18, 22, generator=gen)
    observed = (torch.rand(1, 1, 18, 22, generator=gen) < 0.5).float()
    got = inpaint_pilot(y * observed, observed, base, t, SMALL_MASK)
    assert torch.allclose(got, reference_inpaint_pilot(y * observed, observed, base, t), atol=1e-6)
    # colour: per opponent channel, the mask shared
    q = opponent(3)
    yc, bc = torch.rand(1, 3, 18, 22, generator=gen), torch.rand(1, 3, 18, 22, generator=gen)
    got = inpaint_pilot(yc * observed, observed, bc, t, SMALL_MASK)
    parts = [
        reference_inpaint_pilot(
            torch.einsum("c,bchw->bhw", q[d], yc * observed)[:, None],
            observed,
            torch.einsum("c,bchw->bhw", q[d], bc)[:, None],
            t,
        )
        for d in range(3)
    ]
    assert torch.allclose(got, torch.einsum("dc,bdhw->bchw", q, torch.cat(parts, dim=1)), atol=1e-5)


@pytest.mark.parametrize("channels", [1, 3])
def test_the_inpainters_kglm_start_is_the_closed_form_inpainter(tmp_path: Path, channels: int) -> None:
    grown, _ = init_checkpoint(inpaint_spec(), tmp_path)
    plain, _ = init_checkpoint(DEFAULT_SPECS[2], tmp_path)
    gen = torch.Generator().manual_seed(13)
    x = torch.rand(2, channels, 26, 31, generator=gen)
    missing = torch.rand(2, 1, 26, 31, generator=gen) < 0.6
    a = Inpainter(load_checkpoint(grown)).predict(x, missing)
    b = Inpainter(load_checkpoint(plain)).predict(x, missing)
    # colour's opponent round trip rounds the mean in float32, and the solve at λ = 0.01 amplifies it
    assert torch.allclose(a.output, b.output, atol=1e-5 if channels == 1 else 5e-4)
    assert torch.equal(a.stats.iterations, b.stats.iterations)
    assert b.pilot is None and a.pilot is not None


def test_the_inpainter_corrects_its_pilot_by_kernel_ridge_on_the_observed_pixels(tmp_path: Path) -> None:
    """At a missing pixel the output is ``p + K_{·O}(K_OO + λI)⁻¹(y_O − p_O)`` (a dense solve here)."""
    spec = inpaint_spec()
    t = {**init_tensors(spec), **trained_like(SMALL_MASK, 14)}
    directory = tmp_path / "m" / "1"
    save_checkpoint(directory, spec, t)
    model = Inpainter(load_checkpoint(directory))
    gen = torch.Generator().manual_seed(15)
    height, width = 14, 16
    x = torch.rand(1, 1, height, width, generator=gen)
    missing = torch.rand(1, 1, height, width, generator=gen) < 0.5
    got = model.predict(x, missing, SolverOverride(tol=5e-5, max_iter=1000))
    observed = (~missing).float()
    base = normalized_convolution(x * observed, observed, gaussian_taps(spec.mean_smoothing))
    p = inpaint_pilot(x * observed, observed, base, t, SMALL_MASK).double().flatten()
    obs = ~missing.flatten()
    assert torch.allclose(got.pilot.double().flatten(), p, atol=1e-6)
    bank = t["w1"].double()
    k = dense_operator(
        lambda v: torch.nn.functional.conv2d(v, bank, padding=bank.shape[-1] // 2), (1, height, width)
    )
    lam = spec.lam.value
    coef = torch.linalg.solve(
        k[obs][:, obs] + lam * torch.eye(int(obs.sum()), dtype=torch.float64),
        x.double().flatten()[obs] - p[obs],
    )
    want = torch.where(obs, x.double().flatten(), p + k[:, obs] @ coef)
    assert torch.allclose(got.output.double().flatten(), want, atol=2e-4)  # float32 CG at λ = 0.01
    assert got.stats.converged.all()
    assert not torch.allclose(p, want, atol=1e-2)  # the correction acts


def test_a_padded_inpaint_batch_gives_each_image_its_own_result(tmp_path: Path) -> None:
    spec = inpaint_spec()
    directory = tmp_path / "m" / "1"
    save_checkpoint(directory, spec, {**init_tensors(spec), **trained_like(SMALL_MASK, 16)})
    model = Inpainter(load_checkpoint(directory))
    gen = torch.Generator().manual_seed(17)
    images = [torch.rand(1, 21, 30, generator=gen), torch.rand(1, 27, 19, generator=gen)]
    masks = [torch.rand(1, *im.shape[-2:], generator=gen) < 0.5 for im in images]
    batch, sizes = pad_images(images)
    mask_batch = torch.ones(2, 1, *batch.shape[-2:], dtype=torch.bool)
    for k, (h, w) in enumerate(sizes):
        mask_batch[k, :, :h, :w] = masks[k]
    tight = SolverOverride(tol=5e-5, max_iter=1000)
    together = model.predict(batch, mask_batch, tight, sizes=sizes)
    for k, (h, w) in enumerate(sizes):
        alone = model.predict(images[k][None], masks[k][None], tight)
        assert torch.allclose(together.output[k, :, :h, :w], alone.output[0], atol=2e-4)
        assert torch.allclose(together.pilot[k, :, :h, :w], alone.pilot[0], atol=1e-5)


def test_a_network_must_fit_its_model() -> None:
    for spec, net in (
        (GROWN_SPECS[0], SMALL_MASK),  # a guided denoiser's guide is conditioned on σ
        (GROWN_SPECS[1], SMALL),  # an inpainter's mean on the mask
        (DEFAULT_SPECS[3], SMALL_MASK),  # the segmenter's on the image
        (DEFAULT_SPECS[0], SMALL_IMAGE),  # a guided denoiser's is its guide
    ):
        data = spec.model_dump()
        data["architecture"]["net"] = net.model_dump()
        with pytest.raises(ValueError, match="network"):
            ModelSpec.model_validate(data)
    assert "net_skip" not in SMALL_MASK.shapes() and SMALL_MASK.shapes()["net_0_weight"][1] == 8


def network_bias_gradient(
    model: TrainableModel, batch: dict, solver: SolverOverride, net: GuideNet, k: int
) -> tuple[float, float]:
    """The derivative of ``mean((f − ½)²)`` in the ``k``-th bias of the network's last layer, by
    autograd through the solve (its adjoint solve must converge) and by central differences."""
    bias = model.raw[f"net_{net.depth - 1}_bias"]

    def loss() -> torch.Tensor:
        out, _, converged, _ = model(batch, solver)
        assert converged.all()
        return (out - 0.5).square().mean()

    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # the adjoint solve converges too
        loss().backward()
    one = torch.zeros_like(bias)
    one[k] = 1.0
    return bias.grad[k].item(), central_difference(loss, [(bias, one)])


def test_the_inpainters_network_gradient_through_the_solve_matches_finite_differences() -> None:
    # λ = 0.1 instead of the shipped 0.01: float32 CG then converges to 1e-5, forward and adjoint
    data = inpaint_spec().model_dump()
    data["lam"]["value"] = 0.1
    spec = ModelSpec.model_validate(data)
    model = TrainableModel(spec, {**init_tensors(spec), **trained_like(SMALL_MASK, 18)}, torch.device("cpu"))
    gen = torch.Generator().manual_seed(19)
    clean = torch.rand(2, 1, 16, 18, generator=gen)
    batch = {"image": clean, "missing": torch.rand(2, 1, 16, 18, generator=gen) < 0.5}
    got, want = network_bias_gradient(model, batch, SolverOverride(tol=1e-5, max_iter=1000), SMALL_MASK, 1)
    assert got == pytest.approx(want, rel=2e-2)


def test_training_an_inpainter_runs_its_pilot_phase_then_the_whole_model(tmp_path: Path) -> None:
    _, out = three_epoch_run(
        tmp_path, inpaint_spec(), task="inpaint", val_levels=(), mask_kinds=("pixels", "strokes")
    )
    epochs = json.loads((out / "report" / "metrics.json").read_text())["epochs"]
    assert [e["train_iterations"] for e in epochs[1:3]] == [0.0, 0.0]
    assert epochs[3]["train_iterations"] > 0
    saved = load_checkpoint(out)
    assert saved.tensors[f"net_{SMALL_MASK.depth - 1}_weight"].abs().sum() > 0


# --- the segmenter's learned mean ----------------------------------------------------------------

SMALL_IMAGE = GuideNet(depth=3, channels=8, condition="image")


def segment_spec(net: GuideNet = SMALL_IMAGE) -> ModelSpec:
    data = GROWN_SPECS[2].model_dump()
    data.update(name="seg-net")
    data["architecture"]["net"] = net.model_dump()
    return ModelSpec.model_validate(data)


def noisy_shapes(n: int, size: int, seed: int) -> torch.Tensor:
    """``n`` binary images of shapes ``(n, 1, size, size)`` with ``σ = 0.6`` noise."""
    clean = binary_shapes(n, size, seed).float()
    return clean + 0.6 * torch.randn(clean.shape, generator=torch.Generator().manual_seed(seed))


def test_segment_mean_matches_an_independent_network() -> None:
    t = trained_like(SMALL_IMAGE, 21)
    gen = torch.Generator().manual_seed(22)
    grey = torch.rand(2, 1, 18, 22, generator=gen)
    tau = torch.tensor([0.4, 0.6])
    labels = (grey > tau.reshape(-1, 1, 1, 1)).float()
    unshuffle = nn.PixelUnshuffle(2)
    h = torch.cat([unshuffle(grey - tau.reshape(-1, 1, 1, 1)), unshuffle(labels)], dim=1)
    got = segment_mean(grey, tau, labels, t, SMALL_IMAGE)
    assert torch.allclose(got, reference_network(h, t, SMALL_IMAGE), atol=1e-6)


def test_the_segmenters_kglm_start_is_the_closed_form_segmenter(tmp_path: Path) -> None:
    grown, _ = init_checkpoint(segment_spec(), tmp_path)
    plain, _ = init_checkpoint(DEFAULT_SPECS[3], tmp_path)
    noisy = noisy_shapes(2, 40, 23)
    a = Segmenter(load_checkpoint(grown)).predict(noisy)
    b = Segmenter(load_checkpoint(plain)).predict(noisy)
    # the same fixed point, reached from different starts (b's is the linearised equilibrium)
    assert torch.allclose(a.output, b.output, atol=1e-4)
    assert torch.equal(a.mask, b.mask)
    assert torch.equal(a.pilot, torch.full_like(a.pilot, 0.5)) and b.pilot is None


def test_the_segmenters_output_is_the_equilibrium_around_its_learned_mean(tmp_path: Path) -> None:
    """``z = logistic((K/λ)(t − z) + m)`` with ``m = N_θ(x − τ, t)``, checked by the map itself with an
    independent convolution, and the learned mean changes the mask."""
    spec = segment_spec()
    t = {**init_tensors(spec), **trained_like(SMALL_IMAGE, 24)}
    directory = tmp_path / "m" / "1"
    save_checkpoint(directory, spec, t)
    model = Segmenter(load_checkpoint(directory))
    noisy = noisy_shapes(2, 33, 25)  # odd: the unshuffle pads a row and a column
    got = model.predict(noisy, solver=SolverOverride(tol=1e-6, max_iter=500))
    assert got.stats.converged.all()
    grey = luminance(noisy)
    smooth = torch.nn.functional.conv2d(
        torch.nn.functional.pad(grey, (6,) * 4, mode="reflect"),
        torch.outer(*(2 * (gaussian_taps(spec.presmooth),)))[None, None],
    )
    labels = (smooth > got.threshold.reshape(-1, 1, 1, 1)).float()
    m = segment_mean(grey, got.threshold, labels, t, SMALL_IMAGE)
    assert torch.allclose(got.pilot, torch.sigmoid(m), atol=1e-6)
    bank = t["w1"]
    kz = torch.nn.functional.conv2d(labels - got.output, bank, padding=bank.shape[-1] // 2)
    assert torch.allclose(got.output, torch.sigmoid(kz / spec.lam.value + m), atol=1e-4)
    plain = Segmenter(load_checkpoint(init_checkpoint(DEFAULT_SPECS[3], tmp_path)[0])).predict(noisy)
    assert not torch.equal(plain.mask, got.mask)


def test_training_a_segmenter_runs_its_pilot_phase_then_the_whole_model(tmp_path: Path) -> None:
    _, out = three_epoch_run(tmp_path, segment_spec(), task="segment", val_levels=(), sigma=(0.0, 150.0))
    epochs = json.loads((out / "report" / "metrics.json").read_text())["epochs"]
    assert [e["train_iterations"] for e in epochs[1:3]] == [0.0, 0.0]
    assert epochs[3]["train_iterations"] > 0
    saved = load_checkpoint(out)
    assert saved.tensors[f"net_{SMALL_IMAGE.depth - 1}_weight"].abs().sum() > 0
    assert saved.config.architecture.net == SMALL_IMAGE


# --- the deblurrer's and the super-resolver's learned means -------------------------------------------

SMALL_SCALE = GuideNet(depth=3, channels=8, condition="scale")
GROWN = {s.name: s for s in GROWN_SPECS}


def restore_spec(name: str, net: GuideNet) -> ModelSpec:
    data = GROWN[name].model_dump()
    data.update(name=name.replace("-kglm-net", "-net"))
    data["architecture"]["net"] = net.model_dump()
    return ModelSpec.model_validate(data)


def test_upscale_pilot_matches_an_independent_network() -> None:
    t = trained_like(SMALL_SCALE, 30)
    u = torch.rand(2, 1, 12, 14, generator=torch.Generator().manual_seed(31))
    got = upscale_pilot(u, 3, t, SMALL_SCALE)
    for b in range(2):
        v = u[b : b + 1]
        h = nn.PixelUnshuffle(2)(v - v.mean())
        h = torch.cat([h, torch.full_like(h[:, :1], 1 / 3)], dim=1)
        assert torch.allclose(got[b : b + 1], v + reference_network(h, t, SMALL_SCALE), atol=1e-6)


@pytest.mark.parametrize("channels", [1, 3])
@pytest.mark.parametrize(
    ("name", "net"), [("deblur-kglm-net", SMALL), ("super-resolve-kglm-net", SMALL_SCALE)]
)
def test_the_grown_restorers_kglm_starts_are_the_closed_form_defaults(
    tmp_path: Path, name: str, net: GuideNet, channels: int
) -> None:
    """At the kGLM start the deblurrer with a network is ``deblur-kglm:2`` and the super-resolver
    with one ``super-resolve-kglm:1``; both report the network's pilot."""
    grown, _ = init_checkpoint(restore_spec(name, net), tmp_path)
    defaults = {s.name: s for s in DEFAULT_SPECS}  # the latest version of each name
    plain, _ = init_checkpoint(defaults[name.removesuffix("-net")], tmp_path)
    model_a = TASKS[GROWN[name].task].predictor(load_checkpoint(grown))
    model_b = TASKS[GROWN[name].task].predictor(load_checkpoint(plain))
    x = torch.rand(2, channels, 20, 22, generator=torch.Generator().manual_seed(32))
    args = (gaussian_psf(1.2), 3.0) if name.startswith("deblur") else (2,)
    a, b = model_a.predict(x, *args), model_b.predict(x, *args)
    assert torch.allclose(a.output, b.output, atol=1e-5 if channels == 1 else 5e-4)
    # colour's opponent round trip moves the guide by float32 roundings, and CG's count by one
    slack = 0 if channels == 1 else 1
    assert (a.stats.iterations - b.stats.iterations).abs().max() <= slack
    assert a.pilot is not None and a.pilot.shape == a.output.shape
    assert torch.allclose(model_a.pilot_only(x, *args), a.pilot, atol=1e-6)


def test_the_super_resolver_corrects_its_pilot_by_kernel_ridge_through_the_degradation(
    tmp_path: Path,
) -> None:
    """``f = p + K Aᵀ(A K Aᵀ + λI)⁻¹(y − A p)`` with ``A`` the bicubic degradation, on dense matrices."""
    spec = restore_spec("super-resolve-kglm-net", SMALL_SCALE)
    t = {**init_tensors(spec), **trained_like(SMALL_SCALE, 33)}
    directory = tmp_path / "m" / "1"
    save_checkpoint(directory, spec, t)
    model = SuperResolver(load_checkpoint(directory))
    y = torch.rand(1, 1, 7, 8, generator=torch.Generator().manual_seed(34))
    got = model.predict(y, 2, SolverOverride(tol=1e-6, max_iter=2000))
    assert got.stats.converged.all()
    p = upscale_pilot(upsample(y, 2), 2, t, SMALL_SCALE).double().flatten()
    assert torch.allclose(got.pilot.double().flatten(), p, atol=1e-6)
    taps, offset = bicubic_taps(2, dtype=torch.float64)
    ad = BlurSubsample(taps, offset, 2, "symmetric").dense(14, 16)
    bank = t["w1"].double()
    kd = dense_operator(lambda v: conv(v, bank, spec.architecture.padding), (1, 14, 16))
    gram = ad @ kd @ ad.T + spec.lam.value * torch.eye(ad.shape[0], dtype=torch.float64)
    want = p + kd @ ad.T @ torch.linalg.solve(gram, y.double().flatten() - ad @ p)
    assert torch.allclose(got.output.double().flatten(), want, atol=1e-4)
    assert not torch.allclose(p, want, atol=1e-2)  # the correction acts


def test_the_super_resolvers_network_gradient_through_the_solve_matches_finite_differences() -> None:
    # λ = 0.05 instead of the shipped 0.001: float32 CG then converges to 1e-5, forward and adjoint
    data = restore_spec("super-resolve-kglm-net", SMALL_SCALE).model_dump()
    data["lam"]["value"] = 0.05
    spec = ModelSpec.model_validate(data)
    model = TrainableModel(spec, {**init_tensors(spec), **trained_like(SMALL_SCALE, 35)}, torch.device("cpu"))
    clean = torch.rand(2, 1, 16, 18, generator=torch.Generator().manual_seed(36))
    batch = {"low": degrade(clean, 2), "scale": torch.tensor([2, 2]), "target": clean}
    got, want = network_bias_gradient(model, batch, SolverOverride(tol=1e-5, max_iter=2000), SMALL_SCALE, 2)
    assert got == pytest.approx(want, rel=1e-2)


@pytest.mark.parametrize(
    ("name", "net"), [("deblur-kglm-net", SMALL), ("super-resolve-kglm-net", SMALL_SCALE)]
)
def test_training_a_grown_restorer_runs_its_pilot_phase_then_the_whole_model(
    tmp_path: Path, name: str, net: GuideNet
) -> None:
    spec = restore_spec(name, net)
    changes = {"psfs": ("gaussian:1", "motion:5")} if spec.task == "deblur" else {"scales": (2, 4)}
    _, out = three_epoch_run(
        tmp_path, spec, task=spec.task, sigma=(1.0, 10.0), val_levels=(), patch_size=16, **changes
    )
    epochs = json.loads((out / "report" / "metrics.json").read_text())["epochs"]
    assert [e["train_iterations"] for e in epochs[1:3]] == [0.0, 0.0]
    assert epochs[3]["train_iterations"] > 0
    assert {"val_psnr@0", "val_psnr@1"} <= set(epochs[3]) or {"val_psnr@2", "val_psnr@4"} <= set(epochs[3])
    saved = load_checkpoint(out)
    assert saved.tensors[f"net_{net.depth - 1}_weight"].abs().sum() > 0


def test_a_batch_cut_into_calls_within_the_cpu_budget_gives_the_one_call_s_pilot(monkeypatch) -> None:
    """``N_θ`` runs a CPU batch in calls of at most ``CPU_CALL_BYTES`` of activations (its samples
    are independent): a colour pilot, three opponent channels, cut into calls of one sample equals the
    one call's, and so does its gradient."""
    import kdeq.maths.guidenet as guidenet

    net = GuideNet(depth=4, channels=8)
    tensors = {k: v.requires_grad_() for k, v in net.random_start(seed=3).items()}
    y = torch.rand(2, 3, 20, 22)
    base, sigma = y.flip(-1), torch.tensor([0.1, 0.2])

    def run() -> tuple[torch.Tensor, torch.Tensor]:
        p = pilot(y, base, sigma, tensors, net)
        (grad,) = torch.autograd.grad(p.square().sum(), tensors["net_1_weight"])
        return p.detach(), grad

    whole = run()
    calls: list[int] = []
    layers = guidenet._layers
    monkeypatch.setattr(guidenet, "_layers", lambda h, *a: calls.append(h.shape[0]) or layers(h, *a))
    monkeypatch.setattr(guidenet, "CPU_CALL_BYTES", 8 * 10 * 11 * 4)  # one sample's activations
    cut = run()
    assert calls == [1] * 6
    torch.testing.assert_close(cut[0], whole[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(cut[1], whole[1], rtol=1e-4, atol=1e-5)
