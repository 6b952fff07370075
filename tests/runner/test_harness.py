"""Harness rollouts in the runner (``custom_rl_pipeline.rollout.harness``) on the fake engine.

The harnesses are small Python programs using the openai SDK against their session (``harness_agents/``),
started by the runner as any command harness is; the real pinned ones run in ``tests/harnesses/``.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import sys
from importlib import resources
from pathlib import Path
from typing import Any

import pytest
import yaml

from rollout_proxy.engines.vllm_http import is_routing_probe
from rollout_proxy.examples.swe_tests import swe_tests_reward
from rollout_proxy.runner import JobConfig, JobError, JobFailed, run_job
from rollout_proxy.runner.harness import QUIET, HarnessRollout, Scratch, substitute, task_of, workdir_of
from rollout_proxy.runner.job import HarnessSpec
from rollout_proxy.runner.runner import JobRunner
from rollout_proxy.sdk import ChatCompletionSample, PluginContext, Trajectory
from rollout_proxy.state.feed import JsonlFeed
from tests.harness import ADMIN_KEY, ProxyHarness
from tests.harnesses.conftest import connected_addresses, strace
from tests.runner import harness_plugins
from tests.runner.harness_plugins import AGENTS, fixer_policy, solutions
from tests.runner.test_processes import gone

PROBE = "tests.runner.harness_plugins:probe_grader"


def probe_dataset(path: Path, samples: int = 1) -> Path:
    with path.open("w") as out:
        for index in range(samples):
            record = {"extra": {"id": f"p{index}", "task": f"probe {index}", "files": {"given/file.txt": "hello\n"}}}
            out.write(json.dumps(record) + "\n")
    return path


def harness_job(
    tmp_path: Path,
    harness: dict[str, Any],
    *,
    dataset: Path | None = None,
    grader: str = PROBE,
    generations: int = 2,
    samples: int = 1,
    **proxy: Any,
) -> JobConfig:
    raw = {
        "name": "harness-test",
        "custom_rl_pipeline": {"rollout": {"harness": harness}, "graders": [{"plugin": {"python_func": grader}}]},
        "data": {"training_set": {"local_files": [str(dataset or probe_dataset(tmp_path / "probe.jsonl", samples))]}},
        "hyperparameters": {
            "num_generations": generations,
            "max_new_tokens": 256,
            "batch_size": samples,
            "num_steps": 1,
        },
        "proxy": {"output_dir": str(tmp_path / "out"), **proxy},
    }
    return JobConfig.parse(raw, base_dir=tmp_path)


def probe(mode: str = "ok", **more: Any) -> dict[str, Any]:
    return {"name": "command", "command": ["{python}", str(AGENTS / "probe_agent.py"), mode, "{task}"], **more}


async def published(summary) -> list[Any]:
    return [entry.group for entry in await JsonlFeed(summary.feed.removeprefix("jsonl:")).read(limit=1000)]


def exists(path: str | Path) -> bool:
    return Path(path).exists()


def model_calls(engine) -> list[Any]:
    return [generation for generation in engine.generations if not is_routing_probe(generation.payload)]


@pytest.fixture(autouse=True)
def _fresh_grader_log():
    harness_plugins.SEEN.clear()


async def test_a_command_harness_runs_once_per_rollout_isolated_and_the_grader_sees_its_workdir(
    engine, tmp_path, monkeypatch
):
    monkeypatch.setenv("ROLLOUT_PROXY_ADMIN_KEY", "the-runners-secret")
    monkeypatch.setenv("PASSED_ON", "by name")
    job = harness_job(tmp_path, probe(env={"JOB_VAR": "set"}, pass_env=["PASSED_ON", "NOT_SET_ANYWHERE"]))
    summary = await run_job(job, engines=[engine.url], progress=False)
    assert summary.samples_done == 1 and summary.trajectories == 2 and summary.mean_reward == 1.0
    assert len(model_calls(engine)) == 2  # one per rollout

    [group] = await published(summary)
    seen = harness_plugins.SEEN
    assert len(seen) == 2 and {str(s["workdir"]) for s in seen} == {
        t.extra["harness"]["workdir"] for t in group.trajectories
    }
    workdirs = [Path(s["workdir"]) for s in seen]
    assert workdirs[0] != workdirs[1] and workdirs[0].parent.parent == workdirs[1].parent.parent
    for record, trajectory in zip(seen, group.trajectories, strict=False):
        given = record["probe"]
        env, home = given["env"], Path(given["home"])
        assert given["cwd"] == str(record["workdir"]) and given["argv"][1].startswith("probe ")
        # its HOME is its own, empty, beside its working directory; not the runner's
        assert home == Path(record["workdir"]).parent / "home" and given["home_entries"] == []
        assert home != Path.home() and env["TMPDIR"] == str(home.parent / "tmp")
        # a clean environment: the session, quiet, the job's variables; nothing else of the runner's
        kept = {name for name in ("PATH", "LANG", "LC_ALL", "LC_CTYPE", "TZ") if name in os.environ}
        session = {"ROLLOUT_PROXY_BASE_URL", "ROLLOUT_PROXY_API_KEY", "OPENAI_BASE_URL", "OPENAI_API_KEY"}
        ours = {"HOME", "TMPDIR", "ROLLOUT_PROXY_WORKDIR", "ROLLOUT_PROXY_TASK", "JOB_VAR", "PASSED_ON"}
        xdg = {"XDG_CONFIG_HOME", "XDG_CACHE_HOME", "XDG_DATA_HOME", "XDG_STATE_HOME"}
        assert set(env) - {"LC_CTYPE"} == (kept | set(QUIET) | session | ours | xdg) - {"LC_CTYPE"}
        assert env["JOB_VAR"] == "set" and env["PASSED_ON"] == "by name"
        assert "the-runners-secret" not in json.dumps(env)
        assert env["OPENAI_BASE_URL"].startswith("http://127.0.0.1:") and env["OPENAI_BASE_URL"].endswith("/v1")
        assert env["DO_NOT_TRACK"] == "1" and env["NPM_CONFIG_UPDATE_NOTIFIER"] == "false"
        assert Path(record["workdir"]).parent.name == trajectory.session_id  # one directory per session
        # what it printed and how it ended, in the trajectory's extra
        harness = trajectory.extra["harness"]
        assert harness["exit_code"] == 0 and harness["timed_out"] is False and harness["name"] == "command"
        assert harness["stdout_tail"].startswith("the policy said: ") and harness["stdout_bytes"] > 0
        assert [m["role"] for m in trajectory.messages] == ["user", "assistant"]
    # graded: the working directories and the job's scratch root are gone
    assert not any(path.exists() for path in workdirs) and not workdirs[0].parent.parent.exists()


async def test_the_swe_example_rewards_the_rollout_whose_fix_passes_the_samples_tests(engine, tmp_path):
    """The bundled SWE dataset with a command harness (a planner subagent, then a coder): per task one rollout
    writes the reference fix (reward 1), the other overwrites the test with one that passes (the grader puts
    the sample's tests back: reward 0). Each rollout is two sequences, every sampled token trained once."""
    fixes = solutions()
    engine.policy = fixer_policy(engine, fixes)
    with resources.as_file(resources.files("rollout_proxy.examples") / "swe_job.yaml") as path:
        raw = yaml.safe_load(path.read_text())
        base_dir = path.parent
    raw["custom_rl_pipeline"]["rollout"]["harness"] = {
        "name": "command",
        "command": ["{python}", str(AGENTS / "fix_agent.py"), "{task}"],
    }
    raw["proxy"]["output_dir"] = str(tmp_path / "out")
    job = JobConfig.parse(raw, base_dir=base_dir)
    summary = await run_job(job, engines=[engine.url], progress=False)
    assert summary.samples_done == 3 and summary.trajectories == 6

    groups = await published(summary)
    assert len(groups) == 3
    trained = 0
    for group in groups:
        assert sorted(group.rewards) == [0.0, 1.0]
        assert min(group.advantages) < 0 < max(group.advantages)
        for trajectory in group.trajectories:
            assert [m["role"] for m in trajectory.messages] == ["system", "user", "assistant", "user", "assistant"]
            [planner] = trajectory.branches
            assert planner.branch["kind"] == "new_conversation"
            assert planner.messages[0]["content"] == "You plan bug fixes."
            assert not exists(trajectory.extra["harness"]["workdir"])  # removed once graded
        trained += sum(int(sum(sequence.total_loss_weight or [])) for _, sequence in group.sequences())
    assert trained == sum(len(generation.tokens) for generation in model_calls(engine))


async def test_a_harness_that_hangs_is_killed_with_its_process_group_and_graded_as_it_is(engine, tmp_path):
    pids = tmp_path / "pids.jsonl"
    job = harness_job(tmp_path, probe("hang", timeout=2, on_timeout="grade", env={"PIDS_FILE": str(pids)}))
    summary = await run_job(job, engines=[engine.url], progress=False)
    assert summary.samples_done == 1 and summary.trajectories == 2
    [group] = await published(summary)
    for trajectory in group.trajectories:
        harness = trajectory.extra["harness"]
        assert harness["timed_out"] is True and harness["exit_code"] == -15  # SIGTERM at the bound
        assert harness["stdout_tail"].startswith("the policy said: ")
        # nothing recorded beyond what it sent: its one call
        assert [m["role"] for m in trajectory.messages] == ["user", "assistant"] and not trajectory.branches
    assert len(model_calls(engine)) == 2
    started = [json.loads(line) for line in pids.read_text().splitlines()]
    assert len(started) == 2
    for run in started:
        assert await gone(run["pid"]) and await gone(run["child"])


async def test_a_hang_under_the_default_is_retried_then_dropped_and_its_sessions_say_why(engine, tmp_path):
    pids = tmp_path / "pids.jsonl"
    job = harness_job(tmp_path, probe("hang", timeout=1, env={"PIDS_FILE": str(pids)}), generations=1)
    async with ProxyHarness.running(engine_urls=[engine.url]) as proxy:
        feed = JsonlFeed(tmp_path / "feed.jsonl")
        runner = JobRunner(job, proxy_url=proxy.url, admin_key=ADMIN_KEY, feed=feed, progress=False)
        summary = await runner.run()
        assert summary.samples_dropped == 1 and summary.failed_attempts == 4 and summary.groups_published == 0
        started = [json.loads(line) for line in pids.read_text().splitlines()]
        assert len(started) == 4
        for run in started:
            assert await gone(run["pid"]) and await gone(run["child"])
            assert not exists(run["cwd"])  # nobody grades it: removed at once
            status, record = await proxy.request("GET", f"/v1/sessions/{Path(run['cwd']).parent.name}")
            assert status == 200, record
            assert record["result"]["status"] == "retry"
            assert "harness command timed out after 1s (its process group was killed)" in record["result"]["error"]
            assert record["result"]["extra"]["harness"]["timed_out"] is True
    assert not await feed.read(limit=10)


async def test_a_harness_that_exits_non_zero_fails_the_job_with_what_it_said(engine, tmp_path):
    job = harness_job(tmp_path, probe("fail"), generations=1)
    with pytest.raises(JobFailed) as failed:
        await run_job(job, engines=[engine.url], progress=False)
    message = str(failed.value)
    assert (
        "failed 4 times" in message and "harness command exited 3" in message and "boom: the agent gave up" in message
    )
    assert len(model_calls(engine)) == 4  # 1 + 3 retries, each in a new session


async def test_on_error_grade_publishes_the_run_with_its_exit_code(engine, tmp_path):
    job = harness_job(tmp_path, probe("fail", on_error="grade"), generations=1)
    summary = await run_job(job, engines=[engine.url], progress=False)
    [group] = await published(summary)
    harness = group.trajectories[0].extra["harness"]
    assert harness["exit_code"] == 3 and harness["stderr_tail"] == "boom: the agent gave up\n"
    assert group.rewards == [1.0]  # the grader saw its working directory


@pytest.mark.skipif(strace() is None, reason="strace is not installed (scripts/lib.sh installs it)")
async def test_a_traced_harness_connects_to_nothing_but_loopback_and_kept_workdirs_stay(engine, tmp_path):
    root = tmp_path / "work"
    wrapper = [strace(), "-f", "-qq", "-e", "trace=connect", "-o", "{home}/connect.trace"]
    job = harness_job(tmp_path, probe(wrapper=wrapper, keep_workdirs=True, workdir_root=str(root)))
    summary = await run_job(job, engines=[engine.url], progress=False)
    [group] = await published(summary)
    for trajectory in group.trajectories:
        workdir = workdir_of(trajectory)
        assert workdir is not None and workdir.parent.parent == root and (workdir / "given" / "file.txt").is_file()
        addresses = connected_addresses(workdir.parent / "home" / "connect.trace")
        assert addresses and addresses <= {"127.0.0.1"}, addresses


# -- refused before anything runs ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("harness", "expected"),
    [
        ({"name": "codx"}, "custom_rl_pipeline.rollout.harness.name: Input should be 'codex', 'claude-code'"),
        ({"name": "command"}, "a 'command' harness needs its argv in 'command'"),
        ({"name": "codex", "command": ["x"]}, "'command' is for name: command"),
        ({"name": "command", "command": ["{pyton}"]}, "unknown placeholder {pyton}"),
        ({"name": "codex", "timeout": 0}, "custom_rl_pipeline.rollout.harness.timeout"),
        ({"name": "codex", "on_timeout": "ignore"}, "custom_rl_pipeline.rollout.harness.on_timeout"),
        ({"name": "codex", "tmeout": 5}, "custom_rl_pipeline.rollout.harness.tmeout: unknown field"),
    ],
)
def test_a_bad_harness_section_is_reported_with_its_path(tmp_path, harness, expected):
    with pytest.raises(JobError) as raised:
        harness_job(tmp_path, harness)
    assert expected in str(raised.value)


