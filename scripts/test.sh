#!/usr/bin/env bash
# The test command: sets up what the tests need (idempotently), runs the static checks
# (ruff, mypy: see run_lint in lib.sh), then pytest, the real-vLLM integration suite
# included. Extra arguments go to pytest. A lint failure stops the run before the tests.
set -euo pipefail
source "$(dirname "$0")/lib.sh"
cd "$ROOT"
ensure_system_packages
ensure_venv
run_lint || { say "lint failed: not running the tests"; exit 1; }
ensure_engine
ensure_harnesses
exec "$VENV/bin/python" -m pytest "$@"
