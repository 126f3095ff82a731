"""The denoiser's non-local refinement (``kdeq.maths.refine``): the non-local means of the guided kernel's
patch distances against a dense float64 computation from explicit patches, the refined pilot against
the same steps written out with ``nn`` modules, a zero last layer as the model refined from, and the
option's config, task and training rules."""

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from pydantic import ValidationError
from torch import nn

from kdeq.cli import main as kdeq_main
from kdeq.maths.adaptive import GuidedKernel, GuidedOperator
from kdeq.maths.filters import mirror_pad
from kdeq.maths.guidenet import REFINE, REFINE_COLOUR, GuideNet, Refine
from kdeq.maths.kernels import Kernel
from kdeq.maths.refine import refined_pilot
from kdeq.models.checkpoint import Checkpoint, ModelSpec, load_checkpoint
from kdeq.models.repository import default_models_dir, find_model, load_predictor
from kdeq.predictors.denoise import Denoiser
from kdeq.registry import TASKS
from kdeq.train.model import TrainableModel, start_tensors
from tests.test_guidenet import grown_spec
from tests.test_tiling import noisy, solve
from tests.test_train import smooth_images

SPATIAL = GuidedKernel(spatial=Kernel(profile="se", lengthscale=2.0, radius=3), patch_radius=1)


def dense_nonlocal(
    guide: torch.Tensor,
    v: torch.Tensor,
    taps: torch.Tensor,
    p: int,
    h2: float,
    power: int,
    patches: bool = False,
):
    """``(ν, log(1 + Σu/c))`` for one guide ``(c_g, H, W)`` and image ``(c, H, W)`` in float64 from each
    pixel's explicit mirrored patch: ``u(x, x') = exp(−κ‖g(x) − g(x')‖²/2h²)`` for ``x' ≠ x`` inside the
    image within the taps' window where the tap is non-zero, ``c(x) = max u``, ``Z(x) = c(x) + Σ u``.
    With ``patches``, every group ``z`` (its members ``z'``, itself included with weight ``c(z)``, each
    weighing ``u(z, z')/√(Z(z)Z(z'))``) estimates each pixel ``z + d`` of its patch by ``v(z' + d)``,
    and a pixel averages all such estimates, weighed."""
    _, height, width = guide.shape
    r = taps.shape[0] // 2
    padded = mirror_pad(guide[None].double(), p)[0]
    patch = {
        (i, j): padded[:, i : i + 2 * p + 1, j : j + 2 * p + 1].reshape(-1)
        for i in range(height)
        for j in range(width)
    }

    def inside(i: int, j: int) -> bool:
        return 0 <= i < height and 0 <= j < width

    matches = {z: {} for z in patch}
    for (i, j), g in patch.items():
        for a in range(-r, r + 1):
            for b in range(-r, r + 1):
                k, m = i + a, j + b
                if (a, b) == (0, 0) or not inside(k, m) or taps[r + a, r + b] == 0:
                    continue
                matches[i, j][k, m] = math.exp(-power * float((g - patch[k, m]).square().sum()) / (2 * h2))
    best = {z: max(u.values()) or 1.0 for z, u in matches.items()}
    norm = {z: best[z] + sum(u.values()) for z, u in matches.items()}
    nu, spread = torch.zeros(v.shape, dtype=torch.float64), torch.zeros(1, height, width, dtype=torch.float64)
    for (i, j), u in matches.items():
        spread[0, i, j] = math.log1p(sum(u.values()) / best[i, j])
        nu[:, i, j] = best[i, j] * v[:, i, j].double() + sum(
            w * v[:, k, m].double() for (k, m), w in u.items()
        )
        nu[:, i, j] /= norm[i, j]
    if not patches:
        return nu, spread
    num, den = torch.zeros(v.shape, dtype=torch.float64), torch.zeros(height, width, dtype=torch.float64)
    for z, u in matches.items():
        group = {z: best[z] / norm[z], **{m: w / math.sqrt(norm[z] * norm[m]) for m, w in u.items()}}
        for (k, m), w in group.items():
            for a in range(-p, p + 1):
                for b in range(-p, p + 1):
                    if inside(z[0] + a, z[1] + b) and inside(k + a, m + b):
                        num[:, z[0] + a, z[1] + b] += w * v[:, k + a, m + b].double()
                        den[z[0] + a, z[1] + b] += w
    return num / den, spread


