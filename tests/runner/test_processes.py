"""The runner's child processes: bounded in time (the whole process group) and in output, never blocking the loop."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path

import pytest

from rollout_proxy.runner.processes import OutputTail, run_process

ENV = {"PATH": os.environ["PATH"]}


def ended(pid: int) -> bool:
    """No such process, or a zombie nobody reaped yet."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


async def gone(pid: int, *, within: float = 10.0) -> bool:
    """Whether ``pid`` has ended, looked at until ``within`` seconds (a kill is not instant)."""
    for _ in range(int(within / 0.05)):
        if ended(pid):
            return True
        await asyncio.sleep(0.05)
    return False


def python(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def test_a_tail_keeps_the_last_bytes_and_counts_all():
    tail = OutputTail(5)
    for chunk in (b"abc", b"defg", b"hi"):
        tail.feed(chunk)
    assert tail.text() == "efghi" and tail.total == 9 and tail.truncated
    whole = OutputTail(10)
    whole.feed("é".encode())
    assert whole.text() == "é" and not whole.truncated


async def test_exit_code_and_both_tails(tmp_path):
    code = "import sys; sys.stdout.write('x' * 300000 + 'END'); sys.stderr.write('went wrong'); sys.exit(3)"
    outcome = await run_process(python(code), cwd=tmp_path, env=ENV, wall_time=60, tail_bytes=100)
    assert outcome.exit_code == 3 and not outcome.timed_out
    assert outcome.stdout.total == 300003 and len(outcome.stdout.text()) == 100
    assert outcome.stdout.text().endswith("xEND") and outcome.stderr.text() == "went wrong"
    assert outcome.describe() == "exited 3"


async def test_it_runs_in_its_directory_with_exactly_the_given_environment(tmp_path):
    code = "import os, json; print(json.dumps([os.getcwd(), sorted(os.environ)]))"
    outcome = await run_process(python(code), cwd=tmp_path, env={**ENV, "ONLY": "1"}, wall_time=60)
    cwd, names = json.loads(outcome.stdout.text())
    assert cwd == str(tmp_path)
    assert set(names) - {"LC_CTYPE"} == {"PATH", "ONLY"}  # Python may coerce the C locale (PEP 538)


async def test_at_the_bound_the_whole_process_group_is_killed(tmp_path):
    pids = tmp_path / "pids"
    code = (
        "import subprocess, sys, time, os\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(1000)'])\n"
        f"open({str(pids)!r}, 'w').write(f'{{os.getpid()}} {{child.pid}}')\n"
        "print('started', flush=True)\n"
        "time.sleep(1000)\n"
    )
    outcome = await run_process(python(code), cwd=tmp_path, env=ENV, wall_time=3, tail_bytes=100)
    assert outcome.timed_out and outcome.exit_code < 0
    assert outcome.stdout.text() == "started\n"  # what it wrote before the bound is kept
    assert "timed out after" in outcome.describe() and "process group was killed" in outcome.describe()
    leader, child = map(int, pids.read_text().split())
    assert await gone(leader) and await gone(child)


async def test_what_ignores_sigterm_is_killed_after_the_grace(tmp_path):
    code = (
        "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('up', flush=True); time.sleep(1000)"
    )
    outcome = await run_process(python(code), cwd=tmp_path, env=ENV, wall_time=2, kill_grace=0.5)
    assert outcome.timed_out and outcome.exit_code == -9


async def test_what_a_child_leaves_running_goes_with_it(tmp_path):
    """A normal exit, a background process still holding its stdout: the outcome does not wait for it,
    and it is killed."""
    pid_file = tmp_path / "straggler"
    code = (
        "import subprocess, sys\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(1000)'])\n"
        f"open({str(pid_file)!r}, 'w').write(str(child.pid))\n"
        "print('bye')\n"
    )
    outcome = await run_process(python(code), cwd=tmp_path, env=ENV, wall_time=600)
    assert outcome.exit_code == 0 and not outcome.timed_out and outcome.stdout.text() == "bye\n"
    assert await gone(int(pid_file.read_text()))


async def test_a_cancelled_run_kills_its_group(tmp_path):
    pid_file = tmp_path / "pid"
    code = f"import os, time; open({str(pid_file)!r}, 'w').write(str(os.getpid())); time.sleep(1000)"
    task = asyncio.create_task(run_process(python(code), cwd=tmp_path, env=ENV, wall_time=600))
    for _ in range(400):
        if pid_file.is_file() and pid_file.read_text():
            break
        await asyncio.sleep(0.05)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert await gone(int(pid_file.read_text()))


async def test_the_event_loop_runs_while_the_child_does(tmp_path):
    """The child waits for a file this loop writes while it runs: had the call blocked the loop, it would
    only end at its bound."""
    flag = tmp_path / "go"
    code = f"import os, time\nwhile not os.path.exists({str(flag)!r}): time.sleep(0.02)\nprint('saw it')"
    running = asyncio.create_task(run_process(python(code), cwd=tmp_path, env=ENV, wall_time=60))
    await asyncio.sleep(0.1)
    flag.write_text("")
    outcome = await running
    assert not outcome.timed_out and outcome.stdout.text() == "saw it\n"


async def test_a_program_that_cannot_start_raises(tmp_path):
    with pytest.raises(FileNotFoundError):
        await run_process([str(tmp_path / "no-such-program")], cwd=tmp_path, env=ENV, wall_time=5)
