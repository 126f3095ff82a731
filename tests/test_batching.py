"""Exact batching of different sizes: each image's result in a padded batch equals its result alone."""

from pathlib import Path

import pytest
import torch

from kdeq.cli import test_image as piecewise_image
from kdeq.models.initialize import DEFAULT_SPECS, init_checkpoint
from kdeq.models.repository import find_model, load_predictor
from kdeq.predictors.base import SolverOverride, pad_images
from kdeq.registry import TASKS
from kdeq.tasks.base import solve_batch

MODELS = Path(__file__).resolve().parents[1] / "models"
SHAPES = [(40, 52), (33, 47), (48, 48)]
TIGHT = SolverOverride(tol=1e-6, max_iter=500)


def noisy_images(channels: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(11)
    images = []
    for h, w in SHAPES:
        clean = piecewise_image(64)[0, :, :h, :w].expand(channels, h, w)
        images.append((clean + 0.08 * torch.randn(clean.shape, generator=gen)).clamp(0, 1))
    return images


@pytest.mark.parametrize(
    "name", ["denoise-kglm", "denoise-kglm-x8", "denoise-kglm-collab", "denoise-stationary-kglm"]
)
@pytest.mark.parametrize("channels", [1, 3])
@pytest.mark.parametrize("sigma", [None, 20.0])
def test_padded_denoise_batch_equals_each_image_alone(name: str, channels: int, sigma: float | None) -> None:
    model = load_predictor(find_model(MODELS, name), "cpu")
    assert model.pads_exactly
    images = noisy_images(channels)
    batch, sizes = pad_images(images)
    together = model.predict(batch, sigma=sigma, solver=TIGHT, sizes=sizes)
    for k, (image, (h, w)) in enumerate(zip(images, sizes, strict=True)):
        alone = model.predict(image[None], sigma=sigma, solver=TIGHT)
        torch.testing.assert_close(together.output[k, :, :h, :w], alone.output[0], rtol=0, atol=2e-5)
        torch.testing.assert_close(together.sigma[k], alone.sigma[0])
    assert bool(together.stats.converged.all())


def test_padded_inpaint_batch_equals_each_image_alone() -> None:
    model = load_predictor(find_model(MODELS, "inpaint-kglm"), "cpu")
    images = noisy_images(1)
    gen = torch.Generator().manual_seed(2)
    masks = [torch.rand(1, *im.shape[-2:], generator=gen) < 0.5 for im in images]
    batch, sizes = pad_images(images)
    missing, _ = pad_images(masks)
    together = model.predict(batch, missing, solver=TIGHT, sizes=sizes)
    for k, (h, w) in enumerate(sizes):
        alone = model.predict(images[k][None], masks[k][None], solver=TIGHT)
        # float32 CG stalls near residual 3e-5 on this λ = 0.01 system (κ ≈ 10³), so the two solves
        # agree to ~2e-4; a leak through the padding would be an error of order 0.1 at the borders
        torch.testing.assert_close(together.output[k, :, :h, :w], alone.output[0], rtol=0, atol=5e-4)


def spec_with(name: str, tmp_path: Path, **changes):
    """A default model's predictor with some of its spec's fields (or its architecture's) changed."""
    spec = next(s for s in DEFAULT_SPECS if s.name == name)
    arch = {k: changes.pop(k) for k in list(changes) if k in type(spec.architecture).model_fields}
    spec = spec.model_copy(update={**changes, "architecture": spec.architecture.model_copy(update=arch)})
    return load_predictor(init_checkpoint(spec, tmp_path)[0])


@pytest.mark.parametrize(
    ("name", "mean"),
    [
        ("denoise-stationary-kglm", "normalized_convolution"),
        ("denoise-stationary-kglm", "none"),
        ("inpaint-kglm", "none"),
        ("inpaint-kglm", "global"),
    ],
)
def test_padded_batch_is_exact_for_every_mean(name: str, mean: str, tmp_path: Path) -> None:
    """A smoothed mean is computed on each image's own pixels (mirrored at its own borders)."""
    model = spec_with(name, tmp_path, mean=mean)
    images = noisy_images(1)
    batch, sizes = pad_images(images)
    if model.task == "inpaint":
        gen = torch.Generator().manual_seed(2)
        masks = [torch.rand(1, *im.shape[-2:], generator=gen) < 0.3 for im in images]
        together = model.predict(batch, pad_images(masks)[0], solver=TIGHT, sizes=sizes)
        alone = [model.predict(im[None], m[None], solver=TIGHT) for im, m in zip(images, masks, strict=True)]
    else:
        together = model.predict(batch, sigma=20.0, solver=TIGHT, sizes=sizes)
        alone = [model.predict(im[None], sigma=20.0, solver=TIGHT) for im in images]
    for k, (h, w) in enumerate(sizes):
        torch.testing.assert_close(together.output[k, :, :h, :w], alone[k].output[0], rtol=0, atol=5e-4)


def test_a_border_that_cannot_pad_exactly_refuses_sizes(tmp_path: Path) -> None:
    model = spec_with("denoise-stationary-kglm", tmp_path, padding="symmetric")
    assert not model.pads_exactly
    with pytest.raises(ValueError, match="cannot batch images of different sizes exactly"):
        model.predict(torch.rand(1, 1, 16, 16), sigma=20.0, sizes=[(16, 16)])


def test_models_that_cannot_pad_exactly_refuse_sizes() -> None:
    model = load_predictor(find_model(MODELS, "segment-kglm"), "cpu")
    assert not model.pads_exactly
    with pytest.raises(TypeError):
        model.predict(torch.rand(1, 1, 16, 16), sizes=[(16, 16)])


def test_sizes_must_fit_the_batch() -> None:
    model = load_predictor(find_model(MODELS, "denoise-kglm"), "cpu")
    with pytest.raises(ValueError, match="do not fit"):
        model.predict(torch.rand(2, 1, 16, 16), sizes=[(16, 16), (17, 16)])


def test_service_batches_different_sizes_and_crops_each_result_back() -> None:
    task = TASKS["denoise"]
    model = load_predictor(find_model(MODELS, "denoise-kglm"), "cpu")
    options = task.options(sigma=20.0)
    inputs = [task.prepare(im.numpy(), None, options, {}, TIGHT) for im in noisy_images(1)]
    assert len({i.image.shape for i in inputs}) == len(inputs)
    assert len({task.batch_key(i) for i in inputs}) == 1
    together = solve_batch(task, model, inputs)
    for item, solved in zip(inputs, together, strict=True):
        alone = solve_batch(task, model, [item])[0]
        assert solved.output.shape == item.image.shape
        assert abs(solved.output - alone.output).max() < 2e-5
