"""Codex CLI 0.171.0 (``codex exec``), unmodified, over the streaming Responses API against a session.

Its config is the runner's Codex harness's (``runner.harness.CODEX_CONFIG``: the one the docs show). Codex
resends its whole history every turn (``store: false``), with its two developer messages first and the
reasoning items the policy produced echoed back; a turn must extend the one before it, never fork.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from devtools.fake_engine import FakeEngine
from devtools.harnesses import ensure_codex
from rollout_proxy.engines.vllm_http import is_routing_probe
from rollout_proxy.proxy import keys
from rollout_proxy.runner.harness import codex_environment, codex_home
from tests.harness import ProxyHarness
from tests.harnesses.conftest import assert_exact, connected_addresses, open_session, session_trajectory, strace

TASK = "Read marker.txt and tell me what it says."
THINK_AND_CALL = (
    "<think>\nI should read the marker file first.\n</think>\n\n"
    '<tool_call>\n{"name": "exec_command", "arguments": {"cmd": "cat marker.txt"}}\n</tool_call>'
)
ANSWER = "<think>\nIt printed the marker.\n</think>\n\nThe file says: rollout-proxy-codex-marker"


@pytest.fixture(scope="session")
def codex() -> Path:
    return ensure_codex()  # scripts/lib.sh installs it; a no-op then


async def run_codex(
    codex: Path, session: dict, tmp_path: Path, *, wrap: list[str] | None = None, config: tuple[str, ...] = ()
) -> tuple[int, str, str]:
    """``codex exec TASK`` against the session; ``config``: ``-c key=value`` overrides of its config."""
    workdir = tmp_path / "work"
    workdir.mkdir()
    (workdir / "marker.txt").write_text("rollout-proxy-codex-marker\n")
    home = codex_home(tmp_path / "home", session["base_url"])
    process = await asyncio.create_subprocess_exec(
        *(wrap or []),
        str(codex),
        "exec",
        *(arg for item in config for arg in ("-c", item)),
        "--strict-config",  # every key of the documented config.toml is one this version knows
        "--skip-git-repo-check",
        "--ephemeral",
        "-C",
        str(workdir),
        TASK,
        env=codex_environment(home, session["api_key"]),
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    stdout, stderr = await asyncio.wait_for(process.communicate(), 120)
    return process.returncode or 0, stdout.decode(), stderr.decode()


async def nodes(proxy: ProxyHarness, trajectory: dict[str, Any]) -> list[Any]:
    session_id = trajectory["session_id"]
    return await proxy.app[keys.STORE].get_path(session_id, trajectory["response_id"])


async def test_codex_exec_tool_round_trip_is_recorded_exactly(proxy: ProxyHarness, fake: FakeEngine, codex, tmp_path):
    session = await open_session(proxy)  # Codex owns its prompt: no sample messages
    fake.queue(THINK_AND_CALL, ANSWER)
    code, stdout, stderr = await run_codex(codex, session, tmp_path)
    assert code == 0, stderr
    assert "The file says: rollout-proxy-codex-marker" in stdout
    trajectory = await session_trajectory(proxy, session)
    assert_exact(trajectory, fake, task=TASK, turns=2)
    path = await nodes(proxy, trajectory)
    assert [node.api for node in path] == ["responses", "responses"] and path[1].parent_id == path[0].id
    assert all(node.fork is None for node in path)  # the echoed reasoning and call matched the first turn
    roles = [message["role"] for message in trajectory["messages"]]
    assert roles[:4] == ["developer", "developer", "user", "user"]
    assert roles[4:] == ["assistant", "tool", "assistant"]
    first_prompt = fake.decode(fake.prompts[0])
    assert first_prompt.startswith("<|im_start|>system\nYou are a coding agent running in the Codex CLI")
    assert "<skills_instructions>" in first_prompt  # the second developer message: rendered, not dropped
    assert trajectory["messages"][4]["reasoning_content"] == "I should read the marker file first."
    # Codex sent a namespace tool (its sub-agents) and web_search: functions rendered, web_search left out
    assert '"name": "spawn_agent"' in first_prompt and "web_search" not in first_prompt
    assert path[0].meta["tools_left_out"] == [{"type": "web_search"}]
    assert "client_sampling" not in path[0].meta  # reasoning: {} and the rest change nothing


async def test_codex_with_its_task_as_the_sample_sees_it_once(proxy: ProxyHarness, fake: FakeEngine, codex, tmp_path):
    session = await open_session(proxy, [{"role": "user", "content": TASK}])
    fake.queue(THINK_AND_CALL, ANSWER)
    code, _, stderr = await run_codex(codex, session, tmp_path)
    assert code == 0, stderr
    trajectory = await session_trajectory(proxy, session)
    assert_exact(trajectory, fake, task=TASK, turns=2)
    metrics = proxy.app[keys.METRICS]
    assert metrics.value("sample_placements_total", api="responses", placement="contained") == 2


@pytest.mark.skipif(strace() is None, reason="strace is not installed (scripts/lib.sh installs it)")
async def test_codex_connects_to_nothing_but_loopback(proxy: ProxyHarness, fake: FakeEngine, codex, tmp_path):
    session = await open_session(proxy)
    fake.queue(THINK_AND_CALL, ANSWER)
    trace = tmp_path / "connect.trace"
    code, _, stderr = await run_codex(
        codex, session, tmp_path, wrap=[str(strace()), "-f", "-qq", "-e", "trace=connect", "-o", str(trace)]
    )
    assert code == 0, stderr
    addresses = connected_addresses(trace)
    assert addresses and addresses <= {"127.0.0.1"}, addresses


async def test_codex_compacting_its_history_is_one_rollout_with_every_token_trained_once(
    proxy: ProxyHarness, fake: FakeEngine, codex, tmp_path
):
    """A low auto-compact limit makes Codex summarize its history mid-task (a request of its own) and go on
    from the summary: a rewrite of its first conversation. The export trains every token sampled once."""
    session = await open_session(proxy)
    summary = "<think>\nSummarize.\n</think>\n\nSummary: the marker file was read with cat."
    fake.queue(THINK_AND_CALL, summary, ANSWER)
    limits = ("model_auto_compact_token_limit=7500", "model_context_window=16000")
    code, stdout, stderr = await run_codex(codex, session, tmp_path, config=limits)
    assert code == 0, stderr
    assert "The file says: rollout-proxy-codex-marker" in stdout
    status, export = await proxy.request("GET", f"/v1/sessions/{session['session_id']}/rollout")
    assert status == 200, export
    calls = [generation for generation in fake.generations if not is_routing_probe(generation.payload)]
    assert len(calls) == 3
    assert "CONTEXT CHECKPOINT COMPACTION" in fake.decode(calls[1].prompt)  # Codex's own compaction request
    sampled = sum(len(generation.tokens) for generation in calls)
    assert export["sampled_tokens"] == export["trained_tokens"] == sampled and export["dropped_tokens"] == 0
    assert sum(sum(sequence["total_loss_weight"]) for sequence in export["sequences"]) == sampled
    main, before = export["sequences"]
    assert main["main"] and main["branch"]["kind"] == "rewrite"
    assert main["branch"]["at_message"] == 4 and main["branch"]["from"] == before["response_ids"][0]
    assert before["branch"]["kind"] == "new_conversation"
    # each sequence is what the engine was given and sampled for its last call
    assert main["total_token_ids"] == calls[2].prompt + calls[2].tokens
    assert before["total_token_ids"] == calls[1].prompt + calls[1].tokens
    assert "Summary: the marker file was read with cat." in fake.decode(calls[2].prompt)
