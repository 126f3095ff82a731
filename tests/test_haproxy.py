"""The load balancer for real: two (or one) ``python -m service`` processes on loopback behind a real
HAProxy started from the repository's ``deploy/haproxy/haproxy.cfg``. The file runs as shipped except
for what differs off Docker: its ``LB_*`` variables (listen addresses, check interval), which HAProxy
expands itself, and its one ``server-template`` line (replicas found through Docker's DNS), replaced by
one ``server`` line per local replica. Every per-server parameter sits on the ``default-server`` line,
so the replaced line holds nothing but addresses.

Checked: requests spread over the replicas and each reaches exactly one; a replica stopped with SIGTERM
under continuous load leaves the pool during its drain, before it exits, and no request fails; a
replica killed with SIGKILL costs no request either (refused connections are sent to the other
replica before the health check notices), and with none left HAProxy answers 503 in kdeq's error
shape with ``Retry-After``; a replica's own 503 (queue full) reaches the client untouched, not
retried."""

from __future__ import annotations

import contextlib
import csv
import io
import os
import re
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx2 as httpx
import pytest

from tests.service_helpers import (
    Server,
    encode,
    free_port,
    metric,
    missing_tool,
    noisy,
    run_server,
    smooth_image,
    to_uint8,
)

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "deploy" / "haproxy" / "haproxy.cfg"
# the model with the cheapest warm-up and solve: these tests are about routing, not restoration
MODEL = "denoise-kglm:1"
SMALL = encode(to_uint8(noisy(smooth_image(32, 32), 25.0)))


def haproxy() -> str:
    path = shutil.which("haproxy")
    if path is None:
        missing_tool("haproxy not installed (Debian package haproxy; .ci/run installs it)")
    return path


def local_config(text: str, addresses: list[str]) -> str:
    """The repository's config with its ``server-template`` line (Docker's DNS) replaced by a ``server``
    line per address; the ``default-server`` line above it still gives each its health check."""
    (template,) = re.findall(r"^[ \t]*server-template .*$", text, re.M)
    servers = "\n".join(f"    server kdeq{i} {a}" for i, a in enumerate(addresses, 1))
    return text.replace(template, servers)


@dataclass
class Balancer:
    """A running HAProxy: ``url`` is the kdeq frontend, ``stats`` its stats page."""

    process: subprocess.Popen
    url: str
    stats: str
    log: Path

    def servers(self) -> dict[str, dict[str, str]]:
        """The backend's rows of HAProxy's CSV statistics by server name (``status``: ``UP``,
        ``DOWN``, ``UP 1/2`` while changing; ``wredis``: redispatches), plus ``BACKEND``."""
        text = httpx.get(self.stats + "/stats;csv", timeout=5).text.lstrip("# ")
        return {row["svname"]: row for row in csv.DictReader(io.StringIO(text)) if row["pxname"] == "kdeq"}

    def status(self, name: str) -> str:
        return self.servers()[name]["status"]

    def wait_status(self, name: str, prefix: str, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while not self.status(name).startswith(prefix):
            assert time.monotonic() < deadline, (name, self.servers()[name], self.log.read_text()[-2000:])
            time.sleep(0.05)


@contextlib.contextmanager
def balancer(tmp: Path, replicas: list[Server], check_inter: str) -> Iterator[Balancer]:
    """HAProxy from the repository's config in front of ``replicas``, once it reports all of them UP."""
    binary = haproxy()
    config = tmp / "haproxy.cfg"
    config.write_text(local_config(CONFIG.read_text(), [s.url.split("//")[1] for s in replicas]))
    port, stats = free_port(), free_port()
    env = {
        **os.environ,
        "LB_BIND": f"127.0.0.1:{port}",
        "LB_STATS_BIND": f"127.0.0.1:{stats}",
        "LB_CHECK_INTER": check_inter,
    }
    log = tmp / "haproxy.log"
    with open(log, "wb") as out:
        # the config's own (non-daemon) mode: in the foreground, as the container runs it
        proc = subprocess.Popen([binary, "-f", str(config)], env=env, stdout=out, stderr=out)
    running = Balancer(proc, f"http://127.0.0.1:{port}", f"http://127.0.0.1:{stats}", log)
    try:
        deadline = time.monotonic() + 30
        while True:
            assert proc.poll() is None, log.read_text()
            with contextlib.suppress(httpx.TransportError):
                servers = running.servers()
                if all(servers[f"kdeq{i}"]["status"] == "UP" for i in range(1, len(replicas) + 1)):
                    break
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.1)
        yield running
    finally:
        proc.terminate()
        proc.wait(30)


