"""Devices and device faults, tested on the CPU: the CUDA calls are replaced by fakes that behave as
torch's do (availability, device counts, set_device, mem_get_info) and the failures are the exact
errors torch, cuBLAS, cuDNN and cuFFT raise. tests/test_cuda.py runs the same paths on a real GPU."""

from __future__ import annotations

import logging
import threading
import weakref

import pytest
import torch
from fastapi.testclient import TestClient

from kdeq.maths.adaptive import WEIGHT_BUDGET, weight_budget
from kdeq.predictors.base import resolve_device
from service.app import create_app
from service.devices import choose_devices, classify, select_device
from service.engine import Engine
from service.metrics import Metrics
from service.settings import Settings, SettingsError
from tests.service_helpers import MODELS, encode, metric, noisy, smooth_image, to_uint8

PNG = encode(to_uint8(noisy(smooth_image(48, 48), 20.0)))
MODEL = "denoise-stationary-kglm:2"

OUT_OF_MEMORY = [
    torch.OutOfMemoryError(
        "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79 GiB"
    ),
    RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"),
    RuntimeError("cuDNN error: CUDNN_STATUS_ALLOC_FAILED"),
    RuntimeError("cuDNN error: CUDNN_STATUS_NOT_ENOUGH_WORKSPACE"),
    RuntimeError("cuFFT error: CUFFT_ALLOC_FAILED"),
    RuntimeError("CUDA error: out of memory\nCUDA kernel errors might be asynchronously reported"),
    MemoryError(),
]
STICKY = [
    RuntimeError(
        "CUDA error: device-side assert triggered\nCUDA kernel errors might be asynchronously reported"
    ),
    RuntimeError("CUDA error: an illegal memory access was encountered"),
    RuntimeError("CUDA error: unspecified launch failure"),
    RuntimeError("CUDA error: uncorrectable ECC error encountered"),
    RuntimeError("CUDA error: misaligned address"),
]
OTHER = [
    RuntimeError("The size of tensor a (3) must match the size of tensor b (4) at non-singleton dimension 1"),
    ValueError("sigma must be finite"),
    KeyError("spatial"),
]


def accelerator_error(message: str, code: int) -> Exception:
    """A ``torch.AcceleratorError`` as torch raises it: the message, and the CUDA error code."""
    err = torch.AcceleratorError(message)
    err.error_code = code
    return err


def test_failures_are_classified_by_what_they_mean_for_the_device() -> None:
    assert all(classify(err) == "out_of_memory" for err in OUT_OF_MEMORY)
    assert all(classify(err) == "device" for err in STICKY)
    assert all(classify(err) is None for err in OTHER)
    # torch ≥ 2.8 raises CUDA errors as AcceleratorError with the cudaError_t code: 710 is an assert
    # (sticky, whatever the message), 9 an invalid launch configuration (a request's fault, not the device's)
    assert classify(accelerator_error("CUDA error: device-side assert triggered", 710)) == "device"
    assert classify(accelerator_error("CUDA error: invalid configuration argument", 9)) is None


