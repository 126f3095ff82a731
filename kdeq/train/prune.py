"""A denoiser's guide networks cut to fewer features, the start of a leaner model (``kdeq prune``).

Each hidden layer ``i < depth − 1`` of a network (``kdeq.maths.guidenet``: the grey ``N_θ`` or the joint
colour ``N_θ^c``) keeps the features of largest saliency

    s_j = E|a_ij| · ‖W_{i+1}[:, j]‖₁,

the mean magnitude of feature ``j``'s activation on noisy training patches (grey for ``N_θ``,
colour for ``N_θ^c``) times the weight with which the next layer reads it. Layer ``i`` keeps those
features' filters and biases, and layer ``i + 1`` reads only them, so the pruned network is the
original with every other feature's activation replaced by 0.

A denoiser without a colour network first grows one as three copies of its grey network
(``colour_copies``): copy ``k`` reads and writes opponent channel ``k`` alone, so the grown model's
pilot is the grey network's per-channel pilot, and pruning then picks the features of all three
copies that matter most on colour images. Every other tensor of the checkpoint (the kernel's taps,
``a``, ``β``) and its spec (``λ`` included) are kept: ``kdeq train --spec OUT --warm-start OUT`` then
fine-tunes it (``docs/training.md``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from kdeq.maths.guidenet import GuideNet, network_input, to_opponent
from kdeq.models.checkpoint import (
    Checkpoint,
    CheckpointError,
    ModelSpec,
    Provenance,
    load_checkpoint,
    save_checkpoint,
)
from kdeq.train.data import image_files, load_images, random_patch
from kdeq.train.preflight import check_writable

#: patches the saliency is measured on, their side and their noise range (0–255)
PATCHES, PATCH_SIZE, SIGMA_RANGE = 40, 64, (0.0, 55.0)

Tensors = dict[str, torch.Tensor]


def saliency(tensors: Tensors, prefix: str, depth: int, h: torch.Tensor) -> list[torch.Tensor]:
    """``s`` ``(features,)`` of each hidden layer of the network ``<prefix>_<i>`` on its input ``h``
    ``(N, 5 or 13, H', W')`` (``kdeq.maths.guidenet.network_input``)."""
    out = []
    with torch.no_grad():
        for i in range(depth - 1):
            h = F.relu(F.conv2d(h, tensors[f"{prefix}_{i}_weight"], tensors[f"{prefix}_{i}_bias"], padding=1))
            reads = tensors[f"{prefix}_{i + 1}_weight"].abs().sum(dim=(0, 2, 3))
            out.append(h.abs().mean(dim=(0, 2, 3)) * reads)
    return out


def pruned(tensors: Tensors, prefix: str, depth: int, keep: list[torch.Tensor]) -> Tensors:
    """``tensors`` with hidden layer ``i`` of the network ``<prefix>_<i>`` cut to the features
    ``keep[i]`` (ascending indices)."""
    out = dict(tensors)
    for i in range(depth):
        weight, bias = tensors[f"{prefix}_{i}_weight"], tensors[f"{prefix}_{i}_bias"]
        if i < depth - 1:
            weight, bias = weight[keep[i]], bias[keep[i]]
        if i > 0:
            weight = weight[:, keep[i - 1]]
        out[f"{prefix}_{i}_weight"], out[f"{prefix}_{i}_bias"] = weight.contiguous(), bias.contiguous()
    return out


def colour_copies(tensors: Tensors, net: GuideNet) -> Tensors:
    """``tensors`` with a colour network of ``3·channels`` features made of three copies of the grey
    network: copy ``k`` reads opponent channel ``k``'s four sub-images (inputs ``4k…4k+3``) and the
    ``σ`` map (input 12) and writes that channel's four sub-images (outputs ``4k…4k+3``), its hidden
    layers block-diagonal, and ``a_c = a``."""
    f, last = net.channels, net.depth - 1
    out = dict(tensors)
    for i in range(net.depth):
        weight, bias = tensors[f"net_{i}_weight"], tensors[f"net_{i}_bias"]
        rows = 4 if i == last else f
        grown = weight.new_zeros(3 * rows, 13 if i == 0 else 3 * f, 3, 3)
        for k in range(3):
            block = grown[k * rows : (k + 1) * rows]
            if i == 0:
                block[:, 4 * k : 4 * k + 4] = weight[:, :4]
                block[:, 12] = weight[:, 4]
            else:
                block[:, k * f : (k + 1) * f] = weight
        out[f"net_colour_{i}_weight"], out[f"net_colour_{i}_bias"] = grown, bias.repeat(3)
    out["net_colour_skip"] = tensors["net_skip"].clone()
    return out


def _noisy_patches(images: list[torch.Tensor], gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """``PATCHES`` seeded patches of ``images`` ``(c, H, W)`` with Gaussian noise of levels drawn from
    ``SIGMA_RANGE``: ``(PATCHES, c, PATCH_SIZE, PATCH_SIZE)`` and their ``σ`` ``(PATCHES,)`` in [0, 1]."""
    if not images:
        raise ValueError("the saliency needs images to measure it on; none were given")
    picks = torch.randint(len(images), (PATCHES,), generator=gen).tolist()
    x = torch.stack([random_patch(images[k], PATCH_SIZE, gen) for k in picks])
    lo, hi = SIGMA_RANGE
    sigma = (lo + (hi - lo) * torch.rand(PATCHES, generator=gen)) / 255.0
    return x + sigma.reshape(-1, 1, 1, 1) * torch.randn(x.shape, generator=gen), sigma


def _keep(scores: list[torch.Tensor], features: int) -> list[torch.Tensor]:
    return [s.argsort(descending=True)[:features].sort().values for s in scores]


def prune(
    checkpoint: Checkpoint,
    channels: int | None,
    images: list[torch.Tensor],
    seed: int = 0,
    colour_channels: int | None = None,
    colour_images: list[torch.Tensor] | None = None,
) -> tuple[ModelSpec, Tensors]:
    """The spec and tensors of ``checkpoint`` with its grey network cut to ``channels`` features by
    the saliency on ``PATCHES`` noisy patches of the grey ``images`` ``(1, H, W)``, and its colour
    network (grown by ``colour_copies`` where it has none) cut to ``colour_channels`` by the saliency on
    patches of the ``colour_images`` ``(3, H, W)``; each seeded, ``None`` leaving that network be."""
    spec = checkpoint.config.spec()
    net = getattr(spec.architecture, "net", None)
    if spec.task != "denoise" or net is None or net.condition != "sigma":
        raise ValueError(f"{checkpoint.path}: not a denoiser with a guide network")
    if channels is None and colour_channels is None:
        raise ValueError("nothing to prune: give the grey network's channels, the colour network's, or both")
    tensors, grown, notes = dict(checkpoint.tensors), net, []
    if colour_channels is not None:
        if net.colour_channels is None:
            tensors, grown = (
                colour_copies(tensors, net),
                net.model_copy(update={"colour_channels": 3 * net.channels}),
            )
            notes.append(
                f"colour network grown as three copies of the grey network's {net.channels} features"
            )
        if not 1 <= colour_channels <= grown.colour_channels:
            raise ValueError(
                f"colour channels must be within 1 and the colour network's {grown.colour_channels}, "
                f"got {colour_channels}"
            )
        y, sigma = _noisy_patches(colour_images or [], torch.Generator().manual_seed(seed))
        h = network_input(to_opponent(y), sigma)
        keep = _keep(saliency(tensors, "net_colour", net.depth, h), colour_channels)
        tensors = pruned(tensors, "net_colour", net.depth, keep)
        grown = grown.model_copy(update={"colour_channels": colour_channels})
        notes.append(f"colour network pruned to {colour_channels} features")
    if channels is not None:
        if not 1 <= channels <= net.channels:
            raise ValueError(f"channels must be within 1 and the network's {net.channels}, got {channels}")
        y, sigma = _noisy_patches(images, torch.Generator().manual_seed(seed))
        keep = _keep(saliency(tensors, "net", net.depth, network_input(y, sigma)), channels)
        tensors = pruned(tensors, "net", net.depth, keep)
        grown = grown.model_copy(update={"channels": channels})
        notes.append(f"guide network pruned from {net.channels} features to {channels}")
    lean = spec.architecture.model_copy(update={"net": grown})
    description = f"{spec.description} From {spec.name}:{spec.version}: {'; '.join(notes)}."
    return spec.model_copy(update={"architecture": lean, "description": description}), tensors


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("source", help="a denoiser checkpoint folder with a guide network")
    p.add_argument("--channels", type=int, help="features each hidden layer of the grey network keeps")
    p.add_argument(
        "--colour-channels",
        type=int,
        help="features each hidden layer of the colour network keeps (grown from the grey one where "
        "there is none)",
    )
    p.add_argument(
        "--train", nargs="+", required=True, metavar="DIR", help="images to measure the saliency on"
    )
    p.add_argument("--out", required=True, help="the pruned checkpoint's folder")
    p.add_argument("--seed", type=int, default=0)


def run(args: argparse.Namespace) -> int:
    try:
        check_writable(Path(args.out))  # before the saliencies, which take a while
        checkpoint = load_checkpoint(args.source)
        files = image_files(args.train)
        grey = load_images(files, 1) if args.channels is not None else []
        colour = load_images(files, 3) if args.colour_channels is not None else []
        spec, tensors = prune(checkpoint, args.channels, grey, args.seed, args.colour_channels, colour)
        notes = f"pruned from {args.source} (kdeq prune, seed {args.seed})"
        config = save_checkpoint(Path(args.out), spec, tensors, Provenance(notes=notes))
    except (CheckpointError, ValueError, OSError) as err:
        print(f"kdeq prune: error: {err}", file=sys.stderr)
        return 2
    net = config.architecture.net
    colour = "" if net.colour_channels is None else f", its colour network {net.colour_channels} features"
    print(
        f"wrote {args.out}: {config.name}:{config.version}, the grey network {net.channels} features{colour}"
    )
    return 0