def test_a_rollout_is_a_plugin_or_a_harness(tmp_path):
    with pytest.raises(JobError, match="give exactly one of them"):
        JobConfig.parse(
            {
                "custom_rl_pipeline": {
                    "rollout": {"harness": probe(), "plugin": {"python_func": "a:b"}},
                    "graders": [{"plugin": {"python_func": PROBE}}],
                },
                "data": {"training_set": {"local_files": [str(probe_dataset(tmp_path / "d.jsonl"))]}},
            }
        )


def test_what_a_harness_cannot_do_is_refused_in_words(tmp_path):
    with pytest.raises(JobError, match=r"claude-code sends max_tokens: 128000.*client_sampling: ignore") as raised:
        harness_job(tmp_path, {"name": "claude-code"})
    assert "\n  custom_rl_pipeline.rollout.harness: claude-code sends" in str(raised.value)  # its path first
    assert "Value error" not in str(raised.value) and "(top level)" not in str(raised.value)
    assert harness_job(tmp_path, {"name": "claude-code"}, client_sampling="ignore").proxy.client_sampling == "ignore"
    raw = harness_job(tmp_path, probe()).model_dump(mode="json")
    with pytest.raises(JobError, match="ray: a harness rollout runs in the runner's process"):
        JobConfig.parse({**raw, "ray": {"address": "127.0.0.1:1"}}, base_dir=tmp_path)