@pytest.fixture
def fake_cuda(monkeypatch):
    """Two CUDA devices, CUDA not yet initialised, as torch reports them; nothing really runs."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: "Fake GPU")


def test_cuda_is_named_by_its_index_and_one_device_cannot_be_listed_twice(fake_cuda, monkeypatch) -> None:
    assert resolve_device("cuda") == torch.device("cuda:0")
    assert Settings(device=("cuda",)).devices() == ["cuda:0"]
    assert Settings(device=("cuda:1", "cuda:0")).devices() == ["cuda:1", "cuda:0"]
    with pytest.raises(
        SettingsError, match=r"KDEQ_DEVICE.*`cuda` and `cuda:0` are the same device \(cuda:0\)"
    ):
        Settings.from_env({"KDEQ_DEVICE": "cuda,cuda:0"})
    with pytest.raises(SettingsError, match=r"KDEQ_DEVICE.*has 2 CUDA devices"):
        Settings.from_env({"KDEQ_DEVICE": "cuda:2"})
    # once CUDA is initialised, `cuda` is the current device
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    assert resolve_device("cuda") == torch.device("cuda:1")
    with pytest.raises(SettingsError, match="`cuda:1` and `cuda` are the same device"):
        Settings.from_env({"KDEQ_DEVICE": "cuda:1,cuda"})


def test_unusable_cuda_is_refused_with_its_cause(monkeypatch) -> None:
    if torch.version.cuda is None:  # this machine: the CPU wheel
        with pytest.raises(SettingsError, match=r"KDEQ_DEVICE.*'cuda' is not available: .* without CUDA"):
            Settings.from_env({"KDEQ_DEVICE": "cuda"})
    # a CUDA build whose driver is too old: is_available() is False and only warns; init() says why
    driver = "The NVIDIA driver on your system is too old (found version 11040)."

    def init() -> None:
        raise RuntimeError(driver)

    monkeypatch.setattr(torch.version, "cuda", "12.8")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "init", init)
    with pytest.raises(
        SettingsError, match=r"KDEQ_DEVICE.*'cuda:0' is not available: The NVIDIA driver .* too old"
    ):
        Settings.from_env({"KDEQ_DEVICE": "cuda:0"})
    # auto falls back to the CPU, but says why, as a warning: this torch was meant to use a GPU
    choice = choose_devices(("auto",))
    assert choice.devices == ["cpu"] and driver in choice.reason and choice.level == logging.WARNING


def test_auto_logs_the_devices_it_chose_and_why(fake_cuda, monkeypatch, caplog) -> None:
    choice = choose_devices(("auto",))
    assert choice.devices == ["cuda:0", "cuda:1"] and "cuda:1 Fake GPU" in choice.reason
    caplog.set_level(logging.INFO, logger="kdeq.service")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    create_app(Settings(models_dir=MODELS, models=(MODEL,)))
    (line,) = [r.getMessage() for r in caplog.records if "serving on" in r.getMessage()]
    assert line.startswith("serving on cpu: auto chose the CPU because CUDA is not usable")


def test_every_worker_selects_its_own_device_before_its_first_batch(monkeypatch) -> None:
    selected: list[tuple[str, object]] = []
    monkeypatch.setattr(
        torch.cuda, "set_device", lambda d: selected.append((threading.current_thread().name, d))
    )
    eng = Engine(
        lambda device, jobs: [None] * len(jobs),
        Metrics([10], ["cuda:0", "cuda:1"]),
        queue_size=4,
        max_batch_size=1,
        max_batch_pixels=100,
        batch_wait_seconds=0,
    )
    eng.start(["cuda:0", "cuda:1"], prepare=select_device)
    eng.stop()
    assert sorted(selected) == [
        ("kdeq-worker-cuda:0", torch.device("cuda:0")),
        ("kdeq-worker-cuda:1", torch.device("cuda:1")),
    ]


def test_warm_up_runs_on_the_serving_worker_at_each_configured_size(monkeypatch) -> None:
    import service.registry

    real, warmed = service.registry.solve_batch, []

    def solve(task, predictor, inputs):
        warmed.append((threading.current_thread().name, inputs[0].image.shape[-2:]))
        return real(task, predictor, inputs)

    monkeypatch.setattr(service.registry, "solve_batch", solve)
    settings = Settings(models_dir=MODELS, models=(MODEL,), device=("cpu",), warmup_sizes=(16, 40))
    with TestClient(create_app(settings)) as c:
        assert c.app.state.service.wait_loaded(60)
        assert c.get("/readyz").status_code == 200
    assert warmed == [("kdeq-worker-cpu", (16, 16)), ("kdeq-worker-cpu", (40, 40))]


def test_warm_up_sizes_are_validated_strictly() -> None:
    assert Settings().warmup_sizes_for(["cpu"]) == (32,)
    assert Settings().warmup_sizes_for(["cuda:0"]) == (32, 256)
    assert Settings.from_env({"KDEQ_WARMUP_SIZES": " 64, 128 "}).warmup_sizes == (64, 128)
    for value, message in [
        ("", "at least one size"),
        ("32,32", "listed twice"),
        ("32x32", "valid integer"),
        ("4", "greater than or equal to 8"),
        ("2049", "exceed KDEQ_MAX_UNTILED_PIXELS"),  # warm-ups are solved whole, by every model
    ]:
        with pytest.raises(SettingsError, match=f"KDEQ_WARMUP_SIZES.*{message}"):
            Settings.from_env({"KDEQ_WARMUP_SIZES": value})
    with pytest.raises(SettingsError, match=r"KDEQ_WARMUP_SIZES.*exceed KDEQ_MAX_PIXELS"):
        Settings.from_env({"KDEQ_WARMUP_SIZES": "1024", "KDEQ_MAX_PIXELS": "1000000"})


def test_the_guided_weight_budget_follows_the_free_device_memory(monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (40 * 2**30, 80 * 2**30))
    assert weight_budget(torch.device("cuda:0")) == 10 * 2**30
    assert weight_budget(torch.device("cpu")) == WEIGHT_BUDGET == 2**30


def client(**settings) -> TestClient:
    app = create_app(Settings(models_dir=MODELS, models=(MODEL,), device=("cpu",), warmup=False, **settings))
    return TestClient(app, raise_server_exceptions=False)


@pytest.mark.parametrize("error", OUT_OF_MEMORY[1:5], ids=lambda e: str(e).split()[2].strip(":"))
def test_library_allocation_failures_are_out_of_memory_and_freed_first(monkeypatch, error) -> None:
    """cuBLAS/cuDNN/cuFFT allocation failures arrive as plain RuntimeErrors: 503 out_of_memory, counted,
    and the failed solve's tensors are gone by the time memory is released; the next request is served."""
    import service.state

    failed: list[weakref.ref] = []
    freed_before_release: list[bool] = []
    real_release = service.state.release_memory

    def release(device: str) -> None:
        freed_before_release.append(failed[0]() is None)
        real_release(device)

    monkeypatch.setattr(service.state, "release_memory", release)
    with client() as c:
        assert c.app.state.service.wait_loaded(60)
        predictor = c.app.state.service.registry.slots[MODEL].predictors["cpu"]
        real_predict = predictor.predict

        def predict(images, *args, **kwargs):
            if not failed:
                workspace = torch.empty(1 << 20)  # what the failing solve held
                failed.append(weakref.ref(workspace))
                raise type(error)(
                    *error.args
                )  # a new one, as torch raises: the list's would keep its traceback
            return real_predict(images, *args, **kwargs)

        monkeypatch.setattr(predictor, "predict", predict)
        r = c.post("/denoise", files={"image": PNG})
        assert r.status_code == 503 and r.json()["error"] == "out_of_memory" and r.headers["retry-after"]
        assert freed_before_release == [True]
        assert c.post("/denoise", files={"image": PNG}).status_code == 200
        text = c.get("/metrics").text
        assert metric(text, "kdeq_rejected_requests_total", reason="out_of_memory") == 1
        assert metric(text, "kdeq_http_requests_total", endpoint="/denoise", status="500") == 0


