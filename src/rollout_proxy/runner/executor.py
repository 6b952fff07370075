"""Where a job's plugin calls run: in this process, or as Ray tasks on a cluster.

The runner decides *what* to call and what a status means (retries, drops,
publishing); an executor only makes one call of a plugin and answers with its
``Attempt``, within the plugin's ``Runtime`` (``timeout``; ``max_concurrency``
through the ``limit`` the caller holds per plugin). Both executors take the same
arguments and give the same answers, so the rest of the runner does not know
which one it has::

    executor = await open_executor(job)        # InProcessExecutor, or RayExecutor with job.ray
    outcome = await executor.attempt(plugin, context, proxy, sample, limit=limit)
    await executor.aclose()
"""

from __future__ import annotations

import asyncio
from typing import Any, Protocol

from rollout_proxy.runner.job import JobConfig, JobError, RaySection
from rollout_proxy.sdk.decorators import Plugin, PluginKind
from rollout_proxy.sdk.execution import Attempt, attempt
from rollout_proxy.sdk.proxy import RolloutInferenceProxy
from rollout_proxy.sdk.types import ChatCompletionSample, PluginContext


class PluginExecutor(Protocol):
    """Makes one call of a plugin; never raises for what the plugin did (that is the ``Attempt``)."""

    async def attempt(self, plugin: Plugin, *args: Any, limit: asyncio.Semaphore | None = None) -> Attempt: ...

    async def aclose(self) -> None: ...


def rollout_arguments(
    rollout: Plugin,
    context: PluginContext,
    proxy: RolloutInferenceProxy,
    sample: ChatCompletionSample,
    n_sample: int,
) -> tuple[Any, ...]:
    """A rollout's arguments by its kind (as ``sdk.execution.attempt_rollout``): ``n_sample`` goes to a group rollout only."""
    if rollout.spec.kind is PluginKind.GROUP_ROLLOUT:
        return (context, proxy, sample, n_sample)
    return (context, proxy, sample)


class InProcessExecutor:
    """Plugin calls on this process's event loop (sync plugins in its thread pool): ``sdk.execution.attempt``."""

    async def attempt(self, plugin: Plugin, *args: Any, limit: asyncio.Semaphore | None = None) -> Attempt:
        return await attempt(plugin, *args, limit=limit)

    async def aclose(self) -> None:
        return None


def with_ray_address(job: JobConfig, address: str | None) -> JobConfig:
    """``job`` with ``ray.address`` set to ``address`` (``--ray``), its other Ray settings kept; as is without one."""
    if not address:
        return job
    section = job.ray.model_copy(update={"address": address}) if job.ray else RaySection(address=address)
    return job.model_copy(update={"ray": section})


async def open_executor(job: JobConfig) -> PluginExecutor:
    """The executor the job asks for: Ray tasks with a ``ray`` section, else this process."""
    if job.ray is None:
        return InProcessExecutor()
    try:
        from rollout_proxy.runner.ray_executor import RayExecutor
    except ModuleNotFoundError as exc:
        if (exc.name or "").partition(".")[0] != "ray":
            raise
        raise JobError("ray.address is set but Ray is not installed: pip install 'rollout-proxy[ray]'") from None
    return await RayExecutor.open(job)
