"""The load balancer's cost: two replicas behind HAProxy against the same replicas driven directly.

    .venv/bin/python bench/haproxy.py [--seconds 10] [--clients 2 8] [--size 256] [--rounds 2] [--threads N]

It starts two ``python -m service`` replicas on loopback (CPU, ``denoise-kglm:1``, as
``bench/load.py`` does) and HAProxy (Debian's ``haproxy``) in front of them, from the repository's
``deploy/haproxy/haproxy.cfg`` with its ``LB_*`` variables set and its ``server-template`` line (Docker's
DNS) replaced by one ``server`` line per replica, as ``tests/test_haproxy.py`` runs it. For each
client count N it measures, for ``--seconds`` each and in this order, ``--rounds`` times:

- ``alone A``, ``alone B``: N clients on one replica while the other idles;
- ``direct``: N/2 clients on each replica at once, no balancer (how a client that knew both
  addresses would spread its load);
- ``HAProxy``: N clients on HAProxy's port.

Each client is a thread with its own keep-alive connection posting noisy (σ = 25, seeded) Set12 PNGs of
``--size``² to ``/denoise`` (generated images when ``../shared/data`` is absent). It prints, per round,
throughput, p50 and p99 latency and errors, and the two figures the load-balancer issue asks for:
throughput through HAProxy ÷ (alone A + alone B), and HAProxy's p99 − the direct p99 (the same
concurrency on the same replicas). The ratio HAProxy ÷ direct separates the balancer's own cost from
the replicas sharing this machine's cores. The replicas, HAProxy and the clients share the machine.
``--threads N`` sets ``OMP_NUM_THREADS`` for the replicas (torch's threads per process; default:
torch's own, one per core, so two busy replicas run twice as many threads as there are cores).
"""

from __future__ import annotations

import argparse
import http.client
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from load import drive, free_port, images, multipart, start_server  # noqa: E402

CONFIG = ROOT / "deploy" / "haproxy" / "haproxy.cfg"


def start_haproxy(ports: list[int], workdir: Path) -> tuple[subprocess.Popen, int]:
    """HAProxy from the repository's config in front of ``ports`` on loopback, once both are UP."""
    binary = shutil.which("haproxy")
    if binary is None:
        raise SystemExit("haproxy is not installed (Debian: apt-get install haproxy)")
    text = CONFIG.read_text()
    (template,) = re.findall(r"^[ \t]*server-template .*$", text, re.M)
    servers = "\n".join(f"    server kdeq{i} 127.0.0.1:{p}" for i, p in enumerate(ports, 1))
    config = workdir / "haproxy.cfg"
    config.write_text(text.replace(template, servers))
    port, stats = free_port(), free_port()
    env = {**os.environ, "LB_BIND": f"127.0.0.1:{port}", "LB_STATS_BIND": f"127.0.0.1:{stats}"}
    proc = subprocess.Popen([binary, "-f", str(config)], env=env, stdout=subprocess.DEVNULL)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            conn = http.client.HTTPConnection("127.0.0.1", stats, timeout=2)
            conn.request("GET", "/stats;csv")
            rows = conn.getresponse().read().decode().splitlines()
            up = [r for r in rows if r.startswith("kdeq,kdeq") and ",UP," in r]
            if len(up) == len(ports):
                return proc, port
        except OSError:
            pass
        time.sleep(0.1)
    proc.kill()
    raise RuntimeError("HAProxy did not report both replicas UP")


