#!/usr/bin/env bash
# compose.yaml's topology without Docker, as local processes on free ports: Redis, the vLLM CPU engine
# (--engine fake: the fake vLLM engine, a fast run), two `rollout-proxy serve` replicas on the Redis store
# behind a round-robin balancer, then `rollout-proxy run` on the demo job through the balancer. Same
# commands and environment as compose.yaml (devtools.compose_plan reads it). Prints where
# everything is and what the replicas served; stops everything on exit.
#
#   docker/local-topology.sh [up] [--engine vllm|fake] [--workdir DIR] [--keep] [--json-out FILE]
#   docker/local-topology.sh plan [--engine vllm|fake]      # what it would run, as JSON
#   docker/local-topology.sh down --workdir DIR             # stop what a killed run left behind
set -euo pipefail
source "$(dirname "$0")/../scripts/lib.sh"
cd "$ROOT"
ensure_venv
ensure_system_packages
ensure_engine  # the engine venv and checkpoints (the fake engine uses the real tokenizer)
case "${1:-}" in
    up|plan|down) command="$1"; shift ;;
    *) command=up ;;
esac
exec "$VENV/bin/python" -m devtools.topology "$command" "$@"
