"""A local two-node Ray cluster for the runner's Ray tests: a head and a second node process.

Each node is ``ray start --block`` in its own process group, so stopping that group stops
the node's daemons (Ray makes them share its fate), and it gets SIGTERM if the test process
dies; nothing else on the machine is touched (never ``ray stop``, which stops every Ray of
the user). Every port is chosen free, so other
clusters on the machine do not collide; the object store is small (80 MB per node).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

OBJECT_STORE_BYTES = 80 * 1024 * 1024
#: for the nodes and every driver of the cluster: token authentication off, whatever a
#: ~/.ray/auth_token left by another Ray on the machine would otherwise turn on (Ray 2.60
#: enables token mode where it finds one)
ENVIRON = {"RAY_AUTH_MODE": "disabled"}
READY_LINE = "Ray runtime started"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def ray_binary() -> str:
    """The ``ray`` script of this interpreter's environment."""
    candidate = Path(sys.executable).with_name("ray")
    return str(candidate) if candidate.exists() else (shutil.which("ray") or "ray")


class LocalRayCluster:
    """``start()`` → the head's address; ``stop()`` ends both nodes (idempotent)."""

    def __init__(self, *, head_cpus: int = 1, node_cpus: int = 2) -> None:
        self.head_cpus, self.node_cpus = head_cpus, node_cpus
        # short: Ray puts unix sockets under it (108-byte path limit)
        self.temp_dir = Path(tempfile.mkdtemp(prefix="rpray-", dir="/tmp"))
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.processes: list[subprocess.Popen[bytes]] = []
        self.started_in: float | None = None

    def _node_command(self, *, head: bool) -> list[str]:
        command = [
            ray_binary(),
            "start",
            "--block",
            "--disable-usage-stats",
            "--node-ip-address",
            "127.0.0.1",
            "--num-cpus",
            str(self.head_cpus if head else self.node_cpus),
            "--object-store-memory",
            str(OBJECT_STORE_BYTES),
            "--node-manager-port",
            str(free_port()),
            "--object-manager-port",
            str(free_port()),
            "--metrics-export-port",
            str(free_port()),
            "--dashboard-agent-listen-port",
            str(free_port()),
            "--dashboard-agent-grpc-port",
            str(free_port()),
            "--runtime-env-agent-port",
            str(free_port()),
        ]
        if head:
            command += [
                "--head",
                "--port",
                str(self.port),
                "--include-dashboard",
                "false",
                "--temp-dir",
                str(self.temp_dir),
            ]
        else:
            command += ["--address", self.address]
        return command

    def _start_node(self, *, head: bool, deadline: float) -> None:
        log_path = self.temp_dir / f"{'head' if head else 'node'}.log"
        env = {**os.environ, **ENVIRON, "RAY_USAGE_STATS_ENABLED": "0", "RAY_DEDUP_LOGS": "0"}
        with log_path.open("wb") as log:
            process = subprocess.Popen(
                self._node_command(head=head),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
                preexec_fn=_stop_with_parent,
            )
        self.processes.append(process)
        while READY_LINE not in log_path.read_text(errors="replace"):
            if process.poll() is not None or time.monotonic() > deadline:
                tail = log_path.read_text(errors="replace")[-3000:]
                raise NodeFailed(f"ray node did not start (exit {process.poll()}):\n{tail}")
            time.sleep(0.3)

    def start(self, timeout: float = 240.0, tries: int = 3) -> str:
        """Both nodes; a node that times out registering (Ray gives it 30 s: a loaded machine) is started again."""
        started = time.monotonic()
        deadline = started + timeout
        try:
            for head in (True, False):
                for attempt in range(1, tries + 1):
                    try:
                        self._start_node(head=head, deadline=deadline)
                        break
                    except NodeFailed:
                        if attempt == tries:
                            raise
                        self._stop_process(self.processes.pop())
        except BaseException:
            self.stop()
            raise
        self.started_in = time.monotonic() - started
        return self.address

    def stop(self) -> None:
        """Stop both nodes (the second first) and remove the temp dir; again, it does nothing."""
        try:
            while self.processes:
                self._stop_process(self.processes.pop())
        finally:
            shutil.rmtree(self.temp_dir, ignore_errors=True)

    @staticmethod
    def _stop_process(process: subprocess.Popen[bytes], grace: float = 5.0) -> None:
        """SIGTERM the node's process group, SIGKILL it after ``grace``, then any member left."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=10)
        for pid in group_members(process.pid):  # daemons that outlived their node
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


class NodeFailed(RuntimeError):
    """A node's ``ray start`` exited or did not report ready in time."""


def _stop_with_parent() -> None:
    """preexec_fn: SIGTERM the node if the test process dies (``ray start --block`` then stops its daemons)."""
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def group_members(pgid: int) -> list[int]:
    """Live processes of process group ``pgid``."""
    members = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if fields[0] != "Z" and int(fields[2]) == pgid:
            members.append(int(entry))
    return members
