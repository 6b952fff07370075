"""Harnesses run unmodified against a rollout session on the fake engine (scripted replies).

Every run is checked against what the engine received and sampled (``assert_exact``): each engine call's
prompt is the trajectory so far, token for token (nothing the policy sampled was re-tokenized), the tokens
it sampled follow with loss weight 1 and their logprobs, everything else has weight 0, and the task
reaches the policy once (the proxy's one-token routing probe of a new engine is not a turn). Subprocess harnesses run with a clean environment and, where strace is there
(scripts/lib.sh installs it), are traced to show they connect to nothing but 127.0.0.1.
"""

from __future__ import annotations

import re
import shutil
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from devtools.fake_engine import FakeEngine, FakeEngineServer
from rollout_proxy.engines.vllm_http import is_routing_probe
from tests.conftest import TEMPLATES, TEMPLATES_DIR
from tests.harness import ProxyHarness

TEMPLATE = TEMPLATES_DIR / "qwen3_style.jinja"


@pytest.fixture
async def fake(tokenizer_dir: Path) -> AsyncIterator[FakeEngine]:
    """Room for a harness's own prompt (Codex's is ~7k tokens)."""
    engine = FakeEngine(tokenizer_dir, chat_template=TEMPLATES["qwen3_style"], max_model_len=65536)
    async with FakeEngineServer(engine) as url:
        engine.url = url  # type: ignore[attr-defined]
        yield engine


@pytest.fixture
async def proxy(fake: FakeEngine) -> AsyncIterator[ProxyHarness]:
    async with ProxyHarness.running(engine_urls=[fake.url], fake=fake, chat_template=str(TEMPLATE)) as harness:
        yield harness


async def open_session(proxy: ProxyHarness, messages: list[dict[str, Any]] | None = None, **fields: Any) -> dict:
    """A session for a harness: without sample messages unless given (the harness owns its prompt)."""
    sample: dict[str, Any] = {} if messages is None else {"messages": messages}
    body = {"sample": sample, "generation": {"max_new_tokens": 256}, **fields}
    status, session = await proxy.request("POST", "/v1/sessions", json=body)
    assert status == 201, session
    return session


async def session_trajectory(proxy: ProxyHarness, session: dict) -> dict[str, Any]:
    status, trajectory = await proxy.request("GET", f"/v1/sessions/{session['session_id']}/trajectory")
    assert status == 200, trajectory
    return trajectory


def assert_exact(trajectory: dict[str, Any], fake: FakeEngine, *, task: str, turns: int) -> None:
    """The trajectory is what the engine was given and sampled, call by call, and the task is in it once."""
    total = trajectory["total_token_ids"]
    weights, logprobs = trajectory["total_loss_weight"], trajectory["total_token_logprobs"]
    calls = [generation for generation in fake.generations if not is_routing_probe(generation.payload)]
    assert len(calls) == turns
    expected = [0.0] * len(total)
    for generation in calls:
        prompt, sampled = generation.prompt, generation.tokens
        assert total[: len(prompt)] == prompt  # the prompt is the trajectory so far, token for token
        assert total[len(prompt) : len(prompt) + len(sampled)] == sampled
        for offset, logprob in enumerate(generation.logprobs):
            expected[len(prompt) + offset] = 1.0
            assert logprobs[len(prompt) + offset] == pytest.approx(logprob, abs=1e-6)
    last = calls[-1]
    assert len(total) == len(last.prompt) + len(last.tokens)
    assert weights == expected
    assert fake.decode(total).count(task) == 1
    assert sum(message.get("content") == task for message in trajectory["messages"]) <= 1


def strace() -> str | None:
    return shutil.which("strace")


def connected_addresses(trace: Path) -> set[str]:
    """The IPv4/IPv6 addresses a traced process tree called connect() on."""
    text = trace.read_text()
    found = set(re.findall(r'inet_addr\("([0-9.]+)"\)', text))
    found |= set(re.findall(r'inet_pton\(AF_INET6, "([^"]+)"', text))
    return found
