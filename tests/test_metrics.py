"""``/metrics`` on prometheus_client: declared metrics, histograms after a real turn, several workers."""

from __future__ import annotations

import ast
import asyncio
import os
import subprocess
import sys
from pathlib import Path

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from rollout_proxy.metrics import DECLARED, PREFIX, Metrics
from rollout_proxy.proxy import keys
from tests.fakes import fake_fleet
from tests.harness import ProxyHarness

SRC = Path(__file__).resolve().parents[1] / "src" / "rollout_proxy"
USER = [{"role": "user", "content": "Tell me a fact."}]
METRIC_CALLS = {"inc", "set", "add", "observe", "timer"}


@pytest.fixture
def template_name() -> str:
    return "qwen3_style"


def families(text: str) -> dict[str, object]:
    """Parsed by prometheus_client's own parser: a malformed exposition raises here."""
    return {family.name: family for family in text_string_to_metric_families(text)}


def sample(text: str, name: str, **labels: str) -> float | None:
    for family in text_string_to_metric_families(text):
        for found in family.samples:
            if found.name == name and all(found.labels.get(k) == v for k, v in labels.items()):
                return found.value
    return None


def metric_calls() -> list[tuple[Path, int, str, set[str]]]:
    """Every ``<...metrics...>.inc/set/add/observe/timer("name", ..., label=...)`` call in src."""
    calls = []
    for path in SRC.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
                continue
            if node.func.attr not in METRIC_CALLS or "metrics" not in ast.unparse(node.func.value).lower():
                continue
            if node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str):
                labels = {keyword.arg for keyword in node.keywords if keyword.arg is not None}
                calls.append((path.relative_to(SRC), node.lineno, node.args[0].value, labels))
    return calls


def test_every_metric_the_proxy_writes_is_declared_with_its_labels():
    calls = metric_calls()
    assert len(calls) > 30  # the scan finds the calls (the fleet's, the turns', the middleware's)
    wrong = [
        f"{path}:{line} {name}{sorted(labels)}"
        for path, line, name, labels in calls
        if name not in DECLARED or labels != set(DECLARED[name].labels)
    ]
    assert wrong == []


def test_each_declared_metric_has_help_and_type_and_apps_do_not_share_values():
    first, second = Metrics(), Metrics()
    first.inc("forks_total", api="chat")
    first.observe("turn_seconds", 0.2, api="chat")
    first.set("engines", 2, state="healthy")
    parsed = families(first.render())
    text = first.render()
    for name, declared in DECLARED.items():
        family = name.removesuffix("_total")
        assert f"# HELP {PREFIX}{name} {declared.help}" in text
        assert parsed[PREFIX + family].type == declared.kind  # type: ignore[attr-defined]
    assert first.value("forks_total", api="chat") == 1 and second.value("forks_total", api="chat") == 0
    assert first.value("turn_seconds", api="chat") == 1  # a histogram's count
    assert first.gauge("engines", state="healthy") == 2 and second.gauge("engines", state="healthy") is None
    assert sample(text, PREFIX + "turn_seconds_bucket", api="chat", le="0.25") == 1.0
    assert sample(text, PREFIX + "turn_seconds_bucket", api="chat", le="0.1") == 0.0


def test_counters_are_absent_until_counted_and_an_undeclared_name_still_works():
    metrics = Metrics()
    assert metrics.counters() == {}
    metrics.inc("prompt_drift_total")
    metrics.inc("made_up_elsewhere_total", kind="x")
    assert metrics.counters() == {"prompt_drift_total": 1.0, "made_up_elsewhere_total": 1.0}
    assert "undeclared" in metrics.render()


