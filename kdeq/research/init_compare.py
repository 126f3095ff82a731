"""``kdeq experiment init-compare``: the paper's initialisation experiment (§4, Appendix F, Table 1), small.

Denoising grey ``P×P`` patches (train: one folder, e.g. Train400; test: another, e.g. BSD68)
corrupted by ``N(0, 0.2²)`` noise and clipped to [0, 1], with the convolutional DEQ

    z = W1 z + W2 y,      ŷ = V1 z + V2 y        (σ = identity, T = identity, ρ = 0)

and ``(2r+1)²`` filters, trained with Adam on the mean squared error (implicit gradients,
Anderson forward and adjoint solves). Two arms over a grid of scales and seeds:

- **kGLM**: every map ``±K/λ`` for a tapered SE kernel whose squared lengthscale is drawn from
  ``U(0, 4)`` per seed, with ``λ = ‖K‖/C`` so each layer's spectral norm is ``C``,
  ``C ∈ logspace(−2, 1)``;
- **random**: every filter tap i.i.d. ``N(0, v)``, ``v ∈ logspace(−3, 0)``, whose spectral
  norms cover about the same range.

Recorded per run and epoch 0…E: test MSE, the fraction of test solves that converged, and
each layer's spectral norm (exact, circular, on the patch grid). A run *fails* at an epoch
when its test MSE is not finite or fewer than 90 % of its test solves converged. The table
gives, per arm and epoch, the mean ± sample std over seeds of ``ln`` test MSE at the scale
with the best mean, failed values replaced by the largest finite one first (as the paper's
Table 1 does), and the failures over the whole grid.

Differences from the paper, by design: grey patches instead of CIFAR-10/hyperspectral
images, the identity activation (the paper's ReLU is not an exponential-family ``σ``), a
triangular taper (the paper's box truncation is not PSD, DESIGN §2.2), and a grid and seed
count sized for two CPU cores.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from kdeq.maths.deq import KGLMDEQ, ConvMap
from kdeq.maths.families import Gaussian
from kdeq.maths.kernels import Kernel
from kdeq.maths.kglm import conv_deq
from kdeq.maths.priors import GaussianPrior
from kdeq.maths.solvers import SolverConfig
from kdeq.maths.spectral import circular_spectral_norm
from kdeq.research.experiment import mean_std, run_and_write
from kdeq.train.data import image_files, load_images, random_patch, sample_generator
from kdeq.train.preflight import pyplot

FAILED_BELOW = 0.9  # a run fails at an epoch when fewer of its test solves converge


@dataclass(frozen=True)
class Setup:
    """The experiment's size; the defaults finish in well under 30 minutes on two CPU cores."""

    train_dir: Path
    test_dir: Path
    scales: int = 6
    seeds: int = 3
    epochs: int = 5
    train_patches: int = 256
    test_patches: int = 128
    patch: int = 32
    batch: int = 32
    radius: int = 3
    noise: float = 0.2
    lr: float = 1e-3
    max_iter: int = 60
    tol: float = 1e-4
    seed: int = 0


