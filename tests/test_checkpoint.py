"""Checkpoint format: round trip, the shipped defaults rebuilt bit for bit, and every refusal."""

import hashlib
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from kdeq.maths.kernels import Coregional, Kernel
from kdeq.models.checkpoint import CheckpointError, ModelSpec, load_checkpoint, save_checkpoint
from kdeq.models.initialize import DEFAULT_SPECS, init_tensors, write_defaults
from kdeq.models.repository import VERSION, default_models_dir, list_models
from kdeq.registry import TASKS

SHIPPED = Path(__file__).resolve().parents[1] / "models"


def test_committed_defaults_equal_a_rebuild(tmp_path: Path) -> None:
    built = write_defaults(tmp_path)
    # every default spec (one per task at least) is written once, where the repository holds it
    assert sorted(built) == sorted({tmp_path / s.name / str(s.version) for s in DEFAULT_SPECS})
    assert {s.task for s in DEFAULT_SPECS} == set(TASKS)
    for folder in built:
        for name in ("config.json", "weights.safetensors"):
            shipped = SHIPPED / folder.parent.name / folder.name / name
            assert shipped.read_bytes() == (folder / name).read_bytes(), f"{shipped} differs from a rebuild"


def test_repository_lists_the_shipped_models() -> None:
    """Every version folder under models/ is listed, by name then version, and loads without an error
    (what each version is: the model pages, docs/models/)."""
    assert default_models_dir() == SHIPPED
    on_disk = sorted(
        (model.name, int(version.name))
        for model in SHIPPED.iterdir()
        if model.is_dir()
        for version in model.iterdir()
        if VERSION.match(version.name)
    )
    entries = list_models(SHIPPED)
    assert [(e.name, e.version, e.error) for e in entries] == [(n, v, None) for n, v in on_disk]


@pytest.mark.parametrize("spec", DEFAULT_SPECS, ids=lambda s: s.name)
def test_round_trip(tmp_path: Path, spec: ModelSpec) -> None:
    tensors = init_tensors(spec)
    config = save_checkpoint(tmp_path / "m", spec, tensors)
    loaded = load_checkpoint(tmp_path / "m")
    assert loaded.config == config
    assert loaded.tensors.keys() == tensors.keys()
    for k, v in tensors.items():
        assert torch.equal(loaded.tensors[k], v)


@pytest.fixture
def ckpt(tmp_path: Path) -> Path:
    dest = tmp_path / "inpaint-kglm" / "1"
    shutil.copytree(SHIPPED / "inpaint-kglm" / "1", dest)
    return dest


def _edit_config(folder: Path, change) -> None:
    path = folder / "config.json"
    raw = json.loads(path.read_text())
    change(raw)
    path.write_text(json.dumps(raw))


def _replace_weights(folder: Path, blob: bytes) -> None:
    (folder / "weights.safetensors").write_bytes(blob)
    _edit_config(folder, lambda c: c.update(weights_sha256=hashlib.sha256(blob).hexdigest()))


def _tensors(folder: Path) -> dict[str, torch.Tensor]:
    return st_load((folder / "weights.safetensors").read_bytes())


CONFIG_BREAKS = {
    "unknown format version 2": lambda c: c.update(format_version=2),
    "architecture": lambda c: c["architecture"].update(kind="transformer"),
    "Extra inputs are not permitted": lambda c: c.update(learning_rate=0.1),
    "task": lambda c: c.update(task="deblur"),
    "uses the gaussian family, not bernoulli": lambda c: c.update(family="bernoulli"),
    "not PSD": lambda c: c["architecture"]["kernel"].update(mixing=[[[-1.0]]]),
}


@pytest.mark.parametrize("message", CONFIG_BREAKS)
def test_refuses_bad_configs(ckpt: Path, message: str) -> None:
    _edit_config(ckpt, CONFIG_BREAKS[message])
    with pytest.raises(CheckpointError, match=message) as err:
        load_checkpoint(ckpt)
    assert "config.json" in str(err.value)


def test_refuses_malformed_json_and_missing_files(ckpt: Path) -> None:
    (ckpt / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="not valid JSON"):
        load_checkpoint(ckpt)
    with pytest.raises(CheckpointError, match="no such file"):
        load_checkpoint(ckpt.parent / "9")


