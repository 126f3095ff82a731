"""Faults: broken model files, solves that go non-finite, device out-of-memory, and the API key's secrecy."""

from __future__ import annotations

import hashlib
import json
import logging
import pickle
import shutil
from pathlib import Path

import pytest
import torch
from fastapi.testclient import TestClient
from safetensors.torch import load_file, save_file

from kdeq.models.checkpoint import FixedLambda, ModelSpec, save_checkpoint
from kdeq.models.initialize import DEFAULT_SPECS, init_tensors
from service.app import create_app
from service.registry import ModelRegistry
from service.settings import Settings
from tests.helpers import served
from tests.service_helpers import MODELS, encode, metric, noisy, smooth_image, to_uint8

PNG = encode(to_uint8(noisy(smooth_image(48, 48), 20.0)))


def client(root: Path, **settings) -> TestClient:
    c = TestClient(
        create_app(Settings(models_dir=root, device=("cpu",), **settings)), raise_server_exceptions=False
    )
    return c


def copy_defaults(tmp_path: Path) -> Path:
    root = tmp_path / "models"
    shutil.copytree(MODELS, root)
    return root


def rewrite_weights(directory: Path, change) -> None:
    """Apply ``change`` to the tensors and rewrite them with a matching sha256, so that only the
    change itself is wrong."""
    tensors = load_file(directory / "weights.safetensors")
    change(tensors)
    save_file(tensors, directory / "weights.safetensors")
    blob = (directory / "weights.safetensors").read_bytes()
    config = json.loads((directory / "config.json").read_text())
    config["weights_sha256"] = hashlib.sha256(blob).hexdigest()
    (directory / "config.json").write_text(json.dumps(config))