def test_a_sticky_device_error_retires_the_device(monkeypatch) -> None:
    """A device-side assert: that request and every later one get 503 device_failed, /readyz is 503
    naming the device and the error, the worker ends, and the service reports the fault (the server
    exits on it: tests/test_service_device_exit.py)."""
    with client() as c:
        svc = c.app.state.service
        assert svc.wait_loaded(60)
        predictor = svc.registry.slots[MODEL].predictors["cpu"]
        calls = []

        def predict(*args, **kwargs):
            calls.append(1)
            raise STICKY[0]

        monkeypatch.setattr(predictor, "predict", predict)
        r = c.post("/denoise", files={"image": PNG})
        assert r.status_code == 503 and r.json()["error"] == "device_failed", r.text
        assert "cpu failed" in r.json()["detail"] and r.headers["retry-after"]
        ready = c.get("/readyz")
        assert ready.status_code == 503 and ready.json()["status"] == "device_failed"
        assert ready.json()["detail"].startswith("cpu: CUDA error: device-side assert triggered")
        assert svc.fault is not None and not svc.engine.alive
        again = c.post("/denoise", files={"image": PNG})
        assert again.status_code == 503 and again.json()["error"] == "device_failed"
        assert calls == [1]  # not retried, and the retired worker took no further batch
        assert metric(c.get("/metrics").text, "kdeq_rejected_requests_total", reason="device_failed") == 2


def fail_cuda(*args, **kwargs):
    raise AssertionError("a scrape called into CUDA")


def test_a_scrape_never_initialises_cuda_and_survives_a_failing_collector(monkeypatch, caplog) -> None:
    for name in ("init", "mem_get_info", "memory_allocated", "memory_reserved", "current_device"):
        monkeypatch.setattr(torch.cuda, name, fail_cuda)
    metrics = Metrics([10], ["cuda:0", "cuda:1"])
    # loading: no worker has selected its device yet, so nothing is read
    text = metrics.render().decode()
    assert "kdeq_cuda_memory_total_bytes{" not in text
    assert metric(text, "kdeq_metrics_collector_errors_total", collector="cuda_memory") == 0
    # cuda:0's worker is up: only cuda:0 is read
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda d: (3, 10))
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda d: 1)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda d: 2)
    metrics.device_ready("cuda:0")
    text = metrics.render().decode()
    assert metric(text, "kdeq_cuda_memory_free_bytes", device="cuda:0") == 3
    assert 'device="cuda:1"' not in text
    # a CUDA error at scrape: the scrape succeeds without those series, and the error is counted
    # (in the same scrape) and logged once
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda d: (_ for _ in ()).throw(STICKY[2]))
    with caplog.at_level(logging.ERROR, logger="kdeq.service"):
        for scrape in (1, 2):
            text = metrics.render().decode()
            assert "kdeq_cuda_memory_free_bytes{" not in text and "kdeq_queue_depth" in text
            assert metric(text, "kdeq_metrics_collector_errors_total", collector="cuda_memory") == scrape
    assert [r.getMessage() for r in caplog.records] == [
        "metrics collector cuda_memory failed; its series are left out of scrapes"
    ]
