"""``kdeq train`` and ``python -m kdeq.train`` (also under ``torchrun``): arguments → ``TrainConfig``."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Literal, get_args, get_origin

from pydantic import ValidationError
from pydantic.fields import FieldInfo

from kdeq.models.checkpoint import CheckpointError
from kdeq.registry import TASKS
from kdeq.train.config import TrainConfig
from kdeq.train.loop import TrainingError, train
from kdeq.train.objectives import SquaredError
from kdeq.train.preflight import STATE_DIR, require, state_history
from kdeq.train.trainings import TRAININGS, RunKnobs


def _pair(text: str) -> tuple[float, float]:
    lo, sep, hi = text.partition(",")
    return (float(lo), float(hi if sep else lo))


def _floats(text: str) -> tuple[float, ...]:
    return tuple(float(v) for v in text.split(",") if v)


def _shown(value: object, nargs: object) -> str:
    """``value`` as the option takes it: a list of values spaced (``nargs``), a pair comma-joined."""
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, tuple | list):
        if not value:
            return "none"
        return (" " if nargs in ("+", "*") else ",").join(_shown(v, None) for v in value)
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


def _option(p: argparse.ArgumentParser, flag: str, default: str | None = None, **kwargs: object) -> None:
    """``flag``, the option of the ``TrainConfig`` field of its name: its help is the field's description
    and its default (``default``: what the default is, where the option's own differs from the
    field's), or ``required``. argparse keeps no default of its own (``None``: not given), so that
    ``TrainConfig``'s applies: one source for both."""
    name = flag.removeprefix("--").replace("-", "_")
    field = TrainConfig.model_fields[name]
    if default is None and field.is_required():
        kwargs["required"] = True
        tail = "required"
    else:
        tail = f"default: {default or _shown(field.default, kwargs.get('nargs'))}"
    # argparse formats help with %: a description's own % must stay one
    p.add_argument(flag, help=f"{field.description} ({tail})".replace("%", "%%"), **kwargs)


def knob_kwargs(field: FieldInfo) -> dict[str, object]:
    """``add_argument``'s type, count and choices for a knob field (``kdeq.train.trainings.RunKnobs``),
    from its annotation, and its metavar (``json_schema_extra``'s): ``bool`` a switch, ``int`` or
    ``float`` one value, ``tuple[float, float]`` a comma-joined pair ``LO,HI``, ``tuple[X, ...]`` one
    or more values (a ``Literal``'s choices); ``TypeError`` for another annotation."""
    kind, args = field.annotation, get_args(field.annotation)
    metavar = (field.json_schema_extra or {}).get("metavar")
    if kind is bool:
        return {"action": "store_true"}
    if kind in (int, float):
        return {"type": kind, "metavar": metavar}
    if get_origin(kind) is tuple and args == (float, float):
        return {"type": _pair, "metavar": metavar}
    if get_origin(kind) is tuple and len(args) == 2 and args[1] is Ellipsis:
        if get_origin(args[0]) is Literal:
            return {"nargs": "+", "choices": get_args(args[0])}
        return {"nargs": "+", "type": args[0], "metavar": metavar}
    raise TypeError(f"a knob of type {kind} has no command-line form (kdeq.train.cli.knob_kwargs)")


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The trainer's options: one per ``TrainConfig`` field, described by it, and ``--quiet``."""
    # every registered task: one without a training is refused by TrainConfig, with the reason
    _option(p, "--task", choices=list(TASKS))
    _option(p, "--spec", default="<task>-kglm")
    _option(p, "--init", choices=("kglm", "random"))
    _option(p, "--warm-start", metavar="DIR")
    _option(p, "--train-only", nargs="+", metavar="PREFIX")
    _option(p, "--colour-net", type=int, metavar="N")
    _option(p, "--train", nargs="+", metavar="DIR")
    _option(p, "--val", nargs="+", metavar="DIR")
    _option(p, "--out", metavar="DIR")
    _option(p, "--epochs", type=int, metavar="N")
    _option(p, "--samples-per-epoch", type=int, metavar="N")
    _option(p, "--batch-size", type=int, metavar="N")
    _option(p, "--patch-size", type=int, metavar="PIXELS")
    _option(p, "--loss", choices=get_args(SquaredError))
    _option(p, "--lr", type=float)
    _option(p, "--schedule", choices=("cosine", "constant"))
    _option(p, "--warmup-steps", type=int, metavar="N")
    _option(p, "--clip-grad", type=float, metavar="NORM")
    # the trainings' corruption knobs, each declared once (kdeq.train.tasks)
    for name, field in RunKnobs.model_fields.items():
        _option(p, "--" + name.replace("_", "-"), **knob_kwargs(field))
    _option(p, "--train-tol", type=float, metavar="TOL")
    _option(p, "--train-max-iter", type=int, metavar="N")
    _option(p, "--eval-tol", type=float, metavar="TOL")
    _option(p, "--eval-max-iter", type=int, metavar="N")
    _option(p, "--backward", choices=("implicit", "jacobian_free"))
    _option(p, "--pilot-loss", type=float, metavar="W")
    _option(p, "--pilot-epochs", type=int, metavar="N")
    _option(p, "--min-converged", type=float, metavar="FRACTION")
    _option(p, "--max-rollbacks", type=int, metavar="N")
    _option(p, "--val-levels", type=_floats, metavar="A,B,…")
    _option(p, "--val-limit", type=int, metavar="N")
    _option(p, "--val-crop", type=int, metavar="PIXELS")
    _option(p, "--channels", type=int, choices=(1, 3))
    _option(p, "--seed", type=int)
    _option(p, "--device")
    _option(p, "--workers", type=int, metavar="N")
    _option(p, "--dist-timeout", type=float, metavar="SECONDS")
    _option(p, "--resume", action="store_true")
    _option(p, "--stop-after", type=int, metavar="EPOCH")
    p.add_argument("--quiet", action="store_true", help="no progress bars (default: off, bars on stderr)")


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    """``TrainConfig`` of the options given (those not given take its defaults)."""
    fields = set(TrainConfig.model_fields)
    values = {k: v for k, v in vars(args).items() if k in fields and v is not None}
    values["spec"] = args.spec or f"{args.task}-kglm"
    return TrainConfig.model_validate(values)


def _one_line(err: Exception) -> str:
    """``err``'s message on one line; a ``ValidationError``'s as ``--option: problem`` per error."""
    if isinstance(err, ValidationError):
        parts = []
        for e in err.errors():
            where = "--" + "-".join(str(e["loc"][0]).split("_")) if e["loc"] else ""
            msg = str(e["msg"]).removeprefix("Value error, ")
            parts.append(f"{where}: {msg}" if where else msg)
        text = "; ".join(parts)
    else:
        text = str(err)
    return " ".join(text.split())


def _progress_bars() -> Callable[[int], object]:
    """tqdm bars on standard error (``MissingExtraError`` without tqdm)."""
    tqdm = require("tqdm", "progress bars", "pass --quiet").tqdm

    def progress(total: int) -> object:
        return tqdm(total=total, dynamic_ncols=True, unit="step")

    return progress


def _after_interrupt(out: Path) -> str:
    """What an interrupted run left in ``out``, and what to do next."""
    try:
        state = state_history(out)
    except ValueError:
        state = None
    if state is not None:
        return (
            f"{out / STATE_DIR} holds epoch {state[1]['epoch']}: rerun the command with --resume to continue"
        )
    if out.exists():
        return f"{out} holds no state to resume: rerun the command into another version"
    return f"nothing was written to {out}"


def run(args: argparse.Namespace) -> int:
    """Train; exit status 0, or 2 with one line for bad settings or data, or for what the run would
    have needed (``kdeq.train.preflight``), before anything is written; 4 when training failed; 130
    when interrupted (Ctrl-C), saying how to continue."""
    try:
        cfg = config_from_args(args)
        report = train(cfg, None if args.quiet else _progress_bars())
    except (ValueError, CheckpointError, OSError) as err:  # ValidationError is a ValueError
        print(f"kdeq train: error: {_one_line(err)}", file=sys.stderr)
        return 2
    except TrainingError as err:
        print(f"kdeq train: failed: {_one_line(err)}", file=sys.stderr)
        return 4
    except KeyboardInterrupt:
        print(f"kdeq train: interrupted; {_after_interrupt(Path(args.out))}", file=sys.stderr)
        return 130
    hist = report["history"]
    if not hist["epochs"]:  # another rank's process: rank 0 reports
        return 0
    if hist["best_epoch"] is None:
        print("kdeq train: failed: no epoch had a finite validation score; nothing written", file=sys.stderr)
        return 4
    score = f"val_{TRAININGS[cfg.task].score_name}"
    start, best = hist["epochs"][0][score], hist["epochs"][hist["best_epoch"]][score]
    print(
        f"wrote {cfg.out}: epoch {hist['best_epoch']} of {cfg.epochs}, {score} {start:.4g} at the "
        f"start → {best:.4g}; {hist['rollbacks']} rollbacks; report in {cfg.out / 'report'}"
    )
    if best <= start:
        print(
            f"kdeq train: warning: no epoch beat the start on validation ({best:.4g} ≤ {start:.4g})",
            file=sys.stderr,
        )
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kdeq.train", description="train a kGLM-DEQ checkpoint")
    add_arguments(parser)
    return run(parser.parse_args(argv))
