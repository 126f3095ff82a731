"""The training loop: Adam on the constrained model, rollback on trouble, per-epoch checkpoints, resume, DDP.

One step: the batch's forward solve (``train_tol``/``train_max_iter``), the task's loss
(``Training.loss``: per-sample log MSE or MSE for Gaussian tasks, cross-entropy for segmentation),
implicit (or Jacobian-free) gradients, gradient clipping, an Adam step at the
scheduled rate, and ``project_``, which shortens a step that would make the equilibrium kernel
indefinite.

Before a step is taken its batch is checked: a non-finite loss or gradient, or
fewer than ``min_converged`` of the forward solves converged, means the current
parameters are bad, so they are replaced by the last parameters (and Adam
state) whose batch passed, the step size factor is halved, and the rollback is
counted. Under DistributedDataParallel the ranks agree on the verdict (an
all-reduce) so they stay identical.

After each epoch rank 0 validates (``predict`` with ``eval_*`` settings), writes
the checkpoint to ``out`` when validation improved, the training state to
``out/train-state`` and the report to ``out/report``. ``resume`` reloads the
state and continues with the next epoch; since every sample is a function of
``(seed, epoch, index)`` (``kdeq.train.data``), the result equals an
uninterrupted run's.

A model with a guide network trains in two phases (``pilot_epochs``, then the
whole model), and each phase's loss reaches only some parameters: each epoch
trains through a DistributedDataParallel wrapper of its own over exactly its
phase's parameters (``_epoch_net``).
"""

from __future__ import annotations

import gc
import hashlib
import json
import math
import os
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import load_file
from safetensors.torch import save as save_safetensors
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader

from kdeq.maths import fused
from kdeq.maths.precision import ieee_float32
from kdeq.models.checkpoint import ModelSpec, Provenance, checkpoint_files, save_checkpoint
from kdeq.predictors.base import SolverOverride, resolve_device
from kdeq.runtime import backends, native, netprecision
from kdeq.runtime.atomic import write_files
from kdeq.train.config import TrainConfig
from kdeq.train.data import (
    PatchDataset,
    centre_crop,
    check_patch_size,
    image_files,
    load_images,
    validation_set,
)
from kdeq.train.model import TrainableModel, start_tensors
from kdeq.train.preflight import REPORT_DIR, STATE_DIR, STATE_FILE, check_out, check_space, pyplot
from kdeq.train.report import write_report
from kdeq.train.tasks.base import Training
from kdeq.train.trainings import TRAININGS


class TrainingError(RuntimeError):
    """Training cannot go on (too many rollbacks); the message says why."""


@dataclass
class History:
    """What the run has done so far; ``epochs[0]`` is the validation of the start."""

    epoch: int = 0
    step: int = 0
    lr_factor: float = 1.0
    rollbacks: int = 0
    best_epoch: int | None = None
    epochs: list[dict[str, float]] = field(default_factory=list)


@dataclass
class EpochTotals:
    """Sums over an epoch's applied steps, per sample; ``mean`` of any of them."""

    loss: float = 0.0
    score: float = 0.0
    iterations: float = 0.0
    converged: float = 0.0
    n: int = 0
    backward_nonconverged: int = 0

    def add(
        self,
        training: Training,
        loss: torch.Tensor,
        out: torch.Tensor,
        batch: dict,
        its: torch.Tensor,
        conv: torch.Tensor,
    ):
        n = out.shape[0]
        self.loss += loss.item() * n
        self.score += training.score(out.detach(), batch).sum().item()
        self.iterations += its.float().sum().item()
        self.converged += conv.float().sum().item()
        self.n += n

    def mean(self, name: str) -> float:
        return getattr(self, name) / max(1, self.n)


