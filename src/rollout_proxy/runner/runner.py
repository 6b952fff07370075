"""Drive a job: every sample through the proxy, graded, advantaged, published.

Per sample: ``num_generations`` single rollouts (each its own session) or one group
rollout (``n_sample = num_generations``). Status semantics from the seed, for rollouts
and graders alike: ``failure`` (or an exception, or a timeout) is retried up to 3
times, then the job fails with the plugin's error; ``retry`` is retried up to 3 times,
then the sample is dropped; ``discard`` drops the sample at once.

Samples go in batches of ``batch_size`` (one batch = one step). A batch is published
when all its groups are graded, in sample order, once the batch-level rule is
checked (all or none of its groups carry custom advantages; the same rule as
``sdk.validation.check_advantage_batch``, per group). Group ids are stable
(``job/step/sample``), so a resumed job skips what it already published.
"""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import structlog

from rollout_proxy.runner.grading import aggregate_metrics, custom_advantages, grpo_advantages, weighted_rewards
from rollout_proxy.runner.job import JobConfig
from rollout_proxy.runner.plugins import load_plugin
from rollout_proxy.runner.progress import JobProgress, JobSummary
from rollout_proxy.sdk.decorators import Plugin, PluginKind
from rollout_proxy.sdk.local import load_samples
from rollout_proxy.sdk.proxy import RolloutInferenceProxy, session_body
from rollout_proxy.sdk.types import ChatCompletionSample, GroupGraderResult, PluginContext, PluginStatus, Trajectory
from rollout_proxy.sdk.validation import PluginValidationError
from rollout_proxy.state.feed import Feed
from rollout_proxy.wire.feed import FeedGroup

log = structlog.get_logger(__name__)

MAX_RETRIES = 3


class JobFailed(RuntimeError):
    """A plugin kept failing (``failure`` 1 + 3 times); the job stops with its error."""


class SampleDropped(Exception):
    """The sample is dropped (``discard``, or ``retry`` 1 + 3 times)."""


@dataclass(slots=True)
class Attempt:
    status: PluginStatus
    error: str | None
    result: Any = None


@dataclass(slots=True)
class GradedGroup:
    step: int
    index: int
    group_id: str
    sample: dict[str, Any]
    trajectories: list[Trajectory]
    rewards: list[float]
    grader_rewards: dict[str, list[float]]
    metrics: list[dict[str, float]]
    custom: tuple[str, list[Any]] | None

    def entry(self, job_id: str, advantages: list[Any], kind: str) -> FeedGroup:
        return FeedGroup(
            group_id=self.group_id,
            job_id=job_id,
            step=self.step,
            sample_index=self.index,
            sample=self.sample,
            trajectories=self.trajectories,
            rewards=self.rewards,
            grader_rewards=self.grader_rewards,
            advantages=advantages,
            advantage_kind=kind,
            metrics=self.metrics,
        )


@dataclass
class Graders:
    plugins: list[tuple[Plugin, float]]
    limits: dict[str, asyncio.Semaphore] = field(default_factory=dict)


def _leaves(error: BaseException) -> list[BaseException]:
    if isinstance(error, BaseExceptionGroup):
        return [leaf for inner in error.exceptions for leaf in _leaves(inner)]
    return [error]


async def gather_first_error(coroutines: list[Any]) -> list[Any]:
    """Run together; on an error cancel the rest and raise it (a JobFailed first), not a group."""
    try:
        async with asyncio.TaskGroup() as group:
            tasks = [group.create_task(coroutine) for coroutine in coroutines]
    except BaseExceptionGroup as errors:
        leaves = _leaves(errors)
        raise next((e for e in leaves if isinstance(e, JobFailed)), leaves[0]) from None
    return [task.result() for task in tasks]


async def _attempt(plugin: Plugin, *args: Any) -> Attempt:
    """One call, its outcome as a status (an exception or a timeout is a failure)."""
    try:
        result = await asyncio.wait_for(plugin.arun(*args), plugin.spec.runtime.timeout)
    except TimeoutError:
        return Attempt(PluginStatus.FAILURE, f"timed out after {plugin.spec.runtime.timeout}s")
    except PluginValidationError as exc:
        return Attempt(PluginStatus.FAILURE, f"invalid result: {exc}")
    except Exception as exc:  # a plugin's bug must not take the runner down
        log.warning("plugin_raised", plugin=plugin.spec.name, exc_info=True)
        return Attempt(PluginStatus.FAILURE, f"{type(exc).__name__}: {exc}")
    if result is None:
        return Attempt(PluginStatus.SUCCESS, None, None)
    return Attempt(PluginStatus(result.status), getattr(result, "error", None) or None, result)


