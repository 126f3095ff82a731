"""``kdeq experiment kerdeq``: the seeds' kernel DEQ (KerDEQ) against OptEq, small.

Both layers are dense equilibrium layers on scikit-learn's bundled 8×8 digits (1797 images,
``x ∈ ℝ⁶⁴``, no download), followed by a linear readout ``ŷ = Vz + c`` and trained with Adam on
the cross-entropy (Anderson forward, implicit gradients; the readout's step 30 times the layer's,
``train``):

- **OptEq**: ``z = σ(WᵀWz + Ux + b)``, ``W (d, h)``, ``U (h, 64)``;
- **KerDEQ**: ``z = σ[exp(−γ‖Ux + b − Wz‖²)·Wᵀ(Ux + b − Wz)]``, ``U (d, 64)``, ``W (d, h)``.

Three claims of the seeds' paper, each measured over seeds (one stratified train/test split per
seed, features standardised with the training split's mean and std):

1. *Accuracy at equal parameters*: both layers have the same ``h``; KerDEQ's latent size ``d`` is
   chosen so that the two models' parameter counts (readout included) match within 2 %.
2. *Unseen classes*: trained on digits 0–4 only (a 5-way readout), the accuracy on test digits
   0–4, the mean ``KL(onehot‖q) = −log q_y`` there, and the mean ``KL(u‖q) = −log 5 − mean_k log q_k``
   on test digits 5–9, ``q`` the softmax over the five trained classes and ``u`` uniform: a lower
   ``KL(u‖q)`` is a less confident answer on a class the model never saw.
3. *γ*: KerDEQ's test accuracy over a grid of ``γ``, claimed to rise then fall.

A claim *holds here* when the paired difference over seeds (same split, same seed) has the claimed
sign and exceeds twice its standard error; otherwise it *does not hold here*.

Differences from the seeds' setups, by design: 8×8 digits and dense layers instead of CIFAR and
convolutions, a few thousand parameters, and seeds and epochs sized for two CPU cores.
"""

from __future__ import annotations

import math
import time
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn

from kdeq.maths.solvers import SolverConfig
from kdeq.research.experiment import machine, mean_std, run_and_write
from kdeq.research.optdeq import KerDEQ, OptEq
from kdeq.train.preflight import pyplot, require

PARAM_TOLERANCE = 0.02  # the two models' parameter counts may differ by at most this fraction
KNOWN = (0, 1, 2, 3, 4)  # the classes the unseen-class models are trained on


@dataclass(frozen=True)
class Setup:
    """The experiment's size; the defaults finish in minutes on one CPU thread."""

    seeds: int = 5
    epochs: int = 10
    hidden: int = 64
    latent: int = 32  # OptEq's d; KerDEQ's is chosen to match the parameter count
    gamma: float = 0.5
    gammas: tuple[float, ...] = (0.01, 0.05, 0.1, 0.5, 1.0, 2.0, 5.0)
    batch: int = 64
    lr: float = 3e-4  # Adam's step for the equilibrium layer
    readout_lr: float = 1e-2  # ... and for the readout
    test_fraction: float = 0.3
    max_iter: int = 50
    tol: float = 1e-4
    seed: int = 0


def digits(seed: int, test_fraction: float) -> dict[str, torch.Tensor]:
    """The digits split by ``seed`` (stratified): ``x (N, 64)`` standardised with the training
    split's per-pixel mean and std (pixels constant on the training split keep std 1), ``y (N,)``."""
    datasets = require("sklearn.datasets", "the digits experiments")
    selection = require("sklearn.model_selection", "the digits experiments")

    data = datasets.load_digits()
    x_tr, x_te, y_tr, y_te = selection.train_test_split(
        data.data, data.target, test_size=test_fraction, random_state=seed, stratify=data.target
    )
    x_tr, x_te = torch.tensor(x_tr, dtype=torch.float32), torch.tensor(x_te, dtype=torch.float32)
    mean, std = x_tr.mean(0), x_tr.std(0)
    std = torch.where(std > 0, std, torch.ones_like(std))
    return {
        "x_train": (x_tr - mean) / std,
        "y_train": torch.tensor(y_tr, dtype=torch.long),
        "x_test": (x_te - mean) / std,
        "y_test": torch.tensor(y_te, dtype=torch.long),
    }


