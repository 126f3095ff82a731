"""Training under ``torchrun`` (gloo on the CPU): every learned recipe through its pilot and
whole-model phases, interrupted and resumed; two machines' launchers; rollbacks that one rank
alone asks for; and the choice of backend and device that a CUDA cluster needs. Each run is tiny
(two steps per phase, one thread per process); the images are made here."""

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from PIL import Image
from safetensors.torch import load_file

from kdeq.models.checkpoint import load_checkpoint
from kdeq.models.initialize import GROWN_SPECS
from kdeq.train.config import TrainConfig
from kdeq.train.data import PatchDataset
from kdeq.train.loop import distributed_setup
from kdeq.train.model import TrainableModel, start_tensors
from kdeq.train.trainings import TRAININGS

ROOT = Path(__file__).resolve().parents[1]
TORCHRUN = shutil.which("torchrun", path=str(Path(sys.executable).parent))
SPECS = {s.name: s for s in GROWN_SPECS}
#: each learned recipe's own options (docs/training.md), beside the shared tiny budget
RECIPES = {
    "denoise-kglm-net": ["--task", "denoise", "--val-levels", "25"],
    "inpaint-kglm-net": ["--task", "inpaint", "--mask-kinds", "pixels", "strokes", "--val-levels", "0"],
    "segment-kglm-net": ["--task", "segment", "--sigma", "0,255", "--flip", "0.35"],
    "deblur-kglm-net": ["--task", "deblur", "--sigma", "1,12", "--psfs", "gaussian:1", "motion:5"],
    "super-resolve-kglm-net": ["--task", "super-resolve", "--scales", "2", "4"],
    "denoise-poisson-kglm-net": ["--task", "denoise-poisson", "--peaks", "1,30", "--val-levels", "4"],
}
#: the recipe whose resumed run is compared with an uninterrupted run on two machines (each launch
#: costs seconds of start-up, so one comparison covers both)
REFERENCE = "denoise-kglm-net"
SAMPLES, PER_RANK, RANKS = 4, 1, 2
STEPS_PER_EPOCH = SAMPLES // (PER_RANK * RANKS)


