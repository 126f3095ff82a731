"""The CUDA suite (issue 20): every shipped model, the operators and solvers, the service and one
training epoch on a GPU, against the CPU or float64. Skipped without a CUDA device; on a GPU machine
``bench/gpu.sh`` runs it first (``pytest -m cuda``)."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import httpx2 as httpx
import numpy as np
import pytest
import torch

from kdeq import SOLVERS, Kernel, SolverConfig, solve
from kdeq.maths.adaptive import GuidedOperator
from kdeq.maths.conv import conv
from kdeq.maths.guidenet import REFINE_COLOUR, Refine
from kdeq.maths.precision import ieee_float32
from kdeq.maths.solvers import SPLIT_ONLY, SplitMap
from kdeq.maths.transforms import dct2, idct2
from kdeq.models.checkpoint import load_checkpoint
from kdeq.models.repository import default_models_dir, find_model, load_predictor
from kdeq.predictors.base import SolverOverride
from kdeq.predictors.denoise import Denoiser
from tests.helpers import predict_arguments
from tests.service_helpers import encode, metric, noisy, run_server, smooth_image, to_uint8
from tests.test_refine import with_refine

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = sorted(p.parent for p in (ROOT / "models").glob("*/*/config.json"))
SIGMA = 25.0
TIGHT = SolverOverride(tol=1e-6, max_iter=3000)
# float32 rounding (6e-8) times the condition number of the worst-conditioned shipped system:
# inpaint-kglm:2 (λ = 0.01, ‖K‖/λ ~ 10³) differs by 1.2e-4 at 2 of 5883 pixels on an H100 even solved
# to TIGHT, every other model by under 1e-4; a wrong kernel, border or index differs by 1e-2 or more
PARITY = 2.5e-4


def _id(folder: Path) -> str:
    return f"{folder.parent.name}:{folder.name}"


def _batch(task: str, channels: int, shape: tuple[int, int], count: int, seed: int) -> tuple[tuple, dict]:
    """``predict``'s arguments for ``count`` noisy piecewise-smooth images ``(count, channels, *shape)``
    (half the pixels missing for the inpainter)."""
    gen = torch.Generator().manual_seed(seed)
    clean = torch.stack(
        [torch.from_numpy(smooth_image(*shape, seed=seed + k)).float() for k in range(count)]
    )[:, None].expand(count, channels, *shape)
    images = (clean + SIGMA / 255 * torch.randn(clean.shape, generator=gen)).clamp(0, 1)
    return predict_arguments(task, images, SIGMA, gen)


def _channels(model) -> list[int]:
    return [1] if model.task == "segment" else [1, 3]


def _parity(cpu, gpu, args: tuple, kwargs: dict, **extra) -> None:
    """At the model's own tolerance both devices converge, in iteration counts within 1; solved to
    ``TIGHT`` they agree within ``PARITY``. Solved to the model's tolerance, the outputs would also
    differ by where each device's solver stopped."""
    on_gpu = tuple(a.cuda() if isinstance(a, torch.Tensor) else a for a in args)
    a = cpu.predict(*args, **kwargs, **extra)
    b = gpu.predict(*on_gpu, **kwargs, **extra)
    assert a.stats.converged.all() and b.stats.converged.cpu().all()
    assert (a.stats.iterations - b.stats.iterations.cpu()).abs().max() <= 1
    a = cpu.predict(*args, **kwargs, **extra, solver=TIGHT)
    b = gpu.predict(*on_gpu, **kwargs, **extra, solver=TIGHT)
    torch.testing.assert_close(b.output.cpu(), a.output, rtol=0, atol=PARITY)


@pytest.mark.parametrize("folder", SHIPPED, ids=_id)
def test_every_shipped_model_agrees_with_the_cpu(folder: Path) -> None:
    """Grey and colour, an odd size, and a padded batch of mixed sizes: both devices converge, in
    iteration counts within 1, and, solved to a tolerance of 1e-6, agree within ``PARITY``."""
    cpu, gpu = load_predictor(folder, "cpu"), load_predictor(folder, "cuda:0")
    for channels in _channels(cpu):
        for shape, count in (((64, 64), 2), ((37, 53), 1)):
            args, kwargs = _batch(cpu.task, channels, shape, count, seed=channels)
            _parity(cpu, gpu, args, kwargs)
    if cpu.pads_exactly:
        sizes = [(48, 40), (33, 48)]
        args, kwargs = _batch(cpu.task, 1, (48, 48), 2, seed=7)
        _parity(cpu, gpu, args, kwargs, sizes=sizes)


