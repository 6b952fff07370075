"""``python -m bench.resent_input`` run tiny: each API answers every harness-shaped turn, alone and interleaved
with a subagent and side calls, the proxy's CPU measured; with ``--baseline``, a second proxy from another
checkout runs beside it. And the interleaved traffic in process: each main turn takes in only its new items."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import aiohttp
import pytest

from bench import resent_input
from devtools.fake_engine import FakeEngine
from rollout_proxy.proxy import keys
from tests.conftest import TEMPLATES_DIR
from tests.harness import ADMIN_KEY, ProxyHarness

ROOT = Path(__file__).resolve().parents[2]


def test_a_tiny_run_measures_each_api_alone_and_interleaved_against_a_baseline(tmp_path: Path) -> None:
    command = [sys.executable, "-m", "bench.resent_input", "--turns", "7", "--sessions", "1", "--rounds", "1"]
    command += ["--baseline", str(ROOT)]  # this checkout again: a second proxy process, started from its src/
    run = subprocess.run([*command, "--out", str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    report = json.loads((tmp_path / "resent_input.json").read_text())
    assert list(report["proxies"]) == ["this", "baseline"]
    measured = {(each["proxy"], each["api"], each["case"]) for each in report["runs"]}
    assert measured == {
        (proxy, api, case)
        for proxy in ("this", "baseline")
        for api in ("responses", "chat", "messages")
        for case in ("main", "interleaved")
    }
    for each in report["runs"]:
        assert len(each["cpu_per_turn"]) == 7 and all(cpu > 0 for cpu in each["cpu_per_turn"])
        assert each["ratio"] > 0
    assert all(
        f"| {api} | interleaved | memory | baseline (" in run.stdout for api in ("responses", "chat", "messages")
    )


def test_a_tiny_run_on_both_stores_measures_each(tmp_path: Path) -> None:
    """``--stores memory,redis``: a proxy per store (the Redis one on a private redis-server), each measured."""
    command = [sys.executable, "-m", "bench.resent_input", "--turns", "7", "--sessions", "1", "--rounds", "1"]
    command += ["--apis", "responses", "--cases", "main", "--stores", "memory,redis"]
    run = subprocess.run([*command, "--out", str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    report = json.loads((tmp_path / "resent_input.json").read_text())
    assert sorted(each["store"] for each in report["runs"]) == ["memory", "redis"]
    assert all(len(each["cpu_per_turn"]) == 7 and min(each["cpu_per_turn"]) > 0 for each in report["runs"])
    assert "| responses | main | redis | this (" in run.stdout


def test_a_baseline_that_is_no_checkout_is_refused(tmp_path: Path) -> None:
    command = [sys.executable, "-m", "bench.resent_input", "--turns", "7", "--baseline", str(tmp_path)]
    run = subprocess.run([*command, "--out", str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode != 0 and "rollout_proxy imports from" in run.stderr


@pytest.mark.parametrize("template_name", ["qwen3_style"])
async def test_the_interleaved_cases_main_turns_take_in_only_what_they_add(
    fake_engine: FakeEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What the bench's interleaved case measures is the memory at work: its traffic (Codex's first request
    grown turn by turn, a subagent and a side call after each main turn: more lists than a session keeps)
    against an app in process, whose counters show each main turn taking in only the items it adds."""
    fake_engine.max_model_len = 100_000  # Codex's first request alone is ~9k tokens
    monkeypatch.setattr(resent_input, "ADMIN_KEY", ADMIN_KEY)
    template = str(TEMPLATES_DIR / "qwen3_style.jinja")
    async with (
        ProxyHarness.running(engine_urls=[fake_engine.url], fake=fake_engine, chat_template=template) as proxy,
        aiohttp.ClientSession() as http,
    ):
        memory = proxy.app[keys.RESENT_HISTORY]
        for api in resent_input.APIS:
            status, created = await proxy.request("POST", "/v1/sessions", json={"generation": {"max_new_tokens": 16}})
            assert status == 201, created
            main = resent_input.Conversation(api, 0, created["api_key"], proxy.url)
            session = resent_input.Session(main, interleaved=True)
            fresh = []
            for k in range(12):
                before = memory.fresh_items
                await resent_input.turn(http, main, k)
                fresh.append(memory.fresh_items - before)
                await session.between(http, k)
            # after the first turn: the answer and the next user message (the Messages API: and the message
            # whose cache mark moved on)
            assert fresh[1:] == [3 if api == "messages" else 2] * 11, (api, fresh)