async def test_a_missing_program_is_refused_before_a_session_opens(engine, tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    monkeypatch.setenv("ROLLOUT_PROXY_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("ROLLOUT_PROXY_CODEX", raising=False)
    with pytest.raises(JobError) as raised:
        await run_job(harness_job(tmp_path, {"name": "codex"}), engines=[engine.url], progress=False)
    assert "harness 'codex' is not installed" in str(raised.value)
    assert "npm install -g @openai/codex@0.171.0" in str(raised.value) and "devtools.harnesses setup" in str(
        raised.value
    )
    for harness, where in (
        ({"name": "codex", "executable": str(tmp_path / "no-codex")}, "harness.executable"),
        ({"name": "command", "command": [str(tmp_path / "no-agent")]}, "harness.command[0]"),
        ({"name": "command", "command": ["{python}", "a.py"], "wrapper": ["no-such-sandbox"]}, "harness.wrapper[0]"),
    ):
        with pytest.raises(JobError, match=re.escape(f"custom_rl_pipeline.rollout.{where}")):
            await run_job(harness_job(tmp_path, harness), engines=[engine.url], progress=False)
    monkeypatch.setenv("ROLLOUT_PROXY_CODEX", str(tmp_path / "nowhere"))
    with pytest.raises(JobError, match=r"\$ROLLOUT_PROXY_CODEX is .*not an executable"):
        HarnessRollout(HarnessSpec(name="codex"))
    assert not model_calls(engine) and not (tmp_path / "out").exists()


def test_a_sample_without_a_task_is_refused_with_its_index(tmp_path):
    dataset = tmp_path / "d.jsonl"
    dataset.write_text(json.dumps({"extra": {"task": "fine"}}) + "\n" + json.dumps({"extra": {}}) + "\n")
    job = harness_job(tmp_path, probe(), dataset=dataset)
    with pytest.raises(JobError, match="sample 1 of the training set has no task"):
        JobRunner(job, proxy_url="http://127.0.0.1:9", admin_key="k", feed=JsonlFeed(tmp_path / "f.jsonl"))


@pytest.mark.parametrize(
    ("files", "expected"),
    [
        (["a.py"], "must map relative paths to their text, got list"),
        ({"a.py": 3}, "'a.py': its text must be a string, got int"),
        ({"../a.py": "x"}, "'../a.py' is outside the working directory"),
        ({"/etc/a.py": "x"}, "'/etc/a.py' is outside the working directory"),
    ],
)
def test_sample_files_that_cannot_be_written_are_refused_before_anything_runs(tmp_path, files, expected):
    dataset = tmp_path / "d.jsonl"
    dataset.write_text(json.dumps({"extra": {"task": "t", "files": files}}) + "\n")
    job = harness_job(tmp_path, probe(), dataset=dataset)
    with pytest.raises(JobError, match=r"sample 0 of the training set: extra\.files ") as raised:
        JobRunner(job, proxy_url="http://127.0.0.1:9", admin_key="k", feed=JsonlFeed(tmp_path / "f.jsonl"))
    assert expected in str(raised.value)


# -- the parts --------------------------------------------------------------------------------------------


def test_the_task_is_extra_task_else_the_last_user_message():
    assert (
        task_of(ChatCompletionSample(extra={"task": "do it"}, messages=[{"role": "user", "content": "no"}])) == "do it"
    )
    sample = ChatCompletionSample(messages=[{"role": "user", "content": "first"}, {"role": "user", "content": "last"}])
    assert task_of(sample) == "last"
    assert task_of(ChatCompletionSample(extra={})) is None


def test_placeholders_are_replaced_and_other_braces_kept():
    words = ["{python}", "-c", 'print({"a": 1})', "--dir={workdir}", "{unknown}"]
    assert substitute(words, {"python": "/py", "workdir": "/w"}) == [
        "/py",
        "-c",
        'print({"a": 1})',
        "--dir=/w",
        "{unknown}",
    ]


def test_files_outside_the_working_directory_are_refused(tmp_path):
    with pytest.raises(ValueError, match="outside the working directory"):
        Scratch.create(tmp_path / "s", {"../escape.txt": "x"})
    scratch = Scratch.create(tmp_path / "t", {"a/b.txt": "x"})
    assert (scratch.work / "a" / "b.txt").read_text() == "x" and scratch.home.is_dir() and scratch.tmp.is_dir()


async def test_the_swe_grader_runs_the_samples_tests_in_the_workdir_restoring_them(tmp_path):
    record = json.loads(
        (resources.files("rollout_proxy.examples") / "data" / "swe_tasks.jsonl").read_text().splitlines()[0]
    )
    sample = ChatCompletionSample.model_validate(record)
    extra = sample.extra or {}
    context = PluginContext()

    def rollout_in(files: dict[str, str]) -> Trajectory:
        scratch = Scratch.create(tmp_path / str(len(list(tmp_path.iterdir()))), files)
        return Trajectory(extra={"harness": {"workdir": str(scratch.work)}})

    assert (await swe_tests_reward(context, sample, rollout_in(extra["files"]))).reward == 0.0  # the bug
    fixed = {**extra["files"], **extra["solution"]}
    assert (await swe_tests_reward(context, sample, rollout_in(fixed))).reward == 1.0
    cheated = {**extra["files"], "test_mathx.py": "print('ok')\n"}
    assert (await swe_tests_reward(context, sample, rollout_in(cheated))).reward == 0.0  # its tests put back
    gone_ = await swe_tests_reward(context, sample, Trajectory(extra={}))
    assert gone_.reward == 0.0 and gone_.metrics["ran"] == 0.0


async def test_a_runner_stopped_with_sigterm_stops_its_harnesses(engine, tmp_path):
    """`rollout-proxy run` under a scheduler's SIGTERM: the job is cancelled as by Ctrl-C, and the harness
    processes it started (each in a process group of its own) go with it."""
    pids = tmp_path / "pids.jsonl"
    job = harness_job(tmp_path, probe("hang", env={"PIDS_FILE": str(pids)}), generations=2)
    raw = job.model_dump(mode="json", exclude_none=True)
    raw["proxy"]["engines"] = [engine.url]
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(raw))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    runner = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "rollout_proxy",
        "run",
        str(path),
        "--no-progress",
        env=env,
        cwd=tmp_path,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    for _ in range(1200):  # both harnesses have started
        if lines(pids) == 2:
            break
        await asyncio.sleep(0.05)
    runner.send_signal(signal.SIGTERM)
    _, stderr = await asyncio.wait_for(runner.communicate(), 60)
    assert runner.returncode == 143 and "stopped (SIGTERM)" in stderr.decode()
    for run in map(json.loads, pids.read_text().splitlines()):
        assert await gone(run["pid"]) and await gone(run["child"])
        assert not exists(run["cwd"])


def lines(path: Path) -> int:
    return len(path.read_text().splitlines()) if path.is_file() else 0
