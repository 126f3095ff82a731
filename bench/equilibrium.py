"""What the equilibrium adds: each served model's output against its network's pilot alone and
against its kGLM closed form, on the same validation examples, in one run.

    .venv/bin/python bench/equilibrium.py [--data ../shared/data/Set12] [--crop 128] [--limit 12]

For every model the service serves (the highest version of each folder of ``models/``) whose task
trains (``kdeq.train.trainings.TRAININGS``), the task's validation examples are drawn from the
``--data`` images (centre crops, grey; the task's own corruption at the middle of its validation
levels, seeded as the trainer seeds them) and solved three ways, each scored by the task's training
(PSNR in dB; IoU for the segmenter):

- the model, with its solver's mean iterations;
- its network's pilot alone (``pilot_only``), where it has a network;
- its kGLM closed form: version 1 of the same model, where that was built in closed form and never
  trained (provenance ``kglm``, 0 epochs).

The data are read in place (research-only: never copied).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kdeq.models.repository import default_models_dir, find_model, list_models, load_predictor  # noqa: E402
from kdeq.predictors.base import Predictor  # noqa: E402
from kdeq.train.data import centre_crop, image_files, load_images, validation_set  # noqa: E402
from kdeq.train.trainings import TRAININGS  # noqa: E402


def score(model: Predictor, inputs: tuple, batch: dict, pilot: bool) -> tuple[float, float | None]:
    """The training's mean score of ``model``'s output (or its pilot alone) on ``batch``, and the mean
    iterations of its solve (``None`` for a pilot)."""
    training = TRAININGS[model.task]
    with torch.inference_mode():
        if pilot:
            return float(training.score(model.pilot_only(*inputs), batch).mean()), None
        found = model.predict(*inputs)
    return float(training.score(found.output, batch).mean()), float(found.stats.iterations.float().mean())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", type=Path, default=ROOT.parent / "shared" / "data" / "Set12")
    parser.add_argument("--crop", type=int, default=128)
    parser.add_argument("--limit", type=int, default=12, help="at most this many images")
    args = parser.parse_args()
    root = default_models_dir()
    images = [centre_crop(x, args.crop) for x in load_images(image_files([args.data])[: args.limit], 1)]
    print(f"{len(images)} images of {args.data}, {args.crop}² centre crops, grey\n")
    print("| model | level | output | iterations | pilot alone | output − pilot | kGLM closed form |")
    print("|---|---|---|---|---|---|---|")
    for name in sorted({e.name for e in list_models(root)}):
        model = load_predictor(find_model(root, name))
        training = TRAININGS.get(model.task)
        if training is None:
            continue
        knobs = training.knobs()
        levels = training.val_levels(knobs)
        level = levels[len(levels) // 2]
        examples = validation_set(images, training, knobs, [level], seed=0)
        batch = {k: torch.stack([e[k] for e in examples]) for k in examples[0]}
        inputs = training.predictor_inputs(batch)
        out, iterations = score(model, inputs, batch, pilot=False)
        try:
            pilot = f"{score(model, inputs, batch, pilot=True)[0]:.3f}"
            gain = f"{out - float(pilot):+.3f}"
        except (AttributeError, ValueError):  # no network, or no pilot of its own
            pilot = gain = "—"
        first = load_predictor(find_model(root, name, 1))
        provenance = first.config.provenance
        closed = "—"
        if provenance.init == "kglm" and provenance.epochs == 0 and first.config.architecture.net is None:
            closed = f"{score(first, inputs, batch, pilot=False)[0]:.3f} ({name}:1)"
        print(f"| {model.name} | {level:g} | {out:.3f} | {iterations:.1f} | {pilot} | {gain} | {closed} |")


if __name__ == "__main__":
    main()