@pytest.mark.parametrize(
    ("channels", "power", "budget", "patches"),
    [
        (1, 3, 1 << 30, False),
        (3, 2, 1 << 30, False),
        (1, 3, 1, False),
        (1, 3, 1 << 30, True),
        (3, 4, 1, True),
        (1, 3, 1 << 30, "holes"),
    ],
)
@pytest.mark.usefixtures("guided_backend")
def test_nonlocal_means_match_a_dense_computation_from_explicit_patches(
    channels, power, budget, patches
) -> None:
    """Kept weights, and weights made again a part at a time (a one-byte budget), both, pixel-wise and
    patch-aggregated, and a window with zero taps between the offsets (``holes``: runs of maps split
    around them); the weights are computed in float32 and divided by their taps, hence the
    tolerance."""
    gen = torch.Generator().manual_seed(3)
    guide = torch.rand(2, channels, 9, 11, generator=gen)
    v = torch.rand(2, 2, 9, 11, generator=gen)
    taps = SPATIAL.spatial.filter()
    if patches == "holes":
        taps = taps.clone()
        taps[::2, 1::2] = 0  # point-symmetric: (a, b) and (−a, −b) alike
        patches = True
        assert taps[3, 3] != 0 and (taps == 0).sum() == 12
    h2 = torch.tensor([0.4, 0.9])
    op = GuidedOperator(guide, taps, SPATIAL.patch_radius, h2, normalize=True, budget=budget)
    assert (op.parts > 1) == (budget == 1)
    nu, spread = op.nonlocal_mean(v, power, patches)
    for k in range(2):
        want_nu, want_spread = dense_nonlocal(
            guide[k], v[k], taps, SPATIAL.patch_radius, float(h2[k]), power, patches
        )
        assert torch.allclose(nu[k].double(), want_nu, atol=2e-5)
        assert torch.allclose(spread[k].double(), want_spread, atol=2e-5)
    # the mass is bounded by the window: c is the sum's largest term
    assert float(spread.max()) <= math.log(taps.numel()) + 1e-6
    if patches:  # the aggregation is not the pixel-wise mean
        assert (nu - op.nonlocal_mean(v, power)[0]).abs().amax() > 1e-3


@pytest.mark.usefixtures("guided_backend")
def test_weak_matches_leave_the_patch_mean_finite() -> None:
    """``u^κ`` of weak matches is subnormal, and so is ``Z`` where a pixel has only those: the patch
    mean stays finite (``c/Z``, never ``c·(Z^{-1/2})²``, which overflows there) and within ``v``'s range."""
    gen = torch.Generator().manual_seed(4)
    guide = torch.rand(1, 1, 12, 12, generator=gen)
    v = torch.rand(1, 1, 12, 12, generator=gen)
    op = GuidedOperator(guide, SPATIAL.spatial.filter(), 1, torch.tensor([3e-3]), True)
    nu, _ = op.nonlocal_mean(v, 3, patches=True)
    assert torch.isfinite(nu).all()
    assert float(nu.min()) >= float(v.min()) - 1e-6 and float(nu.max()) <= float(v.max()) + 1e-6


