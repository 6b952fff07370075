#!/usr/bin/env bash
# The main job: sets up everything it needs (idempotently), starts vLLM and the proxy,
# runs a small demo rollout, writes the trajectories, prints a summary, stops.
# Extra arguments go to `python -m rollout_proxy.devtools.demo` (see --help).
set -euo pipefail
source "$(dirname "$0")/lib.sh"
cd "$ROOT"
ensure_venv
exec "$VENV/bin/python" -m rollout_proxy.devtools.demo "$@"