@contextlib.contextmanager
def replicas(tmp: Path, count: int, **settings: object) -> Iterator[list[Server]]:
    """``count`` kdeq processes, started side by side (each takes seconds to load and warm up)."""
    with contextlib.ExitStack() as stack, ThreadPoolExecutor(count) as pool:
        started = pool.map(
            lambda _: stack.enter_context(run_server(tmp, models=MODEL, **settings)), range(count)
        )
        yield list(started)


def served(server: Server) -> float:
    """``/denoise`` requests this replica answered, any status."""
    return metric(
        httpx.get(server.url + "/metrics", timeout=10).text, "kdeq_http_requests_total", endpoint="/denoise"
    )


def test_requests_spread_and_a_draining_replica_leaves_without_a_failed_request(tmp_path) -> None:
    # a drain long enough for HAProxy's checks (every 200 ms here, then 500 ms) to see /readyz's 503
    # several times over, as KDEQ_DRAIN_SECONDS=5 is against the 2 s checks in docker-compose.yml
    with (
        replicas(tmp_path, 2, drain_seconds=3) as (first, second),
        balancer(tmp_path, [first, second], "200ms") as lb,
    ):
        # (a) sequential requests alternate (least connections, ties taken in turn); each reaches one
        # replica once: nothing is retried or duplicated on the way
        before = [served(first), served(second)]
        with httpx.Client(base_url=lb.url, timeout=60) as client:
            for _ in range(12):
                assert client.post("/denoise", files={"image": SMALL}).status_code == 200
        spread = [served(first) - before[0], served(second) - before[1]]
        assert sum(spread) == 12 and min(spread) >= 4, spread

        # (b) two clients post without pause; one replica gets SIGTERM in the middle
        results: list[tuple[float, int]] = []
        stop = threading.Event()

        def client() -> None:
            with httpx.Client(base_url=lb.url, timeout=60) as c:
                while not stop.is_set():
                    try:
                        code = c.post("/denoise", files={"image": SMALL}).status_code
                    except httpx.TransportError as err:  # a failure too, not a crash of the test
                        code = repr(err)
                    results.append((time.monotonic(), code))

        threads = [threading.Thread(target=client) for _ in range(2)]
        for t in threads:
            t.start()
        try:
            while len(results) < 6:
                time.sleep(0.02)
            first.process.send_signal(signal.SIGTERM)
            # HAProxy takes it out of the pool during its drain, while it still accepts connections
            # (a refused connection would be redispatched too, but a request whose connection was
            # accepted just before the listener closed would be lost)
            lb.wait_status("kdeq1", "DOWN")
            try:
                draining = httpx.get(first.url + "/readyz", timeout=10)
            except httpx.TransportError as err:
                raise AssertionError("the replica closed its port before HAProxy noticed its drain") from err
            assert draining.status_code == 503 and draining.json()["status"] == "draining"
            taken_out = len(results)
            assert first.process.wait(60) == 0  # the drain ran to its end: a clean exit
            exited = time.monotonic()
            # and the load goes on to the replica left, with no time bound but the number of requests
            while sum(1 for at, _ in results if at > exited) < 6:
                assert all(t.is_alive() for t in threads)
                time.sleep(0.02)
        finally:
            stop.set()
            for t in threads:
                t.join(60)
        failed = [code for _, code in results if code != 200]
        assert not failed, (failed, lb.log.read_text()[-3000:])
        assert len(results) > taken_out >= 6
        assert lb.status("kdeq2") == "UP"


