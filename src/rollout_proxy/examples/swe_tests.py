"""The grader of the SWE-style example job (``swe_job.yaml``): the sample's tests, run where the harness worked.

Each sample of ``data/swe_tasks.jsonl`` is a small repository with a bug (``extra.files``: a module and
its test), the task ("`python test_x.py` fails: fix ..."), the tests that decide the reward
(``extra.tests``) and how to run them (``extra.test_command``; ``{python}``: this interpreter), and a
reference fix (``extra.solution``: for a scripted demo policy and for checking the dataset; no harness
sees it). The harness rollout leaves its working directory for the graders (``runner.harness.workdir_of``);
this grader writes the sample's tests into it again (a harness that edited or deleted them changes
nothing), runs the test command there with a clean environment and a time bound (``runner.processes``),
and rewards 1.0 when it passes.
"""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path
from typing import Any

from rollout_proxy.runner.harness import substitute, workdir_of
from rollout_proxy.runner.processes import run_process
from rollout_proxy.sdk import (
    ChatCompletionSample,
    PluginContext,
    Runtime,
    SingleGraderResult,
    Trajectory,
    single_grader,
)

#: seconds the sample's tests may take
TEST_TIME = 60.0


def _write_tests(workdir: Path, tests: dict[str, Any]) -> None:
    root = workdir.resolve()
    for name, text in tests.items():
        path = (root / str(name)).resolve()
        if root not in path.parents:
            raise ValueError(f"extra.tests: {name!r} is outside the working directory")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(str(text))


@single_grader(name="swe_tests_reward", runtime=Runtime(max_concurrency=4))
async def swe_tests_reward(
    context: PluginContext, sample: ChatCompletionSample, trajectory: Trajectory
) -> SingleGraderResult:
    """1.0 when the sample's tests pass in the harness's working directory, else 0.0."""
    extra = sample.extra or {}
    workdir = workdir_of(trajectory)
    if workdir is None or not workdir.is_dir():
        return SingleGraderResult(reward=0.0, metrics={"passed": 0.0, "ran": 0.0})
    await asyncio.to_thread(_write_tests, workdir, extra.get("tests") or {})
    command = extra.get("test_command") or ["{python}", "-m", "pytest", "-q"]
    argv = substitute(command, {"python": sys.executable, "workdir": str(workdir)})
    env = {"PATH": os.environ.get("PATH", ""), "HOME": str(workdir.parent / "home"), "PYTHONDONTWRITEBYTECODE": "1"}
    outcome = await run_process(argv, cwd=workdir, env=env, wall_time=TEST_TIME, tail_bytes=2048)
    passed = outcome.exit_code == 0 and not outcome.timed_out
    return SingleGraderResult(reward=1.0 if passed else 0.0, metrics={"passed": float(passed), "ran": 1.0})
