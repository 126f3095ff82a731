"""``kdeq train`` fails before its first step or not at all for what it needs (the ``train`` extra, a
writable ``--out`` with room), never leaves a checkpoint or a resume state half written, resumes
after Ctrl-C, and describes every option with its default."""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

import pytest
import torch

from kdeq.cli import main as kdeq_main
from kdeq.models.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from kdeq.models.initialize import DEFAULT_SPECS, init_tensors
from kdeq.research import experiment
from kdeq.runtime import atomic
from kdeq.train import cli, loop, preflight
from kdeq.train.config import TrainConfig
from kdeq.train.trainings import TRAININGS, knob_fields
from tests.test_train import smooth_images

ROOT = Path(__file__).resolve().parents[1]
SPEC = next(s for s in DEFAULT_SPECS if s.name == "denoise-stationary-kglm")


@pytest.fixture(scope="module")
def images(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("images")
    return smooth_images(root / "train", 4, 40, 0), smooth_images(root / "val", 1, 32, 1)


def train_args(images: tuple[Path, Path], out: Path, *extra: str) -> list[str]:
    """A small run's ``kdeq train`` arguments (three epochs of four steps on the stationary denoiser)."""
    return [
        "train",
        *("--task", "denoise", "--spec", "denoise-stationary-kglm", "--out", str(out)),
        *("--train", str(images[0]), "--val", str(images[1])),
        *("--epochs", "3", "--samples-per-epoch", "16", "--batch-size", "4", "--patch-size", "24"),
        *("--sigma", "10,40", "--val-levels", "25", "--device", "cpu", "--workers", "0"),
        *extra,
    ]


def hide(monkeypatch: pytest.MonkeyPatch, module: str) -> None:
    """Make ``module`` and its submodules fail to import, as where it is not installed."""
    for name in [m for m in sys.modules if m == module or m.startswith(module + ".")] + [module]:
        monkeypatch.setitem(sys.modules, name, None)


def one_line_error(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def train_extra_modules() -> list[str]:
    """The import name of each of the ``train`` extra's packages (pyproject.toml): the one named as
    the package is, or its only one."""
    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["train"]
    modules = []
    for requirement in extra:
        package = re.split(r"[<>=!~\[ ;]", requirement, maxsplit=1)[0].lower()
        names = sorted(
            m
            for m, dists in importlib.metadata.packages_distributions().items()
            if package in {d.lower() for d in dists} and not m.startswith("_")
        )
        own = [m for m in names if m == package.replace("-", "_")]
        assert own or len(names) == 1, (package, names)
        modules.append((own or names)[0])
    return modules


# --- the help -------------------------------------------------------------------------------------


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    cli.add_arguments(p)
    return p


def test_every_option_has_help_with_its_default_or_required() -> None:
    actions = [a for a in parser()._actions if not isinstance(a, argparse._HelpAction)]
    assert {a.dest for a in actions} >= set(TrainConfig.model_fields), "a setting without its option"
    for action in actions:
        assert action.help and len(action.help) > 20, action.option_strings
        assert re.search(r"\((required|default: [^)]+)\)$", action.help), action.help
        assert (action.help.endswith("(required)")) == action.required, action.help
        if action.dest in TrainConfig.model_fields and action.dest != "spec":
            description = TrainConfig.model_fields[action.dest].description
            assert description and action.help.startswith(description), action.dest


def test_the_defaults_the_help_shows_are_the_ones_a_run_takes() -> None:
    """Each shown default, given back to its option in the option's own syntax, makes the same
    settings as leaving the option out; leaving it out takes the config's field default."""
    required = ["--task", "denoise", "--train", "t", "--val", "v", "--out", "m/x/1"]
    p = parser()
    bare = cli.config_from_args(p.parse_args(required))
    for action in p._actions:
        shown = re.search(r"\(default: ([^)]+)\)$", action.help or "")
        if action.dest not in TrainConfig.model_fields or action.dest == "spec" or not shown:
            continue
        field = TrainConfig.model_fields[action.dest]
        assert getattr(bare, action.dest) == field.default, action.dest
        value = shown.group(1)
        if value in ("unset", "none", "off"):
            assert field.default in (None, (), False), (action.dest, value)
            continue
        words = value.split(" ") if action.nargs in ("+", "*") else [value]
        given = cli.config_from_args(p.parse_args([*required, action.option_strings[0], *words]))
        assert given == bare, (action.dest, value)
    assert bare.spec == "denoise-kglm"  # the option's own default, <task>-kglm


def test_kdeq_train_help_lists_every_option(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as done:
        kdeq_main(["train", "--help"])
    assert done.value.code == 0
    shown = capsys.readouterr().out
    for action in parser()._actions:
        for flag in action.option_strings:
            assert flag in shown
    assert shown.count("(default:") + shown.count("(required)") == len(parser()._actions) - 1


def test_the_settings_and_options_beside_the_runs_own_are_exactly_the_trainings_knobs() -> None:
    """``TrainConfig``'s fields beyond those its own class declares are the union of the trainings'
    knobs (``kdeq.train.tasks``), each as declared (type, default, bounds, description), and the
    command line has one option per field plus ``--quiet``: a knob is declared once, in its task's
    training."""
    knobs = knob_fields(list(TRAININGS.values()))
    assert set(knobs) == set().union(*(t.knobs.model_fields for t in TRAININGS.values()))
    own = set(TrainConfig.__annotations__)
    assert own.isdisjoint(knobs) and set(TrainConfig.model_fields) == own | set(knobs)
    for name, declared in knobs.items():
        field = TrainConfig.model_fields[name]
        for key in ("annotation", "default", "description", "metadata"):
            assert getattr(field, key) == getattr(declared, key), (name, key)
    options = {a.dest: a for a in parser()._actions if not isinstance(a, argparse._HelpAction)}
    assert set(options) == set(TrainConfig.model_fields) | {"quiet"}
    for name in knobs:
        assert options[name].option_strings == ["--" + name.replace("_", "-")]


def test_a_new_trainings_knob_is_a_setting_and_an_option_with_no_other_edit(tmp_path: Path) -> None:
    """Training a task is one module in ``kdeq.train.tasks``: one for ``denoise-impulse`` (a task
    without a training), with a knob of its own, makes the task trainable and its knob a
    ``TrainConfig`` field and a ``kdeq train`` option, whose value reaches the training's settings;
    the other tasks keep theirs."""
    (tmp_path / "impulse.py").write_text(
        textwrap.dedent(
            """
            from pydantic import Field

            from kdeq.train.tasks.base import NoiseKnobs, Training


            class ImpulseKnobs(NoiseKnobs):
                impulses: tuple[float, float] = Field(
                    (0.0, 0.2), description="impulse fractions", json_schema_extra={"metavar": "LO,HI"}
                )


            class ImpulseTraining(Training):
                name = "denoise-impulse"
                knobs = ImpulseKnobs

                def corrupt(self, clean, gen, settings, level=None, shared=None):
                    raise NotImplementedError

                def predictor_inputs(self, batch):
                    raise NotImplementedError

                def val_levels(self, settings):
                    return (0.1,)

                def check_level(self, level, settings):
                    pass
            """
        )
    )
    script = textwrap.dedent(
        f"""
        import argparse
        import kdeq.train.tasks
        kdeq.train.tasks.__path__.append({str(tmp_path)!r})
        from kdeq.train import cli
        from kdeq.train.trainings import TRAININGS
        p = argparse.ArgumentParser()
        cli.add_arguments(p)
        required = ["--train", "t", "--val", "v", "--out", "m/x/1"]
        args = ["--task", "denoise-impulse", "--spec", "denoise-impulse-kglm", *required]
        cfg = cli.config_from_args(p.parse_args([*args, "--impulses", "0.1,0.3", "--sigma", "5,9"]))
        print(cfg.task_knobs())
        print(cfg.model_dump()["impulses"], list(TRAININGS))
        print(p.format_help())
        """
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    knobs, dumped, help_text = done.stdout.split("\n", 2)
    assert knobs == "sigma=(5.0, 9.0) impulses=(0.1, 0.3)"
    assert dumped.startswith("(0.1, 0.3) ") and "'denoise-impulse'" in dumped and "'deblur'" in dumped
    assert "--impulses LO,HI" in help_text and "impulse fractions (default: 0,0.2)" in help_text
    assert "--peaks LO,HI" in help_text


# --- what a run needs, checked before it starts ------------------------------------------------------


@pytest.mark.parametrize("module", train_extra_modules())
def test_without_a_module_of_the_train_extra_a_run_fails_at_once_or_not_at_all(
    module: str,
    images: tuple[Path, Path],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture,
) -> None:
    """The README's plain install: a module of the extra missing, ``kdeq train`` (progress bars on)
    either needs it and says so in one line, exit status 2, having written nothing and trained not
    a step, or does not need it and writes its checkpoint."""
    epochs = []  # each epoch takes a snapshot to roll back to before its first step
    snapshot = loop._snapshot
    monkeypatch.setattr(loop, "_snapshot", lambda *a: epochs.append(1) or snapshot(*a))
    hide(monkeypatch, module)
    out = tmp_path / "models" / "plain" / "1"
    code = kdeq_main(train_args(images, out, "--epochs", "1"))
    err = capsys.readouterr().err
    if module in ("matplotlib", "tqdm"):  # what the report and the progress bars draw with
        assert code == 2
    if code == 2:
        line = one_line_error(err)
        assert module in line and "pip install 'kdeq[train]'" in line, line
        assert not (tmp_path / "models").exists() and not epochs
    else:
        assert code == 0 and load_checkpoint(out).config.provenance.epochs == 1


def test_an_output_path_through_a_file_fails_before_anything_is_written(
    images: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    (tmp_path / "models").write_text("not a folder")
    assert kdeq_main(train_args(images, tmp_path / "models" / "x" / "1", "--quiet")) == 2
    assert "is a file, not a folder" in one_line_error(capsys.readouterr().err)
    assert (tmp_path / "models").read_text() == "not a folder"


def test_a_full_disk_fails_before_anything_is_written(
    images: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    usage = preflight.shutil.disk_usage(tmp_path)
    monkeypatch.setattr(preflight.shutil, "disk_usage", lambda p: usage._replace(free=4096))
    assert kdeq_main(train_args(images, tmp_path / "m" / "x" / "1", "--quiet")) == 2
    assert "MiB free on its disk" in one_line_error(capsys.readouterr().err)
    assert not (tmp_path / "m").exists()


def test_an_experiment_without_matplotlib_fails_before_it_computes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    hide(monkeypatch, "matplotlib")
    computed = []
    out = tmp_path / "exp"
    code = experiment.run_and_write(
        "demo", out, lambda: computed.append(1) or {}, lambda r: "", {"plot.png": lambda p, r: None}
    )
    assert code == 2 and not computed and not out.exists()
    assert "matplotlib" in one_line_error(capsys.readouterr().err)


# --- a checkpoint is written whole or not at all ------------------------------------------------------


def fail_at(monkeypatch: pytest.MonkeyPatch, k: int) -> list[int]:
    """Make the ``k``-th of ``kdeq.runtime.atomic``'s file operations (a temporary file's write, a rename)
    raise ``OSError``, as a crash there would stop the writer; the count of operations so far."""
    count = [0]
    write, replace = atomic._write_synced, os.replace

    def counted(real):
        def op(*args):
            count[0] += 1
            if count[0] == k + 1:
                raise OSError("injected: the writer stops here")
            return real(*args)

        return op

    monkeypatch.setattr(atomic, "_write_synced", counted(write))
    monkeypatch.setattr(atomic.os, "replace", counted(replace))
    return count


def tensors_plus(delta: float) -> dict[str, torch.Tensor]:
    """The spec's start scaled by ``1 + delta``: another checkpoint of the same spec."""
    return {k: v * (1 + delta) for k, v in init_tensors(SPEC).items()}


@pytest.mark.parametrize("existing", [False, True], ids=["new", "replacing"])
def test_an_interrupted_save_leaves_the_previous_checkpoint_or_none(
    existing: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A failure injected at each step of the write in turn: the folder then holds the checkpoint it
    held before (or, replacing one beside other files, none), never new weights beside an old config,
    and no temporary file stays behind."""
    new = tensors_plus(0.0)
    k = 0
    while True:
        directory = tmp_path / str(k) / "m" / "1"
        old = None
        if existing:
            old = save_checkpoint(directory, SPEC, tensors_plus(1e-3))
            (directory / "report").mkdir()
        with monkeypatch.context() as m:
            count = fail_at(m, k)
            try:
                config = save_checkpoint(directory, SPEC, new)
            except OSError:
                config = None
        # no temporary file or folder stays behind
        assert [p.name for p in directory.parent.iterdir()] in ([], ["1"])
        if directory.exists():
            assert not [p for p in directory.rglob("*") if p.name.endswith(".tmp")]
        if config is not None:  # no operation left to fail: the new checkpoint is whole
            assert load_checkpoint(directory).config == config and count[0] == k
            break
        if not existing:
            assert not directory.exists()
        elif (directory / "config.json").exists():
            assert load_checkpoint(directory).config == old
        else:
            with pytest.raises(CheckpointError, match="no such file"):
                load_checkpoint(directory)
        k += 1
    assert k == (4 if existing else 3)  # two files written, then two renamed or their folder once


def test_ctrl_c_while_a_checkpoint_is_renamed_in_waits_for_it_to_be_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SIGINT between the renames of a replacement is held back until both files are in place, then
    raised: the folder holds the whole new checkpoint."""
    directory = tmp_path / "m" / "1"
    save_checkpoint(directory, SPEC, tensors_plus(1e-3))
    handler = signal.getsignal(signal.SIGINT)
    replace = os.replace

    def interrupted(src, dst):
        os.kill(os.getpid(), signal.SIGINT)
        return replace(src, dst)

    monkeypatch.setattr(atomic.os, "replace", interrupted)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(directory, SPEC, tensors_plus(0.0))
    monkeypatch.undo()
    assert signal.getsignal(signal.SIGINT) is handler
    for name, t in load_checkpoint(directory).tensors.items():
        torch.testing.assert_close(t, tensors_plus(0.0)[name], rtol=0, atol=0)


# --- Ctrl-C during training, and the rerun --------------------------------------------------------------


@pytest.fixture(scope="module")
def uninterrupted(images: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("whole") / "den" / "1"
    assert kdeq_main(train_args(images, out, "--quiet")) == 0
    return out


@pytest.mark.parametrize("when", ["writing", "renaming"])
def test_ctrl_c_while_the_state_is_saved_resumes_to_the_uninterrupted_result(
    when: str,
    images: tuple[Path, Path],
    uninterrupted: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture,
) -> None:
    """Ctrl-C while epoch 2's resume state is written (its files, or their renames into place): the
    command says how to continue, a rerun without ``--resume`` says to add it, and with it the run
    ends with the uninterrupted run's checkpoint and state, byte for byte."""
    out = tmp_path / "den" / "1"
    write_files = loop.write_files

    def interrupting(directory: Path, files: dict[str, bytes]) -> None:
        epoch = json.loads(files["state.json"])["history"]["epoch"] if "state.json" in files else 0
        if epoch != 2:
            return write_files(directory, files)
        with monkeypatch.context() as m:
            target, real = (atomic, atomic._write_synced) if when == "writing" else (atomic.os, os.replace)
            name = "_write_synced" if when == "writing" else "replace"

            def sigint(*args):
                os.kill(os.getpid(), signal.SIGINT)
                return real(*args)

            m.setattr(target, name, sigint)
            return write_files(directory, files)

    monkeypatch.setattr(loop, "write_files", interrupting)
    assert kdeq_main(train_args(images, out, "--quiet")) == 130
    saved = json.loads((out / "train-state" / "state.json").read_text())["history"]["epoch"]
    assert saved == (1 if when == "writing" else 2)
    assert "rerun the command with --resume" in one_line_error(capsys.readouterr().err)
    monkeypatch.undo()

    assert kdeq_main(train_args(images, out, "--quiet")) == 2
    assert f"after epoch {saved} of 3: add --resume" in one_line_error(capsys.readouterr().err)
    assert kdeq_main(train_args(images, out, "--quiet", "--resume")) == 0
    for name in ("weights.safetensors", "config.json", "train-state/state.safetensors"):
        assert (out / name).read_bytes() == (uninterrupted / name).read_bytes(), name
    assert not [p for p in out.rglob("*") if p.name.endswith(".tmp")]
    assert kdeq_main(train_args(images, out, "--quiet")) == 2
    assert "already holds a checkpoint of this finished run" in capsys.readouterr().err
