"""Models loaded, swapped and unloaded without a restart (``KDEQ_MODEL_CONTROL``): the routes under
``/models/{name}``, in process and against a real server under traffic."""

from __future__ import annotations

import shutil
import threading
import time
from pathlib import Path

import httpx2 as httpx
import numpy as np
import pytest
import torch
from fastapi.testclient import TestClient

from kdeq.models.repository import load_predictor
from service import registry
from service.app import create_app
from service.settings import Settings
from tests.service_helpers import (
    MODELS,
    assert_error,
    decode,
    encode,
    metric,
    noisy,
    run_server,
    smooth_image,
    to_uint8,
)
from tests.test_faults import corrupt

NAME = "denoise-kglm"


def png(size: int = 40, seed: int = 1) -> bytes:
    return encode(to_uint8(noisy(smooth_image(size, size, seed), 20.0, seed)))


def repository(tmp_path: Path) -> Path:
    """A repository with versions 1 and 2 of the default denoiser (and a broken version 3 when made)."""
    root = tmp_path / "models"
    for version in ("1", "2"):
        shutil.copytree(MODELS / NAME / version, root / NAME / version)
    return root


def client(root: Path, **settings: object) -> TestClient:
    settings = {"models": (f"{NAME}:2",), "warmup_sizes": (32,), **settings}
    return TestClient(
        create_app(Settings(models_dir=root, device=("cpu",), **settings)), raise_server_exceptions=False
    )


def served_by(c: TestClient, data: bytes) -> tuple[str, np.ndarray]:
    r = c.post("/denoise", files={"image": ("x.png", data)}, data={"sigma": "20"})
    assert r.status_code == 200, r.text
    return r.headers["X-KDEQ-Model"], np.asarray(decode(r.content))


def test_the_state_of_a_model_is_readable_and_control_is_off_by_default(tmp_path) -> None:
    with client(repository(tmp_path)) as c:
        assert c.app.state.service.wait_loaded(120)
        state = c.get(f"/models/{NAME}").json()
        assert state["serving"] == f"{NAME}:2" and state["version"] == 2 and state["ready"]
        assert state["versions"] == [1, 2] and state["devices"] == ["cpu"]
        assert c.get(f"/models/{NAME}/ready").status_code == 200
        assert_error(c.get("/models/no-such-model"), 404, "no_model")
        assert_error(c.get("/models/no-such-model/ready"), 404, "no_model")
        body = assert_error(c.post(f"/models/{NAME}/load", json={"version": 1}), 403, "model_control_off")
        assert "KDEQ_MODEL_CONTROL" in body["detail"]
        assert_error(c.post(f"/models/{NAME}/unload"), 403, "model_control_off")
        assert served_by(c, png())[0] == f"{NAME}:2"


def test_a_load_swaps_the_version_in_and_an_unload_takes_it_out(tmp_path) -> None:
    root = repository(tmp_path)
    data = png()
    with client(root, model_control=True) as c:
        assert c.app.state.service.wait_loaded(120)
        r = c.post(f"/models/{NAME}/load", json={"version": 1})
        assert r.status_code == 200, r.text
        assert r.json()["serving"] == f"{NAME}:1" and r.json()["ready"]
        model, output = served_by(c, data)
        assert model == f"{NAME}:1"
        # the answer is version 1's, computed independently of the service
        image = torch.from_numpy(np.asarray(decode(data), dtype=np.float32) / 255)[None, None]
        alone = load_predictor(root / NAME / "1").predict(image, sigma=20.0)
        expected = np.clip(np.rint(alone.output[0, 0].numpy() * 255), 0, 255)
        assert np.abs(output.astype(float) - expected).max() <= 1
        assert [m["id"] for m in c.get("/models").json()] == [f"{NAME}:1"]
        text = c.get("/metrics").text
        assert metric(text, "kdeq_model_loads_total", model=NAME) == 1
        assert metric(text, "kdeq_model_serving_version", model=NAME) == 1
        assert metric(text, "kdeq_model_ready", model=f"{NAME}:2") == 0
        assert metric(text, "kdeq_model_ready", model=f"{NAME}:1") == 1

        # no body: the highest version
        assert c.post(f"/models/{NAME}/load").json()["serving"] == f"{NAME}:2"
        assert served_by(c, data)[0] == f"{NAME}:2"

        r = c.post(f"/models/{NAME}/unload")
        assert r.status_code == 200 and r.json()["serving"] is None and r.json()["versions"] == [1, 2]
        assert_error(c.post("/denoise", files={"image": ("x.png", data)}), 404, "no_model")
        assert c.get(f"/models/{NAME}/ready").status_code == 503
        assert metric(c.get("/metrics").text, "kdeq_model_serving_version", model=NAME) == 0
        assert_error(c.post(f"/models/{NAME}/unload"), 404, "no_model")
        assert c.post(f"/models/{NAME}/load").status_code == 200
        assert served_by(c, data)[0] == f"{NAME}:2"


