#!/usr/bin/env bash
# The static checks alone (what scripts/test.sh runs before pytest): ruff check,
# ruff format --check and mypy, with the project venv's tools.
set -euo pipefail
source "$(dirname "$0")/lib.sh"
cd "$ROOT"
ensure_venv
run_lint
