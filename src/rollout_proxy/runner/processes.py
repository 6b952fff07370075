"""Child processes of the runner (a harness rollout, a grader's test command), bounded in time and output.

Each child leads a process group of its own (``start_new_session``), so that what it starts (a shell, the
commands an agent runs, a server it left in the background) goes with it: at the wall-time bound the
whole group gets SIGTERM, then SIGKILL ``kill_grace`` seconds later; after a normal exit the group is
killed too, so no rollout leaves a process behind; a cancelled call (the job stopped) kills it at once.
Its output is read as it comes and only the last ``tail_bytes`` of each stream are kept (with the
count of all it wrote), so a chatty harness costs bounded memory. Everything is asyncio: nothing here
blocks the event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

#: seconds to wait for the pipes to close once the group is gone (a process that left the group may hold them)
DRAIN_WAIT = 5.0


class OutputTail:
    """The last ``limit`` bytes a stream wrote, and how many it wrote in all."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.total = 0
        self._kept = bytearray()

    def feed(self, data: bytes) -> None:
        self.total += len(data)
        self._kept += data
        if len(self._kept) > self.limit:
            del self._kept[: len(self._kept) - self.limit]

    @property
    def truncated(self) -> bool:
        return self.total > len(self._kept)

    def text(self) -> str:
        return self._kept.decode("utf-8", errors="replace")


@dataclass(frozen=True, slots=True)
class ProcessOutcome:
    """How a child ended: its exit status (negative: the signal that ended it), whether the bound did it."""

    exit_code: int
    timed_out: bool
    seconds: float
    stdout: OutputTail
    stderr: OutputTail

    def describe(self) -> str:
        if self.timed_out:
            return f"timed out after {self.seconds:.0f}s (its process group was killed)"
        if self.exit_code < 0:
            return f"killed by signal {-self.exit_code}"
        return f"exited {self.exit_code}"


async def run_process(
    argv: Sequence[str],
    *,
    cwd: Path,
    env: Mapping[str, str],
    wall_time: float,
    tail_bytes: int = 8192,
    kill_grace: float = 2.0,
) -> ProcessOutcome:
    """Run ``argv`` in ``cwd`` with exactly ``env``, stdin closed, for at most ``wall_time`` seconds.

    Raises ``OSError`` when it cannot be started (no such executable, not executable)."""
    loop = asyncio.get_running_loop()
    started = time.monotonic()
    collector = _Collector(OutputTail(tail_bytes), OutputTail(tail_bytes))
    transport, _ = await loop.subprocess_exec(
        lambda: collector,
        *argv,
        cwd=str(cwd),
        env=dict(env),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    pid = transport.get_pid()
    timed_out = False
    try:
        try:
            async with asyncio.timeout(wall_time):
                await collector.exited.wait()
        except TimeoutError:
            timed_out = True
            _signal_group(pid, signal.SIGTERM)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(kill_grace):
                    await collector.exited.wait()
            _signal_group(pid, signal.SIGKILL)
            await collector.exited.wait()
        seconds = time.monotonic() - started
        _signal_group(pid, signal.SIGKILL)  # what is left of the group: stragglers, or what ignored SIGTERM
        with contextlib.suppress(TimeoutError):  # a process that left the group may hold a pipe: not waited for
            async with asyncio.timeout(DRAIN_WAIT):
                await collector.closed.wait()
    except BaseException:  # cancelled: nothing waits for a grace
        _signal_group(pid, signal.SIGKILL)
        raise
    finally:
        transport.close()
    code = transport.get_returncode()
    assert code is not None
    return ProcessOutcome(code, timed_out, seconds, collector.stdout, collector.stderr)


class _Collector(asyncio.SubprocessProtocol):
    """The child's output into its tails as it comes; when it exited (before its pipes close: a process it
    left running may keep them open), when its pipes closed."""

    def __init__(self, stdout: OutputTail, stderr: OutputTail) -> None:
        self.stdout, self.stderr = stdout, stderr
        self.exited, self.closed = asyncio.Event(), asyncio.Event()
        self._open = {1, 2}

    def pipe_data_received(self, fd: int, data: bytes | str) -> None:
        tail = self.stdout if fd == 1 else self.stderr
        tail.feed(data if isinstance(data, bytes) else data.encode())

    def pipe_connection_lost(self, fd: int, exc: Exception | None) -> None:
        self._open.discard(fd)
        if not self._open:
            self.closed.set()

    def process_exited(self) -> None:
        self.exited.set()


def _signal_group(pgid: int, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signum)