@pytest.mark.parametrize("patches", [False, True])
@pytest.mark.usefixtures("guided_backend")
def test_a_padded_batch_gives_each_image_its_own_nonlocal_means(patches) -> None:
    gen = torch.Generator().manual_seed(5)
    small, large = torch.rand(1, 1, 7, 8, generator=gen), torch.rand(1, 1, 10, 12, generator=gen)
    batch = torch.zeros(2, 1, 10, 12)
    batch[0, :, :7, :8], batch[1] = small[0], large[0]
    taps, h2 = SPATIAL.spatial.filter(), torch.tensor([0.5, 0.5])
    op = GuidedOperator(batch, taps, 1, h2, True, sizes=[(7, 8), (10, 12)])
    nu, spread = op.nonlocal_mean(batch, 3, patches)
    assert torch.equal(nu[0, :, 7:], batch[0, :, 7:]) and torch.equal(nu[0, :, :, 8:], batch[0, :, :, 8:])
    for k, image in enumerate((small, large)):
        alone = GuidedOperator(image, taps, 1, h2[:1], True).nonlocal_mean(image, 3, patches)
        h, w = image.shape[-2:]
        assert torch.allclose(nu[k : k + 1, :, :h, :w], alone[0], atol=1e-6)
        assert torch.allclose(spread[k : k + 1, :, :h, :w], alone[1], atol=1e-6)


@pytest.mark.parametrize("patches", [False, True])
@pytest.mark.usefixtures("guided_backend")
def test_the_nonlocal_mean_reads_as_far_as_the_denoisers_reach_says(patches) -> None:
    """``ν(q)`` reads the image within ``R`` of ``q`` and the guide within ``p + R`` (pixel-wise) or
    ``2(p + R)`` (by patch), the distances ``Denoiser.reach`` adds: a change one pixel further leaves
    ``ν(q)`` bit for bit as it was, a change at that distance moves it."""
    gen = torch.Generator().manual_seed(8)
    guide, v = torch.rand(1, 1, 40, 40, generator=gen), torch.rand(1, 1, 40, 40, generator=gen)
    taps, h2, p = SPATIAL.spatial.filter(), torch.tensor([0.5]), SPATIAL.patch_radius
    r = taps.shape[0] // 2
    q = 20

    def at(g: torch.Tensor, x: torch.Tensor) -> float:
        return float(GuidedOperator(g, taps, p, h2, True).nonlocal_mean(x, 3, patches)[0][0, 0, q, q])

    before = at(guide, v)
    for reach, image_is_guide in (((p + r) * (2 if patches else 1), True), (r, False)):
        for distance, moves in ((reach + 1, False), (reach, True)):
            changed = (guide if image_is_guide else v).clone()
            changed[..., q + distance, q - 1 : q + 2] += 0.5
            after = at(changed, v) if image_is_guide else at(guide, changed)
            assert (after != before) == moves, (reach, image_is_guide, distance)


def reference_refined(op, y, p, sigma, t, refine: Refine) -> torch.Tensor:
    """``p + a ⊙ (ν − p)`` with ``H_φ`` by ``nn`` modules; for colour each opponent channel's, the basis
    written out as a 1×1 convolution."""
    nu, spread = op.nonlocal_mean(y, refine.sharpness, refine.aggregate == "patch")
    s = sigma.reshape(-1, 1, 1, 1)
    colour = y.shape[1] == 3
    rotate = nn.Conv2d(3, 3, 1, bias=False)
    if colour:
        rows = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, -1.0], [1.0, -2.0, 1.0]])
        rotate.weight.data = (rows / rows.norm(dim=1, keepdim=True))[..., None, None]
    gap, noisy = (rotate(v) if colour else v for v in (nu - p, y - p))
    h = nn.PixelUnshuffle(2)(torch.cat([gap / s, noisy / s, spread], dim=1))
    h = torch.cat([h, s.expand(-1, 1, *h.shape[-2:])], dim=1)
    prefix = REFINE_COLOUR if colour else REFINE
    for i in range(refine.depth):
        h = F.conv2d(h, t[f"{prefix}_{i}_weight"], t[f"{prefix}_{i}_bias"], padding=1)
        h = torch.relu(h) if i < refine.depth - 1 else h
    step = nn.PixelShuffle(2)(h) * gap
    # the basis is orthonormal: its transpose maps back
    return p + (F.conv2d(step, rotate.weight.data[..., 0, 0].T[..., None, None]) if colour else step)


