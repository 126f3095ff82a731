"""Model control and fairness under load, on real server processes (issue 23, items 3 and 4).

    .venv/bin/python bench/control.py swap [--seconds 8] [--clients 3]
    .venv/bin/python bench/control.py fairness [--before REV] [--seconds 20] [--loaders 3] [--size 128]

``swap``: a server (CPU, ``KDEQ_MODEL_CONTROL=true``) serving ``denoise-kglm:1`` answers ``--clients``
threads that each send 64² denoise requests back to back. After ``--seconds`` of traffic the script
loads ``denoise-kglm:2`` (``POST /models/denoise-kglm/load``) and keeps the traffic going for
``--seconds`` more. It prints the requests that failed (any status but 200), the p99 latency of the
requests that overlapped the load ÷ the p99 before it, and the load's own duration.

``fairness``: a server serving ``denoise-kglm:2`` and ``inpaint-kglm`` answers one probe thread that
sends 64² denoise requests back to back, first alone, then while ``--loaders`` threads send
``--size``² inpainting requests (50 % of the pixels missing) back to back. It prints the probe's
p50 and p99 in both phases and their ratio (how much the inpainting load delays a denoise request), and the
inpainting throughput. With ``--before REV`` it runs the same for the service at git revision ``REV``
(checked out into a temporary worktree) in the same run, so the two rows compare.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx2 as httpx
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.service_helpers import encode, free_port, noisy, smooth_image, to_uint8  # noqa: E402


def png(size: int, seed: int) -> bytes:
    return encode(to_uint8(noisy(smooth_image(size, size, seed), 20.0, seed)))


def mask_png(size: int, seed: int) -> bytes:
    missing = np.random.default_rng(seed).random((size, size)) < 0.5
    return encode(missing.astype(np.uint8) * 255)


@contextlib.contextmanager
def server(tree: Path, **settings: str) -> Iterator[str]:
    """``python -m service`` from ``tree`` on a free loopback port (CPU, warm-up at 32², log
    warnings); its URL once ``/readyz`` is 200."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("KDEQ_")}
    env.update({"KDEQ_PORT": str(port), "KDEQ_DEVICE": "cpu", "KDEQ_MODELS_DIR": str(tree / "models")})
    env.update({"KDEQ_LOG_LEVEL": "warning", "KDEQ_WARMUP_SIZES": "32", "PYTHONPATH": str(tree)})
    env.update({f"KDEQ_{k.upper()}": v for k, v in settings.items()})
    proc = subprocess.Popen([sys.executable, "-m", "service"], cwd=tree, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"the server at {tree} exited {proc.returncode}")
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(url + "/readyz", timeout=2).status_code == 200:
                    break
            time.sleep(0.2)
        else:
            raise RuntimeError(f"the server at {tree} was not ready in 180 s")
        yield url
    finally:
        proc.terminate()
        proc.wait(60)


class Traffic:
    """Threads that each send one kind of request back to back until ``stop``; every request's
    (start, end, status) is kept."""

    def __init__(
        self, url: str, route: str, files: dict[str, bytes], data: dict[str, str], threads: int
    ) -> None:
        self.records: list[tuple[float, float, int]] = []
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._threads = [
            threading.Thread(target=self._run, args=(url, route, files, data), daemon=True)
            for _ in range(threads)
        ]

    def _run(self, url: str, route: str, files: dict[str, bytes], data: dict[str, str]) -> None:
        with httpx.Client(base_url=url, timeout=300) as client:
            while not self._stop.is_set():
                start = time.monotonic()
                try:
                    status = client.post(
                        route, files={k: (f"{k}.png", v) for k, v in files.items()}, data=data
                    )
                    code = status.status_code
                except httpx.TransportError:
                    code = 0
                with self._lock:
                    self.records.append((start, time.monotonic(), code))

    def __enter__(self) -> Traffic:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for t in self._threads:
            t.join()


def machine() -> str:
    return f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores"


def p(latencies: list[float], q: float) -> float:
    return float(np.percentile(latencies, q)) if latencies else float("nan")