class Classifier(nn.Module):
    """An equilibrium layer ``x (B, 64) → z (B, h)`` and a linear readout ``Vz + c (B, classes)``."""

    def __init__(self, layer: nn.Module, hidden: int, classes: int, seed: int) -> None:
        super().__init__()
        self.layer = layer
        torch.manual_seed(seed)  # nn.Linear draws its initial weights from the global generator
        self.readout = nn.Linear(hidden, classes)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Logits ``(B, classes)`` and the per-sample converged flags ``(B,)``."""
        z, stats = self.layer(x)
        return self.readout(z), stats.converged


def build(
    kind: str, setup: Setup, latent: int, classes: int, seed: int, gamma: float | None = None
) -> Classifier:
    """OptEq or KerDEQ (``h = setup.hidden``, latent size ``latent``) with its readout."""
    solver = SolverConfig(method="anderson", tol=setup.tol, max_iter=setup.max_iter)
    if kind == "opteq":
        layer = OptEq(64, setup.hidden, latent, solver=solver, seed=seed)
    else:
        g = setup.gamma if gamma is None else gamma
        layer = KerDEQ(64, setup.hidden, latent, gamma=g, solver=solver, seed=seed)
    return Classifier(layer, setup.hidden, classes, seed)


def count(model: nn.Module) -> int:
    """The number of trainable scalars."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def matched_latent(setup: Setup, classes: int) -> tuple[int, int, int]:
    """KerDEQ's latent size ``d`` whose model has the parameter count nearest OptEq's, and the two
    counts ``(d, P_opteq, P_kerdeq)``; a ``ValueError`` when they differ by more than 2 %."""
    target = count(build("opteq", setup, setup.latent, classes, 0))
    # KerDEQ's count grows by 64 + h + 1 per latent unit: at most 4h units reach any OptEq count
    # with h ≥ 1, so the search is short
    best = min(
        range(1, 4 * setup.hidden + 1),
        key=lambda d: abs(count(build("kerdeq", setup, d, classes, 0)) - target),
    )
    got = count(build("kerdeq", setup, best, classes, 0))
    if abs(got - target) > PARAM_TOLERANCE * target:
        raise ValueError(f"no KerDEQ latent size matches OptEq's {target} parameters within 2 %")
    return best, target, got