def lr_at(cfg: TrainConfig, step: int, total: int) -> float:
    """The scheduled step size at ``step`` of a phase of ``total`` steps: linear warm-up, then cosine
    (or constant) from ``lr`` to 0."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    if cfg.schedule == "constant":
        return cfg.lr
    progress = (step - cfg.warmup_steps) / max(1, total - cfg.warmup_steps)
    return cfg.lr * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


def _fingerprint(cfg: TrainConfig, world: int) -> str:
    """What must not change between a run and its resumption: the settings (but ``resume``,
    ``stop_after``, ``workers``, ``device``, ``dist_timeout``) and the number of ranks, which sets
    the step's batch."""
    data = cfg.model_dump(mode="json", exclude={"resume", "stop_after", "workers", "device", "dist_timeout"})
    data["world_size"] = world
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()


@dataclass(frozen=True)
class Rank:
    """This process's place in a distributed run (``world = 1`` when not distributed)."""

    rank: int = 0
    world: int = 1
    local: int = 0

    @classmethod
    def from_env(cls) -> Rank:
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if world == 1:
            return cls()
        return cls(int(os.environ["RANK"]), world, int(os.environ.get("LOCAL_RANK", "0")))

    @property
    def main(self) -> bool:
        return self.rank == 0


def distributed_setup(device_type: str, local_rank: int, cuda_devices: int) -> tuple[str, torch.device]:
    """The process-group backend and this rank's device in a distributed run on ``device_type``
    (``cpu`` or ``cuda``): gloo on the CPU; nccl on ``cuda:local_rank`` (one GPU per process on
    each machine, whatever index ``--device`` named). ``ValueError`` when this machine has no such
    GPU among its ``cuda_devices`` visible ones, which would otherwise fail inside CUDA."""
    if device_type != "cuda":
        return "gloo", torch.device("cpu")
    if local_rank >= cuda_devices:
        raise ValueError(
            f"LOCAL_RANK {local_rank} needs CUDA device {local_rank}, but this machine has {cuda_devices} "
            f"visible (CUDA_VISIBLE_DEVICES); start at most {cuda_devices} processes per machine "
            "(torchrun --nproc_per_node) or train on the CPU (--device cpu)"
        )
    return "nccl", torch.device("cuda", local_rank)


def _device(cfg: TrainConfig, rank: Rank) -> tuple[torch.device, str]:
    """This process's device and, in a distributed run, its process-group backend (else ``""``)."""
    dev = resolve_device(cfg.device)
    if rank.world == 1:
        return dev, ""
    cuda_devices = torch.cuda.device_count() if dev.type == "cuda" else 0
    backend, dev = distributed_setup(dev.type, rank.local, cuda_devices)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    return dev, backend