def swap(seconds: float, clients: int) -> None:
    with server(ROOT, models="denoise-kglm:1", model_control="true") as url:
        with Traffic(url, "/denoise", {"image": png(64, 1)}, {"sigma": "20"}, clients) as traffic:
            time.sleep(seconds)
            began = time.monotonic()
            r = httpx.post(f"{url}/models/denoise-kglm/load", json={"version": 2}, timeout=300)
            ended = time.monotonic()
            r.raise_for_status()
            time.sleep(seconds)
        records = traffic.records
    failed = sum(code != 200 for _, _, code in records)
    before = [e - s for s, e, _ in records if e < began]
    during = [e - s for s, e, _ in records if e >= began and s <= ended]
    print(f"\n## A version swapped in under traffic ({clients} clients, 64² denoise, CPU)\n")
    print(f"{machine()}; the load took {ended - began:.2f} s\n")
    print("| requests | failed | p99 before | p99 overlapping the load | ratio |")
    print("|---|---|---|---|---|")
    print(
        f"| {len(records)} | {failed} | {p(before, 99) * 1e3:.0f} ms | {p(during, 99) * 1e3:.0f} ms "
        f"({len(during)} requests) | {p(during, 99) / p(before, 99):.2f} |"
    )


def fairness_row(tree: Path, label: str, seconds: float, loaders: int, size: int) -> None:
    probe_args = ("/denoise", {"image": png(64, 2)}, {"sigma": "20"}, 1)
    with server(tree, models="denoise-kglm:2,inpaint-kglm", queue_size="64") as url:
        with Traffic(url, *probe_args) as alone:
            time.sleep(seconds)
        inpaint = {"image": png(size, 3), "mask": mask_png(size, 4)}
        with Traffic(url, "/inpaint", inpaint, {}, loaders) as load:
            time.sleep(2)  # the inpainting backlog builds before the probe starts
            with Traffic(url, *probe_args) as loaded:
                time.sleep(seconds)
    quiet = [e - s for s, e, c in alone.records if c == 200]
    busy = [e - s for s, e, c in loaded.records if c == 200]
    window = (loaded.records[0][0], loaded.records[-1][1]) if loaded.records else (0.0, 1.0)
    done = sum(1 for s, e, c in load.records if c == 200 and window[0] <= e <= window[1])
    failed = sum(c != 200 for *_, c in alone.records + loaded.records + load.records)
    print(
        f"| {label} | {p(quiet, 50) * 1e3:.0f} / {p(quiet, 99) * 1e3:.0f} ms | {p(busy, 50) * 1e3:.0f} / "
        f"{p(busy, 99) * 1e3:.0f} ms ({len(busy)}) | {p(busy, 99) / p(quiet, 99):.1f} | "
        f"{done / (window[1] - window[0]):.2f} | {failed} |"
    )


def fairness(before: str | None, seconds: float, loaders: int, size: int) -> None:
    print(
        f"\n## A denoise request beside an inpainting load ({loaders} inpainting clients at {size}², CPU)\n"
    )
    print(f"{machine()}, {seconds:g} s per phase\n")
    print("| service | denoise p50 / p99 alone | p50 / p99 under the load (requests) | p99 ratio ", end="")
    print("| inpaint/s | failed |")
    print("|---|---|---|---|---|---|")
    if before is not None:
        tmp = Path(tempfile.mkdtemp(prefix="kdeq-before-"))
        subprocess.run(
            ["git", "worktree", "add", "--detach", str(tmp), before],
            cwd=ROOT,
            check=True,
            capture_output=True,
        )
        try:
            fairness_row(tmp, f"`{before}`", seconds, loaders, size)
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(tmp)], cwd=ROOT, check=False)
            shutil.rmtree(tmp, ignore_errors=True)
    fairness_row(ROOT, "this tree", seconds, loaders, size)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="what", required=True)
    s = sub.add_parser("swap")
    s.add_argument("--seconds", type=float, default=8.0)
    s.add_argument("--clients", type=int, default=3)
    f = sub.add_parser("fairness")
    f.add_argument("--before", default=None, help="a git revision to measure beside this tree")
    f.add_argument("--seconds", type=float, default=20.0)
    f.add_argument("--loaders", type=int, default=3)
    f.add_argument("--size", type=int, default=128, help="the inpainting images' side")
    args = parser.parse_args()
    if args.what == "swap":
        swap(args.seconds, args.clients)
    else:
        fairness(args.before, args.seconds, args.loaders, args.size)


if __name__ == "__main__":
    main()
