"""A sticky device error in a real ``kdeq`` server process: the requests in flight get 503, and the
process exits non-zero so that the orchestrator restarts it.

Run as ``python -m tests.test_service_device_exit`` this module is that server: the service itself,
with its batch solver wrapped so that a 40×40 image raises the error CUDA raises after a device-side
assert (the CPU has no device to break). The warm-up's solves are not wrapped.
"""

from __future__ import annotations

import threading
import time

import httpx2 as httpx

from tests.service_helpers import encode, noisy, run_server, smooth_image, to_uint8

TRIGGER = 40


def png(size: int) -> bytes:
    return encode(to_uint8(noisy(smooth_image(size, size), 20.0)))


def test_a_device_failure_answers_in_flight_requests_then_exits_non_zero(tmp_path) -> None:
    settings = {"models": "denoise-stationary-kglm", "max_batch_size": 1}
    with run_server(tmp_path, command=("tests.test_service_device_exit",), **settings) as server:
        answers: dict[str, httpx.Response] = {}

        def send(name: str, size: int) -> None:
            answers[name] = httpx.post(server.url + "/denoise", files={"image": png(size)}, timeout=60)

        failing = threading.Thread(target=send, args=("failing", TRIGGER))
        failing.start()
        time.sleep(0.5)  # the failing solve is running (it takes 1.5 s to fail): the next one queues
        queued = threading.Thread(target=send, args=("queued", 32))
        queued.start()
        failing.join(60)
        queued.join(60)
        for name, r in answers.items():
            assert r.status_code == 503 and r.json()["error"] == "device_failed", (name, r.text)
            assert "device-side assert" in r.json()["detail"]
        assert server.process.wait(30) == 3
    log = server.log.read_text()
    assert "device cpu failed: CUDA error: device-side assert triggered" in log
    assert "exiting with status 3" in log


def _serve_with_a_failing_device() -> int:
    import service.state
    from service.cli import main

    real = service.state.solve_requests

    def solve_requests(task, predictor, inputs, *args):
        if inputs[0].image.shape[-1] == TRIGGER:
            time.sleep(1.5)
            raise RuntimeError("CUDA error: device-side assert triggered\nCompile with TORCH_USE_CUDA_DSA")
        return real(task, predictor, inputs, *args)

    service.state.solve_requests = solve_requests
    return main([])


if __name__ == "__main__":
    raise SystemExit(_serve_with_a_failing_device())
