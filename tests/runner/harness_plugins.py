"""Graders and a fake policy for the harness jobs of the tests (``test_harness.py``, the trainer's loop)."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

from devtools.fake_engine import FakeEngine
from rollout_proxy.runner.harness import workdir_of
from rollout_proxy.sdk import SingleGraderResult, single_grader

AGENTS = Path(__file__).parent / "harness_agents"
#: what the graders saw, per call
SEEN: list[dict[str, Any]] = []


@single_grader(name="probe_grader")
def probe_grader(context, sample, trajectory):
    """Reads what the probe agent left in its working directory: reward 1.0 when it is there."""
    workdir = workdir_of(trajectory)
    probe = json.loads((workdir / "probe.json").read_text()) if workdir and (workdir / "probe.json").is_file() else None
    SEEN.append({"workdir": workdir, "probe": probe, "harness": (trajectory.extra or {}).get("harness")})
    return SingleGraderResult(reward=1.0 if probe else 0.0)


def solutions() -> dict[str, dict[str, str]]:
    """The bundled SWE tasks and their reference fixes."""
    from importlib import resources

    dataset = resources.files("rollout_proxy.examples") / "data" / "swe_tasks.jsonl"
    records = [json.loads(line)["extra"] for line in dataset.read_text().splitlines() if line.strip()]
    return {record["task"]: record["solution"] for record in records}


def fixer_policy(engine: FakeEngine, fixes: dict[str, dict[str, str]]) -> Callable[[list[int]], str]:
    """For ``fix_agent.py``: the planner's plan; then, per task, odd asks answer the reference fix and even ones
    overwrite the test with one that always passes (the grader restores it: no reward); then a last word."""
    asked: Counter[str] = Counter()

    def policy(prompt_ids: list[int]) -> str:
        text = engine.decode(prompt_ids)
        if "You plan bug fixes." in text:
            return "Read the test, then fix the function it calls."
        if "The test exited" in text.split("<|im_start|>user\n")[-1]:
            return "Done."
        task = next(task for task in fixes if task in text)
        asked[task] += 1
        name, body = next(iter(fixes[task].items()))
        if asked[task] % 2:
            return f"FILE: {name}\n```python\n{body}```"
        return f"FILE: test_{name}\n```python\nprint('ok')\n```"

    return policy
