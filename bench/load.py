"""Serving overhead: a real server process under concurrent load vs the same predictor in process.

    .venv/bin/python bench/load.py [--seconds 10] [--clients 1 4 16 64] [--sizes 256 512] [--batch 1 8]
        [--model NAME[:VERSION]] [--colour] [--nlm]

It starts ``python -m service`` on loopback (CPU, default models; ``--batch``
sets ``KDEQ_MAX_BATCH_SIZE``, one server per value, else the service's default applies: 1 on a CPU;
the settings of the arithmetic, ``KDEQ_MALLOC``, ``KDEQ_NETWORK_PRECISION``, ``KDEQ_GUIDED_BACKEND``,
``KDEQ_CONV_BACKEND`` and ``KDEQ_THREADS``, pass from this process's environment to the server's,
every other ``KDEQ_`` variable is dropped).
For each image size and client count it first measures, in this process, one
request's work without HTTP — decode the PNG, ``predict`` a batch of one,
encode the PNG — and the throughput of that loop for ``--seconds``, then
drives ``/denoise`` with N client threads, each with its own keep-alive
connection, for ``--seconds``; each ratio pairs the two adjacent measurements. It prints
throughput, p50 and p99 latency, and the ratios the service issue sets targets
for: server throughput ÷ in-process throughput (≥ 0.8) and, at one client,
request latency ÷ in-process decode + predict + encode (≤ 1.2). Clients and
server share this machine's cores.

Images: noisy (σ = 25, seeded) Set12 images from ``../shared/data`` (01–07 are
256², 08–12 are 512²), or with ``--colour`` the top-left ``size``² of the first three Kodak24
images; generated ones when the data is absent. The model is ``--model`` (``denoise-kglm:1`` by
default, the one the service issue's figures used) in process and on the server. ``--nlm`` also
times scikit-image's non-local means on the same noisy images in this process (``.venv-bench``),
σ given, and prints each p50 ÷ its time.
"""

from __future__ import annotations

import argparse
import http.client
import io
import os
import platform
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from kdeq.cli import test_image  # noqa: E402
from kdeq.models.repository import find_reference, load_predictor  # noqa: E402
from kdeq.runtime import heap  # noqa: E402
from service.decode import decode_image  # noqa: E402
from service.encode import encode_png  # noqa: E402

SET12 = ROOT.parent / "shared" / "data" / "Set12"
KODAK = ROOT.parent / "shared" / "data" / "Kodak24"
BOUNDARY = "kdeqbench"


def images(size: int, seed: int, colour: bool = False) -> tuple[list[bytes], str]:
    """Noisy PNGs of ``size``² (grey, or ``colour``), and where they came from."""
    rng = np.random.default_rng(seed)
    if colour:
        files = sorted(KODAK.glob("*.png"))[:3] if KODAK.is_dir() else []
        clean = [
            np.asarray(Image.open(f).convert("RGB"), dtype=np.float64)[:size, :size] / 255 for f in files
        ]
        source = f"Kodak24 {', '.join(f.name for f in files)}, top-left {size}²"
    else:
        files = sorted(SET12.glob("*.png")) if SET12.is_dir() else []
        picked = [f for f in files if Image.open(f).size == (size, size)]
        clean = [np.asarray(Image.open(f).convert("L"), dtype=np.float64) / 255 for f in picked]
        source = f"Set12 {', '.join(f.name for f in picked)}"
    if not clean:
        grey = test_image(size)[0, 0].double().numpy()
        clean = [np.stack([grey, grey.T, 1 - grey], axis=-1) if colour else grey]
        source = "generated"
    out = []
    for c in clean:
        noisy = np.clip(c + 25 / 255 * rng.standard_normal(c.shape), 0, 1)
        buf = io.BytesIO()
        Image.fromarray(np.round(noisy * 255).astype(np.uint8)).save(buf, format="PNG")
        out.append(buf.getvalue())
    return out, source


def nlm_seconds(pngs: list[bytes]) -> float:
    """Mean seconds of scikit-image's non-local means (``bench/baselines.py``, σ = 25 given) on the
    decoded ``pngs``, after a warm-up."""
    import baselines

    noisy = [np.asarray(Image.open(io.BytesIO(p)), dtype=np.float64) / 255 for p in pngs]
    baselines.nlm_skimage(noisy[0], 25.0)
    start = time.perf_counter()
    for n in noisy:
        baselines.nlm_skimage(n, 25.0)
    return (time.perf_counter() - start) / len(noisy)