async def test_metrics_after_a_real_turn_have_histograms_gauges_and_no_engine_url(fake_engine):
    async with (
        ProxyHarness.running(engine_urls=[fake_engine.url], fake=fake_engine) as proxy,
        aiohttp.ClientSession() as http,
    ):
        fake_engine.queue("Water boils at 100C.")
        session = await proxy.create_session(USER, max_new_tokens=16)
        answer = await session.client.chat.completions.create(model="m", messages=USER)
        async with http.get(proxy.url + "/metrics") as response:
            assert response.status == 200
            during = await response.text()
        status, _ = await proxy.request(
            "POST", f"/v1/sessions/{session.session_id}/finish", json={"status": "success"}, token=session.api_key
        )
        assert status == 200
        await proxy.request("GET", "/v1/nowhere")
        async with http.get(proxy.url + "/metrics") as response:
            after = await response.text()

    parsed = families(after)
    for name in ("turn_seconds", "engine_seconds", "overhead_seconds", "store_seconds", "turn_tokens"):
        assert parsed[PREFIX + name].type == "histogram"  # type: ignore[attr-defined]
    assert sample(after, PREFIX + "turn_seconds_count", api="chat") == 1
    assert sample(after, PREFIX + "overhead_seconds_count", api="chat") == 1
    turn = sample(after, PREFIX + "turn_seconds_sum", api="chat")
    overhead = sample(after, PREFIX + "overhead_seconds_sum", api="chat")
    engine = sample(after, PREFIX + "engine_seconds_sum", path="/v1/completions")
    assert turn is not None and overhead is not None and engine is not None
    assert 0 <= overhead < turn and engine <= turn  # the overhead is the turn less its engine calls
    assert sample(after, PREFIX + "engine_seconds_count", path="/v1/completions") == 1
    assert sample(after, PREFIX + "queue_wait_seconds_count", reason="slot") == 1
    assert sample(after, PREFIX + "store_seconds_count", op="put_node") == 1
    generated = answer.usage.completion_tokens if answer.usage else None
    assert sample(after, PREFIX + "turn_tokens_sum", kind="generated") == generated
    assert sample(after, PREFIX + "turns_total", api="chat") == 1
    assert sample(after, PREFIX + "engine_in_flight") == 0  # every call ended
    assert sample(during, PREFIX + "open_sessions") == 1 and sample(after, PREFIX + "open_sessions") == 0
    assert sample(after, PREFIX + "errors_total", status="404") == 1
    assert sample(after, PREFIX + "requests_total", route="/v1/chat/completions", status="200") == 1
    assert fake_engine.url.split("//")[1] not in after  # engines are named by a hash of their URL


WORKER = """
import sys
from rollout_proxy.metrics import Metrics
metrics = Metrics()
if sys.argv[1] == "count":
    metrics.inc("turns_total", api="chat")
    metrics.observe("turn_seconds", 0.5, api="chat")
    metrics.add("engine_in_flight", 2, engine="engine-x")
else:
    print(metrics.render())
"""


def test_several_worker_processes_are_summed_when_multiprocess(tmp_path):
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path), "PYTHONPATH": str(SRC.parent)}

    def worker(*args: str) -> str:
        done = subprocess.run([sys.executable, "-c", WORKER, *args], env=env, capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
        return done.stdout

    worker("count")
    worker("count")
    text = worker("render")
    assert sample(text, PREFIX + "turns_total", api="chat") == 2
    assert sample(text, PREFIX + "turn_seconds_count", api="chat") == 2
    # gauges by their mode: livesum adds the workers' values (a worker that exits must be marked dead by
    # whoever started it, prometheus_client.multiprocess.mark_process_dead, to drop out of the sum)
    assert sample(text, PREFIX + "engine_in_flight", engine="engine-x") == 4


async def test_a_turn_queued_by_a_pause_is_timed_in_the_pause_queue(tokenizer_dir):
    async with (
        fake_fleet(tokenizer_dir, 1) as fakes,
        ProxyHarness.running(engine_urls=fakes.urls) as proxy,
    ):
        session = await proxy.create_session(USER, max_new_tokens=16)
        status, _ = await proxy.request("POST", "/v1/admin/pause", json={"mode": "keep"})
        assert status == 200
        turn = asyncio.create_task(session.client.chat.completions.create(model="m", messages=USER))
        async with asyncio.timeout(10):
            while proxy.app[keys.METRICS].gauge("paused_turns") != 1:  # noqa: ASYNC110 (the fleet sets it)
                await asyncio.sleep(0.01)
        await asyncio.sleep(0.2)  # queued a while
        status, _ = await proxy.request("POST", "/v1/admin/resume", json={"policy_version": 1})
        assert status == 200
        await turn
        text = proxy.app[keys.METRICS].render()
    assert sample(text, PREFIX + "queue_wait_seconds_count", reason="pause") == 1  # only the wait that queued
    waited = sample(text, PREFIX + "queue_wait_seconds_sum", reason="pause")
    assert waited is not None and waited >= 0.2


def test_the_open_session_gauge_holds_only_open_sessions_whether_or_not_anyone_scrapes():
    """Each open session is an entry until it finishes or expires: counted (the app's sweep each second, or a
    scrape), an expired one goes; a finished one goes at once, and what it left in the heap is rebuilt away."""
    metrics = Metrics()
    sessions = metrics.sessions
    for index in range(1000):
        sessions.opened(f"s{index}", 100.0 + index)
    for index in range(0, 1000, 2):
        sessions.closed(f"s{index}")
    assert len(sessions._expiry) == 500 and len(sessions._heap) <= 2 * 500 + 64
    assert sessions.count(100.0 + 499.5) == 250
    assert sessions.count(1e12) == 0 and sessions._expiry == {} and sessions._heap == []