def drive_many(ports: list[int], bodies: list[bytes], clients: int, seconds: float) -> tuple:
    """``drive`` on every port at once, ``clients`` split evenly; the results pooled."""
    results: list[tuple] = [()] * len(ports)

    def one(i: int) -> None:
        results[i] = drive(ports[i], bodies, clients // len(ports), seconds)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(ports))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    done = sum(r[0] for r in results)
    elapsed = max(r[1] for r in results)
    return done, elapsed, [x for r in results for x in r[2]], sum(r[3] for r in results)


def summary(result: tuple) -> tuple[float, float, float, int]:
    """(images/s, p50 s, p99 s, errors)."""
    done, elapsed, latencies, errors = result
    p50, p99 = np.quantile(latencies, [0.5, 0.99]) if latencies else (float("nan"),) * 2
    return done / elapsed, float(p50), float(p99), errors


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--clients", type=int, nargs="+", default=[2, 8], help="even numbers")
    parser.add_argument("--size", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, help="OMP_NUM_THREADS of each replica (default: unset)")
    args = parser.parse_args()
    if args.threads is not None:
        # start_server passes this process's environment (less most KDEQ_*: bench/load.py) to the replicas
        os.environ["OMP_NUM_THREADS"] = str(args.threads)
    if any(c % 2 for c in args.clients):
        parser.error("--clients: even numbers (the direct runs split them over two replicas)")
    version = subprocess.run(["haproxy", "-v"], capture_output=True, text=True).stdout.split("\n")[0]
    print(
        f"machine: {platform.node()} {platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__} "
        f"(replicas: {args.threads or torch.get_num_threads()} threads each), {version}; "
        f"model denoise-kglm:1 on cpu, σ=25 estimated per image, seed {args.seed}, "
        f"{args.seconds:g} s per point"
    )
    pngs, source = images(args.size, args.seed)
    bodies = [multipart(p) for p in pngs]
    print(f"images: {args.size}×{args.size} ({source})")
    replicas: list[subprocess.Popen] = []
    balancer = None
    rows = []
    try:
        ports = [free_port(), free_port()]
        for port in ports:
            replicas.append(start_server(port, None, max(args.clients)))
        with tempfile.TemporaryDirectory() as tmp:
            balancer, lb = start_haproxy(ports, Path(tmp))
            for port in ports:
                drive(port, bodies, 1, 1.0)  # each replica's allocator warm for this size
            for clients in args.clients:
                for rnd in range(1, args.rounds + 1):
                    a = summary(drive(ports[0], bodies, clients, args.seconds))
                    b = summary(drive(ports[1], bodies, clients, args.seconds))
                    direct = summary(drive_many(ports, bodies, clients, args.seconds))
                    through = summary(drive(lb, bodies, clients, args.seconds))
                    rows.append((clients, rnd, a, b, direct, through))
                    for name, (thr, p50, p99, errors) in (
                        ("alone A", a),
                        ("alone B", b),
                        ("direct", direct),
                        ("HAProxy", through),
                    ):
                        print(
                            f"  {clients:>2} clients, round {rnd}, {name:<8} {thr:6.2f} img/s, "
                            f"p50 {p50 * 1e3:6.0f} ms, p99 {p99 * 1e3:6.0f} ms, {errors} errors",
                            flush=True,
                        )
    finally:
        if balancer is not None:
            balancer.terminate()
            balancer.wait(30)
        for proc in replicas:
            proc.terminate()
            proc.wait(60)
    print(
        "\n| clients | round | alone A img/s | alone B img/s | direct img/s | HAProxy img/s "
        "| HAProxy ÷ (A + B) | HAProxy ÷ direct | direct p99 ms | HAProxy p99 ms | p99 added ms | errors |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for clients, rnd, a, b, direct, through in rows:
        errors = a[3] + b[3] + direct[3] + through[3]
        print(
            f"| {clients} | {rnd} | {a[0]:.2f} | {b[0]:.2f} | {direct[0]:.2f} | {through[0]:.2f} | "
            f"{through[0] / (a[0] + b[0]):.2f} | {through[0] / direct[0]:.2f} | {direct[2] * 1e3:.0f} | "
            f"{through[2] * 1e3:.0f} | {(through[2] - direct[2]) * 1e3:+.0f} | {errors} |"
        )


if __name__ == "__main__":
    main()