def write_images(directory: Path, count: int, size: int, seed: int) -> Path:
    """``count`` grey PNGs of ``size``²: smoothed noise around a brighter disc, so that a patch has
    texture to denoise and an edge to segment."""
    directory.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    ii, jj = torch.meshgrid(torch.arange(size), torch.arange(size), indexing="ij")
    for k in range(count):
        base = F.avg_pool2d(torch.rand(1, 1, size + 4, size + 4, generator=gen), 5, stride=1)[0, 0]
        ci, cj = torch.randint(size // 4, 3 * size // 4, (2,), generator=gen).tolist()
        disc = (ii - ci) ** 2 + (jj - cj) ** 2 < (size // 4) ** 2
        img = 0.25 + 0.3 * base + 0.35 * disc
        Image.fromarray((img * 255).round().to(torch.uint8).numpy()).save(directory / f"{k}.png")
    return directory


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("images")
    return write_images(root / "train", 3, 24, 0), write_images(root / "val", 1, 16, 1)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def train_args(spec: str, task_args: list[str], folders: tuple[Path, Path], out: Path) -> list[str]:
    """The trainer's options for ``spec`` on the tiny budget: ``STEPS_PER_EPOCH`` steps an epoch."""
    train_dir, val_dir = folders
    return [
        "--spec", spec, *task_args, "--train", str(train_dir), "--val", str(val_dir), "--out", str(out),
        "--samples-per-epoch", str(SAMPLES), "--batch-size", str(PER_RANK), "--patch-size", "16",
        "--val-limit", "1", "--val-crop", "16", "--device", "cpu", "--workers", "0", "--quiet",
    ]  # fmt: skip


def recipe_args(recipe: str, folders: tuple[Path, Path], out: Path) -> list[str]:
    """``python -m kdeq.train``'s arguments for ``recipe``: a pilot epoch, then a whole-model epoch."""
    args = train_args(recipe, RECIPES[recipe], folders, out)
    return ["-m", "kdeq.train", *args, "--pilot-epochs", "1", "--epochs", "2"]


def torchrun(args: list[str]) -> None:
    """Run ``args`` under ``torchrun``: ``RANKS`` processes of one thread on a fresh local endpoint;
    fail with its stderr's tail."""
    assert TORCHRUN, "torchrun comes with torch"
    endpoint = f"127.0.0.1:{free_port()}"
    cmd = [TORCHRUN, "--nproc_per_node", str(RANKS), "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([*cmd, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]


def run_report(out: Path) -> dict:
    return json.loads((out / "report" / "run.json").read_text())


@pytest.fixture(scope="module")
def two_machines(folders, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``REFERENCE``'s two epochs, uninterrupted, as two machines run them: two ``torchrun``
    launchers of one process each, ``--nnodes 2`` against one c10d endpoint on 127.0.0.1 (both
    match it, so the first is told to host the store); the run's ``--out``."""
    out = tmp_path_factory.mktemp("two-machines") / REFERENCE / "1"
    endpoint = f"127.0.0.1:{free_port()}"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}

    def machine(host: int) -> subprocess.Popen:
        cmd = [
            TORCHRUN, "--nnodes", "2", "--nproc_per_node", "1", "--rdzv-backend", "c10d",
            "--rdzv-endpoint", endpoint, "--rdzv-id", "two-machines", "--rdzv-conf", f"is_host={host}",
            "--local-addr", "127.0.0.1", *recipe_args(REFERENCE, folders, out),
        ]  # fmt: skip
        return subprocess.Popen(
            cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
        )

    launchers = [machine(1), machine(0)]
    errors = [p.communicate(timeout=120)[1] for p in launchers]
    for proc, err in zip(launchers, errors, strict=True):
        assert proc.returncode == 0, err[-3000:]
    return out


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_a_learned_recipe_trains_and_resumes_on_two_ranks(recipe, folders, request, tmp_path) -> None:
    """The pilot epoch in one ``torchrun``, the whole-model epoch after ``--resume`` in another (whose
    first step is the phase switch): the ranks end equal each time, the pilot phase leaves the
    parameters it does not train where they started and the whole-model phase moves them. For
    ``REFERENCE``, the final state is byte for byte that of the uninterrupted run on two
    machines: neither the interruption nor spreading the ranks over machines changes a bit."""
    out = tmp_path / recipe / "1"
    args = recipe_args(recipe, folders, out)
    torchrun([*args, "--stop-after", "1"])
    first = run_report(out)
    assert first["world_size"] == RANKS and first["max_rank_difference"] == 0.0
    assert first["history"]["step"] == STEPS_PER_EPOCH
    pilot_state = load_file(str(out / "train-state" / "state.safetensors"))

    # the timeout is a process's own setting: a resume may change it
    torchrun([*args, "--resume", "--dist-timeout", "600"])
    second = run_report(out)
    assert second["max_rank_difference"] == 0.0
    assert second["history"]["step"] == 2 * STEPS_PER_EPOCH
    pilot_epoch, whole_epoch = second["history"]["epochs"][1:]
    # the pilot phase runs no solve; the whole model does
    assert pilot_epoch["train_iterations"] == 0 and whole_epoch["train_iterations"] > 0
    whole_state = load_file(str(out / "train-state" / "state.safetensors"))

    spec = SPECS[recipe]
    model = TrainableModel(spec, start_tensors(spec, "kglm", 0), torch.device("cpu"))
    start = {f"param.{n}": p.detach() for n, p in model.named_parameters()}
    pilot_only = set(model.phase_parameters(pilot_only=True))
    whole_only = set(model.phase_parameters(pilot_only=False)) - pilot_only
    assert pilot_only and whole_only
    for name in whole_only:
        assert torch.equal(pilot_state[f"param.{name}"], start[f"param.{name}"]), name
    assert any(not torch.equal(whole_state[f"param.{n}"], start[f"param.{n}"]) for n in whole_only)
    assert any(not torch.equal(whole_state[f"param.{n}"], pilot_state[f"param.{n}"]) for n in pilot_only)

    if recipe == REFERENCE:
        reference = request.getfixturevalue("two_machines") / "train-state" / "state.safetensors"
        assert (out / "train-state" / "state.safetensors").read_bytes() == reference.read_bytes()


def test_two_machines_launchers_train_one_model(two_machines) -> None:
    """Both launchers finished (the fixture), two ranks trained, and they ended identical; the
    checkpoint loads. (That this is the one-machine model: the resume test of ``REFERENCE``.)"""
    report = run_report(two_machines)
    assert report["world_size"] == 2 and report["max_rank_difference"] == 0.0
    assert report["history"]["epoch"] == 2 and report["history"]["step"] == 2 * STEPS_PER_EPOCH
    assert load_checkpoint(two_machines).config.name == REFERENCE


DRIVER = """
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from kdeq.train.cli import main
from kdeq.train.model import TrainableModel

init_process_group, forward, calls = dist.init_process_group, TrainableModel.forward, []


def recorded(backend, **options):
    # what the trainer asks of the process group, for the test to read
    found = {"backend": backend, "timeout": options["timeout"].total_seconds()}
    found["device_id"] = str(options["device_id"])
    Path(__file__).with_name(f"group-{os.environ['RANK']}.json").write_text(json.dumps(found))
    return init_process_group(backend, **options)


def troubled(self, *args):
    # rank 1's second step reports solves that did not converge; rank 0 sees nothing wrong
    out, iterations, converged, pilot = forward(self, *args)
    calls.append(None)
    if os.environ["RANK"] == "1" and len(calls) == 2:
        converged = torch.zeros_like(converged)
    return out, iterations, converged, pilot


dist.init_process_group, TrainableModel.forward = recorded, troubled
sys.exit(main(sys.argv[1:]))
"""


def test_rollbacks_agree_and_the_group_gets_the_timeout(folders, tmp_path) -> None:
    """A model without a network (one phase, every parameter in it) under ``torchrun``, where trouble
    on one rank alone rolls every rank back: one rollback is counted, the step size is halved once,
    the ranks end equal (a rank that stepped while the other rolled back would leave them apart),
    and the checkpoint loads. Each rank's gloo group got ``--dist-timeout`` and no CUDA device."""
    driver = tmp_path / "driver.py"
    driver.write_text(DRIVER)
    out = tmp_path / "rb" / "1"
    args = train_args("inpaint-kglm", ["--task", "inpaint"], folders, out)
    torchrun([str(driver), *args, "--epochs", "1", "--dist-timeout", "77"])
    report = run_report(out)
    assert report["world_size"] == RANKS and report["max_rank_difference"] == 0.0
    assert report["history"]["rollbacks"] == 1 and report["history"]["lr_factor"] == 0.5
    assert report["history"]["step"] == STEPS_PER_EPOCH
    assert load_checkpoint(out).config.task == "inpaint"
    for rank in range(RANKS):
        group = json.loads((tmp_path / f"group-{rank}.json").read_text())
        assert group == {"backend": "gloo", "timeout": 77.0, "device_id": "None"}


@pytest.mark.parametrize("recipe", sorted(SPECS))
def test_each_phase_trains_exactly_the_parameters_its_loss_reaches(recipe) -> None:
    """What DistributedDataParallel reduces in a phase (the parameters requiring gradients) is what
    the phase's loss gives a gradient to, for both phases of every learned model; the parameters
    the trainer keeps frozen stay frozen."""
    spec = SPECS[recipe]
    # the Jacobian-free backward reaches the parameters the implicit one does, without its solve
    model = TrainableModel(spec, start_tensors(spec, "kglm", 0), torch.device("cpu"), "jacobian_free")
    frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
    training = TRAININGS[spec.task]
    data = PatchDataset([torch.rand(1, 24, 24)], 12, training, training.knobs(), 2, seed=0, group=2)
    data.set_epoch(1)
    batch = torch.utils.data.default_collate([data[0], data[1]])
    for pilot_only in (True, False, True):
        model.set_phase(pilot_only)
        model.zero_grad(set_to_none=True)
        out, _, _, pilot = model(batch, None, pilot_only)
        (out.sum() + (0 if pilot is None else pilot.sum())).backward()
        reached = {n for n, p in model.named_parameters() if p.grad is not None}
        requiring = {n for n, p in model.named_parameters() if p.requires_grad}
        assert reached == requiring == set(model.phase_parameters(pilot_only)), pilot_only
        assert not requiring & frozen


def test_pilot_epochs_need_a_network(tmp_path) -> None:
    with pytest.raises(ValueError, match="pilot_epochs needs a model with a network"):
        TrainConfig(
            task="denoise", spec="denoise-kglm", train=(tmp_path,), val=(tmp_path,), out=tmp_path / "m" / "1",
            pilot_epochs=1,
        )  # fmt: skip


def test_backend_and_device_per_rank() -> None:
    """gloo on the CPU whatever the GPUs; nccl with one GPU per local rank; a clear refusal, naming
    the rank and the visible count, when a machine starts more processes than it has GPUs."""
    assert distributed_setup("cpu", 3, 0) == ("gloo", torch.device("cpu"))
    assert distributed_setup("cpu", 0, 8) == ("gloo", torch.device("cpu"))
    for local in range(4):
        assert distributed_setup("cuda", local, 4) == ("nccl", torch.device("cuda", local))
    with pytest.raises(ValueError, match=r"LOCAL_RANK 4 needs CUDA device 4, but this machine has 4 visible"):
        distributed_setup("cuda", 4, 4)
    with pytest.raises(ValueError, match=r"has 0 visible .*--nproc_per_node"):
        distributed_setup("cuda", 0, 0)
