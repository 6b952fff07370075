"""A job's rollouts: each call in its own proxy session, under the seed's retries.

Per sample, a group rollout is called once for the whole group (``n_sample =
num_generations``), a single rollout once per generation (the generations run
together). Every call opens a session, runs the plugin within its
``Runtime.max_concurrency``, finishes the session with the plugin's result, whatever
its status, so the proxy frees it, and closes the clients the plugin opened; a
successful call's trajectories are those the proxy emits at finish.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Awaitable, Callable
from typing import Any

from rollout_proxy.runner.admin import AdminClient, Finished
from rollout_proxy.runner.distill import TeacherUnavailable, distill
from rollout_proxy.runner.executor import InProcessExecutor, PluginExecutor, rollout_arguments
from rollout_proxy.runner.retries import gather_first_error, with_retries
from rollout_proxy.sdk.decorators import Plugin, PluginKind
from rollout_proxy.sdk.execution import Attempt
from rollout_proxy.sdk.types import ChatCompletionSample, PluginContext, PluginStatus
from rollout_proxy.wire.generation import BASE_POLICY


def _no_op() -> None:
    return None


class Rollouts:
    """The job's rollout plugin, run through the proxy with retries."""

    def __init__(
        self,
        plugin: Plugin,
        admin: AdminClient,
        *,
        job_id: str,
        on_failed_attempt: Callable[[], None] = _no_op,
        executor: PluginExecutor | None = None,
        topk: int = 0,
        student_topk: int = 0,
        client_sampling: str = "refuse",
        retry: str = "drop",
        policy: str = BASE_POLICY,
    ) -> None:
        """``topk``: the teacher's top-k recorded per trained token by a teacher pass (``runner.distill``);
        ``student_topk``: the policy's own top-k recorded at sampling (OPD ``topk_type: student``);
        ``client_sampling``: the sessions' setting for the generation parameters a harness sends; ``policy``: the
        policy the sessions sample with (the base, or a LoRA policy registered on the proxy)."""
        runtime = plugin.spec.runtime
        self._client_sampling = client_sampling
        self._retry = retry
        self._policy = policy
        self._topk = topk
        self._student_topk = student_topk
        self.plugin = plugin
        self._admin = admin
        self._executor = executor or InProcessExecutor()
        self._on_failed_attempt = on_failed_attempt
        self._limit = asyncio.Semaphore(runtime.max_concurrency)
        self._concurrency = {"key": job_id, "max_requests": runtime.request_concurrency}

    @property
    def is_group(self) -> bool:
        return self.plugin.spec.kind is PluginKind.GROUP_ROLLOUT

    async def trajectories(
        self, what: str, sample: ChatCompletionSample, context: PluginContext, generations: int
    ) -> Finished:
        """``generations`` trajectories of ``sample`` and the images they name (raises ``SampleDropped`` /
        ``JobFailed``)."""
        if self.is_group:
            return await self._retried(what, lambda: self._session(sample, context, generations))
        singles = await gather_first_error(
            [self._single(f"{what} generation {generation}", sample, context) for generation in range(generations)]
        )
        return functools.reduce(Finished.extend, singles, Finished([]))

    async def _single(self, what: str, sample: ChatCompletionSample, context: PluginContext) -> Finished:
        async def call() -> Attempt:
            attempt = await self._session(sample, context, 1)
            if attempt.succeeded and len(attempt.result.trajectories) != 1:
                return Attempt(PluginStatus.FAILURE, "the rollout made no model call, so it has no trajectory")
            return attempt

        return await self._retried(what, call)

    async def _retried(self, what: str, call: Callable[[], Awaitable[Attempt]]) -> Finished:
        finished: Finished = (await with_retries(what, call, on_failed_attempt=self._on_failed_attempt)).result
        return finished

    async def _session(self, sample: ChatCompletionSample, context: PluginContext, n_sample: int) -> Attempt:
        """One call in a new session; its ``result`` is what the proxy emitted (``Finished``)."""
        proxy = await self._admin.create_session(
            sample,
            n_sample=n_sample if self.is_group else None,
            context=context.model_dump(),
            concurrency=self._concurrency,
            client_sampling=self._client_sampling,
            retry=self._retry,
            **({"policy": self._policy} if self._policy != BASE_POLICY else {}),  # a base session's body as before
            **(
                {"generation": {**sample.generation(), "top_logprobs": self._student_topk}}
                if self._student_topk
                else {}
            ),
        )
        async with proxy:  # closes the clients the plugin made
            arguments = rollout_arguments(self.plugin, context, proxy, sample, n_sample)
            attempt = await self._executor.attempt(self.plugin, *arguments, limit=self._limit)
            finished = await self._admin.finish(proxy.session_id, self._finish_body(attempt))
        if attempt.succeeded and attempt.result is not None:
            try:  # before grading: the teacher's fields and the critic's view, as config asks
                finished.trajectories = await distill(
                    self._admin, proxy.session_id, finished.trajectories, attempt.result.config, topk=self._topk
                )
            except TeacherUnavailable as exc:
                return Attempt(PluginStatus.FAILURE, str(exc))
        return Attempt(attempt.status, attempt.error, finished)

    def _finish_body(self, attempt: Attempt) -> dict[str, Any]:
        """The session's finish: the status, and what the plugin returned for the trainer."""
        body: dict[str, Any] = {"status": attempt.status.value, "error": attempt.error}
        result = attempt.result
        if result is None:
            return body
        body["config"] = result.config
        if self.is_group:
            body["responses"] = [response.model_dump() for response in result.responses] if attempt.succeeded else []
        else:
            body["extra"] = result.extra
        return body