def test_refuses_a_sha256_mismatch(ckpt: Path) -> None:
    blob = bytearray((ckpt / "weights.safetensors").read_bytes())
    blob[-1] ^= 1
    (ckpt / "weights.safetensors").write_bytes(bytes(blob))
    with pytest.raises(CheckpointError, match=r"sha256 .* does not match"):
        load_checkpoint(ckpt)


def test_refuses_a_pickle_even_with_a_matching_sha256(ckpt: Path, tmp_path: Path) -> None:
    torch.save(_tensors(ckpt), tmp_path / "p.pt")
    _replace_weights(ckpt, (tmp_path / "p.pt").read_bytes())
    with pytest.raises(CheckpointError, match=r"a pickle .* never unpickled"):
        load_checkpoint(ckpt)


TENSOR_BREAKS = {
    r"missing \['w2'\]": lambda t: t.pop("w2"),
    r"extra \['bias'\]": lambda t: t.update(bias=torch.zeros(3)),
    "has shape": lambda t: t.update(w1=t["w1"][..., 1:-1, 1:-1].contiguous()),
    "dtype torch.float64": lambda t: t.update(v1=t["v1"].double()),
    "non-finite": lambda t: t["v2"].view(-1).__setitem__(0, float("nan")),
    "not a symmetric kernel": lambda t: t["w1"].view(-1).__setitem__(0, 5.0),
}


@pytest.mark.parametrize("message", TENSOR_BREAKS)
def test_refuses_bad_tensors(ckpt: Path, message: str) -> None:
    tensors = _tensors(ckpt)
    TENSOR_BREAKS[message](tensors)
    _replace_weights(ckpt, st_save(tensors))
    with pytest.raises(CheckpointError, match=message) as err:
        load_checkpoint(ckpt)
    assert "weights.safetensors" in str(err.value)


def test_cg_model_refuses_a_kernel_that_is_not_psd(ckpt: Path) -> None:
    box = Coregional.single(Kernel(profile="se", lengthscale=3.0, radius=4, taper="box")).filter_bank()
    tensors = {k: box.clone() for k in ("w1", "w2", "v1", "v2")}
    _replace_weights(ckpt, st_save(tensors))
    with pytest.raises(CheckpointError, match="not positive semi-definite"):
        load_checkpoint(ckpt)


def test_anderson_model_accepts_an_asymmetric_fine_tuned_w1(tmp_path: Path) -> None:
    spec = next(s for s in DEFAULT_SPECS if s.name == "segment-kglm")
    tensors = init_tensors(spec)
    tensors["w1"].view(-1)[0] += 0.1
    save_checkpoint(tmp_path / "s", spec, tensors)
    assert load_checkpoint(tmp_path / "s").tensors["w1"].view(-1)[0] == tensors["w1"].view(-1)[0]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"task": "inpaint"}, "guided"),
        ({"mean": "local", "architecture": DEFAULT_SPECS[1].architecture}, "local"),
        ({"task": "segment", "mean": "none", "architecture": DEFAULT_SPECS[1].architecture}, "noise λ rule"),
    ],
)
def test_spec_rejects_incompatible_choices(change: dict, message: str) -> None:
    raw = DEFAULT_SPECS[0].model_dump() | {
        k: (v.model_dump() if hasattr(v, "model_dump") else v) for k, v in change.items()
    }
    with pytest.raises(ValueError, match=message):
        ModelSpec.model_validate(raw)


def test_spec_rejects_cg_for_segmentation() -> None:
    raw = DEFAULT_SPECS[3].model_dump()
    raw["solver"]["method"] = "cg"
    with pytest.raises(ValueError, match="not affine"):
        ModelSpec.model_validate(raw)


def test_an_unreadable_config_is_a_checkpoint_error(ckpt: Path) -> None:
    (ckpt / "config.json").unlink()
    (ckpt / "config.json").mkdir()  # a directory where the file should be
    with pytest.raises(CheckpointError, match="cannot be read"):
        load_checkpoint(ckpt)
