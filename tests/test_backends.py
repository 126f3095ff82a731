"""Zero-border convolution backends (``kdeq.runtime.backends``): each against a direct sum, the measured
choice, its cache and its pin."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

from kdeq.maths.conv import conv
from kdeq.runtime import backends, netprecision
from kdeq.runtime.backends import BACKENDS, backend_for, choose, conv_zeros, force_backend, shape_class

F64 = torch.float64


def direct(x: np.ndarray, bank: np.ndarray) -> np.ndarray:
    """``y[b, o, i, j] = Σ_{c, a, d} C[o, c, a, d] · x[b, c, i + a − r, j + d − r']`` over the pixels
    inside the image, as loops over the filter's taps."""
    b, _, h, w = x.shape
    cout, cin, kh, kw = bank.shape
    rh, rw = kh // 2, kw // 2
    padded = np.zeros((b, cin, h + 2 * rh, w + 2 * rw))
    padded[:, :, rh : rh + h, rw : rw + w] = x
    out = np.zeros((b, cout, h, w))
    for a in range(kh):
        for d in range(kw):
            window = padded[:, :, a : a + h, d : d + w]
            out += np.einsum("oc,bchw->bohw", bank[:, :, a, d], window)
    return out


@pytest.fixture(autouse=True)
def fresh_choices():
    backends.forget()
    yield
    backends.forget()


@pytest.mark.parametrize("name", sorted(BACKENDS))
@pytest.mark.parametrize(
    ("x_shape", "bank_shape"),
    [((1, 1, 17, 23), (1, 1, 11, 11)), ((3, 2, 9, 12), (4, 2, 3, 5)), ((2, 1, 6, 7), (1, 1, 13, 9))],
    ids=["one-channel", "channels", "filter-wider-than-image"],
)
def test_every_backend_is_the_zero_border_correlation(name, x_shape, bank_shape) -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(x_shape, generator=gen, dtype=F64)
    bank = torch.randn(bank_shape, generator=gen, dtype=F64)
    expected = direct(x.numpy(), bank.numpy())
    np.testing.assert_allclose(BACKENDS[name](x, bank).numpy(), expected, rtol=0, atol=1e-10)
    with force_backend(name):
        np.testing.assert_allclose(conv(x, bank, "zeros").numpy(), expected, rtol=0, atol=1e-10)


@pytest.mark.parametrize("name", sorted(BACKENDS))
def test_every_backend_has_the_same_gradient(name) -> None:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(2, 1, 10, 12, generator=gen, dtype=F64)
    bank = torch.randn(1, 1, 7, 7, generator=gen, dtype=F64)
    weights = torch.randn(2, 1, 10, 12, generator=gen, dtype=F64)
    grads = {}
    for backend in ("padded", name):
        xs, bs = x.clone().requires_grad_(), bank.clone().requires_grad_()
        (BACKENDS[backend](xs, bs) * weights).sum().backward()
        grads[backend] = (xs.grad, bs.grad)
    for got, want in zip(grads[name], grads["padded"], strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-10)


def test_fft_is_timed_only_for_large_filters_on_few_channel_pairs() -> None:
    assert backends.candidates(torch.ones(1, 1, 11, 11)) == ["padded", "prepadded", "fft"]
    assert backends.candidates(torch.ones(3, 3, 5, 5)) == ["padded", "prepadded", "fft"]
    assert backends.candidates(torch.ones(1, 1, 3, 3)) == ["padded", "prepadded"]
    assert backends.candidates(torch.ones(64, 64, 11, 11)) == ["padded", "prepadded"]
    assert choose({"padded": 1.0, "prepadded": 0.9}) == "padded"


def test_a_backend_is_passed_over_only_for_one_faster_by_the_margin() -> None:
    assert choose({"padded": 1.0, "prepadded": 0.5, "fft": 0.7}) == "prepadded"
    assert choose({"padded": 1.0, "prepadded": 0.9, "fft": 0.95}) == "padded"
    assert choose({"padded": 0.4, "prepadded": 0.5, "fft": 0.7}) == "padded"
    assert choose({"padded": 1.0, "prepadded": 0.11, "fft": 0.1}) == "prepadded"
    assert choose({"padded": 1.0, "prepadded": 0.2, "fft": 0.1}) == "fft"


def test_a_choice_is_measured_once_per_shape_class_and_logged(monkeypatch, caplog) -> None:
    calls = []

    def fake(x, bank):
        calls.append(tuple(x.shape))
        return {"padded": 1.0, "prepadded": 0.1, "fft": 0.5}

    monkeypatch.setattr(backends, "measure", fake)
    bank = torch.ones(1, 1, 11, 11)
    with caplog.at_level(logging.INFO, logger="kdeq.backends"):
        assert backend_for(torch.zeros(1, 1, 200, 250), bank) == "prepadded"
        # the same class (sides up to 256): no new measurement
        assert backend_for(torch.zeros(1, 1, 256, 129), bank) == "prepadded"
        assert backend_for(torch.zeros(1, 1, 300, 250), bank) == "prepadded"  # 512 × 256: measured
    assert calls == [(1, 1, 200, 250), (1, 1, 300, 250)]
    assert "-> prepadded" in caplog.text and "(1, 1, 11, 11)" in caplog.text
    key = ("cpu", torch.float32, (1, 1, 11, 11), 4, 256, 256)
    assert shape_class(torch.zeros(3, 1, 200, 250), bank) == key


def test_a_pinned_backend_is_used_without_measuring(monkeypatch) -> None:
    monkeypatch.setattr(backends, "measure", lambda x, bank: pytest.fail("measured"))
    x, bank = torch.zeros(1, 1, 8, 8), torch.ones(1, 1, 3, 3)
    with force_backend("fft"):
        assert backend_for(x, bank) == "fft"
    monkeypatch.setenv("KDEQ_CONV_BACKEND", "prepadded")
    assert backend_for(x, bank) == "prepadded"
    backends.pin("fft")
    try:
        assert backend_for(x, bank) == "fft"  # over the variable
    finally:
        backends.pin("auto")
    assert backend_for(x, bank) == "prepadded"
    monkeypatch.setenv("KDEQ_CONV_BACKEND", "winograd")
    with pytest.raises(ValueError, match="backend is auto or one of"):
        conv_zeros(x, bank)
    with pytest.raises(ValueError, match="backend is auto or one of"), force_backend("winograd"):
        pass


def test_the_measured_choice_is_one_of_the_backends_on_a_real_input() -> None:
    x, bank = torch.rand(1, 1, 64, 64), torch.rand(1, 1, 11, 11)
    times = backends.measure(x, bank)
    assert set(times) == set(BACKENDS) and all(t > 0 for t in times.values())
    name = backend_for(x, bank)
    assert backends.chosen() == {shape_class(x, bank): name}
    torch.testing.assert_close(conv_zeros(x, bank), BACKENDS["padded"](x, bank), rtol=2e-6, atol=1e-6)


def test_the_service_pins_its_setting(tmp_path) -> None:
    from service.settings import Settings
    from service.state import Service

    try:
        Service(Settings(models_dir=tmp_path, device=("cpu",), conv_backend="fft", warmup=False))
        assert backend_for(torch.zeros(1, 1, 8, 8), torch.ones(1, 1, 3, 3)) == "fft"
        Service(Settings(models_dir=tmp_path, device=("cpu",), warmup=False))
        assert backends._pinned() is None
    finally:
        backends.pin("auto")


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ((None, None), ("prepadded", "float32")),
        (("auto", "auto"), ("prepadded", "float32")),
        (("fft", "bfloat16"), ("fft", "bfloat16")),
    ],
)
def test_training_pins_a_backend_so_that_a_resumed_run_repeats_its_arithmetic(
    monkeypatch, tmp_path, env, expected
) -> None:
    """``kdeq train`` pins the convolution backend and the guide network's precision
    (``kdeq.runtime.netprecision``: float32, so that validation, and the checkpoint it chooses, is the same on
    any machine) unless the environment names one; the pins end with the run."""
    from kdeq.train import loop
    from kdeq.train.config import TrainConfig

    for name, value in zip((backends.ENV, netprecision.ENV), env, strict=True):
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)
    seen = []
    monkeypatch.setattr(
        loop, "_train", lambda *args: seen.append((backends._pinned(), netprecision.choice.pinned())) or {}
    )
    cfg = TrainConfig(
        task="denoise",
        spec="denoise-stationary-kglm",
        train=(tmp_path,),
        val=(tmp_path,),
        out=tmp_path / "m" / "1",
    )
    loop.train(cfg)
    assert seen == [expected]
    after = tuple(None if v in (None, "auto") else v for v in env)
    assert (backends._pinned(), netprecision.choice.pinned()) == after  # the pins end with the run
