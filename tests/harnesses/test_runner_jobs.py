"""The runner's harnesses (``custom_rl_pipeline.rollout.harness``) with the pinned clients, on the fake engine.

Codex on the bundled SWE job; Claude Code and mini-swe-agent on file-reading tasks (their launch: the
session's URL and key as each reads them, the last message: Claude Code's output, mini-swe-agent's
submission).

Codex CLI 0.171.0, unmodified, is started by the runner once per rollout on the fake engine; the policy is
the scripted SWE agent (``devtools.scripted_agent.swe_agent``: it writes the reference fix with Codex's
shell tool on every other rollout of a task, and only runs the test on the others), and the grader runs
the sample's tests in the working directory Codex left. Traced with strace where it is there (the job's
``wrapper``): nothing but 127.0.0.1.
"""

from __future__ import annotations

import json
import re
from importlib import resources
from pathlib import Path

import yaml

from devtools.fake_engine import FakeEngine
from devtools.harnesses import ensure_claude_code, ensure_codex
from devtools.scripted_agent import swe_agent
from rollout_proxy.runner import JobConfig
from rollout_proxy.runner.harness import workdir_of
from rollout_proxy.runner.runner import JobRunner
from rollout_proxy.sdk import Trajectory
from rollout_proxy.state.feed import JsonlFeed
from tests.harness import ADMIN_KEY, ProxyHarness
from tests.harnesses.conftest import assert_exact, connected_addresses, strace
from tests.runner.harness_plugins import solutions


def swe_job(tmp_path: Path, **harness: object) -> JobConfig:
    with resources.as_file(resources.files("rollout_proxy.examples") / "swe_job.yaml") as path:
        raw = yaml.safe_load(path.read_text())
        base_dir = path.parent
    raw["custom_rl_pipeline"]["rollout"]["harness"].update(harness)
    raw["hyperparameters"].update(batch_size=2, num_generations=2)
    raw["proxy"]["output_dir"] = str(tmp_path / "out")
    return JobConfig.parse(raw, base_dir=base_dir)


def has_text(path: Path) -> bool:
    return path.is_file() and bool(path.read_text())


def ran_and_printed(trajectory: Trajectory) -> tuple[str, str]:
    """The command a rollout's tool call ran and what its tool result says it printed (a failure's story)."""
    calls = [m for m in trajectory.messages if m["role"] == "assistant" and m.get("tool_calls")]
    results = [m for m in trajectory.messages if m["role"] == "tool"]
    command = calls[-1]["tool_calls"][0]["function"]["arguments"][:120] if calls else "no tool call"
    return command, str(results[-1]["content"])[:400] if results else "no tool result"


async def test_the_swe_job_with_codex_is_graded_by_its_tests(proxy: ProxyHarness, fake: FakeEngine, tmp_path):
    fake.policy = swe_agent(fake, solutions())
    tracer = strace()
    wrapper = [] if tracer is None else [tracer, "-f", "-qq", "-e", "trace=connect", "-o", "{home}/connect.trace"]
    root = tmp_path / "rollouts"
    job = swe_job(tmp_path, executable=str(ensure_codex()), wrapper=wrapper, keep_workdirs=True, workdir_root=str(root))
    feed = JsonlFeed(tmp_path / "feed.jsonl")
    summary = await JobRunner(job, proxy_url=proxy.url, admin_key=ADMIN_KEY, feed=feed, progress=False).run()
    assert summary.samples_done == 2 and summary.trajectories == 4 and summary.failed_attempts == 0

    groups = [entry.group for entry in await feed.read(limit=10)]
    assert len(groups) == 2
    for group in groups:
        # the rollout that wrote the fix passes the sample's tests (else: what each rollout ran, and what it printed)
        assert sorted(group.rewards) == [0.0, 1.0], [ran_and_printed(t) for t in group.trajectories]
        for trajectory in group.trajectories:
            harness = trajectory.extra["harness"]
            assert harness["name"] == "codex" and harness["exit_code"] == 0 and not harness["timed_out"]
            assert harness["final_message"].strip() == "Done."
            roles = [message["role"] for message in trajectory.messages]
            assert roles[:2] == ["developer", "developer"] and roles[-3:] == ["assistant", "tool", "assistant"]
            assert trajectory.messages[-3]["tool_calls"][0]["function"]["name"] == "exec_command"
            workdir = workdir_of(trajectory)
            assert workdir is not None and workdir.parent.parent == root
            assert has_text(workdir.parent / "home" / ".codex" / "config.toml")  # its own CODEX_HOME, per rollout
            if tracer is not None:
                addresses = connected_addresses(workdir.parent / "home" / "connect.trace")
                assert addresses and addresses <= {"127.0.0.1"}, addresses