def test_the_patch_refinement_and_its_colour_network_agree_with_the_cpu() -> None:
    """``Refine(aggregate="patch", colour_channels=…)`` on version 7 (not a shipped model: docs/training.md's
    candidate): the patch mean within float32's rounding of float64, and the refined denoiser, grey and
    colour, an odd size and a padded batch, as ``test_every_shipped_model_agrees_with_the_cpu``."""
    gen = torch.Generator().manual_seed(11)
    checkpoint = load_checkpoint(find_model(default_models_dir(), "denoise-kglm", 7))
    taps = checkpoint.tensors["spatial"]
    for channels in (1, 3):
        guide = torch.rand(2, channels, 40, 52, generator=gen, dtype=torch.float64)
        v = torch.rand(2, channels, 40, 52, generator=gen, dtype=torch.float64)
        h2 = torch.tensor([8.0, 16.0], dtype=torch.float64) * channels  # weights of order 1
        exact = GuidedOperator(guide, taps.double(), 3, h2, True).nonlocal_mean(v, 3, patches=True)[0]
        op = GuidedOperator(guide.float().cuda(), taps.cuda(), 3, h2.float().cuda(), True)
        got = op.nonlocal_mean(v.float().cuda(), 3, patches=True)[0].double().cpu()
        assert float((got - exact).norm() / exact.norm()) < 1e-6
    refine = Refine(aggregate="patch", colour_channels=8)
    net = checkpoint.config.architecture.net.model_copy(update={"refine": refine})
    # a colour network that moves the pilot (its kGLM start would leave it as it is)
    shapes = {n: shape for n, shape in net.shapes().items() if n.startswith(REFINE_COLOUR)}
    colour = {n: 0.02 * torch.randn(shape, generator=gen) for n, shape in shapes.items()}
    refined = with_refine(checkpoint, net.refine, colour)
    cpu, gpu = Denoiser(refined, "cpu"), Denoiser(refined, "cuda:0")
    for channels in (1, 3):
        for shape, count in (((64, 64), 2), ((37, 53), 1)):
            args, kwargs = _batch("denoise", channels, shape, count, seed=channels)
            _parity(cpu, gpu, args, kwargs)
    args, kwargs = _batch("denoise", 1, (48, 48), 2, seed=7)
    _parity(cpu, gpu, args, kwargs, sizes=[(48, 40), (33, 48)])


@pytest.mark.parametrize("padding", ["zeros", "circular", "symmetric", "reflect"])
def test_convolutions_in_float32_match_float64_whatever_the_process_allows(padding: str) -> None:
    """cuDNN's float32 convolution with TF32 allowed process-wide, inside the IEEE section: within
    float32's rounding of the float64 result (TF32 would be ~1e-3 off)."""
    gen = torch.Generator().manual_seed(0)
    x = torch.rand(4, 3, 65, 47, generator=gen, dtype=torch.float64)
    bank = torch.randn(3, 3, 11, 11, generator=gen, dtype=torch.float64)
    exact = conv(x, bank, padding)
    before = torch.backends.cudnn.conv.fp32_precision
    torch.backends.cudnn.conv.fp32_precision = "tf32"
    try:
        with ieee_float32():
            got = conv(x.float().cuda(), bank.float().cuda(), padding).double().cpu()
    finally:
        torch.backends.cudnn.conv.fp32_precision = before
    assert ((got - exact).abs().max() / exact.abs().max()) < 1e-5


@pytest.mark.parametrize("batch", [1, 8])
def test_transforms_match_float64(batch: int) -> None:
    x = torch.rand(batch, 1, 64, 48, generator=torch.Generator().manual_seed(batch), dtype=torch.float64)
    got = dct2(x.float().cuda()).double().cpu()
    torch.testing.assert_close(got, dct2(x), rtol=0, atol=1e-5)
    torch.testing.assert_close(idct2(dct2(x.float().cuda())).double().cpu(), x, rtol=0, atol=1e-5)


def _affine(device: str, batch: int):
    """``f(z) = (t − z) ⊛ k/λ`` with a PSD taper kernel at ``‖K/λ‖ = 5`` (its positive taps' sum):
    a linear Gaussian kGLM-DEQ that damped iteration also solves (``β = 0.3``)."""
    gen = torch.Generator().manual_seed(batch)
    t = torch.rand(batch, 1, 48, 48, generator=gen).to(device)
    taps = Kernel(lengthscale=2**0.5, radius=4).filter()
    bank = (5 * taps / taps.sum())[None, None].to(device)
    return lambda z: conv(t - z, bank), torch.zeros_like(t)


