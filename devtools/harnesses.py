"""Agent harnesses from the npm registry, pinned and installed once into the cache (Codex CLI, Claude Code).

The Python harnesses (the OpenAI Agents SDK, mini-swe-agent, litellm) come with the project's ``dev``
extra; a harness shipped on npm is installed here, by name and version, into
``$ROLLOUT_PROXY_CACHE/npm/<name>@<version>`` (``npm install --global --prefix``: its own ``bin/``), with
the registry's update notifier, audit and funding calls off; npm itself is installed with apt when it is
missing (``devtools.apt``). Idempotent: an installed version is a
``--version`` call; an interrupted install is redone (it is written to a temporary folder and renamed).

CLI::

    python -m devtools.harnesses setup      # install what is missing
    python -m devtools.harnesses paths      # JSON: each harness's executable
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from devtools import apt, paths
from rollout_proxy.runner.harness import NPM_PINS


@dataclass(frozen=True, slots=True)
class NpmHarness:
    package: str  # the npm package
    version: str
    executable: str  # its command, under bin/

    @property
    def directory(self) -> Path:
        return paths.cache_dir() / "npm" / f"{self.package.strip('@').replace('/', '-')}@{self.version}"

    @property
    def binary(self) -> Path:
        return self.directory / "bin" / self.executable


#: Codex CLI: `codex exec` speaks the Responses API (streamed) to a custom provider (the pins are the runner's:
#: ``runner.harness.NPM_PINS``, where a job's harness finds the install)
CODEX = NpmHarness(*NPM_PINS["codex"])
#: Claude Code: `claude -p` speaks the Anthropic Messages API (streamed) to ANTHROPIC_BASE_URL; the package
#: ships its native executable (a registry package of its own, ~400 MB unpacked)
CLAUDE_CODE = NpmHarness(*NPM_PINS["claude-code"])
NPM_HARNESSES = {"codex": CODEX, "claude-code": CLAUDE_CODE}


def log(message: str) -> None:
    print(f"[harnesses] {message}", file=sys.stderr, flush=True)


def installed_version(harness: NpmHarness) -> str | None:
    """The version the cached executable reports, or None (absent, or it does not run)."""
    if not harness.binary.is_file():
        return None
    try:
        done = subprocess.run(
            [str(harness.binary), "--version"], capture_output=True, text=True, timeout=60, check=False
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return harness.version if done.returncode == 0 and harness.version in done.stdout else None


def ensure(harness: NpmHarness, *, force: bool = False) -> Path:
    """The harness's executable, installed from the npm registry if it is not there yet."""
    if not force and installed_version(harness) == harness.version:
        return harness.binary
    npm = apt.ensure_command("npm", why=f"installing {harness.package}@{harness.version}")
    target = harness.directory
    staging = target.with_name(f"{target.name}.tmp-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    started = time.monotonic()
    log(f"installing {harness.package}@{harness.version} into {target}")
    env = {**os.environ, "NPM_CONFIG_UPDATE_NOTIFIER": "false", "NPM_CONFIG_FUND": "false", "NPM_CONFIG_AUDIT": "false"}
    command = [npm, "install", "--global", "--prefix", str(staging), "--no-audit", "--no-fund"]
    subprocess.run([*command, f"{harness.package}@{harness.version}"], check=True, env=env, stdout=sys.stderr)
    shutil.rmtree(target, ignore_errors=True)
    staging.rename(target)
    if installed_version(harness) != harness.version:
        raise RuntimeError(f"{harness.binary} does not report version {harness.version} after installing it")
    log(f"{harness.package}@{harness.version} ready in {time.monotonic() - started:.0f}s")
    return harness.binary


def ensure_codex(*, force: bool = False) -> Path:
    return ensure(CODEX, force=force)


def ensure_claude_code(*, force: bool = False) -> Path:
    return ensure(CLAUDE_CODE, force=force)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m devtools.harnesses", description=(__doc__ or "").split("\n\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    setup = sub.add_parser("setup", help="install the npm harnesses that are missing (Codex CLI, Claude Code)")
    setup.add_argument("--force", action="store_true", help="install again")
    sub.add_parser("paths", help="print each harness's executable as JSON")
    args = parser.parse_args(argv)
    if args.cmd == "setup":
        for harness in NPM_HARNESSES.values():
            ensure(harness, force=args.force)
    print(json.dumps({name: str(harness.binary) for name, harness in NPM_HARNESSES.items()}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