def test_a_killed_replica_costs_no_request_and_none_left_is_a_503_with_retry_after(tmp_path) -> None:
    # checks 10 s apart: the whole test runs before HAProxy's health check can notice the kill, so
    # what keeps requests from failing is the redispatch of refused connections alone
    with (
        replicas(tmp_path, 2) as (first, second),
        balancer(tmp_path, [first, second], "10s") as lb,
        httpx.Client(base_url=lb.url, timeout=60) as client,
    ):
        for _ in range(2):  # one each, so both have answered before
            assert client.post("/denoise", files={"image": SMALL}).status_code == 200
        before = served(second)
        first.process.kill()
        first.process.wait()
        codes = [client.post("/denoise", files={"image": SMALL}).status_code for _ in range(6)]
        assert codes == [200] * 6
        # all of them on the replica left, and the ones sent to the dead one went on to it
        assert served(second) - before == 6
        servers = lb.servers()
        assert servers["kdeq1"]["status"].startswith("UP"), "checked before the test was over"
        assert int(servers["BACKEND"]["wredis"]) >= 1, servers["BACKEND"]

        # no replica at all: HAProxy's 503 in kdeq's error shape, with the Retry-After that makes
        # kdeq.client wait and send again, and the caller's request ID
        second.process.kill()
        second.process.wait()
        answer = client.post("/denoise", files={"image": SMALL}, headers={"X-Request-ID": "lb-test-1"})
        assert answer.status_code == 503 and answer.headers["retry-after"] == "1"
        assert answer.headers["content-type"] == "application/json"
        assert answer.json() == {
            "error": "no_replica",
            "detail": "no kdeq replica is ready; retry shortly",
            "request_id": "lb-test-1",
        }


def test_a_replicas_own_503_reaches_the_client_untouched(tmp_path) -> None:
    # One replica with room for one queued request. Two large solves fill it (one solving, one
    # queued); small requests then meet kdeq's 503 `queue_full` with its Retry-After. They are small
    # so that HAProxy could replay them (it can only replay a request that fits in its buffer): the
    # config must not, nor replace the answer with its own. The large solves must outlast the small
    # requests' round trips: at 384² the first one sometimes finished before the first small request
    # arrived, leaving the queue room (3 failures in 11 runs on the 2-core development machine, two of
    # them in whole-suite runs); 768² takes about four times as long.
    big = encode(to_uint8(noisy(smooth_image(768, 768), 25.0)))
    with replicas(tmp_path, 1, queue_size=1) as (only,), balancer(tmp_path, [only], "2s") as lb:
        before = served(only)

        def replica_metric(name: str) -> float:
            return metric(httpx.get(only.url + "/metrics", timeout=10).text, name)

        def until(condition, large) -> None:
            deadline = time.monotonic() + 60
            while not condition():
                assert time.monotonic() < deadline and not any(f.done() for f in large), large
                time.sleep(0.01)

        with ThreadPoolExecutor(2) as pool:
            post_big = lambda: httpx.post(lb.url + "/denoise", files={"image": big}, timeout=120)  # noqa: E731
            # one after the other: the first leaves the queue for a worker, the second waits in it
            started = replica_metric("kdeq_queue_wait_seconds_count")
            large = [pool.submit(post_big)]
            until(lambda: replica_metric("kdeq_queue_wait_seconds_count") > started, large)
            large.append(pool.submit(post_big))
            until(lambda: replica_metric("kdeq_queue_depth") >= 1, large)
            small = [
                httpx.post(
                    lb.url + "/denoise", files={"image": SMALL}, headers={"X-Request-ID": f"q{i}"}, timeout=60
                )
                for i in range(4)
            ]
            assert [f.result().status_code for f in large] == [200, 200]
        refused = [(i, a) for i, a in enumerate(small) if a.status_code == 503]
        assert refused and all(a.status_code == 200 for a in small if a.status_code != 503)
        for i, answer in refused:
            assert answer.headers["retry-after"] == "1"
            assert answer.json()["error"] == "queue_full" and answer.json()["request_id"] == f"q{i}"
        # each request reached the replica exactly once: a replica's 503 is not retried
        assert served(only) - before == 6


@pytest.mark.parametrize("variable", ["LB_BIND", "LB_STATS_BIND", "LB_CHECK_INTER"])
def test_every_variable_the_tests_set_is_one_the_config_reads(variable: str) -> None:
    # a renamed variable in the config would otherwise leave the tests on its default silently
    assert f'"${{{variable}-' in CONFIG.read_text()
