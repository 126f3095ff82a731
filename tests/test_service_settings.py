"""Settings from KDEQ_* variables, the configuration page, and the direction of dependencies."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from service.encode import wants_json
from service.settings import Settings, SettingsError

ROOT = Path(__file__).resolve().parents[1]


def test_settings_parse_typed_values_from_the_environment(tmp_path) -> None:
    s = Settings.from_env(
        {
            "KDEQ_MODELS_DIR": str(tmp_path),
            "KDEQ_MODELS": "denoise-kglm, segment-kglm:1",
            "KDEQ_DEVICE": "cpu",
            "KDEQ_PORT": "9000",
            "KDEQ_MAX_BATCH_SIZE": "4",
            "KDEQ_BATCH_WAIT_SECONDS": "0.01",
            "KDEQ_API_KEY": "s3cr3t-key",
            "KDEQ_WARMUP": "false",
            "KDEQ_CONV_BACKEND": "prepadded",
            "KDEQ_NETWORK_PRECISION": "bfloat16",
            "KDEQ_GUIDED_BACKEND": "loop",
            "KDEQ_MALLOC": "system",
            "KDEQ_NATIVE_CACHE": str(tmp_path / "native"),
            "PATH": "/bin",
        }
    )
    assert s.models_dir == tmp_path and s.models == ("denoise-kglm", "segment-kglm:1")
    assert s.device == ("cpu",) and s.devices() == ["cpu"]
    assert (s.port, s.max_batch_size, s.batch_wait_seconds, s.warmup) == (9000, 4, 0.01, False)
    assert (s.conv_backend, s.network_precision, s.guided_backend) == ("prepadded", "bfloat16", "loop")
    assert (s.malloc, Settings().malloc) == ("system", "keep")
    assert (s.native_cache, Settings().native_cache) == (tmp_path / "native", None)
    assert s.api_key.get_secret_value() == "s3cr3t-key" and "s3cr3t" not in repr(s)
    assert Settings.from_env({"KDEQ_PORT": "9000"}, port=9100).port == 9100


@pytest.mark.parametrize(
    ("env", "named"),
    [
        ({"KDEQ_PORTT": "1"}, "KDEQ_PORTT"),
        ({"KDEQ_PORT": "0"}, "KDEQ_PORT"),
        ({"KDEQ_MAX_BATCH_SIZE": "many"}, "KDEQ_MAX_BATCH_SIZE"),
        ({"KDEQ_DEVICE": "tpu"}, "KDEQ_DEVICE"),
        ({"KDEQ_DEVICE": "cuda:7"}, "KDEQ_DEVICE"),
        ({"KDEQ_DEVICE": "auto,cpu"}, "KDEQ_DEVICE"),
        ({"KDEQ_LOG_LEVEL": "loud"}, "KDEQ_LOG_LEVEL"),
        ({"KDEQ_CONV_BACKEND": "winograd"}, "KDEQ_CONV_BACKEND"),
        ({"KDEQ_NETWORK_PRECISION": "float16"}, "KDEQ_NETWORK_PRECISION"),
        ({"KDEQ_MALLOC": "jemalloc"}, "KDEQ_MALLOC"),
        ({"KDEQ_REQUEST_TIMEOUT_SECONDS": "-1"}, "KDEQ_REQUEST_TIMEOUT_SECONDS"),
        ({"KDEQ_API_KEY": ""}, "KDEQ_API_KEY"),  # an empty key must not silently turn auth off
        ({"KDEQ_TILE_SIZE": "63"}, "KDEQ_TILE_SIZE"),
        ({"KDEQ_TILE_SIZE": "101"}, "KDEQ_TILE_SIZE"),
        ({"KDEQ_TILE_SIZE": "4096"}, "KDEQ_TILE_SIZE.*KDEQ_MAX_UNTILED_PIXELS"),
    ],
)
def test_invalid_settings_name_the_variable(env: dict, named: str) -> None:
    with pytest.raises(SettingsError, match=named):
        Settings.from_env(env)


def test_default_batch_size_follows_the_device() -> None:
    assert Settings.from_env({"KDEQ_DEVICE": "cpu"}).batch_size() == 1
    assert Settings.from_env({"KDEQ_DEVICE": "cpu", "KDEQ_MAX_BATCH_SIZE": "4"}).batch_size() == 4


def test_auto_device_is_the_cpu_without_cuda() -> None:
    import torch

    expected = (
        [f"cuda:{i}" for i in range(torch.cuda.device_count())] if torch.cuda.is_available() else ["cpu"]
    )
    assert Settings.from_env({}).devices() == expected


def test_the_configuration_page_documents_every_setting() -> None:
    page = (ROOT / "docs" / "configuration.md").read_text()
    for variable, _default, meaning in Settings.describe():
        assert f"`{variable}`" in page, variable
        assert meaning


@pytest.mark.parametrize(
    ("accept", "json"),
    [
        (None, False),
        ("*/*", False),
        ("image/png", False),
        ("application/json", True),
        ("application/json, */*;q=0.8", True),
        ("image/png, application/json", False),
        ("image/png;q=0.5, application/json", True),
        ("application/*", True),
        ("image/png;q=0", True),
        ("text/html", False),
    ],
)
def test_response_type_negotiation(accept: str | None, json: bool) -> None:
    assert wants_json(accept) is json


def _imports(path: Path) -> list[tuple[str, list[str]]]:
    tree = ast.parse(path.read_text())
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(alias.name, []) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.append((node.module, [alias.name for alias in node.names]))
    return found


def test_dependencies_point_one_way() -> None:
    for path in (ROOT / "kdeq").rglob("*.py"):
        assert not any(m.split(".")[0] == "service" for m, _ in _imports(path)), path
    for path in (ROOT / "service").rglob("*.py"):
        for module, names in _imports(path):
            if module.split(".")[0] == "kdeq":
                assert not any(part.startswith("_") for part in module.split(".")), (path, module)
                assert not any(n.startswith("_") for n in names), (path, names)


def test_only_the_inference_workers_touch_torch() -> None:
    """decode/encode/routes stay numpy-only (see ``service.decode``): torch's OpenMP pool then has one
    master thread."""
    for name in ("decode", "encode", "routes", "engine", "middleware", "errors", "app"):
        modules = {m.split(".")[0] for m, _ in _imports(ROOT / "service" / f"{name}.py")}
        assert "torch" not in modules, name
