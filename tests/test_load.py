"""Overload and soak against a real server process: rejections are fast and explicit, accepted requests
keep their latency, the service recovers at once, and a long bounded load leaks nothing."""

from __future__ import annotations

import http.client
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import NamedTuple

import numpy as np
import pytest

from tests.service_helpers import encode, noisy, run_server, smooth_image, to_uint8
from tests.test_hostile import SUMMARY, rss_bytes

pytestmark = pytest.mark.slow


def images(size: int, count: int = 4) -> list[bytes]:
    return [encode(to_uint8(noisy(smooth_image(size, size, s), 20.0, s))) for s in range(count)]


def multipart(png: bytes) -> tuple[bytes, str]:
    boundary = "kdeqload"
    body = (
        (
            f'--{boundary}\r\nContent-Disposition: form-data; name="image"; filename="x.png"\r\n'
            f"Content-Type: image/png\r\n\r\n"
        ).encode()
        + png
        + f"\r\n--{boundary}\r\n".encode()
        + b'Content-Disposition: form-data; name="sigma"\r\n\r\n20\r\n'
        + f"--{boundary}--\r\n".encode()
    )
    return body, f"multipart/form-data; boundary={boundary}"


#: the status ``hammer`` records for a request whose connection was reset before an answer was read
RESET = 0


class Sent(NamedTuple):
    """One request of ``hammer``: when it was sent (monotonic seconds), how long its answer took, its
    status, its ``Retry-After`` and the seconds of its solve by ``Server-Timing`` (None without one)."""

    start: float
    seconds: float
    status: int
    retry: str | None
    inference: float | None


def inference_seconds(server_timing: str | None) -> float | None:
    """The ``inference;dur=`` phase of a ``Server-Timing`` header, in seconds."""
    for part in (server_timing or "").split(","):
        name, _, duration = part.strip().partition(";dur=")
        if name == "inference":
            return float(duration) / 1e3
    return None


def hammer(
    url: str, pngs: list[bytes], clients: int, seconds: float, interval: float | None = None
) -> list[Sent]:
    """Every request ``clients`` threads sent for ``seconds``, each thread with its own keep-alive
    connection: back to back, or one every ``interval`` seconds per thread (an open load that does not
    slow down when the server does). The client is plain ``http.client`` with bodies built beforehand,
    so the measuring side costs little CPU."""
    host, port = url.split("//")[1].split(":")
    bodies = [multipart(p) for p in pngs]
    out: list[Sent] = []
    lock = threading.Lock()
    stop = time.monotonic() + seconds

    def client(k: int) -> None:
        conn = http.client.HTTPConnection(host, int(port), timeout=120)
        i = k
        due = time.monotonic() + (interval or 0) * k / clients
        while time.monotonic() < stop:
            if interval is not None:
                time.sleep(max(0.0, due - time.monotonic()))
                due += interval
            body, ctype = bodies[i % len(bodies)]
            t0 = time.monotonic()
            try:
                conn.request("POST", "/denoise", body=body, headers={"Content-Type": ctype})
                r = conn.getresponse()
                r.read()
                status, retry, close = (
                    r.status,
                    r.getheader("retry-after"),
                    r.getheader("connection") == "close",
                )
                inference = inference_seconds(r.getheader("server-timing"))
            except (ConnectionError, http.client.HTTPException):
                # a refusal sent before the upload is read closes the connection; while this side is
                # still sending, the close can reach it as a reset before the 503 can be read
                status, retry, close, inference = RESET, None, True, None
            elapsed = time.monotonic() - t0
            with lock:
                out.append(Sent(t0, elapsed, status, retry, inference))
            if close:
                conn.close()
                conn = http.client.HTTPConnection(host, int(port), timeout=120)
            i += clients
        conn.close()

    with ThreadPoolExecutor(clients) as pool:
        list(pool.map(client, range(clients)))
    return out


def one_request_seconds(url: str, png: bytes) -> float:
    """Seconds of one ``POST /denoise`` of ``png`` on a new connection, with the plain client ``hammer``
    uses: what the server takes, not what a client library adds (``httpx.post`` builds a client per
    call, ~20 ms on this machine, twice a 128² solve, which once made the "6× capacity" load 2×)."""
    host, port = url.split("//")[1].split(":")
    body, ctype = multipart(png)
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    t0 = time.monotonic()
    conn.request("POST", "/denoise", body=body, headers={"Content-Type": ctype})
    r = conn.getresponse()
    r.read()
    elapsed = time.monotonic() - t0
    conn.close()
    assert r.status == 200, r.status
    return elapsed


