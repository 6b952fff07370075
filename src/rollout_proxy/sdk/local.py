"""``test_with_dataset``: run a rollout and a grader over a JSONL file, locally.

Inference mode against any OpenAI-compatible endpoint (no proxy, no tokens), with
bounded concurrency and a progress bar: the way to check a plugin, and the load it
puts on its tools, before a job runs it at ``batch_size`` concurrency. Plugins are
called as a job calls them (``sdk.execution``: the runtime timeout, a raised
exception or an invalid result is a failure), but nothing is retried: what does not
succeed is skipped.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from rollout_proxy.sdk.decorators import Plugin, PluginKind
from rollout_proxy.sdk.execution import attempt_rollout, grade
from rollout_proxy.sdk.proxy import InferenceProxy, Mode
from rollout_proxy.sdk.types import ChatCompletionSample, GroupRolloutResult, PluginContext, Trajectory


def load_samples(jsonl_path: str | Path, limit: int | None = None, **overrides: Any) -> list[ChatCompletionSample]:
    samples: list[ChatCompletionSample] = []
    with open(jsonl_path, encoding="utf-8") as lines:
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            if limit is not None and len(samples) >= limit:
                break
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{jsonl_path}:{number}: not valid JSON ({exc})") from None
            record.update({key: value for key, value in overrides.items() if value is not None})
            samples.append(ChatCompletionSample.model_validate(record))
    return samples


def _test_context() -> PluginContext:
    return PluginContext(phase="test", is_mock=True)


async def _rollout_sample(
    rollout: Plugin, sample: ChatCompletionSample, *, api_key: str, base_url: str, n_sample: int, model: str | None
) -> list[Trajectory]:
    """The trajectories of the rollouts that succeeded (one group call, or ``n_sample`` single calls)."""
    group = rollout.spec.kind is PluginKind.GROUP_ROLLOUT
    calls = 1 if group else n_sample
    trajectories: list[Trajectory] = []
    for _ in range(calls):
        async with InferenceProxy(
            sample, url=base_url, jwt_token=api_key, mode=Mode.Inference, group=group, model=model
        ) as proxy:
            outcome = await attempt_rollout(rollout, _test_context(), proxy, sample, n_sample)
        if outcome.succeeded:
            trajectories += _trajectories(proxy, outcome.result)
    return trajectories


def _trajectories(proxy: InferenceProxy, result: Any) -> list[Trajectory]:
    """What a successful call produced: one trajectory per group response, or the single one."""
    if isinstance(result, GroupRolloutResult):
        return [
            Trajectory(
                messages=proxy._histories.get(response.id, []), extra=response.extra or {}, response_id=response.id
            )
            for response in result.responses
        ]
    return [proxy.trajectory(extra=result.extra if result is not None else {})]


async def test_with_dataset(
    jsonl_path: str | Path,
    rollout: Plugin,
    grader: Plugin,
    api_key: str,
    base_url: str,
    limit: int | None = None,
    max_concurrent: int = 8,
    n_sample: int = 1,
    top_p: float | None = None,
    temperature: float | None = None,
    *,
    max_new_tokens: int | None = None,
    model: str | None = None,
    progress: bool = True,
) -> list[float]:
    """Rewards of every graded trajectory (samples whose rollout or grading did not succeed are skipped).

    ``top_p`` / ``temperature`` / ``max_new_tokens`` override the samples' settings;
    ``model`` replaces the model name the plugin sends (see ``InferenceProxy``).
    """
    if not isinstance(rollout, Plugin) or not rollout.spec.kind.is_rollout:
        raise TypeError("rollout must be a function decorated with @rollout / @single_rollout / @group_rollout")
    if not isinstance(grader, Plugin) or grader.spec.kind.is_rollout:
        raise TypeError("grader must be a function decorated with @single_grader / @group_grader")
    samples = load_samples(jsonl_path, limit, top_p=top_p, temperature=temperature, max_new_tokens=max_new_tokens)
    limit_calls = asyncio.Semaphore(max_concurrent)
    bar = tqdm(total=len(samples), desc="samples", disable=not progress)
    rewards: list[float] = []

    async def one(sample: ChatCompletionSample) -> None:
        async with limit_calls:
            trajectories = await _rollout_sample(
                rollout, sample, api_key=api_key, base_url=base_url, n_sample=n_sample, model=model
            )
            if trajectories:
                rewards.extend((await grade(grader, _test_context(), sample, trajectories)).rewards)
        bar.update(1)
        if rewards:
            bar.set_postfix(mean_reward=f"{sum(rewards) / len(rewards):.3f}")

    try:
        await asyncio.gather(*(one(sample) for sample in samples))
    finally:
        bar.close()
    return rewards


test_with_dataset.__test__ = False  # type: ignore[attr-defined]  # not a pytest test, despite its name