class JobRunner:
    def __init__(
        self,
        job: JobConfig,
        *,
        proxy_url: str,
        admin_key: str,
        feed: Feed,
        job_id: str | None = None,
        progress: bool = True,
    ) -> None:
        self.job = job
        self.job_id = job_id or job.name
        self._proxy_url = proxy_url.rstrip("/")
        self._admin_key = admin_key
        self._feed = feed
        self._progress_enabled = progress
        pipeline = job.custom_rl_pipeline
        base = job.base_dir
        self.rollout = load_plugin(
            pipeline.rollout.plugin.python_func,
            base_dir=base,
            kinds=(PluginKind.SINGLE_ROLLOUT, PluginKind.GROUP_ROLLOUT),
            envs=pipeline.rollout.plugin.envs,
            where="custom_rl_pipeline.rollout.plugin",
        )
        self.graders = Graders(
            [
                (
                    load_plugin(
                        grader.plugin.python_func,
                        base_dir=base,
                        kinds=(PluginKind.SINGLE_GRADER, PluginKind.GROUP_GRADER),
                        envs=grader.plugin.envs,
                        where=f"custom_rl_pipeline.graders[{index}].plugin",
                    ),
                    grader.weight,
                )
                for index, grader in enumerate(pipeline.graders)
            ]
        )
        records: list[dict[str, Any]] = []
        for path in job.dataset_files():
            records += [sample.model_dump(mode="json", exclude_none=True) for sample in load_samples(path)]
        if not records:
            raise ValueError("the training set has no samples")
        self.records = records
        runtime = self.rollout.spec.runtime
        self._rollout_limit = asyncio.Semaphore(runtime.max_concurrency)
        self._http: aiohttp.ClientSession | None = None
        self.progress: JobProgress | None = None

    # -- the proxy's admin API --------------------------------------------------------------

    async def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        assert self._http is not None
        headers = {"Authorization": f"Bearer {self._admin_key}"}
        async with self._http.post(self._proxy_url + path, json=body, headers=headers) as answer:
            payload = await answer.json(content_type=None)
            if answer.status >= 400:
                raise RuntimeError(f"proxy answered {path} with {answer.status}: {payload}")
            return payload

    def _sample(self, record: dict[str, Any]) -> ChatCompletionSample:
        hyper = self.job.hyperparameters
        settings = {
            "max_new_tokens": hyper.max_new_tokens,
            "temperature": hyper.temperature,
            "top_p": hyper.top_p,
            "top_k": hyper.top_k,
        }
        return ChatCompletionSample.model_validate({**record, **settings, "n": 1})

    def _context(self, step: int) -> PluginContext:
        model = (self.job.model_reference or {}).get("foundation_model") or {}
        return PluginContext(
            model_customization_job_id=self.job_id,
            foundation_model_name=model.get("name", ""),
            foundation_model_version=str(model.get("model_version", "")),
            customization_type=self.job.customization_type,
            phase="train",
            current_training_step=step,
        )

    async def _open_session(
        self, sample: ChatCompletionSample, context: PluginContext, n_sample: int | None
    ) -> RolloutInferenceProxy:
        body = session_body(
            sample,
            n_sample=n_sample,
            context=context.model_dump(),
            concurrency={"key": self.job_id, "max_requests": self.rollout.spec.runtime.request_concurrency},
        )
        created = await self._post("/v1/sessions", body)
        return RolloutInferenceProxy(created["base_url"], created["api_key"], sample=sample)

    async def _finish(self, proxy: RolloutInferenceProxy, attempt: Attempt) -> list[Trajectory]:
        body: dict[str, Any] = {"status": attempt.status.value, "error": attempt.error}
        result = attempt.result
        if result is not None:
            body["config"] = result.config
            if self.rollout.spec.kind is PluginKind.GROUP_ROLLOUT:
                body["responses"] = (
                    [r.model_dump() for r in result.responses] if attempt.status is PluginStatus.SUCCESS else []
                )
            else:
                body["extra"] = result.extra
        finished = await self._post(f"/v1/sessions/{proxy.session_id}/finish", body)
        return [Trajectory.model_validate(t) for t in finished["trajectories"]]

    # -- status semantics --------------------------------------------------------------------

    async def _with_retries(self, what: str, call) -> Attempt:
        """Run ``call()`` until success; failure 4x fails the job, retry 4x drops the sample."""
        for attempt_number in range(1 + MAX_RETRIES):
            attempt = await call()
            if attempt.status is PluginStatus.SUCCESS:
                return attempt
            assert self.progress is not None
            if attempt.status is PluginStatus.DISCARD:
                log.info("sample_discarded", what=what, error=attempt.error)
                raise SampleDropped(f"{what}: discarded: {attempt.error}")
            self.progress.attempt_failed()
            log.warning(
                "plugin_retry", what=what, status=attempt.status.value, attempt=attempt_number + 1, error=attempt.error
            )
        if attempt.status is PluginStatus.FAILURE:
            raise JobFailed(f"{what} failed {1 + MAX_RETRIES} times; last error: {attempt.error}")
        log.info("sample_discarded", what=what, error=attempt.error, reason="retries exhausted")
        raise SampleDropped(f"{what}: still 'retry' after {MAX_RETRIES} retries: {attempt.error}")

    async def _rollout_once(
        self, sample: ChatCompletionSample, context: PluginContext, n_sample: int | None
    ) -> tuple[Attempt, list[Trajectory]]:
        proxy = await self._open_session(sample, context, n_sample)
        async with self._rollout_limit:
            if n_sample is None:
                attempt = await _attempt(self.rollout, context, proxy, sample)
            else:
                attempt = await _attempt(self.rollout, context, proxy, sample, n_sample)
        return attempt, await self._finish(proxy, attempt)

    async def _trajectories(self, step: int, index: int, sample: ChatCompletionSample) -> list[Trajectory]:
        context = self._context(step)
        generations = self.job.hyperparameters.num_generations
        what = f"step {step} sample {index}: rollout {self.rollout.spec.name}"
        if self.rollout.spec.kind is PluginKind.GROUP_ROLLOUT:
            found: list[Trajectory] = []

            async def group_call() -> Attempt:
                attempt, trajectories = await self._rollout_once(sample, context, generations)
                found[:] = trajectories
                return attempt

            await self._with_retries(what, group_call)
            return found

        async def one(generation: int) -> Trajectory:
            found: list[Trajectory] = []

            async def single_call() -> Attempt:
                attempt, trajectories = await self._rollout_once(sample, context, None)
                found[:] = trajectories
                if attempt.status is PluginStatus.SUCCESS and len(trajectories) != 1:
                    return Attempt(PluginStatus.FAILURE, "the rollout made no model call, so it has no trajectory")
                return attempt

            await self._with_retries(f"{what} generation {generation}", single_call)
            return found[0]

        return await gather_first_error([one(g) for g in range(generations)])

    # -- grading -------------------------------------------------------------------------------

    async def _grade(self, step: int, index: int, sample: ChatCompletionSample, trajectories: list[Trajectory]):
        context = self._context(step)
        per_grader: list[tuple[float, list[float]]] = []
        by_name: dict[str, list[float]] = {}
        metrics: list[dict[str, float]] = []
        group_results: list[tuple[float, GroupGraderResult]] = []
        for grader, weight in self.graders.plugins:
            limit = self.graders.limits.setdefault(
                grader.spec.name, asyncio.Semaphore(grader.spec.runtime.max_concurrency)
            )
            what = f"step {step} sample {index}: grader {grader.spec.name}"

            async def call(*args: Any, grader: Plugin = grader, limit: asyncio.Semaphore = limit) -> Attempt:
                async with limit:
                    return await _attempt(grader, context, sample, *args)

            if grader.spec.kind is PluginKind.GROUP_GRADER:
                result = (await self._with_retries(what, lambda call=call: call(trajectories))).result
                rewards = list(result.rewards)
                group_results.append((weight, result))
                metrics.append({f"{grader.spec.name}/{k}": v for k, v in result.metrics.items()})
            else:
                results = []
                for trajectory in trajectories:
                    results.append((await self._with_retries(what, lambda call=call, t=trajectory: call(t))).result)
                rewards = [r.reward for r in results]
                metrics += [{f"{grader.spec.name}/{k}": v for k, v in r.metrics.items()} for r in results]
            per_grader.append((weight, rewards))
            by_name[grader.spec.name] = rewards
        token_counts = [len(t.total_token_ids or []) for t in trajectories]
        return (
            weighted_rewards(per_grader, len(trajectories)),
            by_name,
            metrics,
            custom_advantages(group_results, token_counts),
        )

    async def _run_sample(self, step: int, index: int, record: dict[str, Any]) -> GradedGroup | None:
        assert self.progress is not None
        group_id = f"{self.job_id}/step-{step}/sample-{index}"
        if await self._feed.published(group_id):
            self.progress.sample_resumed()
            return None
        sample = self._sample(record)
        try:
            trajectories = await self._trajectories(step, index, sample)
            rewards, by_name, metrics, custom = await self._grade(step, index, sample, trajectories)
        except SampleDropped:
            self.progress.sample_dropped()
            return None
        self.progress.sample_done(trajectories, rewards)
        return GradedGroup(step, index, group_id, record, trajectories, rewards, by_name, metrics, custom)

    async def _publish_step(self, step: int, groups: list[GradedGroup]) -> None:
        """Batch rule, advantages, then publish in sample order."""
        customised = [g.custom is not None for g in groups]
        if any(customised) and not all(customised):
            raise JobFailed(
                f"step {step}: {sum(customised)} of {len(groups)} groups carry custom advantages; "
                "a batch must use custom advantages for all of its groups or for none"
            )
        for group in groups:
            kind, advantages = group.custom if group.custom is not None else ("grpo", grpo_advantages(group.rewards))
            entry_id = await self._feed.publish(group.entry(self.job_id, advantages, kind))
            assert self.progress is not None
            self.progress.published(entry_id is not None)

    # -- the job -------------------------------------------------------------------------------

    def batches(self) -> list[list[tuple[int, dict[str, Any]]]]:
        hyper = self.job.hyperparameters
        steps = hyper.num_steps or math.ceil(len(self.records) / hyper.batch_size)
        cursor = 0
        batches = []
        for _ in range(steps):
            batch = []
            for _ in range(hyper.batch_size):
                batch.append((cursor, self.records[cursor % len(self.records)]))
                cursor += 1
            batches.append(batch)
        return batches

    async def run(self) -> JobSummary:
        batches = self.batches()
        self.progress = JobProgress(total=sum(len(b) for b in batches), enabled=self._progress_enabled)
        started = time.monotonic()
        step_metrics: dict[int, dict[str, dict[str, float]]] = {}
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as self._http:
            try:
                for step, batch in enumerate(batches):
                    results = await gather_first_error(
                        [self._run_sample(step, index, record) for index, record in batch]
                    )
                    groups = [g for g in results if g is not None]
                    await self._publish_step(step, groups)
                    step_metrics[step] = aggregate_metrics(m for g in groups for m in g.metrics)
                    log.info("step_published", step=step, groups=len(groups), metrics=step_metrics[step])
            finally:
                self.progress.close()
            drift, forks = await self._proxy_counters()
        return self.progress.summary(
            job_id=self.job_id,
            steps=len(batches),
            elapsed=time.monotonic() - started,
            drift=drift,
            forks=forks,
            step_metrics=step_metrics,
        )

    async def _proxy_counters(self) -> tuple[int, int]:
        """Prompt drift and forks the proxy counted (from its /metrics)."""
        assert self._http is not None
        async with self._http.get(self._proxy_url + "/metrics") as answer:
            text = await answer.text()
        counts = {"prompt_drift_total": 0.0, "forks_total": 0.0}
        for line in text.splitlines():
            name, _, value = line.rpartition(" ")
            for counter in counts:
                if name.startswith(f"rollout_proxy_{counter}"):
                    counts[counter] += float(value)
        return int(counts["prompt_drift_total"]), int(counts["forks_total"])