def single_solve_seconds(url: str, png: bytes, repeats: int = 5) -> float:
    """The median of ``repeats`` requests after as many unmeasured: a fresh server's first solves of a
    shape are slower (allocations, the compiled loops' first call) and once made the median 2× slow."""
    for _ in range(repeats):
        one_request_seconds(url, png)
    return float(np.median([one_request_seconds(url, png) for _ in range(repeats)]))


def probed(url: str, stop: threading.Event, period: float = 0.1) -> list[float]:
    """Seconds of each ``GET /healthz`` sent every ``period`` until ``stop``: how fast the server
    answers a request that needs no solve, at each moment (a neighbour's load included)."""
    out: list[float] = []
    conn = http.client.HTTPConnection(*url.split("//")[1].split(":"), timeout=60)
    while not stop.wait(period):
        t0 = time.monotonic()
        conn.request("GET", "/healthz")
        conn.getresponse().read()
        out.append(time.monotonic() - t0)
    conn.close()
    return out


def test_overload_is_refused_fast_and_the_service_recovers(tmp_path) -> None:
    """An open load of 6× capacity: refusals (503) within 50 ms at the p99, or within three times the
    slowest liveness probe sent beside them (on a machine slowed by a neighbour; ~80 probes against
    200–500 refusals, so the probes' maximum lies about as deep in their tail as the refusals' p99,
    which a stall that holds up several refusals at once reaches and the probes' own p99 may miss);
    accepted requests within the queue's wait; and the next request after the load at its unloaded
    latency. The solve time that bounds the waits is the slower of two measured beside the load,
    before and after it."""
    queue = 4
    with run_server(tmp_path, queue_size=queue, max_batch_size=1) as server:
        # 256²: a solve of ~40 ms here puts the 6× load near 150 requests/s; at 128² (~13 ms) it was
        # ~450/s, whose HTTP handling on 2 cores slowed the accepted solves to within 6 % of their bound
        pngs = images(256)
        alone = single_solve_seconds(server.url, pngs[0])
        # an open load of 6× what one worker serves (1 / `alone`), spread over 16 clients, whatever
        # this machine's speed
        clients, offered = 16, 6.0 / alone
        stop = threading.Event()
        with ThreadPoolExecutor(1) as pool:
            probes = pool.submit(probed, server.url, stop)
            try:
                results = hammer(server.url, pngs, clients=clients, seconds=8.0, interval=clients / offered)
            finally:
                stop.set()  # the probe ends whatever happened to the load, or the pool would wait for ever
            probe_max = max(probes.result())
        codes = [r.status for r in results]
        assert set(codes) <= {200, 503, RESET}, set(codes)
        # a refusal the client could not read for a reset is rare: the 503s are what clients get
        assert codes.count(RESET) <= 0.05 * codes.count(503), (codes.count(RESET), codes.count(503))
        rejected = [r.seconds for r in results if r.status == 503]
        accepted = [r.seconds for r in results if r.status == 200]
        assert len(rejected) > len(accepted) > 0  # offered load far above capacity
        assert all(r.retry == "1" for r in results if r.status == 503)
        p99_rejected = float(np.quantile(rejected, 0.99))
        assert p99_rejected <= max(0.050, 3.0 * probe_max), (p99_rejected, probe_max)
        # recovery: the next request is served at once, at its unloaded latency
        recovered = one_request_seconds(server.url, pngs[0])
        after = single_solve_seconds(server.url, pngs[0])
        unit = max(alone, after)
        # an accepted request waits for at most the queue ahead of it, the one being solved and itself,
        # each a solve as slow as the load makes it: the server's own handling of ~150 refusals a
        # second and a neighbour's work share the cores with the solves (with a busy loop beside the
        # test on 2 cores, solves took 2× their unloaded time)
        loaded = float(np.quantile([r.inference for r in results if r.status == 200], 0.99))
        p99_accepted = float(np.quantile(accepted, 0.99))
        assert p99_accepted <= 2.0 * (queue + 2) * max(unit, loaded), (p99_accepted, alone, after, loaded)
        assert recovered <= 3.0 * unit + 0.05, (recovered, alone, after)
    summary = {
        "clients": clients,
        "offered_per_s": round(offered, 1),
        "capacity_per_s": round(1 / alone, 2),
        "seconds": 8.0,
        "queue_size": queue,
        "requests": len(results),
        "accepted": len(accepted),
        "rejected_503": len(rejected),
        "other": len(results) - len(accepted) - len(rejected),
        "single_solve_ms_before_after": [round(alone * 1e3, 1), round(after * 1e3, 1)],
        "p99_solve_under_load_ms": round(loaded * 1e3, 1),
        "slowest_probe_ms": round(probe_max * 1e3, 1),
        "p99_rejection_ms": round(p99_rejected * 1e3, 1),
        "probes": len(probes.result()),
        "p99_accepted_ms": round(p99_accepted * 1e3, 1),
        "recovered_request_ms": round(recovered * 1e3, 1),
    }
    SUMMARY.mkdir(parents=True, exist_ok=True)
    (SUMMARY / "overload.json").write_text(json.dumps(summary, indent=1))


