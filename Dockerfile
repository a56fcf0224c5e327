# ThunderAgent image: `thunderagent frontend` and `thunderagent worker` (the multi-process deployment
# over NATS). Extras: nats (client) and engines (the model's tokenizer for frontends, pyzmq for the
# workers' KV-event streams from vLLM/SGLang). Build from the repository root:
#   docker build -t thunderagent:0.1.0 .
# Linted by tests/unit/test_deploy.py with hadolint (pinned in the `test` extra).

FROM python:3.11-slim-bookworm AS build
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
# gcc: the build compiles the routing core with mypyc (setup.py); the runtime stage needs no compiler.
# Versions come with the pinned base image's Debian release.
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends gcc libc6-dev \
 && rm -rf /var/lib/apt/lists/*
RUN python -m venv /opt/venv
WORKDIR /src
COPY pyproject.toml setup.py README.md ./
COPY src ./src
# every dependency is pinned exactly in pyproject.toml
RUN /opt/venv/bin/pip install --no-cache-dir '.[nats,engines,otel]'

FROM python:3.11-slim-bookworm
RUN groupadd --system --gid 10001 thunderagent \
 && useradd --system --uid 10001 --gid 10001 --no-create-home --home-dir /tmp \
      --shell /usr/sbin/nologin thunderagent
COPY --from=build /opt/venv /opt/venv
# HOME=/tmp: the only writable place when the root filesystem is read-only (an emptyDir in the pods);
# HF_HUB_OFFLINE: tokenizers load from the local model directory, never from the network
ENV PATH=/opt/venv/bin:$PATH \
    HOME=/tmp \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    HF_HUB_OFFLINE=1
USER 10001:10001
# 8000: a frontend's HTTP API; 9400: a worker's own metrics (thunderagent worker --metrics-port 9400)
EXPOSE 8000 9400
ENTRYPOINT ["thunderagent"]
CMD ["--help"]