@pytest.mark.parametrize("fault", ["corrupt weights", "wrong shapes"])
def test_a_load_that_fails_leaves_the_version_serving_untouched(tmp_path, fault: str) -> None:
    root = repository(tmp_path)
    shutil.copytree(root / NAME / "2", root / NAME / "3")
    phrase = corrupt(root / NAME / "3", fault)
    data = png()
    with client(root, model_control=True) as c:
        assert c.app.state.service.wait_loaded(120)
        before = served_by(c, data)
        body = assert_error(c.post(f"/models/{NAME}/load"), 422, "load_failed")
        assert str(root / NAME / "3") in body["detail"] and phrase in body["detail"]
        assert served_by(c, data)[0] == before[0] == f"{NAME}:2"
        assert np.array_equal(served_by(c, data)[1], before[1])
        state = c.get(f"/models/{NAME}").json()
        assert state["serving"] == f"{NAME}:2" and state["versions"] == [1, 2, 3]
        text = c.get("/metrics").text
        assert metric(text, "kdeq_model_load_failures_total", model=NAME) == 1
        assert metric(text, "kdeq_model_loads_total", model=NAME) == 0
        assert metric(text, "kdeq_model_serving_version", model=NAME) == 2


def test_bad_load_requests_are_refused_with_the_reason(tmp_path) -> None:
    with client(repository(tmp_path), model_control=True, api_key="s3cret") as c:
        assert c.app.state.service.wait_loaded(120)
        for path in (f"/models/{NAME}", f"/models/{NAME}/ready"):
            assert_error(c.get(path), 401, "unauthorized")
        assert_error(c.post(f"/models/{NAME}/load"), 401, "unauthorized")
        assert_error(c.post(f"/models/{NAME}/unload"), 401, "unauthorized")
        key = {"X-API-Key": "s3cret"}
        assert_error(c.post(f"/models/{NAME}/load", json={"version": 7}, headers=key), 404, "no_model")
        assert_error(c.post("/models/nothing-here/load", headers=key), 404, "no_model")
        assert_error(c.post("/models/..%2F..%2Fetc/load", headers=key), 404)
        assert_error(c.post(f"/models/{NAME}/load", json={"version": 0}, headers=key), 422)
        assert_error(c.post(f"/models/{NAME}/load", json={"versoin": 1}, headers=key), 422)
        assert c.get(f"/models/{NAME}", headers=key).json()["serving"] == f"{NAME}:2"