def in_process(pngs: list[bytes], seconds: float, ref: str) -> tuple[float, float, float]:
    """(images/s of decode+predict+encode, mean seconds of that, mean seconds of predict alone), for
    the model ``ref`` (``NAME[:VERSION]``)."""
    model = load_predictor(find_reference(ROOT / "models", ref), "cpu")
    full, predict = [], []
    end = time.monotonic() + seconds
    i = 0
    while time.monotonic() < end or i < len(pngs):
        t0 = time.perf_counter()
        decoded = decode_image(pngs[i % len(pngs)], "image", 1 << 26)
        t1 = time.perf_counter()
        out = model.predict(torch.from_numpy(decoded.pixels[None])).output[0].numpy()
        t2 = time.perf_counter()
        encode_png(out, decoded.mode)
        full.append(time.perf_counter() - t0)
        predict.append(t2 - t1)
        i += 1
    return len(full) / sum(full), statistics.mean(full), statistics.mean(predict)


def batch_cost(pngs: list[bytes], sizes: list[int], ref: str, repeats: int = 3) -> dict[int, float]:
    """Per-image ``predict`` time of a batch of ``B`` ÷ that of a batch of one, for each ``B``
    (best of ``repeats``; the batch cycles through ``pngs``), for the model ``ref``."""
    model = load_predictor(find_reference(ROOT / "models", ref), "cpu")
    pixels = [decode_image(p, "image", 1 << 26).pixels for p in pngs]
    per_image = {}
    for b in sorted({1, *sizes}):
        x = torch.from_numpy(np.stack([pixels[i % len(pixels)] for i in range(b)]))
        model.predict(x)
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            model.predict(x)
            best = min(best, time.perf_counter() - t0)
        per_image[b] = best / b
    return {b: t / per_image[1] for b, t in per_image.items()}


def multipart(png: bytes) -> bytes:
    head = (
        f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="image"; filename="x.png"\r\n'
        "Content-Type: image/png\r\n\r\n"
    ).encode()
    return head + png + f"\r\n--{BOUNDARY}--\r\n".encode()


