"""Claude Code 2.1.332 (``claude -p``), unmodified, over the streaming Anthropic Messages API against a session.

Its configuration is docs/messages.md's: ``ANTHROPIC_BASE_URL`` (the proxy's root, or the session's
``base_url``), ``ANTHROPIC_API_KEY`` (the session key, sent as ``x-api-key``), a temporary home and config
dir, and telemetry, error reporting, the auto-updater and non-essential traffic off. It sends its own
prompt (three system blocks, a ``role: "system"`` turn after the task, 12 tools, one of them deferred) and
``max_tokens: 128000``, ``thinking: {"type": "adaptive"}``, ``output_config.effort``: a session that
``ignore``s them records them; one that ``refuse``s them answers an Anthropic 400 that Claude Code prints.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

import pytest

from devtools.fake_engine import FakeEngine
from devtools.harnesses import ensure_claude_code
from rollout_proxy.proxy import keys
from tests.harness import ProxyHarness, store_snapshot
from tests.harnesses.conftest import assert_exact, connected_addresses, open_session, session_trajectory, strace

TASK = "Read marker.txt and tell me what it says."
MARKER = "rollout-proxy-claude-marker"


def think_and_read(workdir: Path) -> str:
    return (
        "<think>\nI should read the marker file first.\n</think>\n\n"
        f'<tool_call>\n{{"name": "Read", "arguments": {{"file_path": "{workdir / "marker.txt"}"}}}}\n</tool_call>'
    )


ANSWER = f"<think>\nIt printed the marker.\n</think>\n\nThe file says: {MARKER}"


@pytest.fixture(scope="session")
def claude() -> Path:
    return ensure_claude_code()  # scripts/lib.sh installs it; a no-op then


def claude_environment(home: Path, base_url: str, api_key: str) -> dict[str, str]:
    """What ``claude -p`` needs against a session, and nothing that reaches past 127.0.0.1."""
    keep = {name: os.environ[name] for name in ("PATH", "LANG", "TERM", "TMPDIR") if name in os.environ}
    return {
        **keep,
        "HOME": str(home),
        "CLAUDE_CONFIG_DIR": str(home / ".claude"),
        "ANTHROPIC_BASE_URL": base_url,
        "ANTHROPIC_API_KEY": api_key,
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        "DISABLE_TELEMETRY": "1",
        "DISABLE_ERROR_REPORTING": "1",
        "DISABLE_AUTOUPDATER": "1",
        "NO_COLOR": "1",
    }


def proxy_root(session: dict[str, Any]) -> str:
    return session["base_url"].removesuffix("/v1")


async def run_claude(
    claude: Path, session: dict[str, Any], tmp_path: Path, *, base_url: str, wrap: list[str] | None = None
) -> tuple[int, str, str]:
    workdir = tmp_path / "work"
    home = tmp_path / "home"
    home.mkdir()
    process = await asyncio.create_subprocess_exec(
        *(wrap or []),
        str(claude),
        "-p",
        TASK,
        cwd=workdir,
        env=claude_environment(home, base_url, session["api_key"]),
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    stdout, stderr = await asyncio.wait_for(process.communicate(), 180)
    return process.returncode or 0, stdout.decode(), stderr.decode()


def workdir_with_marker(tmp_path: Path) -> Path:
    workdir = tmp_path / "work"
    workdir.mkdir()
    (workdir / "marker.txt").write_text(f"{MARKER}\n")
    return workdir


@pytest.mark.parametrize("where", ["root", "base_url"])
async def test_claude_code_tool_round_trip_is_recorded_exactly(
    proxy: ProxyHarness, fake: FakeEngine, claude: Path, tmp_path: Path, where: str
):
    session = await open_session(proxy, client_sampling="ignore")  # Claude Code owns its prompt
    workdir = workdir_with_marker(tmp_path)
    fake.queue(think_and_read(workdir), ANSWER)
    base_url = proxy_root(session) if where == "root" else session["base_url"]
    code, stdout, stderr = await run_claude(claude, session, tmp_path, base_url=base_url)
    assert code == 0, (stdout, stderr)
    assert f"The file says: {MARKER}" in stdout
    trajectory = await session_trajectory(proxy, session)
    assert_exact(trajectory, fake, task=TASK, turns=2)
    path = await proxy.app[keys.STORE].get_path(session["session_id"], trajectory["response_id"])
    assert path is not None and [node.api for node in path] == ["messages", "messages"]
    assert path[1].parent_id == path[0].id and all(node.fork is None for node in path)  # the echo matched
    roles = [message["role"] for message in trajectory["messages"]]
    assert roles == ["system", "user", "system", "assistant", "tool", "assistant"]
    assert trajectory["messages"][3]["tool_calls"][0]["function"]["name"] == "Read"
    assert MARKER in trajectory["messages"][4]["content"]  # Claude Code ran the call and sent its result
    assert trajectory["messages"][3]["reasoning_content"] == "I should read the marker file first."
    first_prompt = fake.decode(assert_first_prompt(fake))
    assert "You are a Claude agent" in first_prompt and '"name": "Bash"' in first_prompt
    assert "DeferredToolPlaceholder" not in first_prompt  # deferred: left out, as Anthropic leaves it out
    asked = path[0].meta["client_sampling"]
    assert asked["max_tokens"] == 128000 and asked["thinking"]["type"] == "adaptive"
    assert "effort" in asked["output_config"]
    assert {"type": "deferred", "name": "DeferredToolPlaceholder"} in path[0].meta["tools_left_out"]


def assert_first_prompt(fake: FakeEngine) -> list[int]:
    from rollout_proxy.engines.vllm_http import is_routing_probe

    return next(g.prompt for g in fake.generations if not is_routing_probe(g.payload))


async def test_claude_code_against_a_refusing_session_prints_the_anthropic_error(
    proxy: ProxyHarness, fake: FakeEngine, claude: Path, tmp_path: Path
):
    session = await open_session(proxy)  # client_sampling: refuse (the default)
    workdir_with_marker(tmp_path)
    before = await store_snapshot(proxy.app[keys.STORE])
    code, stdout, stderr = await run_claude(claude, session, tmp_path, base_url=proxy_root(session))
    assert code != 0
    assert "400" in stdout + stderr and "max_tokens" in stdout + stderr, (stdout, stderr)
    assert await store_snapshot(proxy.app[keys.STORE]) == before
    assert not [g for g in fake.generations if g.tokens]


@pytest.mark.skipif(strace() is None, reason="strace is not installed (scripts/lib.sh installs it)")
async def test_claude_code_connects_to_nothing_but_loopback(
    proxy: ProxyHarness, fake: FakeEngine, claude: Path, tmp_path: Path
):
    session = await open_session(proxy, client_sampling="ignore")
    workdir = workdir_with_marker(tmp_path)
    fake.queue(think_and_read(workdir), ANSWER)
    trace = tmp_path / "connect.trace"
    code, stdout, stderr = await run_claude(
        claude,
        session,
        tmp_path,
        base_url=proxy_root(session),
        wrap=[str(strace()), "-f", "-qq", "-e", "trace=connect", "-o", str(trace)],
    )
    assert code == 0, (stdout, stderr)
    addresses = connected_addresses(trace)
    assert addresses and addresses <= {"127.0.0.1"}, addresses