@pytest.mark.parametrize(("aggregate", "channels"), [("pixel", 1), ("patch", 1), ("patch", 3)])
def test_the_refined_pilot_matches_an_independent_network(aggregate, channels) -> None:
    refine = Refine(depth=3, channels=6, aggregate=aggregate, colour_channels=5 if channels == 3 else None)
    net = GuideNet(depth=2, channels=4, refine=refine)
    gen = torch.Generator().manual_seed(7)
    shapes = {n: shape for n, shape in net.shapes().items() if n.startswith(REFINE)}
    # weights that move the pilot by about its own range (the colour network has 29 inputs)
    t = {
        n: (0.1 if channels == 3 else 0.3) * torch.randn(shape, generator=gen) for n, shape in shapes.items()
    }
    y, p = torch.rand(2, channels, 12, 14, generator=gen), torch.rand(2, channels, 12, 14, generator=gen)
    sigma = torch.tensor([0.05, 0.2])
    op = GuidedOperator(p, SPATIAL.spatial.filter(), 1, torch.tensor([0.3, 0.6]), True)
    got = refined_pilot(op, y, p, sigma, t, refine)[0]
    assert torch.allclose(got, reference_refined(op, y, p, sigma, t, refine), rtol=1e-5, atol=1e-5)
    assert (got - p).abs().amax() > 1e-3  # a network that moves the pilot
    # a padded batch: each image refined as it would be alone
    batch, pilots = torch.zeros(2, channels, 12, 14), torch.zeros(2, channels, 12, 14)
    batch[0, :, :9, :10], batch[1] = y[0, :, :9, :10], y[1]
    pilots[0, :, :9, :10], pilots[1] = p[0, :, :9, :10], p[1]
    sizes = [(9, 10), (12, 14)]
    op = GuidedOperator(pilots, SPATIAL.spatial.filter(), 1, torch.tensor([0.3, 0.6]), True, sizes=sizes)
    padded = refined_pilot(op, batch, pilots, sigma, t, refine, sizes)[0]
    alone = GuidedOperator(pilots[:1, :, :9, :10], SPATIAL.spatial.filter(), 1, torch.tensor([0.3]), True)
    first = refined_pilot(alone, batch[:1, :, :9, :10], pilots[:1, :, :9, :10], sigma[:1], t, refine)[0]
    assert torch.allclose(padded[:1, :, :9, :10], first, atol=1e-6)
    assert torch.equal(padded[0, :, 9:], pilots[0, :, 9:])
    if channels == 1:  # colour needs the colour network
        with pytest.raises(ValueError, match="grey images"):
            refined_pilot(op, batch.expand(-1, 3, -1, -1), pilots.expand(-1, 3, -1, -1), sigma, t, refine)


def with_refine(checkpoint: Checkpoint, refine: Refine, tensors: dict[str, torch.Tensor]) -> Checkpoint:
    arch = checkpoint.config.architecture
    net = arch.net.model_copy(update={"refine": refine})
    config = checkpoint.config.model_copy(update={"architecture": arch.model_copy(update={"net": net})})
    return Checkpoint(config, {**checkpoint.tensors, **tensors}, checkpoint.path)


