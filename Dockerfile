# kdeq: the HTTP service with the default models.
#
# GPU (default): a CUDA base and torch's wheel for that same CUDA, from the PyTorch index named by
# TORCH_INDEX (torch 2.13 is built for CUDA 12.6, 13.0 and 13.2; PyPI's own wheel is the 13.0 one, which
# is why the default pair is 13.0). The wheel brings its CUDA libraries; the base image brings the
# CUDA_VERSION and NVIDIA_REQUIRE_CUDA that the NVIDIA Container Toolkit checks against the host's
# driver, so the two must name the same CUDA: the build fails when they do not (see "the build's
# promise" below).
#   docker build -t kdeq .
# Another CUDA (an older driver: CUDA 13 needs R580 or later), the pair changed together:
#   docker build -t kdeq:cu126 --build-arg BASE_IMAGE=nvidia/cuda:12.6.3-base-ubuntu24.04 \
#     --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu126 .
# CPU: a plain Python base and torch's CPU wheel index.
#   docker build -t kdeq:cpu --build-arg BASE_IMAGE=python:3.11-slim-bookworm \
#     --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cpu .
# Offline / air-gapped: fill wheelhouse/ with wheels for the base's Python on a connected machine
# (deploy/test-image.sh shows how; torch from the index matching the base) and build with
# --build-arg OFFLINE=1: nothing is downloaded.
ARG BASE_IMAGE=nvidia/cuda:13.0.2-base-ubuntu24.04

FROM ${BASE_IMAGE} AS base
# the CUDA base images have no Python; Python images and the Debian-bootstrapped test base do
RUN if ! python3 -m venv --help >/dev/null 2>&1; then \
      apt-get update \
      && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
           python3 python3-venv ca-certificates \
      && rm -rf /var/lib/apt/lists/*; \
    fi

FROM base AS build
ARG TORCH_INDEX=https://download.pytorch.org/whl/cu130
ARG OFFLINE=0
WORKDIR /src
COPY wheelhouse/ /wheels/
COPY pyproject.toml constraints.txt ./
# the dependencies first, in a layer of their own: a code change does not reinstall torch. torch
# alone comes from TORCH_INDEX (--index-url, not --extra-index-url: PyPI's wheel of the same version
# is never a candidate); its own dependencies and the rest come from PyPI with the constraints.
RUN python3 -m venv /opt/kdeq \
    && if [ "${OFFLINE}" = 1 ]; then \
         set -- --no-index --find-links /wheels; torch_from="$*"; \
       else \
         torch_from="--index-url ${TORCH_INDEX}"; \
       fi \
    && /opt/kdeq/bin/pip install --no-cache-dir --no-deps ${torch_from} -c constraints.txt torch \
    && python3 -c "import tomllib; print('\n'.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies']))" > requirements.txt \
    && /opt/kdeq/bin/pip install --no-cache-dir "$@" -c constraints.txt -r requirements.txt \
    && if [ "${OFFLINE}" = 1 ]; then /opt/kdeq/bin/pip install --no-cache-dir "$@" "setuptools>=68" wheel; fi
# the build's promise: torch's CUDA is the base image's (its CUDA_VERSION, major.minor), or none on a
# base without CUDA; a mismatched TORCH_INDEX or wheelhouse stops the build here, not at the first
# request on a GPU host
RUN /opt/kdeq/bin/python -c 'import os, sys, torch; \
base = ".".join(os.environ.get("CUDA_VERSION", "").split(".")[:2]) or None; \
sys.exit(None if torch.version.cuda == base else \
  f"torch {torch.__version__} is built for CUDA {torch.version.cuda} but the base image has CUDA {base}: " \
  "set TORCH_INDEX to the PyTorch index of the base image CUDA (its cpu index on a base without CUDA)")'
# on a CUDA base, the gpu extra (Triton: the guided kernel's fused kernels, kdeq/maths/fused.py), which torch
# installed without its dependencies does not bring; after the CUDA check, which a mismatch meets first
RUN if [ -n "${CUDA_VERSION:-}" ]; then \
      if [ "${OFFLINE}" = 1 ]; then set -- --no-index --find-links /wheels; fi; \
      python3 -c "import tomllib; print('\n'.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['optional-dependencies']['gpu']))" > gpu.txt \
      && /opt/kdeq/bin/pip install --no-cache-dir "$@" -c constraints.txt -r gpu.txt; \
    fi
COPY README.md ./
COPY kdeq/ kdeq/
COPY service/ service/
RUN if [ "${OFFLINE}" = 1 ]; then set -- --no-index --find-links /wheels --no-build-isolation; fi \
    && /opt/kdeq/bin/pip install --no-cache-dir --no-deps "$@" . \
    && cd / && /opt/kdeq/bin/python -c "import kdeq, service.app, service.healthcheck"

FROM base AS runtime
# a C compiler: kdeq compiles the guided kernel's CPU loops for the host's CPU on first use (the warm-up's),
# 1.2-2.3x faster than torch's (kdeq/runtime/native.py; docs/log/benchmarks-2026-11-21-to-2026-11-28.md, "the
# offset loops compiled"); without one it runs torch's. NATIVE=0 leaves it out (a GPU-only image); an offline
# build installs nothing, so its base must bring one (deploy/test-image.sh's does)
ARG NATIVE=1
ARG OFFLINE=0
RUN if [ "${NATIVE}" = 1 ] && [ "${OFFLINE}" != 1 ] && ! command -v cc >/dev/null 2>&1; then \
      apt-get update \
      && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends gcc libc6-dev \
      && rm -rf /var/lib/apt/lists/*; \
    fi
RUN useradd --system --uid 10001 --no-create-home --home-dir /nonexistent --shell /usr/sbin/nologin kdeq
COPY --from=build /opt/kdeq /opt/kdeq
COPY --chown=kdeq:kdeq models/ /models/
# PYTORCH_ALLOC_CONF is the allocator's setting as torch 2.13 documents it (PYTORCH_CUDA_ALLOC_CONF is
# its older alias, still read, and the one that counts when both are set). Expandable segments grow a
# mapping instead of caching fixed blocks per request size: request image sizes vary, and fixed
# blocks fragment a long-running server's GPU memory until an allocation fails.
ENV PATH=/opt/kdeq/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTORCH_ALLOC_CONF=expandable_segments:True \
    KDEQ_HOST=0.0.0.0 \
    KDEQ_PORT=8000 \
    KDEQ_MODELS_DIR=/models
# other models: mount a folder of <name>/<version>/ checkpoints here
VOLUME ["/models"]
USER kdeq
EXPOSE 8000
STOPSIGNAL SIGTERM
HEALTHCHECK --interval=10s --timeout=5s --start-period=120s --retries=3 \
  CMD ["/opt/kdeq/bin/python", "-m", "service.healthcheck"]
ENTRYPOINT ["/opt/kdeq/bin/kdeq", "serve"]
