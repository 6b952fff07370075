"""Debian packages the demos need, installed with apt the first time their command is missing.

``make train-demo`` needs ``redis-server`` (its feed), ``./scripts/demo.sh --job codex`` needs ``npm`` (to
install the pinned Codex CLI): on a fresh machine they install them as ``scripts/lib.sh``'s
``ensure_system_packages`` does for the tests (``apt-get install --no-install-recommends``, an ``apt-get
update`` first only when the install fails; root, else ``sudo``), and a second run finds the command and
installs nothing. Debian's redis-server package starts a system service: it is stopped again, since the demo
starts a private server of its own.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys


class SetupError(SystemExit):
    """A package the demo needs cannot be installed here; the message says what to do."""


def log(message: str) -> None:
    print(f"[setup] {message}", file=sys.stderr, flush=True)


def _as_root(command: list[str], *, packages: list[str], why: str) -> list[str]:
    if os.geteuid() == 0:
        return command
    sudo = shutil.which("sudo")
    if sudo is None:
        raise SetupError(
            f"{why} needs {' '.join(packages)}, and installing it needs root: run `sudo apt-get install -y "
            f"{' '.join(packages)}` (or as root), then this again"
        )
    return [sudo, *command]


def install(packages: list[str], *, why: str) -> None:
    """``apt-get install`` the packages (an ``apt-get update`` first only if that fails)."""
    apt = shutil.which("apt-get")
    if apt is None:
        raise SetupError(f"{why} needs {' '.join(packages)}, and this machine has no apt-get: install it, then retry")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    command = _as_root([apt, "install", "-y", "-q", "--no-install-recommends", *packages], packages=packages, why=why)
    log(f"installing {' '.join(packages)} (apt) for {why}")
    if subprocess.run(command, env=env, stdout=subprocess.DEVNULL, check=False).returncode != 0:
        update = _as_root([apt, "update", "-q"], packages=packages, why=why)
        subprocess.run(update, env=env, stdout=subprocess.DEVNULL, check=False)
        if subprocess.run(command, env=env, stdout=subprocess.DEVNULL, check=False).returncode != 0:
            raise SetupError(f"`{' '.join(command)}` failed: install {' '.join(packages)} yourself, then retry")
    service = shutil.which("service")
    if "redis-server" in packages and service is not None:  # the package's own server: the demo starts its own
        stop = _as_root([service, "redis-server", "stop"], packages=packages, why=why)
        subprocess.run(stop, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False)


def ensure_command(command: str, *, package: str | None = None, why: str) -> str:
    """``command``'s path, its Debian package installed first when it is not on PATH."""
    found = shutil.which(command)
    if found is not None:
        return found
    install([package or command], why=why)
    found = shutil.which(command)
    if found is None:
        raise SetupError(f"{package or command} is installed but {command!r} is not on PATH ({os.environ.get('PATH')})")
    return found