def test_a_refinement_at_its_start_is_the_model_it_refines() -> None:
    """``H_φ``'s and ``H_φ^c``'s last layers at zero (``GuideNet.kglm_start``): the outputs are bit for
    bit the unrefined model's, grey and colour. Moved off zero, ``H_φ`` changes a grey image's and not
    a colour one's; ``H_φ^c`` a colour image's and not a grey one's; without ``H_φ^c`` a colour image
    is not refined."""
    checkpoint = load_checkpoint(find_model(default_models_dir(), "denoise-kglm", 6))
    base = Denoiser(checkpoint)
    refine = Refine(aggregate="patch", colour_channels=8)
    net = base.config.architecture.net.model_copy(update={"refine": refine})
    start = {n: t for n, t in net.kglm_start().items() if n.startswith(REFINE)}
    assert {n for n in net.last_layers() if n.startswith(REFINE)} == {
        f"{REFINE}_{refine.depth - 1}_weight",
        f"{REFINE_COLOUR}_{refine.depth - 1}_weight",
    }
    assert all(float(start[n].abs().max()) == 0 for n in net.last_layers() if n.startswith(REFINE))
    refined = Denoiser(with_refine(checkpoint, refine, start))
    gen = torch.Generator().manual_seed(2)
    grey, colour = torch.rand(1, 1, 40, 44, generator=gen), torch.rand(1, 3, 40, 44, generator=gen)
    want = {c: base.predict(y, sigma=25).output for c, y in ((1, grey), (3, colour))}
    for c, y in ((1, grey), (3, colour)):
        assert torch.equal(refined.predict(y, sigma=25).output, want[c])
    for prefix, moves in ((REFINE, 1), (REFINE_COLOUR, 3)):
        moved = dict(start)
        moved[f"{prefix}_{refine.depth - 1}_bias"] = torch.full(
            moved[f"{prefix}_{refine.depth - 1}_bias"].shape, 0.5
        )
        model = Denoiser(with_refine(checkpoint, refine, moved))
        for c, y in ((1, grey), (3, colour)):
            out = model.predict(y, sigma=25).output
            assert (out - want[c]).abs().amax() > 1e-3 if c == moves else torch.equal(out, want[c])
    # without a colour network a colour image is not refined (kdeq.predictors.denoise)
    moved = {n: t for n, t in start.items() if not n.startswith(REFINE_COLOUR)}
    moved[f"{REFINE}_{refine.depth - 1}_bias"] = torch.full((4,), 0.5)
    grey_only = refine.model_copy(update={"colour_channels": None})
    out = Denoiser(with_refine(checkpoint, grey_only, moved)).predict(colour, sigma=25).output
    assert torch.equal(out, want[3])


def test_the_option_is_written_only_when_set_and_only_for_the_denoisers_sigma_network() -> None:
    plain = GuideNet(depth=3, channels=8)
    refined = GuideNet(depth=3, channels=8, refine=Refine(depth=2, channels=4))
    assert "refine" not in plain.model_dump()
    assert refined.model_dump()["refine"] == {"depth": 2, "channels": 4, "sharpness": 3}
    patched = Refine(depth=2, channels=4, aggregate="patch", colour_channels=6)
    assert patched.model_dump() == {
        "depth": 2,
        "channels": 4,
        "sharpness": 3,
        "aggregate": "patch",
        "colour_channels": 6,
    }
    assert Refine.model_validate_json(patched.model_dump_json()) == patched
    shapes = GuideNet(depth=3, channels=8, refine=patched).shapes()
    assert shapes[f"{REFINE_COLOUR}_0_weight"] == (6, 29, 3, 3)
    assert shapes[f"{REFINE_COLOUR}_1_weight"] == (12, 6, 3, 3)
    with pytest.raises(ValidationError):
        Refine(aggregate="group")
    assert {n for n in refined.shapes() if n.startswith(REFINE)} == {
        f"{REFINE}_{i}_{part}" for i in range(2) for part in ("weight", "bias")
    }
    assert refined.shapes()[f"{REFINE}_0_weight"] == (4, 13, 3, 3)
    spec = grown_spec(refined)
    assert ModelSpec.model_validate_json(spec.model_dump_json()) == spec
    TASKS["denoise"].check_spec(spec)
    with pytest.raises(ValidationError, match="refinement"):
        GuideNet(depth=3, channels=8, condition="mask", refine=Refine())
    deblur = spec.model_copy(update={"task": "deblur"})
    with pytest.raises(ValueError, match="refine is denoise's"):
        TASKS["deblur"].check_spec(deblur)
    with pytest.raises(ValidationError):
        Refine(sharpness=1.5)


