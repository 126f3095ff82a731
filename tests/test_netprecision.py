"""The guide networks' arithmetic (``kdeq.runtime.netprecision``): the measured choice, its pins, who is never
rounded, and what bfloat16 costs a real checkpoint's output."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kdeq.cli import psnr
from kdeq.cli import test_image as piecewise_smooth
from kdeq.maths.guidenet import GuideNet, pilot
from kdeq.models.repository import load_predictor
from kdeq.runtime import autotune, netprecision
from kdeq.runtime.netprecision import dtype_for, shape_class

MODELS = Path(__file__).resolve().parents[1] / "models"
NET = GuideNet(depth=3, channels=8, condition="sigma")


@pytest.fixture(autouse=True)
def measured(monkeypatch):
    """The suite pins float32 (``tests/conftest.py``); here the choice is measured, from scratch."""
    monkeypatch.setenv(netprecision.ENV, "auto")
    netprecision.choice.forget()
    yield
    netprecision.choice.forget()


def network(seed: int) -> dict[str, torch.Tensor]:
    """``NET``'s tensors, random (a trained network's last layer is not zero)."""
    gen = torch.Generator().manual_seed(seed)
    tensors = {name: 0.3 * torch.randn(shape, generator=gen) for name, shape in NET.shapes().items()}
    tensors["net_skip"] = torch.tensor([0.2])
    return tensors


@pytest.mark.parametrize(
    ("times", "expected"),
    [({"float32": 1.3, "bfloat16": 1.0}, "bfloat16"), ({"float32": 1.1, "bfloat16": 1.0}, "float32")],
    ids=["bf16-1.3x-faster", "bf16-1.1x-faster"],
)
def test_bfloat16_is_chosen_only_when_it_measures_a_margin_faster(
    monkeypatch, caplog, times, expected
) -> None:
    calls = []
    monkeypatch.setattr(netprecision, "measure", lambda h, features: calls.append(tuple(h.shape)) or times)
    with caplog.at_level(logging.INFO, logger="kdeq.netprecision"):
        assert dtype_for(torch.zeros(3, 5, 100, 120), 48, grad=False) == netprecision.DTYPES[expected]
        # the same class (batch up to 4, sides up to 128): no new measurement
        assert dtype_for(torch.zeros(4, 5, 128, 65), 48, grad=False) == netprecision.DTYPES[expected]
        dtype_for(torch.zeros(4, 5, 128, 65), 64, grad=False)  # other features: another class
    assert calls == [(3, 5, 100, 120), (4, 5, 128, 65)]
    assert f"-> {expected}" in caplog.text and "48 features" in caplog.text
    assert netprecision.choice.chosen() == {
        ("cpu", 48, 4, 128, 128): expected,
        ("cpu", 64, 4, 128, 128): expected,
    }
    assert shape_class(torch.zeros(3, 5, 100, 120), 48) == ("cpu", 48, 4, 128, 128)


def test_gradients_float64_and_other_devices_are_never_rounded(monkeypatch) -> None:
    monkeypatch.setattr(netprecision, "measure", lambda h, features: pytest.fail("measured"))
    with netprecision.choice.force("bfloat16"):
        assert dtype_for(torch.zeros(1, 5, 8, 8), 8, grad=True) == torch.float32
        assert dtype_for(torch.zeros(1, 5, 8, 8, dtype=torch.float64), 8, grad=False) == torch.float64
        assert dtype_for(torch.zeros(1, 5, 8, 8), 8, grad=False) == torch.bfloat16
    # off the CPU float32 unless pinned: a GPU's choice has not been measured
    assert dtype_for(torch.zeros(1, 5, 8, 8, device="meta"), 8, grad=False) == torch.float32


def test_a_pin_is_used_without_measuring_and_a_bad_name_is_refused(monkeypatch) -> None:
    monkeypatch.setattr(netprecision, "measure", lambda h, features: pytest.fail("measured"))
    h = torch.zeros(1, 5, 8, 8)
    monkeypatch.setenv(netprecision.ENV, "bfloat16")
    assert dtype_for(h, 8, grad=False) == torch.bfloat16
    netprecision.choice.pin("float32")
    try:
        assert dtype_for(h, 8, grad=False) == torch.float32  # over the variable
        with netprecision.choice.force("bfloat16"):
            assert dtype_for(h, 8, grad=False) == torch.bfloat16  # over the pin
    finally:
        netprecision.choice.pin("auto")
    monkeypatch.setenv(netprecision.ENV, "float16")
    with pytest.raises(ValueError, match="network precision is auto or one of"):
        dtype_for(h, 8, grad=False)


def test_the_measurement_times_both_options_on_a_real_layer() -> None:
    times = netprecision.measure(torch.zeros(2, 5, 24, 20), 16)
    assert set(times) == set(netprecision.DTYPES) and all(t > 0 for t in times.values())
    choice = dtype_for(torch.zeros(2, 5, 24, 20), 16, grad=False)
    name = next(n for n, dtype in netprecision.DTYPES.items() if dtype == choice)
    assert netprecision.choice.chosen() == {("cpu", 16, 2, 32, 32): name}


def test_the_pilot_runs_in_the_chosen_dtype_and_training_keeps_float32() -> None:
    t = network(1)
    gen = torch.Generator().manual_seed(2)
    y, base, sigma = (
        torch.rand(2, 1, 20, 18, generator=gen),
        torch.rand(2, 1, 20, 18, generator=gen),
        torch.ones(2),
    )
    with netprecision.choice.force("float32"):
        exact = pilot(y, base, sigma, t, NET)
    with netprecision.choice.force("bfloat16"):
        low = pilot(y, base, sigma, t, NET)
        # the weights a trainer updates: autograd through the network keeps float32, bit for bit
        trained = {name: v.clone().requires_grad_(True) for name, v in t.items()}
        graded = pilot(y, base, sigma, trained, NET)
    assert low.dtype == torch.float32 and not torch.equal(low, exact)
    torch.testing.assert_close(low, exact, rtol=0, atol=0.05 * exact.abs().max().item())
    assert torch.equal(graded.detach(), exact)
    graded.sum().backward()
    assert trained["net_0_weight"].grad is not None


def test_bfloat16_moves_the_default_denoisers_output_by_under_a_grey_level() -> None:
    """``denoise-kglm:8`` (the default) on a grey and a colour image at σ = 25: the output in bfloat16
    differs from float32's (so the rounding happened) by under a grey level, and its PSNR by under
    0.02 dB."""
    model = load_predictor(MODELS / "denoise-kglm" / "8")
    grey = piecewise_smooth(96)
    for clean in (grey, torch.cat([grey, grey.flip(-1), 0.5 * grey + 0.3], 1)):
        noisy = clean + 0.1 * torch.randn(clean.shape, generator=torch.Generator().manual_seed(0))
        out = {}
        for name in netprecision.DTYPES:
            with netprecision.choice.force(name):
                pred = model.predict(noisy, sigma=25.0)
            assert bool(pred.stats.converged.all())
            out[name] = pred.output
        diff = (out["bfloat16"] - out["float32"]).abs()
        assert 0 < diff.max() < 1 / 255 and diff.square().mean().sqrt() < 1e-3
        assert abs(psnr(out["bfloat16"], clean) - psnr(out["float32"], clean)) < 0.02


def test_the_service_pins_its_setting(tmp_path) -> None:
    from service.settings import Settings
    from service.state import Service

    try:
        Service(Settings(models_dir=tmp_path, device=("cpu",), network_precision="bfloat16", warmup=False))
        assert netprecision.choice.pinned() == "bfloat16"
        Service(Settings(models_dir=tmp_path, device=("cpu",), warmup=False))
        assert netprecision.choice.pinned() is None
    finally:
        netprecision.choice.pin("auto")


def test_the_margin_is_autotunes() -> None:
    # one rule for both measured choices (kdeq.runtime.backends' and this one)
    assert autotune.choose({"float32": 1.19, "bfloat16": 1.0}, tuple(netprecision.DTYPES)) == "float32"
    assert autotune.choose({"float32": 1.21, "bfloat16": 1.0}, tuple(netprecision.DTYPES)) == "bfloat16"


CHOICE = """
import json
import torch
from kdeq.runtime import netprecision
measured = {}
measure = netprecision.measure
netprecision.measure = lambda h, features: measured.setdefault("times", measure(h, features))
dtype = netprecision.dtype_for(torch.zeros(3, 5, 128, 128), 48, grad=False)
print(json.dumps({"times": measured["times"], "dtype": str(dtype).removeprefix("torch.")}))
"""


def _choice_in_a_process(**env: str) -> tuple[dict[str, float], str]:
    """The measured times and the choice for a 256² colour image's network input, in a fresh
    process (no choice kept from this one)."""
    environ = {**os.environ, netprecision.ENV: "auto", **env}
    done = subprocess.run(
        [sys.executable, "-c", CHOICE], env=environ, capture_output=True, text=True, check=True
    )
    answer = json.loads(done.stdout)
    return answer["times"], answer["dtype"]


@pytest.mark.parametrize(
    "env",
    [
        pytest.param({}, id="this-cpu"),
        # oneDNN held to AVX2 (this project's other CPU kind), where bfloat16 is emulated
        pytest.param({"ONEDNN_MAX_CPU_ISA": "AVX2"}, id="avx2"),
    ],
)
def test_a_fresh_process_chooses_what_its_own_measurement_says(env: dict[str, str]) -> None:
    """The contract, on the real layer in each dtype, whichever way the timings go on this machine
    and its load at the time: both options are timed, and the choice is ``autotune.choose`` of those
    times. Which option wins is the hardware's (bfloat16 units, a busy neighbour), not the test's."""
    times, dtype = _choice_in_a_process(**env)
    assert set(times) == set(netprecision.DTYPES) and all(t > 0 for t in times.values())
    assert dtype == autotune.choose(times, tuple(netprecision.DTYPES))


class _Clock:
    """A virtual ``time.perf_counter`` for ``autotune.compare``: a call of an option advances it by
    the option's cost, times ``slow`` while the clock is inside ``burst`` (a neighbour's busy spell)."""

    def __init__(self, burst: tuple[float, float], slow: float) -> None:
        self.now, self.burst, self.slow = 0.0, burst, slow

    def __call__(self) -> float:
        return self.now

    def option(self, cost: float):
        def call() -> None:
            self.now += cost * (self.slow if self.burst[0] <= self.now < self.burst[1] else 1.0)

        return call


def _sequential_medians(options: dict) -> dict[str, float]:
    """How the measurement timed before: a warm-up call, then the median of three, option after
    option."""
    times = {}
    for name, call in options.items():
        call()
        runs = []
        for _ in range(3):
            start = autotune.time.perf_counter()
            call()
            runs.append(autotune.time.perf_counter() - start)
        times[name] = sorted(runs)[1]
    return times


@pytest.mark.parametrize("burst_start", [0.0, 1.0, 2.0, 4.0, 6.0])
def test_a_busy_spell_does_not_choose(monkeypatch, burst_start: float) -> None:
    """Options of cost 1.0 (float32) and 0.5 (bfloat16, 2× faster) under a 4× slowdown lasting 6 s:
    wherever the spell falls, each option keeps a call outside it, so the times stay the true
    costs and the choice stays bfloat16."""
    clock = _Clock((burst_start, burst_start + 6.0), slow=4.0)
    monkeypatch.setattr(autotune.time, "perf_counter", clock)
    times = autotune.compare({"float32": clock.option(1.0), "bfloat16": clock.option(0.5)})
    assert times == {"float32": 1.0, "bfloat16": 0.5}
    assert autotune.choose(times, tuple(netprecision.DTYPES)) == "bfloat16"


def test_the_same_spell_fools_a_timing_of_one_option_after_the_other(monkeypatch) -> None:
    """The spell above, starting as float32's four calls end, covers all of bfloat16's: timed option
    after option, bfloat16 measures 2× slower than float32 and loses (what ``compare`` prevents)."""
    clock = _Clock((4.0, 10.0), slow=4.0)
    monkeypatch.setattr(autotune.time, "perf_counter", clock)
    times = _sequential_medians({"float32": clock.option(1.0), "bfloat16": clock.option(0.5)})
    assert times == {"float32": 1.0, "bfloat16": 2.0}
    assert autotune.choose(times, tuple(netprecision.DTYPES)) == "float32"


def test_compare_warms_each_option_and_times_them_in_turns() -> None:
    calls: list[str] = []
    times = autotune.compare({n: lambda n=n: calls.append(n) for n in "abc"}, runs=3)
    assert set(times) == set("abc") and all(t >= 0 for t in times.values())
    # one warm-up call each, then three rounds, each starting at the next option
    assert calls == list("abc") + list("abc") + list("bca") + list("cab")