def _to(ex: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    return {k: v.to(device, non_blocking=True) for k, v in ex.items()}


def _worker_init(_: int) -> None:
    torch.set_num_threads(1)


def _save_state(
    directory: Path, model: TrainableModel, opt: torch.optim.Adam, hist: History, fp: str
) -> None:
    """Parameters and Adam's moments (safetensors) and the counters (JSON), replaced as one set
    (``kdeq.runtime.atomic.write_files``): an interrupted run leaves the previous epoch's state whole."""
    tensors = {f"param.{k}": v.detach().cpu().contiguous() for k, v in model.named_parameters()}
    for i, name in enumerate(_adam_order(model, opt)):
        for key, value in opt.state_dict()["state"].get(i, {}).items():
            tensors[f"adam.{name}.{key}"] = value.detach().cpu().contiguous()
    meta = {"fingerprint": fp, "history": hist.__dict__}
    # the counters last: their file marks the state complete (kdeq.train.preflight reads it)
    write_files(
        directory,
        {
            "state.safetensors": save_safetensors(tensors),
            STATE_FILE: (json.dumps(meta, indent=1) + "\n").encode(),
        },
    )


def _adam_order(model: TrainableModel, opt: torch.optim.Adam) -> list[str]:
    """The parameters' names in the order Adam indexes its state (its groups', not
    ``named_parameters``'): the saved moments are labelled by name, so a state written under another
    grouping resumes the same."""
    by_id = {id(p): k for k, p in model.named_parameters()}
    return [by_id[id(p)] for group in opt.param_groups for p in group["params"]]


def _load_state(directory: Path, model: TrainableModel, opt: torch.optim.Adam) -> History:
    """The saved parameters and Adam's moments into ``model`` and ``opt``; the saved counters. That
    the state exists and has this run's settings is ``check_out``'s to say, before the run starts."""
    meta = json.loads((directory / STATE_FILE).read_text())
    tensors = load_file(str(directory / "state.safetensors"))
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, p in params.items():
            p.copy_(tensors[f"param.{name}"])
    sd = opt.state_dict()
    for i, name in enumerate(_adam_order(model, opt)):
        entry = {k.rsplit(".", 1)[1]: v for k, v in tensors.items() if k.startswith(f"adam.{name}.")}
        if entry:
            sd["state"][i] = {k: v.to(params[name].device) if k != "step" else v for k, v in entry.items()}
    opt.load_state_dict(sd)
    return History(**meta["history"])


def evaluate(
    model: TrainableModel, examples: list[dict[str, torch.Tensor]], cfg: TrainConfig, device: torch.device
) -> tuple[dict[str, float], list[torch.Tensor]]:
    """Validation metrics (mean loss, the task's score overall and per level, iterations, converged
    fraction) and the outputs ``(c, H, W)`` of the examples, one image at a time."""
    training = TRAININGS[cfg.task]
    override = SolverOverride(tol=cfg.eval_tol, max_iter=cfg.eval_max_iter)
    scores: dict[float, list[float]] = {}
    losses, iters, conv, outputs = [], [], [], []
    with torch.inference_mode():
        for ex in examples:
            batch = {k: v[None].to(device) for k, v in ex.items() if k != "level"}
            pred = model.run(batch, override)
            losses.append(training.loss(pred.output, batch["target"], cfg.loss).item())
            scores.setdefault(float(ex["level"]), []).append(training.score(pred.output, batch).item())
            iters.append(pred.stats.iterations.float().mean().item())
            conv.append(pred.stats.converged.float().mean().item())
            outputs.append(pred.output[0].cpu())
    score = training.score_name
    metrics = {
        "val_loss": sum(losses) / len(losses),
        f"val_{score}": sum(sum(v) for v in scores.values()) / sum(len(v) for v in scores.values()),
        "val_iterations": sum(iters) / len(iters),
        "val_converged": sum(conv) / len(conv),
    }
    for level, values in scores.items():
        metrics[f"val_{score}@{level:g}"] = sum(values) / len(values)
    return metrics, outputs


def validation_examples(cfg: TrainConfig) -> list[dict[str, torch.Tensor]]:
    """``cfg``'s fixed validation examples: the first ``val_limit`` images of ``val``, centre-cropped
    to ``val_crop``, each at every level (``validation_set``), the same for every epoch and run."""
    images = [centre_crop(x, cfg.val_crop) for x in load_images(image_files(cfg.val), cfg.channels)]
    training, settings = TRAININGS[cfg.task], cfg.task_knobs()
    return validation_set(images[: cfg.val_limit], training, settings, cfg.levels(), cfg.seed)


#: the zero-border convolution backend training uses where ``KDEQ_CONV_BACKEND`` is unset: the one
#: that beats torch's own call for every filter the models have on this project's CPU
TRAINING_BACKEND = "prepadded"


@contextmanager
def reproducible_arithmetic(device: torch.device | None = None) -> Iterator[None]:
    """The arithmetic every rank, a resumed run and ``bench/validate.py`` must repeat, within: no
    per-process timing of the convolution backends (``TRAINING_BACKEND``), the networks in float32 on
    any machine (a validation chooses the checkpoint), and the guided kernel's loops by torch whether
    or not a machine compiles its own on a CPU; on a CUDA ``device`` by Triton's fused kernels where
    it imports (``kdeq.maths.fused``: deterministic sums, no atomics), torch's otherwise."""
    guided = "triton" if device is not None and device.type == "cuda" and fused.available() else "loop"
    with (
        backends.reproducible(TRAINING_BACKEND),
        netprecision.choice.reproducible("float32"),
        native.choice.reproducible(guided),
    ):
        yield


def train(cfg: TrainConfig, progress: Callable[..., object] | None = None) -> dict:
    """Run ``cfg``; returns the report (also written to ``out/report/metrics.json`` by rank 0).

    ``progress(total=steps)`` makes rank 0's progress bar over the run's remaining steps (e.g.
    ``tqdm``: ``update``, ``set_description``, ``set_postfix``, ``write``, ``close``), whose estimate
    of the time left covers the whole run. Under ``torchrun`` (``WORLD_SIZE > 1``) the ranks train
    one model with DistributedDataParallel (gloo on the CPU, nccl on CUDA), each on its share of
    every batch.

    Everything the run needs only when it writes is checked before anything else (``preflight``):
    a run that cannot finish raises ``ValueError`` with nothing written.
    """
    rank = Rank.from_env()
    preflight(cfg, rank)
    device, backend = _device(cfg, rank)
    owned = rank.world > 1 and not dist.is_initialized()
    if owned:
        # device_id binds nccl's communicator to this rank's GPU up front (a barrier would otherwise
        # guess it); the timeout must outlast rank 0's validation, which the other ranks wait for
        dist.init_process_group(
            backend,
            timeout=timedelta(seconds=cfg.dist_timeout),
            device_id=device if device.type == "cuda" else None,
        )
    try:
        with reproducible_arithmetic(device):
            return _train(cfg, progress, rank, device)
    finally:
        if owned:
            # a group left to the interpreter's exit can abort the process (gloo's threads outlive it);
            # so can one still held by the epochs' DistributedDataParallel wrappers, whose reference
            # cycles only the collector frees: free them while the interpreter is whole, then destroy
            gc.collect()
            dist.destroy_process_group()


def preflight(cfg: TrainConfig, rank: Rank) -> None:
    """``ValueError`` (``MissingExtraError`` for the ``train`` extra) for what would otherwise stop the
    run at its first write: ``out`` taken (a checkpoint, another run's state) or, with ``resume``,
    without this run's state; and, on the rank that writes, ``out`` not writable or the report's
    plotting not installed. Nothing is written. (The settings were checked as ``cfg`` was made; the
    device, data and start are checked as they are set up, before the first step, and the disk's
    room once the model's size is known, ``_check_room``.)"""
    check_out(cfg.out, cfg.epochs, cfg.resume, _fingerprint(cfg, rank.world), writes=rank.main)
    if rank.main:
        pyplot()


def _check_room(cfg: TrainConfig, model: TrainableModel) -> None:
    """``ValueError`` when ``out``'s disk lacks room for what an epoch writes: the checkpoint and the
    state (parameters and Adam's two moments), each written beside the one it replaces, and the
    report (its image grid at most a few MiB)."""
    size = sum(p.numel() * p.element_size() for p in model.parameters())
    check_space(cfg.out, 2 * (size + 3 * size) + 16 * 2**20)


def _train(
    cfg: TrainConfig, progress: Callable[..., object] | None, rank: Rank, device: torch.device
) -> dict:
    spec = cfg.model_spec()
    fp = _fingerprint(cfg, rank.world)
    training, settings = TRAININGS[cfg.task], cfg.task_knobs()
    # the data before the model: a folder without images is reported before any set-up
    train_files = image_files(cfg.train)
    train_images = load_images(train_files, cfg.channels)
    check_patch_size(train_files, train_images, cfg.patch_size)
    val_set = validation_examples(cfg)
    start = start_tensors(spec, cfg.init, cfg.seed, cfg.warm_start)
    model = TrainableModel(spec, start, device, cfg.backward, cfg.train_only)
    # log-scale factors and one-element gains (a guide network's skip a and mean mixing β) move by
    # O(1) over a run, where the banks' absolute step would crawl
    scalars = [p for n, p in model.named_parameters() if not n.startswith("raw.") or p.numel() == 1]
    tensors = [p for n, p in model.named_parameters() if n.startswith("raw.") and p.numel() > 1]
    groups = [{"params": tensors, "scale": 1.0}]
    if scalars:
        groups.append({"params": scalars, "scale": 10.0})
    opt = torch.optim.Adam(groups, lr=cfg.lr)
    state_dir, report_dir = cfg.out / STATE_DIR, cfg.out / REPORT_DIR
    if rank.main:
        _check_room(cfg, model)
    if cfg.resume:
        hist = _load_state(state_dir, model, opt)
        model.project_()  # the resumed kernel, not the start, is the last feasible point
    else:
        hist = History()

    per_step = cfg.batch_size * rank.world
    dataset = PatchDataset(
        train_images, cfg.patch_size, training, settings, cfg.samples_per_epoch, cfg.seed, per_step
    )
    steps_per_epoch = math.ceil(cfg.samples_per_epoch / per_step)
    total = steps_per_epoch * cfg.epochs
    # pilot-only epochs and the rest are two phases, each with its own warm-up and decay: the mean
    # mixing and λ only move in the second, which a schedule spent on the first would starve
    split = steps_per_epoch * min(cfg.pilot_epochs, cfg.epochs)

    def phase_lr(step: int) -> float:
        return lr_at(cfg, step, split) if step < split else lr_at(cfg, step - split, total - split)

    train_override = SolverOverride(tol=cfg.train_tol, max_iter=cfg.train_max_iter)
    score = training.score_name
    start_outputs: list[torch.Tensor] = []
    started = time.perf_counter()

    if rank.main and not hist.epochs:
        metrics, start_outputs = evaluate(model, val_set, cfg, device)
        hist.epochs.append({"epoch": 0, **metrics})
    elif rank.main:
        _, start_outputs = evaluate(TrainableModel(spec, start, device), val_set, cfg, device)
    if rank.main:
        # the checkpoint an epoch writes, made (not written) of the model as it stands: what its
        # making checks (the spec, the provenance, the tensors) fails now rather than after an epoch
        checkpoint_files(*_checkpoint(cfg, model, hist.epochs[0], hist.epochs[0], train_files), cfg.out)

    last = min(cfg.epochs, cfg.stop_after or cfg.epochs)
    bar = progress(total=(last - hist.epoch) * steps_per_epoch) if progress and rank.main else None
    first = hist.epoch + 1
    for epoch in range(first, last + 1):
        pilot_only = epoch <= cfg.pilot_epochs
        net = _epoch_net(model, pilot_only, rank, device, sync=epoch == first)
        # the state an epoch starts from was validated; it is the first "last good state", here and
        # after a resume alike
        good = _snapshot(model, opt)
        dataset.set_epoch(epoch)
        indices = list(range(rank.rank, steps_per_epoch * per_step, rank.world))
        loader = DataLoader(
            torch.utils.data.Subset(dataset, indices),
            batch_size=cfg.batch_size,
            num_workers=cfg.workers,
            worker_init_fn=_worker_init,
            pin_memory=device.type == "cuda",
        )
        sums = EpochTotals()
        truncated_before = model.truncated_steps
        epoch_start = time.perf_counter()
        if bar is not None:
            bar.set_description(f"epoch {epoch}/{cfg.epochs}")
        for batch in loader:
            batch = _to(batch, device)
            base_lr = phase_lr(hist.step) * hist.lr_factor
            for g in opt.param_groups:
                g["lr"] = base_lr * g["scale"]
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always", RuntimeWarning)
                out, iterations, converged, pilot = net(batch, train_override, pilot_only)
                loss = training.loss(out, batch["target"], cfg.loss)
                if pilot is not None and cfg.pilot_loss > 0:
                    loss = loss + cfg.pilot_loss * training.loss(pilot, batch["target"], cfg.loss)
                opt.zero_grad(set_to_none=False)
                # the backward's convolutions run outside the forward's IEEE section (kdeq.maths.precision)
                with ieee_float32():
                    loss.backward()
            # the adjoint solve's shortfalls are counted, not printed at every step; others pass through
            for w in caught:
                if "implicit backward" in str(w.message):
                    sums.backward_nonconverged += 1
                else:
                    warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
            grads_ok = all(
                bool(torch.isfinite(p.grad).all()) for p in model.parameters() if p.grad is not None
            )
            verdict = torch.tensor(
                [
                    float(not (bool(torch.isfinite(loss)) and grads_ok)),
                    float(converged.float().mean() < cfg.min_converged),
                ],
                device=device,
            )
            if rank.world > 1:
                dist.all_reduce(verdict, op=dist.ReduceOp.MAX)
            hist.step += 1
            if bar is not None:
                bar.update(1)
            if bool(verdict.any()):
                _roll_back(
                    model, opt, good, hist, cfg, "a non-finite loss or gradient" if verdict[0] else None
                )
                continue
            good = _snapshot(model, opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.clip_grad)
            opt.step()
            model.project_()
            sums.add(training, loss, out, batch, iterations, converged)
            if bar is not None:
                bar.set_postfix(
                    loss=f"{sums.mean('loss'):.3g}",
                    **{score: f"{sums.mean('score'):.3g}"},
                    it=f"{sums.mean('iterations'):.1f}",
                    lr=f"{base_lr:.2g}",
                    rollbacks=hist.rollbacks,
                )
        hist.epoch = epoch
        if rank.main:
            metrics, outputs = evaluate(model, val_set, cfg, device)
            entry = {
                "epoch": epoch,
                "train_loss": sums.mean("loss"),
                f"train_{score}": sums.mean("score"),
                "train_iterations": sums.mean("iterations"),
                "train_converged": sums.mean("converged"),
                "rollbacks": hist.rollbacks,
                "backward_nonconverged_steps": sums.backward_nonconverged,
                "psd_truncated_steps": model.truncated_steps - truncated_before,
                "lr": phase_lr(hist.step - 1) * hist.lr_factor,
                "seconds": time.perf_counter() - epoch_start,
                **metrics,
            }
            hist.epochs.append(entry)
            best = -math.inf if hist.best_epoch is None else hist.epochs[hist.best_epoch][f"val_{score}"]
            if metrics[f"val_{score}"] > best:
                hist.best_epoch = epoch
                save_checkpoint(cfg.out, *_checkpoint(cfg, model, entry, hist.epochs[0], train_files))
            _save_state(state_dir, model, opt, hist, fp)
            write_report(report_dir, cfg, hist, val_set, start_outputs, outputs)
            if bar is not None:
                note = ", ".join(f"{k} {v:.4g}" for k, v in metrics.items() if "@" not in k)
                bar.write(f"epoch {epoch}: {note}")
        if rank.world > 1:
            dist.barrier()
    if bar is not None:
        bar.close()

    report = {"history": hist.__dict__, "seconds": time.perf_counter() - started, "world_size": rank.world}
    if rank.world > 1:
        report["max_rank_difference"] = _rank_difference(model)
    if rank.main:
        write_files(report_dir, {"run.json": (json.dumps(report, indent=1) + "\n").encode()})
    return report


def _epoch_net(
    model: TrainableModel, pilot_only: bool, rank: Rank, device: torch.device, sync: bool
) -> nn.Module:
    """What an epoch's steps call: ``model`` with only its phase's parameters requiring gradients
    (``TrainableModel.set_phase``), wrapped, in a distributed run, in a DistributedDataParallel of
    its own, which reduces exactly those. ``sync``: broadcast rank 0's parameters first.

    One wrapper over every parameter fails at the pilot phase's second step: it waits for the
    gradients of the kernel banks, ``λ`` and ``β``, which the pilot's loss never produces.
    ``find_unused_parameters`` would walk the autograd graph at every step and still all-reduce
    zeros for those parameters; ``static_graph`` assumes one graph for the whole run, which the
    switch to the whole model breaks. A wrapper per epoch costs one reducer set-up an epoch, and
    makes its gradient buckets, which it lays out afresh after its first step (the layout can
    change the order of the all-reduce's sums beyond two ranks), a function of the epoch alone: a
    resumed run, which starts at an epoch, reduces exactly as an uninterrupted one. Only a
    process's first wrapper broadcasts: the ranks' starts are computed on each machine (where
    rounding may differ), but from then on identical steps keep them equal, which
    ``max_rank_difference`` checks and a broadcast every epoch would hide."""
    model.set_phase(pilot_only)
    if rank.world == 1:
        return model
    ids = [device.index] if device.type == "cuda" else None
    return DistributedDataParallel(model, device_ids=ids, init_sync=sync)


def _roll_back(
    model: TrainableModel,
    opt: torch.optim.Adam,
    good: tuple,
    hist: History,
    cfg: TrainConfig,
    why: str | None,
) -> None:
    """Restore the last good parameters and Adam state, halve the step size, count it; raise
    ``TrainingError`` past ``max_rollbacks``. ``why``: the reason, default non-convergence."""
    hist.rollbacks += 1
    hist.lr_factor *= 0.5
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(good[0][name])
    opt.load_state_dict(good[1])
    model.project_()  # the restored kernel is the new feasible point
    if hist.rollbacks > cfg.max_rollbacks:
        raise TrainingError(
            f"{hist.rollbacks} rollbacks (the last for {why or 'solves that stopped converging'}) exceed "
            f"max_rollbacks={cfg.max_rollbacks}; lower lr or loosen the training solver"
        )


def _snapshot(model: TrainableModel, opt: torch.optim.Adam) -> tuple[dict[str, torch.Tensor], dict]:
    """Copies of the parameters and of Adam's state, to roll back to."""
    sd = opt.state_dict()
    state = {i: {k: v.clone() for k, v in s.items()} for i, s in sd["state"].items()}
    groups = [dict(g) for g in sd["param_groups"]]
    return {n: p.detach().clone() for n, p in model.named_parameters()}, {
        "state": state,
        "param_groups": groups,
    }


def _rank_difference(model: TrainableModel) -> float:
    """Largest ``|θ_rank − θ_0|`` over the parameters and ranks (0 when DDP kept them identical)."""
    # on the parameters' device: nccl gathers CUDA tensors only
    flat = torch.cat([p.detach().flatten() for p in model.parameters()]).to(torch.float64)
    gathered = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, flat)
    return max(float((g - gathered[0]).abs().max()) for g in gathered)