def patches(
    directory: Path, count: int, size: int, seed: int, noise: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``count`` clean grey patches ``(N, 1, P, P)`` and their noisy, clipped copies."""
    images = load_images(image_files([directory]), 1)
    clean, noisy = [], []
    for i in range(count):
        gen = sample_generator(seed, 0, i)
        x = random_patch(images[int(torch.randint(len(images), (), generator=gen))], size, gen)
        clean.append(x)
        noisy.append((x + noise * torch.randn(x.shape, generator=gen)).clamp(0, 1))
    return torch.stack(clean), torch.stack(noisy)


def kglm_model(setup: Setup, scale: float, seed: int, solver: SolverConfig) -> KGLMDEQ:
    """Every map ``±K/λ`` with ``λ = ‖K‖/C``: each layer's spectral norm is ``C = scale``."""
    gen = torch.Generator().manual_seed(seed)
    ell2 = 4.0 * torch.rand((), generator=gen).item()
    kern = Kernel(profile="se", lengthscale=max(math.sqrt(ell2), 1e-3), radius=setup.radius)
    bank = kern.filter()[None, None]
    lam = circular_spectral_norm(bank, (setup.patch, setup.patch)) / scale
    return conv_deq(Gaussian(), GaussianPrior(), bank, lam, solver=solver)


def random_model(setup: Setup, variance: float, seed: int, solver: SolverConfig) -> KGLMDEQ:
    """Every filter tap i.i.d. ``N(0, variance)``."""
    gen = torch.Generator().manual_seed(seed)
    k = 2 * setup.radius + 1

    def bank() -> ConvMap:
        return ConvMap(math.sqrt(variance) * torch.randn(1, 1, k, k, generator=gen))

    return KGLMDEQ(Gaussian(), GaussianPrior(), bank(), bank(), None, bank(), bank(), solver)


def spectral_norms(model: KGLMDEQ, size: int) -> list[float]:
    """``‖W1‖, ‖W2‖, ‖V1‖, ‖V2‖`` as circular convolutions on a ``size²`` grid."""
    return [
        circular_spectral_norm(m.weight.detach(), (size, size))
        for m in (model.w1, model.w2, model.v1, model.v2)
    ]


def evaluate(model: KGLMDEQ, clean: torch.Tensor, noisy: torch.Tensor, batch: int) -> tuple[float, float]:
    """Test MSE and the fraction of test solves that converged."""
    err, conv = 0.0, 0.0
    with torch.inference_mode():
        for i in range(0, len(clean), batch):
            out = model(noisy[i : i + batch])
            err += (out.eta - clean[i : i + batch]).square().sum().item()
            conv += out.stats.converged.float().sum().item()
    return err / clean.numel(), conv / len(clean)


def run_one(setup: Setup, model: KGLMDEQ, data: dict[str, torch.Tensor], seed: int) -> list[dict[str, float]]:
    """Train ``model``; the test MSE, converged fraction and spectral norms after each epoch 0…E."""
    opt = torch.optim.Adam(model.parameters(), lr=setup.lr)
    gen = torch.Generator().manual_seed(seed)
    epochs = []
    for epoch in range(setup.epochs + 1):
        if epoch > 0:
            order = torch.randperm(len(data["train_clean"]), generator=gen)
            for i in range(0, len(order), setup.batch):
                idx = order[i : i + setup.batch]
                out = model(data["train_noisy"][idx])
                loss = (out.eta - data["train_clean"][idx]).square().mean()
                opt.zero_grad()
                loss.backward()
                opt.step()
        mse, converged = evaluate(model, data["test_clean"], data["test_noisy"], setup.batch)
        norms = spectral_norms(model, setup.patch)
        failed = not math.isfinite(mse) or converged < FAILED_BELOW
        epochs.append(
            {"epoch": epoch, "mse": mse, "converged": converged, "norm": sum(norms) / 4, "failed": failed}
        )
    return epochs


def run(setup: Setup, log=print) -> dict:
    """Every (arm, scale, seed); returns the runs and the summary table."""
    import warnings

    solver = SolverConfig(method="anderson", tol=setup.tol, max_iter=setup.max_iter)
    train_clean, train_noisy = patches(
        setup.train_dir, setup.train_patches, setup.patch, setup.seed, setup.noise
    )
    test_clean, test_noisy = patches(
        setup.test_dir, setup.test_patches, setup.patch, setup.seed + 1, setup.noise
    )
    data = {
        "train_clean": train_clean,
        "train_noisy": train_noisy,
        "test_clean": test_clean,
        "test_noisy": test_noisy,
    }
    grids = {
        "kglm": torch.logspace(-2, 1, setup.scales).tolist(),
        "random": torch.logspace(-3, 0, setup.scales).tolist(),
    }
    runs = []
    start = time.perf_counter()
    for arm, scales in grids.items():
        for scale in scales:
            for s in range(setup.seeds):
                seed = setup.seed * 1000 + s
                build = kglm_model if arm == "kglm" else random_model
                model = build(setup, scale, seed, solver)
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", RuntimeWarning)  # failures are counted, not printed
                    epochs = run_one(setup, model, data, seed)
                runs.append({"arm": arm, "scale": scale, "seed": seed, "epochs": epochs})
                last = epochs[-1]
                log(
                    f"{arm:>6} scale {scale:.3g} seed {seed}: norm {epochs[0]['norm']:.3g}, "
                    f"test MSE {epochs[0]['mse']:.3g} → {last['mse']:.3g}, failed epochs "
                    f"{sum(e['failed'] for e in epochs)} ({time.perf_counter() - start:.0f} s)"
                )
    return {
        "setup": {k: str(v) for k, v in setup.__dict__.items()},
        "runs": runs,
        "table": summarize(runs, setup),
    }


def summarize(runs: list[dict], setup: Setup) -> list[dict]:
    """Per arm and epoch: mean ± std of ln MSE at the best scale, and failures over the grid."""
    rows = []
    for arm in ("kglm", "random"):
        arm_runs = [r for r in runs if r["arm"] == arm]
        for epoch in range(setup.epochs + 1):
            values = [r["epochs"][epoch] for r in arm_runs]
            finite = [v["mse"] for v in values if not v["failed"]]
            worst = max(finite) if finite else float("nan")
            by_scale: dict[float, list[float]] = {}
            for r, v in zip(arm_runs, values, strict=True):
                mse = v["mse"] if not v["failed"] else worst
                by_scale.setdefault(r["scale"], []).append(math.log(mse) if mse > 0 else float("nan"))
            best_scale, logs = min(by_scale.items(), key=lambda kv: sum(kv[1]) / len(kv[1]))
            mean, std = mean_std(logs)
            rows.append(
                {
                    "arm": arm,
                    "epoch": epoch,
                    "best_scale": best_scale,
                    "mean_log_mse": mean,
                    "std_log_mse": std,
                    "failed": sum(v["failed"] for v in values),
                    "runs": len(values),
                }
            )
    return rows


def table_markdown(rows: list[dict]) -> str:
    """The summary as a Markdown table, arms side by side per epoch."""
    lines = [
        "| epoch | kGLM: ln MSE (mean ± std) | kGLM failed | random: ln MSE (mean ± std) | random failed |",
        "|---|---|---|---|---|",
    ]
    by = {(r["arm"], r["epoch"]): r for r in rows}
    for epoch in sorted({r["epoch"] for r in rows}):
        k, q = by[("kglm", epoch)], by[("random", epoch)]
        lines.append(
            f"| {epoch} | {k['mean_log_mse']:.2f} ± {k['std_log_mse']:.2f} (C = {k['best_scale']:.3g}) "
            f"| {k['failed']}/{k['runs']} | {q['mean_log_mse']:.2f} ± {q['std_log_mse']:.2f} "
            f"(var = {q['best_scale']:.3g}) | {q['failed']}/{q['runs']} |"
        )
    return "\n".join(lines) + "\n"


def scatter(path: Path, result: dict) -> None:
    """Test MSE against mean spectral norm per epoch (log-log), kGLM blue and random red; failed
    runs at the top border."""
    plt = pyplot()

    runs = result["runs"]
    epochs = len(runs[0]["epochs"])
    cols = min(3, epochs)
    rows = math.ceil(epochs / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4 * cols, 3.2 * rows), dpi=100, squeeze=False)
    for e in range(epochs):
        ax = axes[e // cols][e % cols]
        finite = [r["epochs"][e]["mse"] for r in runs if not r["epochs"][e]["failed"]]
        top = max(finite) * 2 if finite else 1.0
        for arm, colour in (("kglm", "tab:blue"), ("random", "tab:red")):
            pts = [r["epochs"][e] for r in runs if r["arm"] == arm]
            ax.scatter(
                [p["norm"] for p in pts],
                [p["mse"] if not p["failed"] else top for p in pts],
                s=12,
                c=colour,
                alpha=0.7,
                label="kGLM init" if arm == "kglm" else "random init",
                marker="o",
            )
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_title(f"epoch {e}")
        ax.set_xlabel("mean spectral norm per layer")
        ax.set_ylabel("test MSE")
        ax.grid(alpha=0.3)
        if e == 0:
            ax.legend(fontsize=8)
    for e in range(epochs, rows * cols):
        axes[e // cols][e % cols].set_axis_off()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main(args) -> int:
    setup = Setup(
        train_dir=Path(args.train),
        test_dir=Path(args.test),
        scales=args.scales,
        seeds=args.seeds,
        epochs=args.epochs,
        train_patches=args.train_patches,
        test_patches=args.test_patches,
        seed=args.seed,
    )
    return run_and_write(
        "init-compare",
        Path(args.out),
        lambda: run(setup),
        lambda result: table_markdown(result["table"]),
        {"scatter.png": scatter},
    )


def add_arguments(p) -> None:
    p.add_argument("--train", required=True, help="training image folder (e.g. Train400)")
    p.add_argument("--test", required=True, help="test image folder (e.g. BSD68)")
    p.add_argument("--out", default="init-compare", help="folder for results.json, table.md, scatter.png")
    p.add_argument("--scales", type=int, default=6, help="points on each arm's scale grid")
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--train-patches", type=int, default=256)
    p.add_argument("--test-patches", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
