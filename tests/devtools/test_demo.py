"""The demo's options, its --keep-running, its harness jobs and what they set up, on the fake engine (the real
run is `make demo`)."""

from __future__ import annotations

import json
import os
import signal
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx2
import pytest

from devtools import demo, harnesses
from devtools.fake_engine import FakeEngine
from rollout_proxy.embedded import BackgroundLoop, serve_app
from rollout_proxy.runner.harness import HarnessRollout, pinned_install
from rollout_proxy.runner.job import HarnessSpec
from tests.conftest import TEMPLATES
from tests.devtools.test_train_demo import fake_apt
from tests.runner.test_short_answer_job import answer_policy, demo_job


@pytest.fixture
def engine(tokenizer_dir: Path) -> Iterator[FakeEngine]:
    loop = BackgroundLoop("demo-engine")
    fake = FakeEngine(tokenizer_dir, chat_template=TEMPLATES["qwen3_style"])
    runner, fake.url = loop.run(serve_app(fake.app()))  # type: ignore[attr-defined]
    yield fake
    loop.run(runner.cleanup())
    loop.close()


def test_help_names_the_options(capsys):
    with pytest.raises(SystemExit) as exited:
        demo.main(["--help"])
    assert exited.value.code == 0
    text = capsys.readouterr().out
    for option in ("--keep-running", "--job", "--engine", "--samples", "--generations", "--steps", "--out"):
        assert option in text
    assert "viewer" in text and "Ctrl-C" in text


def test_bundled_jobs_load_with_the_command_line_sizes():
    job = demo.load_job("short-answer", samples=3, generations=2, steps=None)
    assert job.name == "short-answer-demo" and job.custom_rl_pipeline.rollout.plugin.name == "short_answer_rollout"
    assert (job.hyperparameters.batch_size, job.hyperparameters.num_generations, job.hyperparameters.num_steps) == (
        3,
        2,
        2,
    )
    assert demo.load_job("weather", samples=None, generations=None, steps=None).name == "weather-demo"
    assert demo.load_job("codex", samples=None, generations=None, steps=None).name == "codex-demo"
    swe = demo.load_job("swe", samples=None, generations=None, steps=None)
    assert swe.name == "swe-demo" and swe.custom_rl_pipeline.rollout.harness is not None
    assert swe.custom_rl_pipeline.rollout.harness.name == "codex"


def test_the_codex_job_runs_codex_on_the_fake_engine(tmp_path, capsys):
    """`./scripts/demo.sh --job codex --engine fake`: Codex CLI per sample, a scripted shell agent as the policy;
    every rollout reads its file with Codex's tool and answers, and the grader rewards it."""
    assert (
        demo.main(
            ["--job", "codex", "--engine", "fake", "--samples", "2", "--generations", "1", "--out", str(tmp_path)]
        )
        == 0
    )
    printed = capsys.readouterr().out
    assert "2 graded, 0 dropped" in printed and "mean reward   1.0000" in printed
    (run,) = [path for path in tmp_path.iterdir() if path.name.startswith("codex-demo-")]
    lines = [json.loads(line) for line in (run / "trajectories.jsonl").read_text().splitlines()]
    assert len(lines) == 2 and all(line["reward"] == 1.0 for line in lines)
    for line in lines:
        roles = [message["role"] for message in line["messages"]]
        assert roles[:2] == ["developer", "developer"] and roles[-3:] == ["assistant", "tool", "assistant"]
        assert line["extra"]["harness"]["final_message"].startswith("The file says: ")
        assert line["extra"]["harness"]["exit_code"] == 0 and not line["extra"]["harness"]["timed_out"]


