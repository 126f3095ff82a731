"""A denoiser's guide network cut to fewer features, the start of a leaner model (``kdeq prune``).

Each hidden layer ``i < depth − 1`` of ``N_θ`` (``kdeq.guidenet``) keeps the ``channels`` features
of largest saliency

    s_j = E|a_ij| · ‖W_{i+1}[:, j]‖₁,

the mean magnitude of feature ``j``'s activation on noisy training patches times the weight with
which the next layer reads it. Layer ``i`` keeps those features' filters and biases, and layer
``i + 1`` reads only them, so the pruned network is the original with every other feature's
activation replaced by 0. Every other tensor of the checkpoint (the kernel's taps, ``a``, ``β``) and
its spec (``λ`` included) are kept: ``kdeq train --spec OUT --warm-start OUT`` then fine-tunes it
(``docs/training.md``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from kdeq.checkpoint import (
    Checkpoint,
    CheckpointError,
    ModelSpec,
    Provenance,
    load_checkpoint,
    save_checkpoint,
)
from kdeq.guidenet import GuideNet, network_input
from kdeq.train.data import image_files, load_images, random_patch

#: patches the saliency is measured on, their side and their noise range (0–255)
PATCHES, PATCH_SIZE, SIGMA_RANGE = 40, 64, (0.0, 55.0)

Tensors = dict[str, torch.Tensor]


def saliency(tensors: Tensors, net: GuideNet, h: torch.Tensor) -> list[torch.Tensor]:
    """``s`` ``(channels,)`` of each hidden layer's features on the network input ``h``
    ``(N, 5, H', W')`` (``kdeq.guidenet.network_input``)."""
    out = []
    with torch.no_grad():
        for i in range(net.depth - 1):
            h = F.relu(F.conv2d(h, tensors[f"net_{i}_weight"], tensors[f"net_{i}_bias"], padding=1))
            reads = tensors[f"net_{i + 1}_weight"].abs().sum(dim=(0, 2, 3))
            out.append(h.abs().mean(dim=(0, 2, 3)) * reads)
    return out


def pruned(tensors: Tensors, net: GuideNet, keep: list[torch.Tensor]) -> Tensors:
    """``tensors`` with hidden layer ``i`` cut to the features ``keep[i]`` (ascending indices)."""
    out = dict(tensors)
    for i in range(net.depth):
        weight, bias = tensors[f"net_{i}_weight"], tensors[f"net_{i}_bias"]
        if i < net.depth - 1:
            weight, bias = weight[keep[i]], bias[keep[i]]
        if i > 0:
            weight = weight[:, keep[i - 1]]
        out[f"net_{i}_weight"], out[f"net_{i}_bias"] = weight.contiguous(), bias.contiguous()
    return out


def prune(
    checkpoint: Checkpoint, channels: int, images: list[torch.Tensor], seed: int = 0
) -> tuple[ModelSpec, Tensors]:
    """The spec and tensors of ``checkpoint``'s guide network cut to ``channels`` features, by the
    saliency on ``PATCHES`` noisy patches of the grey ``images`` ``(1, H, W)`` (seeded)."""
    spec = checkpoint.config.spec()
    net = getattr(spec.architecture, "net", None)
    if spec.task != "denoise" or net is None or net.condition != "sigma":
        raise ValueError(f"{checkpoint.path}: not a denoiser with a guide network")
    if not 1 <= channels <= net.channels:
        raise ValueError(f"channels must be within 1 and the network's {net.channels}, got {channels}")
    gen = torch.Generator().manual_seed(seed)
    picks = torch.randint(len(images), (PATCHES,), generator=gen).tolist()
    x = torch.stack([random_patch(images[k], PATCH_SIZE, gen) for k in picks])
    lo, hi = SIGMA_RANGE
    sigma = (lo + (hi - lo) * torch.rand(PATCHES, generator=gen)) / 255.0
    y = x + sigma.reshape(-1, 1, 1, 1) * torch.randn(x.shape, generator=gen)
    scores = saliency(checkpoint.tensors, net, network_input(y, sigma))
    keep = [s.argsort(descending=True)[:channels].sort().values for s in scores]
    lean = spec.architecture.model_copy(update={"net": net.model_copy(update={"channels": channels})})
    description = (
        f"{spec.description} Guide network pruned from {spec.name}:{spec.version}'s {net.channels} "
        f"features to {channels}."
    )
    return spec.model_copy(update={"architecture": lean, "description": description}), pruned(
        checkpoint.tensors, net, keep
    )


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("source", help="a denoiser checkpoint folder with a guide network")
    p.add_argument("--channels", type=int, required=True, help="features each hidden layer keeps")
    p.add_argument(
        "--train", nargs="+", required=True, metavar="DIR", help="images to measure the saliency on"
    )
    p.add_argument("--out", required=True, help="the pruned checkpoint's folder")
    p.add_argument("--seed", type=int, default=0)


def run(args: argparse.Namespace) -> int:
    try:
        checkpoint = load_checkpoint(args.source)
        images = load_images(image_files(args.train), 1)
        spec, tensors = prune(checkpoint, args.channels, images, args.seed)
        notes = f"pruned from {args.source} to {args.channels} features (kdeq prune, seed {args.seed})"
        config = save_checkpoint(Path(args.out), spec, tensors, Provenance(notes=notes))
    except (CheckpointError, ValueError, OSError) as err:
        print(f"kdeq prune: error: {err}", file=sys.stderr)
        return 2
    print(f"wrote {args.out}: {config.name}:{config.version}, {args.channels} features")
    return 0
