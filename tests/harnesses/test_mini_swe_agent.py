"""mini-swe-agent 2.4.6 (its ``mini`` command, unmodified, with the ``mini.yaml`` it ships), through litellm
1.110.2's OpenAI provider, over Chat Completions against a session: its bash tool, then its submit command.

litellm reads its model cost map from the package, not the network (``LITELLM_LOCAL_MODEL_COST_MAP``), and
mini-swe-agent keeps its config in a temporary directory and prints no banner.
"""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path

from devtools.fake_engine import FakeEngine
from tests.harness import ProxyHarness
from tests.harnesses.conftest import assert_exact, connected_addresses, open_session, session_trajectory, strace

TASK = "Read marker.txt and submit the word it contains."
READ = 'I will read the file.\n<tool_call>\n{"name": "bash", "arguments": {"command": "cat marker.txt"}}\n</tool_call>'
SUBMIT = (
    "It says heliotrope.\n<tool_call>\n"
    '{"name": "bash", "arguments": {"command": "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT && cat marker.txt"}}'
    "\n</tool_call>"
)
MINI = Path(sys.executable).with_name("mini")


async def run_mini(session: dict, tmp_path: Path, *, wrap: list[str] | None = None) -> tuple[int, str, str]:
    workdir, home = tmp_path / "work", tmp_path / "home"
    workdir.mkdir()
    home.mkdir()
    (workdir / "marker.txt").write_text("heliotrope\n")
    env = {
        "PATH": os.environ["PATH"],
        "HOME": str(home),
        "MSWEA_GLOBAL_CONFIG_DIR": str(home),
        "MSWEA_SILENT_STARTUP": "1",
        "MSWEA_CONFIGURED": "true",
        "LITELLM_LOCAL_MODEL_COST_MAP": "True",
    }
    args = ["-m", "openai/policy", "-t", TASK, "--yolo", "--exit-immediately", "-c", "mini.yaml"]
    args += ["-c", f"model.model_kwargs.api_base={session['base_url']}"]
    args += ["-c", f"model.model_kwargs.api_key={session['api_key']}", "-c", "model.cost_tracking=ignore_errors"]
    process = await asyncio.create_subprocess_exec(
        *(wrap or []),
        str(MINI),
        *args,
        "-o",
        str(home / "trajectory.json"),
        cwd=workdir,
        env=env,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    stdout, stderr = await asyncio.wait_for(process.communicate(), 120)
    return process.returncode or 0, stdout.decode(), stderr.decode()


async def test_mini_swe_agent_is_recorded_exactly(proxy: ProxyHarness, fake: FakeEngine, tmp_path):
    """One run (litellm's import alone is seconds of CPU), traced where strace is there: nothing but loopback."""
    session = await open_session(proxy)
    fake.queue(READ, SUBMIT)
    trace = tmp_path / "connect.trace"
    tracer = strace()
    wrap = None if tracer is None else [tracer, "-f", "-qq", "-e", "trace=connect", "-o", str(trace)]
    code, stdout, stderr = await run_mini(session, tmp_path, wrap=wrap)
    assert code == 0, stderr
    assert "heliotrope" in stdout.split("Exit:")[-1]  # its submission
    trajectory = await session_trajectory(proxy, session)
    assert_exact(trajectory, fake, task=TASK, turns=2)
    roles = [message["role"] for message in trajectory["messages"]]
    assert roles == ["system", "user", "assistant", "tool", "assistant"]
    assert trajectory["messages"][2]["tool_calls"][0]["function"]["name"] == "bash"
    if tracer is not None:
        addresses = connected_addresses(trace)
        assert addresses and addresses <= {"127.0.0.1"}, addresses