def side_by_side(urls: list[str], pngs: list[bytes], seconds: float) -> list[list[float]]:
    """Each server's accepted latencies under the same closed load (3 clients each), given to all of
    them at once for ``seconds``: whatever a neighbour does, it does to all of them at the same
    moments."""
    with ThreadPoolExecutor(len(urls)) as pool:
        runs = [pool.submit(hammer, url, pngs, 3, seconds) for url in urls]
        return [[r.seconds for r in run.result() if r.status == 200] for run in runs]


def test_soak_holds_memory_and_latency(tmp_path, request) -> None:
    """A bounded load for ``--soak-seconds``: no errors and no memory growth; then the soaked server
    against a fresh one started beside it, both under the same load at the same time: its p90
    latency within 1.5× the fresh one's + 50 ms. A drift — a leak, a growing structure, a slower path
    — shows as the soaked process being slower than a new one at the same moments, which a
    neighbour's load, falling on both, does not fake (the p99 of the soak's last third against its
    first did, on a shared machine; so did slices of load alternating between the two servers, when
    the neighbour's load came in bursts)."""
    seconds = request.config.getoption("--soak-seconds")
    pngs = images(96, count=6)
    with run_server(tmp_path) as server:
        pid = server.process.pid
        hammer(server.url, pngs, clients=3, seconds=5.0)  # warm-up: allocator and caches settle
        rss_start = rss_bytes(pid)
        results = hammer(server.url, pngs, clients=3, seconds=seconds)
        rss_end = rss_bytes(pid)
        errors = [r.status for r in results if r.status != 200]
        assert not errors, errors[:10]
        growth = (rss_end - rss_start) / rss_start
        assert growth < 0.10, (rss_start, rss_end)
        start = results[0].start
        thirds = [[r.seconds for r in results if int(3 * (r.start - start) / seconds) == k] for k in range(3)]
        p99 = [float(np.quantile(part, 0.99)) for part in thirds]
        with run_server(tmp_path) as fresh:
            hammer(fresh.url, pngs, clients=3, seconds=5.0)  # the same warm-up
            soaked_lat, fresh_lat = side_by_side([server.url, fresh.url], pngs, seconds=15.0)
        p90 = [float(np.quantile(lat, 0.9)) for lat in (soaked_lat, fresh_lat)]
        assert p90[0] <= 1.5 * p90[1] + 0.05, p90  # no drift
    summary = {
        "seconds": seconds,
        "clients": 3,
        "requests": len(results),
        "errors": len(errors),
        "rss_mb_start_end": [round(rss_start / 2**20), round(rss_end / 2**20)],
        "rss_growth": round(growth, 4),
        "p99_ms_by_third": [round(x * 1e3, 1) for x in p99],
        "p90_ms_soaked_fresh": [round(x * 1e3, 1) for x in p90],
        "requests_soaked_fresh": [len(soaked_lat), len(fresh_lat)],
        "p50_ms": round(float(np.median([r.seconds for r in results])) * 1e3, 1),
    }
    SUMMARY.mkdir(parents=True, exist_ok=True)
    (SUMMARY / "soak.json").write_text(json.dumps(summary, indent=1))