def test_the_swe_job_runs_codex_and_grades_each_rollout_by_its_tests(tmp_path, capsys):
    """`./scripts/demo.sh --job swe --engine fake`: Codex per rollout on a small bug fix; the scripted policy
    writes the fix on one rollout of each task, so the sample's tests pass there only."""
    assert demo.main(["--job", "swe", "--engine", "fake", "--generations", "2", "--out", str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    assert "3 graded, 0 dropped" in printed and "mean reward   0.5000" in printed
    (run,) = [path for path in tmp_path.iterdir() if path.name.startswith("swe-demo-")]
    lines = [json.loads(line) for line in (run / "trajectories.jsonl").read_text().splitlines()]
    by_task: dict[str, list[float]] = {}
    for line in lines:
        by_task.setdefault(line["group_id"], []).append(line["reward"])
        assert line["extra"]["harness"]["exit_code"] == 0
    assert sorted(sorted(rewards) for rewards in by_task.values()) == [[0.0, 1.0]] * 3


def test_keep_running_serves_the_viewer_and_feed_until_ctrl_c(engine, tmp_path, capsys):
    _, answers = demo_job()
    engine.policy = answer_policy(engine, answers)
    job = demo.load_job("short-answer", samples=2, generations=4, steps=1)
    seen: dict[str, object] = {}

    def browse_then_ctrl_c(proxy: demo.DemoProxy) -> None:
        """While the demo waits: the viewer and the recorded groups are there; then Ctrl-C."""
        seen["url"] = proxy.url
        seen["viewer"] = httpx2.get(f"{proxy.url}/ui").status_code
        feed = httpx2.get(f"{proxy.url}/v1/feed", headers={"Authorization": f"Bearer {proxy.admin_key}"}).json()
        seen["groups"] = len(feed["entries"])
        threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGINT)).start()
        demo.wait_for_ctrl_c(proxy)

    out = demo.demo_on(engine.url, job, tmp_path, keep_running=True, wait=browse_then_ctrl_c)
    printed = capsys.readouterr().out
    assert seen["viewer"] == 200 and seen["groups"] == 2
    assert f"{seen['url']}/ui#key=" in printed and "Ctrl-C stops both." in printed
    assert "2 of 2 group(s) with rewards that differ" in printed
    lines = (out / "trajectories.jsonl").read_text().splitlines()
    assert len(lines) == 8 and {json.loads(line)["reward"] for line in lines} == {0.0, 0.5, 1.0}
    assert (out / "steps.png").is_file()
    with pytest.raises(httpx2.ConnectError):  # the proxy stopped with the demo
        httpx2.get(f"{seen['url']}/healthz")


def test_the_codex_jobs_set_up_npm_and_the_pinned_codex_once(tmp_path, monkeypatch):
    """`--job codex` on a machine without npm: npm comes from apt, the pinned Codex from npm into the cache,
    where a job's codex harness finds it; a second run installs nothing. (apt and npm are stand-ins that log.)"""
    npm = tmp_path / "npm-stand-in"
    npm.write_text(
        "#!/bin/sh\n"
        f'echo "$@" >> {tmp_path / "npm-calls.log"}\n'
        'while [ "$1" != --prefix ]; do shift; done\n'
        '/bin/mkdir -p "$2/bin"\n'
        "printf '#!/bin/sh\\necho codex-cli 0.171.0\\n' > \"$2/bin/codex\"\n"
        '/bin/chmod +x "$2/bin/codex"\n'
    )
    npm.chmod(0o755)
    apt_calls = fake_apt(tmp_path / "bin", provides={"npm": str(npm)})
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))
    monkeypatch.setenv("ROLLOUT_PROXY_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("ROLLOUT_PROXY_CODEX", raising=False)
    first, again = harnesses.ensure_codex(), harnesses.ensure_codex()
    assert first == again == tmp_path / "cache" / "npm" / "openai-codex@0.171.0" / "bin" / "codex"
    assert apt_calls.read_text().splitlines() == ["install -y -q --no-install-recommends npm"]
    [installed] = (tmp_path / "npm-calls.log").read_text().splitlines()
    assert installed.startswith("install --global --prefix ") and installed.endswith(" @openai/codex@0.171.0")
    # a job's codex harness runs that install when nothing names another
    assert HarnessRollout(HarnessSpec(name="codex")).executable == str(first)
    assert (
        pinned_install("codex") == harnesses.CODEX.binary
        and pinned_install("claude-code") == harnesses.CLAUDE_CODE.binary
    )