def _checkpoint(
    cfg: TrainConfig,
    model: TrainableModel,
    best: dict[str, float],
    start: dict[str, float],
    files: list[Path],
) -> tuple[ModelSpec, dict[str, torch.Tensor], Provenance]:
    """The spec, tensors and provenance of the checkpoint of ``model`` as it stands, the epoch whose
    validation is ``best`` (``start``: the start's)."""
    spec, tensors = model.export()
    metrics = {k: float(v) for k, v in best.items() if k.startswith("val_") and "@" not in k}
    metrics.update(
        {f"start_{k}": float(v) for k, v in start.items() if k.startswith("val_") and "@" not in k}
    )
    data = tuple(f"{d} ({sum(1 for f in files if f.parent == d)} images)" for d in cfg.train)
    warm = "" if cfg.warm_start is None else f", warm-started from {cfg.warm_start}"
    provenance = Provenance(
        init=cfg.init,
        data=data,
        epochs=int(best["epoch"]),
        metrics=metrics,
        notes=f"kdeq train from {cfg.spec} ({cfg.init} init{warm}), best of {cfg.epochs} epochs by "
        f"validation on {', '.join(map(str, cfg.val))}; seed {cfg.seed}",
    )
    what = (
        f"{spec.description} Fine-tuned by kdeq train ({cfg.init} start{warm}, epoch {int(best['epoch'])})."
    )
    return spec.model_copy(update={"description": what}), tensors, provenance