def test_train_only_moves_the_named_tensors_alone_and_the_pilot_phase_leaves_the_refinement() -> None:
    spec = grown_spec(GuideNet(depth=2, channels=4, refine=Refine(depth=2, channels=4)))
    start = start_tensors(spec, "kglm", 0)
    # at a kGLM start β = 0: the refinement alone would never reach the output
    with pytest.raises(ValueError, match="net_mean_mix"):
        TrainableModel(spec, start, torch.device("cpu"), train_only=(REFINE,))
    assert float(start["net_mean_mix"]) == 0
    model = TrainableModel(
        spec, {**start, "net_mean_mix": torch.full((1,), 0.5)}, torch.device("cpu"), train_only=(REFINE,)
    )
    trained = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trained == {f"raw.{n}" for n in start if n.startswith(REFINE)}
    whole = TrainableModel(spec, start, torch.device("cpu"))
    assert {n for n in whole.phase_parameters(pilot_only=True) if REFINE in n} == set()
    assert {n for n in whole.phase_parameters(pilot_only=False) if REFINE in n} == {
        f"raw.{n}" for n in start if n.startswith(REFINE)
    }
    with pytest.raises(ValueError, match="names none"):
        TrainableModel(spec, start, torch.device("cpu"), train_only=("nothing_",))
    # without a network: the named bank alone, the λ and bandwidth factors kept
    bare = spec.model_copy(update={"architecture": spec.architecture.model_copy(update={"net": None})})
    model = TrainableModel(bare, start_tensors(bare, "kglm", 0), torch.device("cpu"), train_only=("spatial",))
    assert {n for n, p in model.named_parameters() if p.requires_grad} == {"raw.spatial"}
    free = TrainableModel(bare, start_tensors(bare, "kglm", 0), torch.device("cpu"))
    assert {"log_lam", "log_bandwidth"} <= {n for n, p in free.named_parameters() if p.requires_grad}


def test_the_refined_default_tiled_matches_the_untiled_solve() -> None:
    """``Denoiser.reach`` covers ``p'``'s non-local mean and ``H_φ``: at halo = reach a grey image's
    tiles match the whole image's solve (tol 10⁻⁶) to 10⁻³; without a halo they do not."""
    model = load_predictor(find_model(default_models_dir(), "denoise-kglm", 7))
    assert model.config.architecture.net.refine is not None
    image = noisy(150, 206, colour=False, seed=3)
    whole = solve(model, image, 25.0, tol=1e-6)
    cut = solve(model, image, 25.0, tol=1e-6, size=64)
    bare = solve(model, image, 25.0, tol=1e-6, size=64, halo=0)
    assert np.abs(cut.output - whole.output).max() < 1e-3
    assert np.abs(bare.output - whole.output).max() > 3e-2


def test_kdeq_train_only_trains_the_refinement_and_keeps_every_other_tensor(tmp_path) -> None:
    """``kdeq train --train-only net_refine_ net_mean_mix`` from a refined spec's kGLM start (``β`` = 0
    there, so the refinement needs ``β`` to reach the output): the refinement's last layer and ``β``
    leave zero, every other tensor and ``λ`` are written back bit for bit as they started."""
    spec = grown_spec(GuideNet(depth=2, channels=4, refine=Refine(depth=2, channels=4)))
    path = tmp_path / "spec.json"
    path.write_text(spec.model_dump_json())
    train_dir = smooth_images(tmp_path / "train", 6, 40, 0)
    val_dir = smooth_images(tmp_path / "val", 2, 32, 1)
    out = tmp_path / "refined" / "1"
    argv = ["train", "--task", "denoise", "--spec", str(path), "--train", str(train_dir)]
    argv += ["--val", str(val_dir), "--out", str(out), "--epochs", "2", "--samples-per-epoch", "8"]
    argv += ["--batch-size", "4"]
    argv += ["--patch-size", "24", "--lr", "0.01", "--workers", "0", "--device", "cpu", "--quiet"]
    assert kdeq_main([*argv, "--train-only", REFINE, "net_mean_mix"]) == 0
    trained = load_checkpoint(out)
    start = start_tensors(spec, "kglm", 0)
    assert trained.config.lam == spec.lam
    for name, tensor in start.items():
        if not name.startswith((REFINE, "net_mean_mix")):
            assert torch.equal(trained.tensors[name], tensor), name
    assert float(trained.tensors[f"{REFINE}_1_weight"].abs().max()) > 0
    assert float(trained.tensors["net_mean_mix"].abs().max()) > 0
