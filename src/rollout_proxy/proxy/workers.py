"""``rollout-proxy serve --workers N``: N serving processes on one port.

The parent only supervises: it starts N copies of the same command line as fresh Python
processes (``python -m rollout_proxy serve ...`` with ``ROLLOUT_PROXY_WORKER`` set), each of
which binds the port with ``SO_REUSEPORT`` so the kernel spreads connections over them; it
restarts a worker that dies, and forwards SIGINT/SIGTERM so they all shut down gracefully.

Fresh processes rather than ``fork``: each worker opens its own event loop, Redis pool and
engine connections, and ``prometheus_client`` reads ``PROMETHEUS_MULTIPROC_DIR`` at import,
so it must be in the environment before Python starts (``metrics``). The parent sets it to an
empty directory shared by the workers (the caller's, emptied, or a temporary one).

What workers share lives in Redis, so more than one needs the Redis store: a session, its
tree and its sticky engine; each job's request_concurrency (leases, ``RedisStore.request_slot``).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from types import FrameType

import structlog
from prometheus_client.multiprocess import mark_process_dead

log = structlog.get_logger(__name__)

#: Set in a worker's environment (its index): serve with SO_REUSEPORT instead of supervising.
WORKER_ENV = "ROLLOUT_PROXY_WORKER"
#: Response header naming the worker process that answered (only with several workers).
WORKER_HEADER = "X-Rollout-Proxy-Worker"
#: A worker that dies sooner than this after its start is not restarted in a loop: the parent stops.
MIN_UPTIME_S = 5.0
#: A worker's exit status when it could not start serving (its store unreachable after its retries, the port
#: taken): the parent stops rather than restart it, however long it tried.
EXIT_CANNOT_SERVE = 3


def worker_index() -> int | None:
    """This process's index when it is a worker of ``serve --workers``; None otherwise."""
    raw = os.environ.get(WORKER_ENV)
    return int(raw) if raw else None


def metrics_dir() -> str:
    """The shared ``PROMETHEUS_MULTIPROC_DIR``, emptied (values of an earlier run must not add up)."""
    given = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    if not given:
        return tempfile.mkdtemp(prefix="rollout-proxy-metrics-")
    path = Path(given)
    path.mkdir(parents=True, exist_ok=True)
    for entry in path.glob("*.db"):
        entry.unlink()
    return given


class Supervisor:
    def __init__(self, n: int, argv: Sequence[str], env: dict[str, str], *, grace_s: float = 65.0) -> None:
        self._n = n
        self._argv = list(argv)
        self._env = env
        self._grace_s = grace_s
        self._stopping = False
        self._workers: list[tuple[subprocess.Popen[bytes], float]] = []

    def _start(self, index: int) -> tuple[subprocess.Popen[bytes], float]:
        command = [sys.executable, "-m", "rollout_proxy", *self._argv]
        # a process group of its own: a terminal's Ctrl-C reaches the parent only, which stops each worker once
        process = subprocess.Popen(command, env={**self._env, WORKER_ENV: str(index)}, start_new_session=True)
        log.info("worker_started", worker=index, pid=process.pid)
        return process, time.monotonic()

    def _stop(self, signum: int, frame: FrameType | None) -> None:
        self._stopping = True

    def run(self) -> int:
        """Start the workers, keep them running until SIGINT/SIGTERM, then stop them; the exit status."""
        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, self._stop)
        self._workers = [self._start(index) for index in range(self._n)]
        status = 0
        while not self._stopping:
            time.sleep(0.2)  # the parent has no event loop: it only waits on its children
            for index, (process, started) in enumerate(self._workers):
                code = process.poll()
                if code is None or self._stopping:
                    continue
                log.warning("worker_exited", worker=index, pid=process.pid, code=code)
                mark_process_dead(
                    process.pid, self._env.get("PROMETHEUS_MULTIPROC_DIR")
                )  # its live gauges (in-flight, open sessions) leave the sum
                if code == EXIT_CANNOT_SERVE or time.monotonic() - started < MIN_UPTIME_S:
                    log.error("worker_failed_at_start", worker=index, code=code)
                    self._stopping, status = True, 1 if code == EXIT_CANNOT_SERVE else code or 1
                    break
                self._workers[index] = self._start(index)
        self._shutdown()
        return status

    def _shutdown(self) -> None:
        for process, _ in self._workers:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + self._grace_s
        for process, _ in self._workers:
            try:
                process.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def run_workers(n: int, argv: Sequence[str], *, admin_key: str) -> int:
    """Supervise ``n`` workers running ``serve`` with ``argv`` (the same admin key for all: tokens agree)."""
    directory = metrics_dir()
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": directory, "ROLLOUT_PROXY_ADMIN_KEY": admin_key}
    try:
        return Supervisor(n, argv, env).run()
    finally:
        if not os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
            shutil.rmtree(directory, ignore_errors=True)
