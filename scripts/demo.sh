#!/usr/bin/env bash
# The main job: sets up everything it needs (idempotently), starts vLLM and the proxy, runs the
# bundled short-answer job (rewards that differ within a group: non-zero GRPO advantages), writes
# the trajectories and a per-step plot, prints a summary, stops (--keep-running: stays up for the
# viewer until Ctrl-C). Extra arguments go to `python -m devtools.demo` (see --help);
# --train runs the reference GRPO trainer between the steps (make train-demo, docs/training.md); --train
# --lora trains a LoRA adapter instead, published without a pause (docs/policies.md).
set -euo pipefail
source "$(dirname "$0")/lib.sh"
cd "$ROOT"
ensure_venv
exec "$VENV/bin/python" -m devtools.demo "$@"