def corrupt(directory: Path, fault: str) -> str:
    """Break ``directory``'s checkpoint in the way ``fault`` names; returns a phrase the error must hold."""
    weights, config = directory / "weights.safetensors", directory / "config.json"
    if fault == "corrupt weights":
        data = bytearray(weights.read_bytes())
        data[len(data) // 2] ^= 0xFF
        weights.write_bytes(bytes(data))
        return "sha256"
    if fault == "truncated weights":
        weights.write_bytes(weights.read_bytes()[:100])
        return "sha256"
    if fault == "sha256 mismatch":
        c = json.loads(config.read_text())
        c["weights_sha256"] = "0" * 64
        config.write_text(json.dumps(c))
        return "sha256"
    if fault == "wrong shapes":
        rewrite_weights(directory, lambda t: t.update(spatial=torch.zeros(3, 3)))
        return "shape"
    if fault == "NaN weights":
        rewrite_weights(directory, lambda t: t["spatial"].__setitem__((0, 0), float("nan")))
        return "finite"
    if fault == "unknown format version":
        c = json.loads(config.read_text())
        c["format_version"] = 99
        config.write_text(json.dumps(c))
        return "format"
    if fault == "pickle named as weights":
        weights.write_bytes(pickle.dumps({"spatial": torch.zeros(3, 3)}))
        return "pickle"
    raise AssertionError(fault)


FAULTS = [
    "corrupt weights",
    "truncated weights",
    "sha256 mismatch",
    "wrong shapes",
    "NaN weights",
    "unknown format version",
    "pickle named as weights",
]


@pytest.mark.parametrize("fault", FAULTS)
def test_a_broken_model_file_is_refused_by_name_and_the_rest_serve(tmp_path, caplog, fault: str) -> None:
    root = copy_defaults(tmp_path)
    broken = root / "denoise-kglm" / "8"
    reason = corrupt(broken, fault)
    with caplog.at_level(logging.ERROR, logger="kdeq.service"), client(root) as c:
        assert c.app.state.service.wait_loaded(120)
        models = {m["id"]: m for m in c.get("/models").json()}
        error = models[served("denoise-kglm")]["error"]
        assert not models[served("denoise-kglm")]["ready"] and reason in error.lower(), error
        assert str(broken) in error
        assert all(m["ready"] for k, m in models.items() if k != served("denoise-kglm"))
        assert metric(c.get("/metrics").text, "kdeq_model_ready", model=served("denoise-kglm")) == 0
        assert c.get("/readyz").status_code == 200  # other models are usable
        r = c.post("/denoise", files={"image": PNG})  # the next denoiser by name takes over as the default
        assert r.status_code == 200 and r.headers["x-kdeq-model"] == served("denoise-kglm-collab")
    assert any(str(broken) in rec.getMessage() for rec in caplog.records)


def test_readiness_is_503_only_when_no_model_is_usable(tmp_path) -> None:
    root = copy_defaults(tmp_path)
    for d in root.glob("*/*"):
        corrupt(d, "sha256 mismatch")
    with client(root) as c:
        assert c.app.state.service.wait_loaded(120)
        r = c.get("/readyz")
        assert r.status_code == 503 and r.json() == {"status": "no_models"}
        assert c.get("/healthz").status_code == 200


def test_a_pickle_is_never_unpickled(tmp_path) -> None:
    root = copy_defaults(tmp_path)
    marker = tmp_path / "pwned"

    class Exploit:
        def __reduce__(self):
            return (Path.touch, (marker,))

    (root / "segment-kglm" / "2" / "weights.safetensors").write_bytes(pickle.dumps(Exploit()))
    with client(root) as c:
        assert c.app.state.service.wait_loaded(120)
        models = {m["id"]: m for m in c.get("/models").json()}
        assert not models[served("segment-kglm")]["ready"]
    assert not marker.exists()


def test_a_solve_that_goes_non_finite_never_returns_nans(tmp_path) -> None:
    """A stationary denoiser whose λ is so small that float32 overflows: the client gets a clear 422,
    and the metrics count the solve as not converged."""
    base = next(s for s in DEFAULT_SPECS if s.name == "denoise-stationary-kglm")
    spec = ModelSpec(**{**base.model_dump(), "name": "overflow", "lam": FixedLambda(value=1e-38)})
    save_checkpoint(tmp_path / "overflow" / "1", spec, {k: v * 1e30 for k, v in init_tensors(spec).items()})
    with client(tmp_path, warmup=False) as c:
        assert c.app.state.service.wait_loaded(60)
        r = c.post("/denoise", files={"image": PNG})
        if r.status_code == 200:  # a finite best iterate: it must be flagged and finite
            assert r.headers["x-kdeq-converged"] == "false"
        else:
            assert r.status_code == 422 and r.json()["error"] == "non_finite", r.text
        text = c.get("/metrics").text
        assert metric(text, "kdeq_solver_nonconverged_total", model="overflow:1") == 1


def test_out_of_memory_gives_503_and_the_service_keeps_serving(monkeypatch) -> None:
    """An out-of-memory error injected into the model (CPU has no device memory to exhaust): that
    request gets 503 with Retry-After, the batch limit backs off, the next request is served. The
    back-off itself is tested in tests/test_engine.py."""
    with client(MODELS, max_batch_size=8) as c:
        assert c.app.state.service.wait_loaded(120)
        predictor = c.app.state.service.registry.slots[served("denoise-kglm")].predictors["cpu"]
        real, calls = predictor.predict, []

        def predict(images, *args, **kwargs):
            calls.append(images.shape[0])
            if len(calls) == 1:
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (injected)")
            return real(images, *args, **kwargs)

        monkeypatch.setattr(predictor, "predict", predict)
        r = c.post("/denoise", files={"image": PNG})
        assert r.status_code == 503 and r.json()["error"] == "out_of_memory" and r.headers["retry-after"]
        # a single request too large for the device says nothing about batches: the limit stays
        assert c.app.state.service.engine.batch_limit == 8
        assert c.post("/denoise", files={"image": PNG}).status_code == 200
        text = c.get("/metrics").text
        assert metric(text, "kdeq_batch_size_limit") == 8
        assert metric(text, "kdeq_rejected_requests_total", reason="out_of_memory") == 1
        assert metric(text, "kdeq_http_requests_total", endpoint="/denoise", status="503") == 1


def test_the_api_key_never_appears_in_logs(tmp_path, caplog, capfd) -> None:
    secret = "kdeq-secret-7f3a9c"
    with caplog.at_level(logging.DEBUG), client(MODELS, api_key=secret) as c:
        assert c.app.state.service.wait_loaded(120)
        c.post("/denoise", files={"image": PNG}, headers={"Authorization": f"Bearer {secret}"})
        c.post("/denoise", files={"image": PNG}, headers={"X-API-Key": "wrong-" + secret})
        c.get("/models", headers={"X-API-Key": secret})
        assert secret not in repr(c.app.state.service.settings)
    out, err = capfd.readouterr()
    logged = "\n".join(r.getMessage() for r in caplog.records) + out + err
    assert caplog.records and secret not in logged


def test_model_names_cannot_reach_outside_the_repository(tmp_path) -> None:
    (tmp_path / "outside").mkdir()
    with client(MODELS) as c:
        assert c.app.state.service.wait_loaded(120)
        for name in (
            "../outside",
            "..",
            "/etc/passwd",
            "denoise-kglm/../../x",
            "a" * 200,
            "denoise-kglm:../1",
        ):
            r = c.post("/denoise", files={"image": PNG}, data={"model": name})
            assert r.status_code in (400, 404, 422) and r.json()["error"], (name, r.text)
    # a configured name is checked the same way before any file is opened
    registry = ModelRegistry(MODELS, ("../outside", "/etc/passwd"))
    assert all(slot.path is None and "invalid model name" in slot.error for slot in registry.slots.values())