async def test_one_codex_rollout_through_the_runner_is_recorded_exactly(
    proxy: ProxyHarness, fake: FakeEngine, tmp_path
):
    """One rollout alone: every engine call's prompt is its trajectory so far, its tokens follow, the task once."""
    tasks = solutions()
    fake.policy = swe_agent(fake, tasks)
    job = swe_job(tmp_path, executable=str(ensure_codex()))
    job.hyperparameters.batch_size = job.hyperparameters.num_generations = 1
    feed = JsonlFeed(tmp_path / "feed.jsonl")
    await JobRunner(job, proxy_url=proxy.url, admin_key=ADMIN_KEY, feed=feed, progress=False).run()
    [entry] = await feed.read(limit=10)
    [trajectory] = entry.group.trajectories
    assert entry.group.rewards == [1.0] and not trajectory.branches
    assert_exact(trajectory.model_dump(), fake, task=next(iter(tasks)), turns=2)


def marker_job(tmp_path: Path, harness: dict[str, object], **proxy: object) -> JobConfig:
    """Two samples, each a file with a word to report (graded on the harness's last message)."""
    dataset = tmp_path / "markers.jsonl"
    words = ["heliotrope", "marigold"]
    dataset.write_text(
        "".join(
            json.dumps({"extra": {"task": TASK, "files": {"marker.txt": f"{word}\n"}, "answer": word}}) + "\n"
            for word in words
        )
    )
    raw = {
        "name": "marker-job",
        "custom_rl_pipeline": {
            "rollout": {"harness": {"timeout": 120, **harness, "workdir_root": str(tmp_path / "rollouts")}},
            "graders": [{"plugin": {"python_func": "rollout_proxy.examples.codex_answer:codex_answer_reward"}}],
        },
        "data": {"training_set": {"local_files": [str(dataset)]}},
        "hyperparameters": {"num_generations": 1, "max_new_tokens": 256, "batch_size": 2, "num_steps": 1},
        "proxy": {"output_dir": str(tmp_path / "out"), **proxy},
    }
    return JobConfig.parse(raw, base_dir=tmp_path)


TASK = "Read marker.txt and tell me the word it contains."


def reader_policy(fake: FakeEngine, root: Path, *, tool: str, argument: str, answer: str):
    """Reads ``marker.txt`` of the rollout's own working directory (found in the prompt), then says ``answer``
    with the word the tool returned in it."""

    def policy(prompt_ids: list[int]) -> str:
        text = fake.decode(prompt_ids)
        turn = text[text.rfind("<|im_start|>user\n") :]
        if "<tool_response>" in turn:
            result = turn.split("<tool_response>\n", 1)[1].split("\n</tool_response>", 1)[0]
            word = next(w for w in ("heliotrope", "marigold") if w in result)
            return answer.format(word=word)
        if tool == "Read":  # an absolute path: its working directory is in its prompt
            value = re.findall(re.escape(str(root)) + r"/sess_[0-9a-f]+/work", text)[-1] + "/marker.txt"
        else:
            value = "cat marker.txt"
        call = json.dumps({"name": tool, "arguments": {argument: value}})
        return f"<think>\nRead it first.\n</think>\n\n<tool_call>\n{call}\n</tool_call>"

    return policy


async def test_claude_code_as_the_jobs_harness(proxy: ProxyHarness, fake: FakeEngine, tmp_path):
    job = marker_job(
        tmp_path, {"name": "claude-code", "executable": str(ensure_claude_code())}, client_sampling="ignore"
    )
    fake.policy = reader_policy(
        fake, tmp_path / "rollouts", tool="Read", argument="file_path", answer="It says {word}."
    )
    feed = JsonlFeed(tmp_path / "feed.jsonl")
    summary = await JobRunner(job, proxy_url=proxy.url, admin_key=ADMIN_KEY, feed=feed, progress=False).run()
    assert summary.samples_done == 2 and summary.failed_attempts == 0 and summary.mean_reward == 1.0
    for entry in await feed.read(limit=10):
        [trajectory] = entry.group.trajectories
        harness = trajectory.extra["harness"]
        assert (
            harness["exit_code"] == 0
            and harness["final_message"] == f"It says {entry.group.sample['extra']['answer']}."
        )
        assert [m["role"] for m in trajectory.messages][-3:] == ["assistant", "tool", "assistant"]


async def test_mini_swe_agent_as_the_jobs_harness(proxy: ProxyHarness, fake: FakeEngine, tmp_path):
    job = marker_job(tmp_path, {"name": "mini-swe-agent"})
    submit = (
        '<tool_call>\n{{"name": "bash", "arguments": {{"command": "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT && '
        'echo {word}"}}}}\n</tool_call>'
    )
    fake.policy = reader_policy(fake, tmp_path / "rollouts", tool="bash", argument="command", answer=submit)
    feed = JsonlFeed(tmp_path / "feed.jsonl")
    summary = await JobRunner(job, proxy_url=proxy.url, admin_key=ADMIN_KEY, feed=feed, progress=False).run()
    assert summary.samples_done == 2 and summary.failed_attempts == 0 and summary.mean_reward == 1.0
    for entry in await feed.read(limit=10):
        [trajectory] = entry.group.trajectories
        harness = trajectory.extra["harness"]
        assert harness["exit_code"] == 0 and harness["final_message"].strip() == entry.group.sample["extra"]["answer"]
        assert [m["role"] for m in trajectory.messages] == ["system", "user", "assistant", "tool", "assistant"]