def train(model: Classifier, x: torch.Tensor, y: torch.Tensor, setup: Setup, seed: int) -> None:
    """Adam on the mean cross-entropy over shuffled minibatches, ``setup.epochs`` passes.

    The readout steps 30 times faster than the layer: KerDEQ's features are small
    (``‖z‖ ≤ ‖W‖·max_t t·e^{−γt²}``) so its readout must grow, while a layer step as large lets ``‖W‖``
    outgrow the contraction regime within a few epochs (both layers' maps are ``‖W‖²``-Lipschitz),
    where the forward solves stop converging and the accuracy collapses. Both models get the
    same rates."""
    opt = torch.optim.Adam(
        [
            {"params": model.layer.parameters(), "lr": setup.lr},
            {"params": model.readout.parameters(), "lr": setup.readout_lr},
        ]
    )
    gen = torch.Generator().manual_seed(seed)
    model.train()
    for _ in range(setup.epochs):
        order = torch.randperm(len(x), generator=gen)
        for i in range(0, len(order), setup.batch):
            idx = order[i : i + setup.batch]
            logits, _ = model(x[idx])
            loss = nn.functional.cross_entropy(logits, y[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()


def predict(model: Classifier, x: torch.Tensor) -> tuple[torch.Tensor, float]:
    """Log-probabilities ``log q (B, classes)`` and the fraction of forward solves that converged."""
    model.eval()
    with torch.no_grad():
        logits, converged = model(x)
    return torch.log_softmax(logits, dim=1), converged.float().mean().item()


def run_compare(setup: Setup, kind: str, latent: int, data: dict, seed: int, gamma=None) -> dict:
    """Train on all ten classes; the test accuracy and the converged fraction."""
    model = build(kind, setup, latent, 10, seed, gamma)
    start = time.perf_counter()
    train(model, data["x_train"], data["y_train"], setup, seed)
    logq, converged = predict(model, data["x_test"])
    accuracy = (logq.argmax(1) == data["y_test"]).float().mean().item()
    return {
        "test_accuracy": accuracy,
        "converged": converged,
        "params": count(model),
        "seconds": time.perf_counter() - start,
    }


def run_unseen(setup: Setup, kind: str, latent: int, data: dict, seed: int) -> dict:
    """Train on digits 0–4 only (five outputs): accuracy and ``KL(onehot‖q)`` on test 0–4, and
    ``KL(u‖q)`` on test 5–9, each a mean over the test samples."""
    known = torch.tensor(KNOWN)
    tr = torch.isin(data["y_train"], known)
    te = torch.isin(data["y_test"], known)
    model = build(kind, setup, latent, len(KNOWN), seed)
    train(model, data["x_train"][tr], data["y_train"][tr], setup, seed)
    logq_known, conv_known = predict(model, data["x_test"][te])
    logq_unseen, conv_unseen = predict(model, data["x_test"][~te])
    y = data["y_test"][te]
    k = len(KNOWN)
    return {
        "known_accuracy": (logq_known.argmax(1) == y).float().mean().item(),
        "kl_known": -logq_known.gather(1, y[:, None]).mean().item(),
        "kl_unknown": (-math.log(k) - logq_unseen.mean(1)).mean().item(),
        "converged": (conv_known * te.sum().item() + conv_unseen * (~te).sum().item()) / len(te),
        "params": count(model),
    }


def paired(a: list[float], b: list[float]) -> dict[str, float]:
    """The paired difference ``a − b`` over ``S`` seeds: its mean and standard error ``std/√S``."""
    mean, std = mean_std([x - y for x, y in zip(a, b, strict=True)])
    return {"mean": mean, "se": std / math.sqrt(len(a)), "seeds": len(a)}


def verdict(diff: dict[str, float], sign: int, what: str) -> dict:
    """*holds here* when ``sign·mean > 2·SE`` over at least two seeds (one seed has no standard
    error); the reason quotes the numbers."""
    size, band = sign * diff["mean"], 2 * diff["se"]
    holds = diff["seeds"] >= 2 and size > band
    if holds:
        where = "in the claimed direction, beyond"
    elif size > 0:
        where = "in the claimed direction but within"
    else:
        where = "against the claimed direction" + (", beyond" if -size > band else ", within")
    return {
        "holds": holds,
        "verdict": "holds here" if holds else "does not hold here",
        "reason": f"{what}: paired difference {diff['mean']:+.4f} over {diff['seeds']} seeds, {where} "
        f"2 × SE = {band:.4f}",
    }


def summarize(result: dict) -> dict:
    """Means ± std per model and setting, and a verdict per claim."""

    def col(rows: list[dict], key: str, **match) -> list[float]:
        return [r[key] for r in rows if all(r[k] == v for k, v in match.items())]

    comp, unseen, sweep = result["compare"], result["unseen"], result["gamma_sweep"]
    out: dict = {"compare": {}, "unseen": {}, "gamma": []}
    for kind in ("opteq", "kerdeq"):
        out["compare"][kind] = {
            "accuracy": mean_std(col(comp, "test_accuracy", model=kind)),
            "converged": mean_std(col(comp, "converged", model=kind)),
            "params": col(comp, "params", model=kind)[0],
        }
        out["unseen"][kind] = {
            key: mean_std(col(unseen, key, model=kind))
            for key in ("known_accuracy", "kl_known", "kl_unknown", "converged")
        }
    gammas = sorted({r["gamma"] for r in sweep})
    for g in gammas:
        out["gamma"].append(
            {
                "gamma": g,
                "accuracy": mean_std(col(sweep, "test_accuracy", gamma=g)),
                "converged": mean_std(col(sweep, "converged", gamma=g)),
            }
        )

    acc = {k: col(comp, "test_accuracy", model=k) for k in ("opteq", "kerdeq")}
    verdicts = {"accuracy": verdict(paired(acc["kerdeq"], acc["opteq"]), +1, "KerDEQ − OptEq test accuracy")}
    for key, sign, what in (
        ("known_accuracy", +1, "KerDEQ − OptEq accuracy on known classes"),
        ("kl_known", -1, "KerDEQ − OptEq KL(onehot‖q) on known classes"),
        ("kl_unknown", -1, "KerDEQ − OptEq KL(u‖q) on unseen classes"),
    ):
        verdicts[f"unseen_{key}"] = verdict(
            paired(col(unseen, key, model="kerdeq"), col(unseen, key, model="opteq")), sign, what
        )
    means = [row["accuracy"][0] for row in out["gamma"]]
    peak = max(range(len(means)), key=means.__getitem__)
    peak_acc = col(sweep, "test_accuracy", gamma=gammas[peak])
    rise = paired(peak_acc, col(sweep, "test_accuracy", gamma=gammas[0]))
    fall = paired(peak_acc, col(sweep, "test_accuracy", gamma=gammas[-1]))
    interior = 0 < peak < len(gammas) - 1
    holds = (
        len(peak_acc) >= 2 and interior and rise["mean"] > 2 * rise["se"] and fall["mean"] > 2 * fall["se"]
    )
    verdicts["gamma_rise_fall"] = {
        "holds": holds,
        "verdict": "holds here" if holds else "does not hold here",
        "reason": f"peak at γ = {gammas[peak]:g} ({'inside' if interior else 'at an end of'} the grid); "
        f"peak − first γ {rise['mean']:+.4f} (2 × SE {2 * rise['se']:.4f}), peak − last γ "
        f"{fall['mean']:+.4f} (2 × SE {2 * fall['se']:.4f})",
    }
    out["verdicts"] = verdicts
    return out


def run(setup: Setup, log=print) -> dict:
    """Every claim's runs over ``setup.seeds`` seeds; the per-seed records and the summary."""
    start = time.perf_counter()
    latent10, p_opt10, p_ker10 = matched_latent(setup, 10)
    latent5, p_opt5, p_ker5 = matched_latent(setup, len(KNOWN))
    log(f"parameters: OptEq {p_opt10} (d = {setup.latent}), KerDEQ {p_ker10} (d = {latent10})")
    result: dict = {
        "machine": machine(),
        "setup": asdict(setup),
        "sizes": {
            "hidden": setup.hidden,
            "opteq_latent": setup.latent,
            "kerdeq_latent": latent10,
            "opteq_params": p_opt10,
            "kerdeq_params": p_ker10,
            "kerdeq_latent_unseen": latent5,
            "opteq_params_unseen": p_opt5,
            "kerdeq_params_unseen": p_ker5,
        },
        "compare": [],
        "unseen": [],
        "gamma_sweep": [],
    }
    latents = {"opteq": (setup.latent, setup.latent), "kerdeq": (latent10, latent5)}
    with warnings.catch_warnings():
        # an unconverged adjoint solve warns per step; the converged fractions are recorded instead
        warnings.simplefilter("ignore", RuntimeWarning)
        for s in range(setup.seeds):
            seed = setup.seed * 1000 + s
            data = digits(seed, setup.test_fraction)
            for kind in ("opteq", "kerdeq"):
                rec = run_compare(setup, kind, latents[kind][0], data, seed)
                result["compare"].append({"model": kind, "seed": seed, **rec})
                rec_u = run_unseen(setup, kind, latents[kind][1], data, seed)
                result["unseen"].append({"model": kind, "seed": seed, **rec_u})
                log(
                    f"seed {seed} {kind}: accuracy {rec['test_accuracy']:.3f}; 0–4 only: accuracy "
                    f"{rec_u['known_accuracy']:.3f}, KL known {rec_u['kl_known']:.3f}, KL unseen "
                    f"{rec_u['kl_unknown']:.3f} ({time.perf_counter() - start:.0f} s)"
                )
            for g in setup.gammas:
                # claim 1's KerDEQ is the sweep's run at its γ: the same seed, split and settings
                rec = (
                    result["compare"][-1]
                    if g == setup.gamma
                    else run_compare(setup, "kerdeq", latent10, data, seed, gamma=g)
                )
                rec = {k: rec[k] for k in ("test_accuracy", "converged", "params", "seconds")}
                result["gamma_sweep"].append({"gamma": g, "seed": seed, **rec})
            log(f"seed {seed}: γ sweep done ({time.perf_counter() - start:.0f} s)")
    result["summary"] = summarize(result)
    result["wall_seconds"] = time.perf_counter() - start
    return result


def _pm(pair: tuple[float, float], scale: float = 1.0, digits: int = 2) -> str:
    return f"{pair[0] * scale:.{digits}f} ± {pair[1] * scale:.{digits}f}"


def table_markdown(result: dict) -> str:
    """The three claims' tables (accuracies in %) and the verdicts, as Markdown."""
    s, sizes = result["summary"], result["sizes"]
    seeds = result["setup"]["seeds"]
    v = s["verdicts"]
    names = {"opteq": "OptEq", "kerdeq": "KerDEQ"}
    lines = [
        f"### 1. Test accuracy at equal parameter counts ({seeds} seeds, mean ± std)",
        "",
        "| model | h | d | parameters | test accuracy (%) | forward solves converged (%) |",
        "|---|---|---|---|---|---|",
    ]
    for kind, latent in (("opteq", sizes["opteq_latent"]), ("kerdeq", sizes["kerdeq_latent"])):
        c = s["compare"][kind]
        lines.append(
            f"| {names[kind]} | {sizes['hidden']} | {latent} | {c['params']} | {_pm(c['accuracy'], 100)} "
            f"| {_pm(c['converged'], 100, 1)} |"
        )
    lines += [
        "",
        f"Verdict (higher accuracy than OptEq at equal parameters): **{v['accuracy']['verdict']}**: "
        f"{v['accuracy']['reason']}.",
        "",
        f"### 2. Trained on digits 0–4: known and unseen classes ({seeds} seeds, mean ± std)",
        "",
        "| model | parameters | accuracy on 0–4 (%) | KL(onehot‖q) on 0–4 | KL(u‖q) on 5–9 |",
        "|---|---|---|---|---|",
    ]
    for kind in ("opteq", "kerdeq"):
        u = s["unseen"][kind]
        params = sizes["opteq_params_unseen" if kind == "opteq" else "kerdeq_params_unseen"]
        lines.append(
            f"| {names[kind]} | {params} | {_pm(u['known_accuracy'], 100)} | {_pm(u['kl_known'], 1, 3)} "
            f"| {_pm(u['kl_unknown'], 1, 3)} |"
        )
    lines += [""]
    for key, what in (
        ("unseen_known_accuracy", "higher accuracy on the known classes"),
        ("unseen_kl_known", "lower KL on the known classes"),
        ("unseen_kl_unknown", "closer to uniform on unseen classes"),
    ):
        lines.append(f"- Verdict ({what}): **{v[key]['verdict']}**: {v[key]['reason']}.")
    lines += [
        "",
        f"### 3. KerDEQ's test accuracy against γ ({seeds} seeds, mean ± std)",
        "",
        "| γ | test accuracy (%) | forward solves converged (%) |",
        "|---|---|---|",
    ]
    for row in s["gamma"]:
        lines.append(f"| {row['gamma']:g} | {_pm(row['accuracy'], 100)} | {_pm(row['converged'], 100, 1)} |")
    g = v["gamma_rise_fall"]
    lines += ["", f"Verdict (accuracy rises then falls with γ): **{g['verdict']}**: {g['reason']}."]
    return "\n".join(lines) + "\n"


def plot(path: Path, result: dict) -> None:
    """Test accuracy against γ (log axis), mean ± std over seeds with the seeds as dots, and
    OptEq's mean ± std at equal parameters as a band."""
    plt = pyplot()

    s = result["summary"]
    fig, ax = plt.subplots(figsize=(5.5, 3.6), dpi=100)
    gammas = [row["gamma"] for row in s["gamma"]]
    means = [100 * row["accuracy"][0] for row in s["gamma"]]
    stds = [100 * row["accuracy"][1] for row in s["gamma"]]
    ax.errorbar(gammas, means, yerr=stds, marker="o", capsize=3, color="tab:blue", label="KerDEQ")
    ax.scatter(
        [r["gamma"] for r in result["gamma_sweep"]],
        [100 * r["test_accuracy"] for r in result["gamma_sweep"]],
        s=8,
        color="tab:blue",
        alpha=0.4,
    )
    mean, std = s["compare"]["opteq"]["accuracy"]
    ax.axhspan(100 * (mean - std), 100 * (mean + std), color="tab:red", alpha=0.15)
    ax.axhline(100 * mean, color="tab:red", lw=1, label="OptEq (equal parameters)")
    ax.set_xscale("log")
    ax.set_xlabel("γ")
    ax.set_ylabel("test accuracy (%)")
    ax.set_title("digits 8×8: KerDEQ accuracy against γ")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main(args) -> int:
    setup = Setup(
        seeds=args.seeds,
        epochs=args.epochs,
        hidden=args.hidden,
        latent=args.latent,
        gamma=args.gamma,
        gammas=tuple(args.gammas),
        lr=args.lr,
        readout_lr=args.readout_lr,
        seed=args.seed,
    )
    return run_and_write("kerdeq", Path(args.out), lambda: run(setup), table_markdown, {"gamma.png": plot})


def add_arguments(p) -> None:
    d = Setup()
    p.add_argument("--out", default="exp-kerdeq", help="folder for results.json, table.md, gamma.png")
    p.add_argument("--seeds", type=int, default=d.seeds)
    p.add_argument("--epochs", type=int, default=d.epochs)
    p.add_argument("--hidden", type=int, default=d.hidden, help="h, both layers' width")
    p.add_argument("--latent", type=int, default=d.latent, help="OptEq's latent size d")
    p.add_argument("--gamma", type=float, default=d.gamma, help="KerDEQ's γ in claims 1 and 2")
    p.add_argument("--gammas", type=float, nargs="+", default=list(d.gammas), help="the γ sweep")
    p.add_argument("--lr", type=float, default=d.lr, help="Adam's step for the layer")
    p.add_argument("--readout-lr", type=float, default=d.readout_lr, help="Adam's step for the readout")
    p.add_argument("--seed", type=int, default=d.seed)