def _host_syncs(run):
    """``run()``'s result, and the host synchronisations torch's sync-debug mode warned of during it."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            result = run()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return result, [w for w in caught if "synchroniz" in str(w.message)]


@pytest.mark.parametrize("method", sorted(SOLVERS))
@pytest.mark.parametrize("batch", [1, 8])
def test_solvers_agree_with_the_cpu_with_few_host_synchronisations(
    method: str, batch: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Same fixed point and iterations within 1; the host synchronises a handful of times per solve
    (CG's restart checks), not once per step (``torch.cuda.set_sync_debug_mode``): the eager loop's
    look-ahead, replay off (whatever a service made earlier in the process pinned)."""
    from kdeq.maths import graphs

    monkeypatch.setattr(graphs, "_pinned", False)
    cfg = SolverConfig(method=method, tol=1e-5, max_iter=300, damping=0.3 if method == "fixed_point" else 1.0)
    f_cpu, z0_cpu = _affine("cpu", batch)
    f_gpu, z0_gpu = _affine("cuda", batch)
    if method in SPLIT_ONLY:  # the affine map split with the identity as prox, damped like fixed_point
        f_cpu, f_gpu = (SplitMap(pre=f, prox=lambda x, _alpha: x, step=0.3) for f in (f_cpu, f_gpu))
    z_cpu, s_cpu = solve(f_cpu, z0_cpu, cfg)
    torch.cuda.synchronize()
    with ieee_float32():
        (z_gpu, s_gpu), syncs = _host_syncs(lambda: solve(f_gpu, z0_gpu, cfg))
    assert s_cpu.converged.all() and s_gpu.converged.cpu().all()
    assert int(s_gpu.iterations.max()) >= 5
    assert len(syncs) <= 3, [str(w.message) for w in syncs]
    assert (s_cpu.iterations - s_gpu.iterations.cpu()).abs().max() <= 1
    torch.testing.assert_close(z_gpu.cpu(), z_cpu, rtol=0, atol=1e-4)


def _post(url: str, route: str, files: dict, data: dict | None = None) -> httpx.Response:
    return httpx.post(url + route, files=files, data=data or {}, timeout=120)


def test_the_service_on_cuda_answers_every_route_and_exports_gpu_memory(tmp_path: Path) -> None:
    clean = smooth_image(96, 80)
    png = encode(to_uint8(noisy(clean, SIGMA)))
    holes = encode(to_uint8((np.random.default_rng(0).random(clean.shape) < 0.3).astype(float)))
    with run_server(tmp_path, device="cuda:0") as server:
        assert httpx.get(server.url + "/readyz").status_code == 200
        for route, files in (
            ("/denoise", {"image": png}),
            ("/inpaint", {"image": png, "mask": holes}),
            ("/segment", {"image": png}),
        ):
            r = _post(server.url, route, files)
            assert r.status_code == 200, (route, r.text)
            assert r.headers["X-KDEQ-Converged"] == "true"
        text = httpx.get(server.url + "/metrics").text
        assert metric(text, "kdeq_cuda_memory_allocated_bytes", device="cuda:0") > 0
        assert metric(text, "kdeq_cuda_memory_total_bytes", device="cuda:0") > 0