def drive(
    port: int, bodies: list[bytes], clients: int, seconds: float
) -> tuple[int, float, list[float], int]:
    """(completed, elapsed, latencies, errors) of ``clients`` threads posting for ``seconds``."""
    latencies: list[float] = []
    errors = 0
    lock = threading.Lock()
    start = time.monotonic()
    stop = start + seconds

    def client(k: int) -> None:
        nonlocal errors
        headers = {"Content-Type": f"multipart/form-data; boundary={BOUNDARY}"}
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
        i = k
        while time.monotonic() < stop:
            t0 = time.perf_counter()
            try:
                conn.request("POST", "/denoise", body=bodies[i % len(bodies)], headers=headers)
                resp = conn.getresponse()
                resp.read()
                ok = resp.status == 200
            except OSError:  # counted, and the client carries on with a new connection
                ok = False
                conn.close()
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
            with lock:
                if ok:
                    latencies.append(time.perf_counter() - t0)
                else:
                    errors += 1
            i += clients
        conn.close()

    threads = [threading.Thread(target=client, args=(k,)) for k in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return len(latencies), time.monotonic() - start, latencies, errors


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(
    port: int, batch: int | None, clients: int, device: str = "cpu", model: str = "denoise-kglm:1"
) -> subprocess.Popen:
    """A ``python -m service`` on ``port`` serving ``model`` on ``device``, once ready; the default
    model is the one of the in-process measurement beside it."""
    # the settings that choose the arithmetic pass through, so that the server computes as this
    # process's in-process measurement does; every other KDEQ_ variable is dropped
    shared = {
        "KDEQ_MALLOC",
        "KDEQ_NETWORK_PRECISION",
        "KDEQ_GUIDED_BACKEND",
        "KDEQ_CONV_BACKEND",
        "KDEQ_THREADS",
    }
    env = {k: v for k, v in os.environ.items() if not k.startswith("KDEQ_") or k in shared}
    env.update(
        KDEQ_PORT=str(port),
        KDEQ_DEVICE=device,
        KDEQ_LOG_LEVEL="warning",
        KDEQ_QUEUE_SIZE=str(max(64, 2 * clients)),
        KDEQ_DRAIN_SECONDS="0",
        KDEQ_MODELS_DIR=str(ROOT / "models"),
        KDEQ_MODELS=model,
    )
    if batch is not None:
        env["KDEQ_MAX_BATCH_SIZE"] = str(batch)
    proc = subprocess.Popen([sys.executable, "-m", "service"], cwd=ROOT, env=env)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with status {proc.returncode}")
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
            conn.request("GET", "/readyz")
            if conn.getresponse().status == 200:
                return proc
        except OSError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError("server did not become ready")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--sizes", type=int, nargs="+", default=[256, 512])
    parser.add_argument(
        "--batch",
        type=int,
        nargs="+",
        help="KDEQ_MAX_BATCH_SIZE of the server, one server per value, each driven after the same "
        "in-process measurement (default: the service's own)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model", default="denoise-kglm:1", metavar="NAME[:VERSION]")
    parser.add_argument("--colour", action="store_true", help="colour images (Kodak24 crops)")
    parser.add_argument("--nlm", action="store_true", help="scikit-image NLM's time beside (.venv-bench)")
    parser.add_argument(
        "--batch-sizes", type=int, nargs="+", default=[2, 4, 8], help="in-process batch costs"
    )
    args = parser.parse_args()
    heap.configure()  # the in-process side's heap as the server configures its own
    batches: list[int | None] = list(args.batch) if args.batch else [None]
    print(
        f"machine: {platform.node()} {platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__} "
        f"({torch.get_num_threads()} threads), model {args.model} on cpu, σ=25 estimated per image, "
        f"seed {args.seed}, {args.seconds:g} s per point, server batch ≤ "
        + ", ".join(str(b) if b else "default (1 on CPU)" for b in batches)
    )
    servers = {}
    rows = []
    try:
        for batch in batches:
            port = free_port()
            servers[batch] = (port, start_server(port, batch, max(args.clients), model=args.model))
        for size in args.sizes:
            pngs, source = images(size, args.seed, args.colour)
            bodies = [multipart(p) for p in pngs]
            for port, _ in servers.values():
                drive(port, bodies, 1, 1.0)  # warm the server's allocator for this size
            print(f"\n{size}×{size} ({source})")
            ratios = batch_cost(pngs, args.batch_sizes, args.model)
            nlm = nlm_seconds(pngs) if args.nlm else None
            if nlm is not None:
                print(f"  scikit-image NLM {nlm * 1e3:.0f} ms per image")
            print(
                "  in-process batch of B, per-image time ÷ batch of 1: "
                + ", ".join(f"B={b} {r:.2f}×" for b, r in ratios.items())
            )
            for clients in args.clients:
                # the in-process baseline is measured right before the server points: the machine drifts
                rate, full, predict = in_process(pngs, args.seconds, args.model)
                print(
                    f"  in process {rate:.2f} img/s, decode+predict+encode {full * 1e3:.0f} ms "
                    f"(predict {predict * 1e3:.0f} ms)"
                )
                for batch, (port, _) in servers.items():
                    done, elapsed, lat, errors = drive(port, bodies, clients, args.seconds)
                    q = np.quantile(lat, [0.5, 0.99]) if lat else [float("nan")] * 2
                    thr = done / elapsed
                    rows.append((size, clients, batch or 1, rate, full, thr, q[0], q[1], errors, nlm))
                    vs_nlm = "" if nlm is None else f", p50 ÷ NLM {q[0] / nlm:.2f}"
                    print(
                        f"    batch ≤ {batch or 1}, {clients:>2} clients: {thr:.2f} img/s "
                        f"({thr / rate:.2f}×), p50 {q[0] * 1e3:.0f} ms ({q[0] / full:.2f}×{vs_nlm}), "
                        f"p99 {q[1] * 1e3:.0f} ms, {errors} errors",
                        flush=True,
                    )
    finally:
        for _, server in servers.values():
            server.terminate()
            server.wait(60)
    print(
        "\n| size | clients | server batch ≤ | in-process img/s | server img/s | ratio "
        "| in-process request ms | p50 ms | p50 ratio | p99 ms | errors |"
        + (" p50 ÷ NLM |" if args.nlm else "")
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|" + ("---|" if args.nlm else ""))
    for size, clients, batch, rate, full, thr, p50, p99, errors, nlm in rows:
        print(
            f"| {size}² | {clients} | {batch} | {rate:.2f} | {thr:.2f} | {thr / rate:.2f} | "
            f"{full * 1e3:.0f} | {p50 * 1e3:.0f} | {p50 / full:.2f} | {p99 * 1e3:.0f} | {errors} |"
            + ("" if nlm is None else f" {p50 / nlm:.2f} |")
        )


if __name__ == "__main__":
    main()
