# kdeq: the HTTP service with the default models.
#
# GPU (default): a CUDA base; torch's CUDA wheel from PyPI brings its own CUDA libraries, the host's
# NVIDIA Container Toolkit the driver.
#   docker build -t kdeq .
# CPU: a plain Python base and torch's CPU wheel index.
#   docker build -t kdeq:cpu --build-arg BASE_IMAGE=python:3.11-slim-bookworm \
#     --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cpu .
# Offline / air-gapped: fill wheelhouse/ with wheels for the base's Python on a connected machine
# (deploy/test-image.sh shows how) and build with --build-arg OFFLINE=1: nothing is downloaded.
ARG BASE_IMAGE=nvidia/cuda:12.8.1-base-ubuntu24.04

FROM ${BASE_IMAGE} AS base
# the CUDA base images have no Python; Python images and the Debian-bootstrapped test base do
RUN if ! python3 -m venv --help >/dev/null 2>&1; then \
      apt-get update \
      && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
           python3 python3-venv ca-certificates \
      && rm -rf /var/lib/apt/lists/*; \
    fi

FROM base AS build
ARG TORCH_INDEX=""
ARG OFFLINE=0
WORKDIR /src
COPY wheelhouse/ /wheels/
COPY pyproject.toml constraints.txt ./
# the dependencies first, in a layer of their own: a code change does not reinstall torch
RUN python3 -m venv /opt/kdeq \
    && if [ "${OFFLINE}" = 1 ]; then \
         set -- --no-index --find-links /wheels; \
       elif [ -n "${TORCH_INDEX}" ]; then \
         set -- --extra-index-url "${TORCH_INDEX}"; \
       fi \
    && python3 -c "import tomllib; print('\n'.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies']))" > requirements.txt \
    && /opt/kdeq/bin/pip install --no-cache-dir "$@" -c constraints.txt -r requirements.txt \
    && if [ "${OFFLINE}" = 1 ]; then /opt/kdeq/bin/pip install --no-cache-dir "$@" "setuptools>=68" wheel; fi
COPY README.md ./
COPY kdeq/ kdeq/
COPY service/ service/
RUN if [ "${OFFLINE}" = 1 ]; then set -- --no-index --find-links /wheels --no-build-isolation; fi \
    && /opt/kdeq/bin/pip install --no-cache-dir --no-deps "$@" . \
    && cd / && /opt/kdeq/bin/python -c "import kdeq, service.app, service.healthcheck"

FROM base AS runtime
RUN useradd --system --uid 10001 --no-create-home --home-dir /nonexistent --shell /usr/sbin/nologin kdeq
COPY --from=build /opt/kdeq /opt/kdeq
COPY --chown=kdeq:kdeq models/ /models/
ENV PATH=/opt/kdeq/bin:$PATH \
    PYTHONUNBUFFERED=1 \
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