def test_out_of_memory_is_a_503_and_the_next_request_succeeds_with_memory_back(tmp_path: Path) -> None:
    """A real out-of-memory: another process (this one) holds nearly all the GPU while a 4-megapixel
    guided denoise arrives; 503 with Retry-After, then, with the memory given back, 200. Twice: the
    second failure leaves the server's allocated bytes where the first left them (nothing of a failed
    batch is kept), and the first leaves them within 64 MiB of before — room for what a library keeps
    from its first call at that size (on an H100, 32 MiB stayed: a cuBLAS workspace or a cuFFT plan),
    where keeping the failed batch's tensors would be ~2 GiB."""
    big = encode(to_uint8(noisy(smooth_image(2000, 2000), SIGMA)))
    small = encode(to_uint8(noisy(smooth_image(96, 96), SIGMA)))
    with run_server(tmp_path, device="cuda:0", models="denoise-kglm:2", max_pixels=4_200_000) as server:

        def allocated() -> float:
            return metric(httpx.get(server.url + "/metrics").text, "kdeq_cuda_memory_allocated_bytes")

        def fail_then_succeed() -> float:
            free, _ = torch.cuda.mem_get_info(0)
            hog = torch.empty(max(0, free - (96 << 20)), dtype=torch.uint8, device="cuda:0")
            try:
                r = _post(server.url, "/denoise", {"image": big})
            finally:
                del hog
                torch.cuda.empty_cache()
            assert r.status_code == 503 and r.json()["error"] == "out_of_memory", r.text
            assert "Retry-After" in r.headers
            assert _post(server.url, "/denoise", {"image": small}).status_code == 200
            return allocated()

        assert _post(server.url, "/denoise", {"image": small}).status_code == 200
        before = allocated()
        first = fail_then_succeed()
        second = fail_then_succeed()
        assert first <= before + (64 << 20), (before, first)
        assert second <= first + (2 << 20), (first, second)
        text = httpx.get(server.url + "/metrics").text
        assert metric(text, "kdeq_rejected_requests_total", reason="out_of_memory") >= 2
        assert httpx.get(server.url + "/readyz").status_code == 200


def test_one_training_epoch_on_cuda_needs_no_rollback(tmp_path: Path) -> None:
    from kdeq.train.config import TrainConfig
    from kdeq.train.loop import train
    from tests.test_train import smooth_images

    train_dir = smooth_images(tmp_path / "train", 6, 40, 0)
    val_dir = smooth_images(tmp_path / "val", 2, 32, 1)
    cfg = TrainConfig.model_validate(
        dict(
            task="denoise",
            spec="denoise-kglm-net",
            train=(train_dir,),
            val=(val_dir,),
            out=tmp_path / "models" / "denoise-kglm-net" / "1",
            epochs=2,
            pilot_epochs=1,
            samples_per_epoch=16,
            batch_size=4,
            patch_size=32,
            device="cuda",
            workers=0,
        )
    )
    train(cfg)
    metrics = json.loads((cfg.out / "report" / "metrics.json").read_text())
    trained = [e for e in metrics["epochs"] if "rollbacks" in e]
    assert len(trained) == 2 and metrics["rollbacks"] == 0, metrics["epochs"]
    assert all(e["train_converged"] == 1.0 and e["val_converged"] == 1.0 for e in trained)


def test_cuda_is_named_by_its_index_and_listed_once() -> None:
    from kdeq.predictors.base import resolve_device
    from service.settings import Settings, SettingsError

    assert resolve_device("cuda") == torch.device("cuda", torch.cuda.current_device())
    assert resolve_device("auto").type == "cuda"
    with pytest.raises((SettingsError, ValueError), match="same device"):
        Settings.from_env({"KDEQ_DEVICE": "cuda,cuda:0"}).devices()


TRIGGER = 40


def test_a_real_device_side_assert_retires_the_device_and_exits_3(tmp_path: Path) -> None:
    """A real device-side assert (an out-of-range gather on the GPU) inside a request's solve: the
    request gets 503 ``device_failed`` and the process exits 3 for the orchestrator to restart it."""
    image = encode(to_uint8(noisy(smooth_image(TRIGGER, TRIGGER), 20.0)))
    settings = {"models": "denoise-stationary-kglm", "max_batch_size": 1, "device": "cuda:0"}
    with run_server(tmp_path, command=("tests.test_cuda",), **settings) as server:
        r = _post(server.url, "/denoise", {"image": image})
        assert r.status_code == 503 and r.json()["error"] == "device_failed", r.text
        assert server.process.wait(60) == 3


def _serve_with_a_device_side_assert() -> int:
    import service.state
    from service.cli import main

    real = service.state.solve_requests

    def solve_requests(task, predictor, inputs, *args):
        if inputs[0].image.shape[-1] == TRIGGER:
            dev = predictor.device
            torch.arange(4, device=dev)[torch.tensor([10**9], device=dev)]
            torch.cuda.synchronize(dev)
        return real(task, predictor, inputs, *args)

    service.state.solve_requests = solve_requests
    return main([])


if __name__ == "__main__":
    raise SystemExit(_serve_with_a_device_side_assert())


