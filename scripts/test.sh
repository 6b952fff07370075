#!/usr/bin/env bash
# The test command: sets up what the tests need (idempotently), then runs pytest,
# the real-vLLM integration suite included. Extra arguments go to pytest.
set -euo pipefail
source "$(dirname "$0")/lib.sh"
cd "$ROOT"
ensure_system_packages
ensure_venv
ensure_engine
exec "$VENV/bin/python" -m pytest "$@"
