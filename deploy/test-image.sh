#!/usr/bin/env bash
# Build the Dockerfile with podman and check the container: /readyz, a /denoise round trip, the
# health check, the non-root user, the models volume, the absence of benchmark files, torch's CUDA
# (none, on this base without CUDA) and the allocator setting, and a clean SIGTERM drain; then that a
# base claiming a CUDA the wheel lacks stops the build. For machines with no image registry: the base image is bootstrapped from Debian's
# packages and the Python packages come from a wheelhouse filled on the host (the Dockerfile's
# offline path). Needs root, podman, runc and debootstrap (apt-get install podman runc debootstrap).
#
#   deploy/test-image.sh [WORKDIR]      (default /tmp/kdeq-image; the base image is cached there)
set -euo pipefail
cd "$(dirname "$0")/.."
work=${1:-/tmp/kdeq-image}
port=${IMAGE_TEST_PORT:-18080}
mkdir -p "$work"

# podman here: runc (crun's rlimit calls are refused), no default ulimits, vfs storage (no overlay
# inside this sandbox); the build uses --format docker, which keeps HEALTHCHECK (OCI images have none)
cat > "$work/containers.conf" <<'EOF'
[containers]
default_ulimits = []
[engine]
runtime = "runc"
EOF
cat > "$work/storage.conf" <<EOF
[storage]
driver = "vfs"
runroot = "$work/run"
graphroot = "$work/storage"
EOF
export CONTAINERS_CONF="$work/containers.conf" CONTAINERS_STORAGE_CONF="$work/storage.conf"

step() { printf '\n== %s\n' "$*"; }
fail() { echo "FAILED: $*"; exit 1; }

if ! podman image exists localhost/kdeq-base:bookworm-cc; then
  step "bootstrapping a Debian bookworm base image (python3, venv, pip, a C compiler)"
  rm -rf "$work/rootfs"
  debootstrap --variant=minbase --include=python3,python3-venv,python3-pip,ca-certificates,gcc,libc6-dev \
    bookworm "$work/rootfs" >"$work/debootstrap.log" 2>&1
  tar -C "$work/rootfs" -c . | podman import - localhost/kdeq-base:bookworm-cc >/dev/null
  rm -rf "$work/rootfs"
fi

step "filling wheelhouse/ on the host (torch from its local CPU wheel)"
python3 -m venv "$work/venv" >/dev/null
"$work/venv/bin/pip" download -q -d wheelhouse -c constraints.txt torch==2.13.0 \
  numpy pillow pydantic safetensors fastapi fastapi-offline uvicorn python-multipart prometheus-client \
  "setuptools>=68" wheel
ls wheelhouse/*.whl | wc -l | xargs echo "wheels:"

step "podman build (host network, chroot isolation, offline)"
start=$(date +%s)
podman build --format docker --network host --isolation chroot --build-arg OFFLINE=1 \
  --build-arg BASE_IMAGE=localhost/kdeq-base:bookworm-cc -t localhost/kdeq:test . >"$work/build.log" 2>&1 \
  || { tail -40 "$work/build.log"; exit 1; }
echo "built in $(( $(date +%s) - start )) s; image $(podman image inspect localhost/kdeq:test --format '{{.Size}}' | numfmt --to=iec)"

step "run"
podman rm -f kdeq-test >/dev/null 2>&1 || true
podman run -d --name kdeq-test --network host -e KDEQ_PORT="$port" -e KDEQ_DRAIN_SECONDS=1 \
  localhost/kdeq:test >/dev/null
ready=""
for _ in $(seq 1 120); do
  if curl -fsS "http://127.0.0.1:$port/readyz" >/dev/null 2>&1; then ready=1; break; fi
  sleep 1
done
[ -n "$ready" ] || { podman logs kdeq-test | tail -30; fail "not ready within 120 s"; }
echo "readyz: $(curl -sS "http://127.0.0.1:$port/readyz")"

step "denoise round trip"
python3 - "$port" <<'EOF'
import io, json, sys, urllib.request, uuid
import zlib, struct
port = sys.argv[1]
w, h = 64, 48
rows = b"".join(b"\x00" + bytes((x * 3 + y * 5 + (x * y) % 17) % 256 for x in range(w)) for y in range(h))
def chunk(kind, data):
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)
png = b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 0, 0, 0, 0)) \
    + chunk(b"IDAT", zlib.compress(rows)) + chunk(b"IEND", b"")
boundary = uuid.uuid4().hex
body = (f"--{boundary}\r\nContent-Disposition: form-data; name=\"image\"; filename=\"x.png\"\r\n"
        f"Content-Type: image/png\r\n\r\n").encode() + png + f"\r\n--{boundary}--\r\n".encode()
req = urllib.request.Request(f"http://127.0.0.1:{port}/denoise", data=body,
                             headers={"Content-Type": f"multipart/form-data; boundary={boundary}"})
with urllib.request.urlopen(req, timeout=60) as r:
    out = r.read()
    headers = {k: v for k, v in r.headers.items() if k.lower().startswith("x-kdeq")}
    assert r.status == 200 and out[:8] == b"\x89PNG\r\n\x1a\n", r.status
    width, height = struct.unpack(">II", out[16:24])
    assert (width, height) == (w, h), (width, height)
print(f"200 image/png {width}x{height}, {json.dumps(headers)}")
EOF

step "container facts"
uid=$(podman exec kdeq-test id -u)
echo "user: $uid ($(podman exec kdeq-test id -un))"
[ "$uid" != 0 ] || fail "runs as root"
podman healthcheck run kdeq-test >/dev/null 2>&1 || fail "health check unhealthy"
echo "health check: healthy"
models=$(podman exec kdeq-test sh -c 'ls /models | tr "\n" " "')
echo "models: $models"
[ "$(echo "$models" | wc -w)" -ge 4 ] || fail "default models missing"
volumes=$(podman image inspect localhost/kdeq:test --format '{{json .Config.Volumes}}')
echo "volumes: $volumes"
case "$volumes" in *'"/models"'*) ;; *) fail "no /models volume" ;; esac
extra=$(podman exec kdeq-test sh -c \
  'find / -xdev \( -path "*/site-packages/bench" -o -path "*/site-packages/tests" -o -name baselines.py \
     -o -name "Set12" -o -name "BSD68" -o -name "CBSD68" -o -name "Kodak24" -o -name "Train400" \) \
     -print 2>/dev/null | wc -l')