def test_requests_admitted_before_a_swap_finish_on_their_version(tmp_path) -> None:
    """Hold the worker on a first request while a second waits in the queue, swap version 1 in, then
    let them go: both answer from version 2, the version they were admitted with; the next, from 1."""
    with client(repository(tmp_path), model_control=True) as c:
        svc = c.app.state.service
        assert svc.wait_loaded(120)
        entered, release = threading.Event(), threading.Event()
        run = svc.engine.run_batch

        def held(device, jobs):
            entered.set()
            release.wait(60)
            return run(device, jobs)

        svc.engine.run_batch = held
        answers: list[str] = []
        # different sizes: two batches, so the second request waits in the queue
        threads = [
            threading.Thread(target=lambda s=s: answers.append(served_by(c, png(s))[0])) for s in (40, 56)
        ]
        threads[0].start()
        assert entered.wait(30)
        threads[1].start()
        deadline = time.monotonic() + 30
        while svc.engine.depth < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert svc.engine.depth == 1
        assert c.post(f"/models/{NAME}/load", json={"version": 1}).status_code == 200
        release.set()
        for t in threads:
            t.join(60)
        assert answers == [f"{NAME}:2", f"{NAME}:2"]
        assert served_by(c, png())[0] == f"{NAME}:1"


def test_a_load_under_traffic_fails_no_request(tmp_path) -> None:
    """A real server answering a steady stream of requests swaps version 1 for version 2: not one
    request fails, and the requests sent after the load answer from version 2."""
    with run_server(
        tmp_path, models=f"{NAME}:1", model_control="true", warmup_sizes="32,64", request_timeout_seconds=120
    ) as server:
        stop = threading.Event()
        outcomes: list[tuple[int, int, str | None]] = []

        def traffic(seed: int) -> None:
            data = png(48 + 8 * seed, seed)
            with httpx.Client(base_url=server.url, timeout=120) as http:
                while not stop.is_set():
                    r = http.post("/denoise", files={"image": ("x.png", data)}, data={"sigma": "20"})
                    outcomes.append((seed, r.status_code, r.headers.get("X-KDEQ-Model")))

        threads = [threading.Thread(target=traffic, args=(k,)) for k in range(3)]
        for t in threads:
            t.start()
        while len(outcomes) < 10:
            time.sleep(0.05)
        r = httpx.post(f"{server.url}/models/{NAME}/load", json={"version": 2}, timeout=120)
        assert r.status_code == 200, r.text
        after = len(outcomes)
        while len(outcomes) < after + 10:
            time.sleep(0.05)
        stop.set()
        for t in threads:
            t.join(120)
        statuses = [status for _, status, _ in outcomes]
        assert statuses.count(200) == len(statuses), sorted(set(statuses))
        assert [model for _, _, model in outcomes[:10]] == [f"{NAME}:1"] * 10
        for k in range(len(threads)):
            # a client had at most one request in flight across the swap: its later ones are 2's
            late = [model for seed, _, model in outcomes[after:] if seed == k]
            assert set(late[1:]) <= {f"{NAME}:2"}, late
        assert outcomes[-1][2] == f"{NAME}:2"
        text = httpx.get(f"{server.url}/metrics").text
        assert metric(text, "kdeq_model_loads_total", model=NAME) == 1
        assert metric(text, "kdeq_model_serving_version", model=NAME) == 2


def test_a_sticky_device_error_during_a_load_retires_the_device(tmp_path, monkeypatch) -> None:
    """A load whose warm-up meets a sticky device error answers 503 ``device_failed`` and retires
    the device (the replica then exits to be restarted), as a failing solve does."""
    with client(repository(tmp_path), model_control=True) as c:
        svc = c.app.state.service
        assert svc.wait_loaded(120)

        def broken(*args, **kwargs):
            raise RuntimeError("CUDA error: an illegal memory access was encountered")

        monkeypatch.setattr(registry, "solve_batch", broken)
        body = assert_error(c.post(f"/models/{NAME}/load", json={"version": 1}), 503, "device_failed")
        assert "illegal memory access" in body["detail"]
        assert svc.fault is not None and svc.fault.startswith("cpu: ")
        assert c.get("/readyz").json()["status"] == "device_failed"
        assert c.get(f"/models/{NAME}").json()["serving"] == f"{NAME}:2"