def test_the_guide_network_in_bfloat16_on_cuda_moves_the_default_denoiser_by_under_a_grey_level() -> None:
    """Off the CPU ``kdeq.runtime.netprecision`` keeps float32 unless pinned; pinned to bfloat16 on the GPU,
    the default denoiser's output moves by under a grey level from float32's, as on the CPU
    (``tests/test_netprecision.py``), and its pilot really was rounded (the outputs differ)."""
    from kdeq.runtime import netprecision

    model = load_predictor(find_model(default_models_dir(), "denoise-kglm"), "cuda:0")
    args, kwargs = _batch(model.task, 3, (96, 80), 2, 3)
    images = args[0].cuda()
    out = {}
    for name in netprecision.DTYPES:
        with netprecision.choice.force(name):
            pred = model.predict(images, **kwargs)
        assert bool(pred.stats.converged.all())
        out[name] = pred.output
    diff = (out["bfloat16"] - out["float32"]).abs()
    assert 0 < diff.max().item() < 1 / 255
    assert netprecision.choice.pinned() in (None, "float32")  # the suite's pin, restored


@pytest.mark.parametrize("method", ["fixed_point", "anderson", "cg"])
def test_replayed_solves_match_the_eager_ones_and_read_the_host_once_a_chunk(
    method: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``kdeq.maths.graphs``: the same fixed point and counts as the eager CUDA loop (``KDEQ_CUDA_GRAPHS=0``),
    a second solve of the key replays its graphs without capturing again, and a replayed solve
    synchronises the host once a chunk (its done flag), plus the copies out."""
    from kdeq.maths import graphs

    cfg = SolverConfig(method=method, tol=1e-5, max_iter=300, damping=0.3 if method == "fixed_point" else 1.0)
    f, z0 = _affine("cuda", 4)
    graphs.clear()
    monkeypatch.setattr(graphs, "_pinned", False)  # pinned, whatever a service made earlier pinned
    z_eager, s_eager = solve(f, z0, cfg)
    monkeypatch.setattr(graphs, "_pinned", True)
    z_graph, s_graph = solve(f, z0, cfg)  # warm-up and capture
    assert graphs.cached() == 1
    torch.cuda.synchronize()
    (z_again, s_again), syncs = _host_syncs(lambda: solve(f, z0, cfg))
    assert graphs.cached() == 1
    assert torch.equal(s_eager.iterations, s_graph.iterations)
    torch.testing.assert_close(z_graph, z_eager, rtol=0, atol=0)
    torch.testing.assert_close(z_again, z_graph, rtol=0, atol=0)
    chunks = -(-int(s_again.iterations.max()) // graphs.CHUNK)
    assert len(syncs) <= chunks + 3, [str(w.message) for w in syncs]


def test_the_default_denoiser_replayed_is_the_eager_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """The shipped default denoiser on a 256² image: replayed (second request of the size class)
    and eager outputs and counts agree exactly."""
    from kdeq.maths import graphs

    model = load_predictor(find_model(default_models_dir(), "denoise-kglm"), "cuda:0")
    images = torch.rand(1, 1, 256, 256, generator=torch.Generator().manual_seed(5))
    graphs.clear()
    monkeypatch.setattr(graphs, "_pinned", False)
    eager = model.predict(images, sigma=SIGMA)
    monkeypatch.setattr(graphs, "_pinned", True)
    model.predict(images, sigma=SIGMA)
    replayed = model.predict(images, sigma=SIGMA)
    assert graphs.cached() >= 1
    assert torch.equal(eager.stats.iterations, replayed.stats.iterations)
    assert torch.equal(eager.output, replayed.output)


def test_each_device_captures_its_own_graphs(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every visible device replays its own solve (each captured on its own stream: torch's default
    capture stream belongs to the first device captured, and a capture for another device on it
    records nothing), the same as that device's eager loop, bit for bit."""
    from kdeq.maths import graphs

    cfg = SolverConfig(method="cg", tol=1e-5, max_iter=300)
    graphs.clear()
    for index in range(torch.cuda.device_count()):
        f, z0 = _affine(f"cuda:{index}", 4)
        monkeypatch.setattr(graphs, "_pinned", False)
        z_eager, s_eager = solve(f, z0, cfg)
        monkeypatch.setattr(graphs, "_pinned", True)
        solve(f, z0, cfg)  # warm-up and capture
        z_graph, s_graph = solve(f, z0, cfg)
        assert graphs.cached() == index + 1 and graphs.replays()
        assert torch.equal(s_eager.iterations, s_graph.iterations)
        assert torch.equal(z_eager, z_graph)


def test_a_step_that_reads_the_host_is_refused_in_its_warm_up(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A map that reads a value to the host (``.item()``) is caught in the warm-up, before any capture
    (a failed capture would leave the allocator unable to capture again): its key runs eagerly, logged,
    replay stays on for other keys, and the answer is the eager loop's."""
    from kdeq.maths import graphs

    f, z0 = _affine("cuda", 2)

    def reads(z: torch.Tensor) -> torch.Tensor:
        return f(z) * (1.0 + 0.0 * z.abs().max().item())

    cfg = SolverConfig(method="fixed_point", tol=1e-5, max_iter=300, damping=0.3)
    graphs.clear()
    monkeypatch.setattr(graphs, "_pinned", False)
    z_eager, s_eager = solve(reads, z0, cfg)
    monkeypatch.setattr(graphs, "_pinned", True)
    z_graph, s_graph = solve(reads, z0, cfg)
    assert graphs.cached() == 0 and graphs.replays()
    assert any("synchronises with the host" in r.message for r in caplog.records)
    assert torch.equal(s_eager.iterations, s_graph.iterations)
    assert torch.equal(z_eager, z_graph)
    solve(f, z0, cfg)
    assert graphs.cached() == 1


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_fused_kernels_equal_torchs_loops_on_cuda(dtype) -> None:
    """``kdeq.maths.fused`` compiled for the GPU (``auto``'s choice there) against torch's loops on the same
    device: the weight maps, ``K x``, ``K̃ x``, the degree and both non-local means at κ = 1 and 3, on
    a padded colour batch whose images cross the kernels' tile edges; float64 to 1e-12 relative,
    float32 to 1e-6 (issue 55's bar) with a floor of float32's rounding of the outputs' scale."""
    pytest.importorskip("triton")
    from kdeq.maths import fused
    from kdeq.maths.adaptive import apply_weights, guided_weights
    from kdeq.runtime import native

    gen = torch.Generator().manual_seed(12)
    guide = torch.rand(2, 3, 45, 70, generator=gen, dtype=dtype).cuda()
    x = torch.randn(2, 2, 45, 70, generator=gen, dtype=dtype).cuda()
    v = torch.rand(2, 3, 45, 70, generator=gen, dtype=dtype).cuda()
    h2 = torch.tensor([0.1, 0.4], dtype=dtype).cuda()
    spatial = Kernel(profile="matern32", lengthscale=2.0, radius=5).filter(dtype).cuda()
    sizes = [(45, 70), (33, 41)]
    assert fused.enabled(native.choice.pinned(), guide, spatial, h2)

    def run() -> list[torch.Tensor]:
        op = GuidedOperator(guide, spatial, 2, h2, True, sizes=sizes)
        weights = guided_weights(guide, spatial, 2, h2, sizes=sizes)
        means = [t for k in (1, 3) for by in (False, True) for t in op.nonlocal_mean(v, k, patches=by)]
        return [weights, apply_weights(weights, x), op(x), op.degree, *means]

    with torch.no_grad():
        with native.choice.force("loop"):
            loop = run()
        with native.choice.force("triton"):
            fast = run()
    rtol = 1e-12 if dtype == torch.float64 else 1e-6
    for k, (a, b) in enumerate(zip(loop, fast, strict=True)):
        floor = 4 * torch.finfo(dtype).eps * float(a.abs().max())
        assert float((b - a).abs().max()) <= rtol * float(a.abs().max()) + floor, k


def test_fused_kernels_gradients_on_cuda() -> None:
    """The fused weights' and ``K x``'s backward kernels, compiled, by finite differences (float64)."""
    pytest.importorskip("triton")
    from kdeq.maths import fused
    from kdeq.maths.adaptive import half_offsets

    gen = torch.Generator().manual_seed(13)
    offsets = half_offsets(2)
    padded = torch.rand(2, 2, 13, 40, generator=gen, dtype=torch.float64).cuda().requires_grad_()
    taps = torch.rand(len(offsets), generator=gen, dtype=torch.float64).cuda().requires_grad_()
    inv = torch.tensor([-1.5, -0.7], dtype=torch.float64).cuda().requires_grad_()
    sizes = [(11, 38), (7, 20)]

    def weights(p, t, i):
        return fused.weights(p, t, i, offsets, sizes, 3, -60.0)

    assert torch.autograd.gradcheck(weights, (padded, taps, inv), fast_mode=True)
    w = weights(padded, taps, inv).detach().requires_grad_()
    x = torch.randn(2, 3, 11, 38, dtype=torch.float64).cuda().requires_grad_()
    assert torch.autograd.gradcheck(lambda a, b: fused.apply(a, b, offsets), (w, x), fast_mode=True)