echo "project benchmark/test files or research images in the image: $extra"
[ "$extra" = 0 ] || fail "benchmark, test or research files in the image"
cuda=$(podman exec kdeq-test /opt/kdeq/bin/python -c 'import torch; print(torch.version.cuda)')
alloc=$(podman exec kdeq-test sh -c 'echo "$PYTORCH_ALLOC_CONF"')
echo "torch CUDA: $cuda; PYTORCH_ALLOC_CONF: $alloc"
[ "$cuda" = None ] || fail "a CUDA torch on a base without CUDA"
[ "$alloc" = expandable_segments:True ] || fail "the allocator setting is missing"
# the warm-up solved with the default denoiser, so the guided kernel's loops were compiled, as the
# image's user, into a cache it can write
loops=$(podman exec kdeq-test /opt/kdeq/bin/python -c 'from kdeq.runtime import native; print(native.summary())')
echo "guided loops: $loops"
case "$loops" in "not built"*) fail "the guided kernel's loops were not compiled in the container" ;; esac
families=$(curl -sS "http://127.0.0.1:$port/metrics" | grep -c '^# TYPE kdeq_')
echo "metrics families: $families"
page=$(curl -sS -o /dev/null -w '%{http_code} %{content_type}' "http://127.0.0.1:$port/")
script=$(curl -sS -o /dev/null -w '%{http_code}' "http://127.0.0.1:$port/static/app.js")
echo "page: $page, app.js: $script"
[ "${page%% *}" = 200 ] && [ "$script" = 200 ] || fail "the page or its files are missing from the image"

step "SIGTERM: drain and exit"
podman stop -t 30 kdeq-test >/dev/null
code=$(podman inspect kdeq-test --format '{{.State.ExitCode}}')
echo "exit code: $code"
[ "$code" = 0 ] || fail "exit code $code after SIGTERM"
podman logs kdeq-test 2>&1 | grep -E "draining|Shutting down|Finished server process" | sed 's/^/  /'
podman rm -f kdeq-test >/dev/null

step "a base whose CUDA the wheel lacks: the build must stop at the CUDA check"
# the test base plus the CUDA_VERSION an nvidia/cuda:13.0.2 image sets; the wheelhouse's torch is CPU
mkdir -p "$work/fake-cuda"
printf 'FROM localhost/kdeq-base:bookworm-cc\nENV CUDA_VERSION=13.0.2\n' >"$work/fake-cuda/Containerfile"
podman build --format docker --isolation chroot -t localhost/kdeq-base:fake-cuda "$work/fake-cuda" >/dev/null
if podman build --format docker --network host --isolation chroot --build-arg OFFLINE=1 --target build \
     --build-arg BASE_IMAGE=localhost/kdeq-base:fake-cuda . >"$work/build-mismatch.log" 2>&1; then
  fail "a CPU torch on a CUDA 13.0 base was built"
fi
grep -q "is built for CUDA None but the base image has CUDA 13.0" "$work/build-mismatch.log" \
  || { tail -20 "$work/build-mismatch.log"; fail "the build failed, but not at the CUDA check"; }
grep "^torch .* is built for CUDA" "$work/build-mismatch.log" | sed "s/^/  /"
echo
echo "image test passed"
