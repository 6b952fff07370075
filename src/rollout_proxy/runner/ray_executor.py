"""Plugin calls as Ray tasks: a job's rollouts and grading spread over a Ray cluster.

One task per plugin call (a rollout attempt, a grader call). The runner is the Ray
driver and keeps everything else: it opens and finishes the sessions, decides
retries and publishes the steps, exactly as in-process. What crosses to a worker is
the plugin's ``module:function`` and its arguments (the session's URL and token in
place of the proxy object); what comes back is the call's ``Attempt``.

The plugin's ``Runtime``, across the cluster:

- ``max_concurrency``: the driver holds the plugin's limit from submitting a task until
  the task has ended; one driver submits all of a job's tasks, so at most that many
  calls of a plugin run at once anywhere.
- ``timeout``: counted on the worker from the call's start (waiting for a free CPU is
  not the plugin's time), and answered there as in-process. A worker whose call's threads
  still run ``END_GRACE`` after its answer (a sync plugin past its timeout: no thread can
  be stopped) says so (``LINGERING``), and the driver kills it (``ray.cancel(force=True)``)
  before the slot is given back, so on Ray a timed-out call really stops. The worker
  measures that grace itself: a loaded machine that is slow to report a task's end
  does not get a healthy worker killed (which could be running the next task by then).
  A worker that does not answer within the timeout and ``ANSWER_GRACE`` (its event loop
  blocked), or does not end within ``END_WAIT`` of its answer, is killed the same way.
- cancellation (a sibling call failed the job, or dropped its sample): a task seen to start is
  killed; one not yet seen to start is cancelled without force (a forced cancel of a queued task
  kills the worker it was pushed to, and the call that worker is finishing: a crashed-worker
  failure of another sample), and killed only if it still runs ``ANSWER_GRACE`` later. Either
  way its ``max_concurrency`` slot is given back once the task is gone, not at the cancel.
- retries stay the runner's: Ray's own are off (``max_retries=0``: a call must not run
  twice in one session); a worker or node lost mid-call is a ``failure`` of that
  attempt, retried in a new session like any other.

The task is a streaming generator: it yields when it starts, then the outcome, and
ends when the call's threads are done (or yields ``LINGERING`` first, when they are not soon).
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import sys
import threading
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray
import structlog
from ray.exceptions import RayError

import rollout_proxy
from rollout_proxy.runner.job import JobConfig, JobError, PluginRef, RaySection
from rollout_proxy.runner.plugins import load_graders, load_plugin, load_rollout
from rollout_proxy.sdk.decorators import Plugin, PluginKind
from rollout_proxy.sdk.execution import Attempt, attempt
from rollout_proxy.sdk.proxy import RolloutInferenceProxy
from rollout_proxy.sdk.types import ChatCompletionSample, PluginStatus

log = structlog.get_logger(__name__)

STARTED = "started"
#: what a worker yields when its call's threads still run ``END_GRACE`` after its answer: kill me
LINGERING = "lingering"
#: seconds past a plugin's timeout before a worker that has not answered is killed
ANSWER_GRACE = 5.0
#: seconds, on the worker, its call's threads may run after its answer (normally milliseconds)
END_GRACE = 3.0
#: seconds the driver waits for a task to end (or say ``LINGERING``) after its answer before killing it
END_WAIT = 60.0
#: seconds to wait for a killed task to be gone before its concurrency slot is given back anyway
KILL_WAIT = 30.0


@dataclass(frozen=True, slots=True)
class SessionHandle:
    """The plugin's session as it travels to a worker, which rebuilds its ``RolloutInferenceProxy``."""

    url: str
    token: str
    sample: ChatCompletionSample | None

    @classmethod
    def of(cls, proxy: RolloutInferenceProxy) -> SessionHandle:
        return cls(proxy.url, proxy.jwt_token, proxy.sample)

    def proxy(self) -> RolloutInferenceProxy:
        return RolloutInferenceProxy(self.url, self.token, sample=self.sample)


# -- on the worker ----------------------------------------------------------------------------


def run_plugin_call(python_func: str, base_dir: str, args: tuple[Any, ...]) -> Iterator[Any]:
    """The Ray task: yields ``STARTED``, then the call's ``Attempt``; ends once the call's threads have,
    or yields ``LINGERING`` when they still run ``END_GRACE`` later (the driver then kills this worker)."""
    yield STARTED
    loop = asyncio.new_event_loop()
    threads = ThreadPoolExecutor(thread_name_prefix="plugin")  # where a sync plugin runs
    loop.set_default_executor(threads)
    try:
        yield loop.run_until_complete(_call(python_func, base_dir, args))
        # a sync plugin that timed out still runs in its thread: wait for it a while, then say so
        joiner = threading.Thread(target=threads.shutdown, daemon=True)
        joiner.start()
        joiner.join(END_GRACE)
        if joiner.is_alive():
            yield LINGERING
            joiner.join()
    finally:
        loop.close()


async def _call(python_func: str, base_dir: str, args: tuple[Any, ...]) -> Attempt:
    """``sdk.execution.attempt`` on the worker, with the session's proxy rebuilt and closed after."""
    try:
        plugin = load_plugin(
            python_func, base_dir=Path(base_dir), kinds=tuple(PluginKind), envs={}, where="ray worker: plugin"
        )
    except Exception as exc:  # JobError, or the module's own import-time error
        host = socket.gethostname()
        return Attempt(PluginStatus.FAILURE, f"cannot load {python_func} on Ray worker {host}: {exc}")
    proxies = {index: arg.proxy() for index, arg in enumerate(args) if isinstance(arg, SessionHandle)}
    try:
        return await attempt(plugin, *(proxies.get(index, arg) for index, arg in enumerate(args)))
    finally:
        for proxy in proxies.values():
            await proxy.aclose()


# -- in the driver ----------------------------------------------------------------------------


def import_roots(module_names: Sequence[str]) -> list[str]:
    """The ``sys.path`` entries these (imported) modules were found under, e.g. ``/repo`` for ``tests.plugins``."""
    roots = []
    for name in module_names:
        file = getattr(sys.modules.get(name), "__file__", None)
        if not file:
            continue
        depth = name.count(".") + (1 if Path(file).name == "__init__.py" else 0)
        roots.append(str(Path(file).resolve().parents[depth]))
    return roots


def worker_runtime_env(
    job: JobConfig, plugins: Sequence[tuple[Plugin, PluginRef]], user: Mapping[str, Any]
) -> dict[str, Any]:
    """The job's ``runtime_env`` plus what makes the plugins import and behave as in the driver.

    ``PYTHONPATH`` gets the job's directory, the directories the driver imported each
    plugin (and this package) from, then any ``PYTHONPATH`` the job's ``runtime_env``
    sets; ``env_vars`` get each plugin's ``envs`` (as in-process, where they go into the
    runner's environment)."""
    modules = [name for plugin, ref in plugins for name in (ref.python_func.partition(":")[0], plugin.__module__)]
    paths = [
        str(job.base_dir.resolve()),
        *import_roots(modules),
        str(Path(rollout_proxy.__file__).resolve().parents[1]),
    ]
    env_vars = {str(k): str(v) for k, v in (user.get("env_vars") or {}).items()}
    for _, ref in plugins:
        env_vars.update(ref.envs)
    if env_vars.get("PYTHONPATH"):
        paths.append(env_vars["PYTHONPATH"])
    env_vars["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    return {**user, "env_vars": env_vars}


def head_endpoint(address: str) -> tuple[str, int] | None:
    """(host, port) to probe for ``HOST:PORT`` or ``ray://HOST:PORT``; None for ``auto`` (Ray's own lookup)."""
    if address == "auto":
        return None
    host, _, port = address.removeprefix("ray://").rpartition(":")
    if not host or not port.isdigit():
        raise JobError(f"ray.address {address!r}: expected 'auto', HOST:PORT or ray://HOST:PORT")
    return host, int(port)


def connect(section: RaySection) -> None:
    """Join the cluster (blocking; run in a thread). Probes the head first: Ray itself retries for minutes."""
    endpoint = head_endpoint(section.address)
    if endpoint is not None:
        try:
            socket.create_connection(endpoint, timeout=section.connect_timeout).close()
        except OSError as exc:
            raise JobError(f"ray.address {section.address}: cannot reach the Ray head: {exc}") from None
    try:
        ray.init(address=section.address, logging_level=logging.WARNING, log_to_driver=True)
    except (ConnectionError, RuntimeError, ValueError) as exc:
        raise JobError(f"ray.address {section.address}: cannot join the Ray cluster: {exc}") from None


def check_resources(section: RaySection) -> None:
    """A call that no node can hold would wait forever: refuse the job instead."""
    cpus = [float(node.get("Resources", {}).get("CPU", 0.0)) for node in ray.nodes() if node.get("Alive")]
    if section.num_cpus > max(cpus, default=0.0):
        raise JobError(
            f"ray.num_cpus {section.num_cpus:g}: no node of the cluster has that many CPUs "
            f"(alive nodes' CPUs: {', '.join(f'{c:g}' for c in cpus) or 'none'})"
        )


async def _next(task: Any) -> Any:
    """The task's next yielded value (raises StopAsyncIteration once it has ended, RayError if it failed)."""
    ref = await task.__anext__()
    return await ref


class RayExecutor:
    """Plugin calls as Ray tasks of a cluster this process has joined (``open``) or already belonged to."""

    def __init__(
        self,
        section: RaySection,
        *,
        base_dir: Path,
        python_funcs: Mapping[int, str],
        runtime_env: dict[str, Any],
        owns_connection: bool,
    ) -> None:
        self.section = section
        self.runtime_env = runtime_env
        self._base_dir = str(base_dir)
        self._python_funcs = dict(python_funcs)
        self._owns_connection = owns_connection
        self._stopping: set[asyncio.Task[None]] = set()  # cancelled calls' tasks, until each is gone
        self._remote = ray.remote(run_plugin_call).options(
            num_returns="streaming",
            num_cpus=section.num_cpus,
            max_retries=0,
            scheduling_strategy=section.scheduling_strategy,
            runtime_env=runtime_env,
        )

    @classmethod
    async def open(cls, job: JobConfig) -> RayExecutor:
        """Join ``job.ray.address`` (unless this process is already a Ray driver) and check the cluster."""
        section = job.ray
        if section is None:
            raise ValueError("the job has no ray section")
        pipeline = job.custom_rl_pipeline
        if pipeline.rollout.plugin is None:  # job.py refuses a harness with a ray section
            raise JobError("ray: a harness rollout runs in the runner's process")
        plugins = [
            (load_rollout(job), pipeline.rollout.plugin),
            *((grader, spec.plugin) for (grader, _), spec in zip(load_graders(job), pipeline.graders, strict=True)),
        ]
        owns_connection = not ray.is_initialized()
        if owns_connection:
            await asyncio.to_thread(connect, section)
        try:
            await asyncio.to_thread(check_resources, section)
        except BaseException:
            if owns_connection:
                await asyncio.to_thread(ray.shutdown)
            raise
        log.info("ray_joined", address=section.address, owns_connection=owns_connection)
        return cls(
            section,
            base_dir=job.base_dir,
            python_funcs={id(plugin): ref.python_func for plugin, ref in plugins},
            runtime_env=worker_runtime_env(job, plugins, section.runtime_env),
            owns_connection=owns_connection,
        )

    async def attempt(self, plugin: Plugin, *args: Any, limit: asyncio.Semaphore | None = None) -> Attempt:
        """One call of ``plugin`` as a Ray task; ``limit`` is held until the task has ended."""
        python_func = self._python_funcs.get(id(plugin))
        if python_func is None:
            raise ValueError(f"{plugin!r} is not one of the job's plugins")
        payload = tuple(SessionHandle.of(arg) if isinstance(arg, RolloutInferenceProxy) else arg for arg in args)
        if limit is not None:
            await limit.acquire()
        try:
            task = self._remote.remote(python_func, self._base_dir, payload)
        except BaseException:  # not submitted (its arguments would not serialize): nothing holds the slot
            if limit is not None:
                limit.release()
            raise
        started = False
        try:
            await _next(task)  # started on a worker: the plugin's time starts now
            started = True
            return await self._outcome(task, python_func, plugin.spec.runtime.timeout)
        except RayError as exc:
            message = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            log.warning("ray_task_failed", plugin=python_func, error=type(exc).__name__, message=message)
            return Attempt(PluginStatus.FAILURE, f"the Ray task failed: {type(exc).__name__}: {message}")
        except StopAsyncIteration:  # ended without an answer (not something run_plugin_call does)
            return Attempt(PluginStatus.FAILURE, "the Ray task ended without an answer")
        except BaseException:  # cancelled (a sibling call failed the job, or dropped the sample): the task stops too
            self._stop_cancelled(task, python_func, started=started, limit=limit)
            limit = None  # given back once the task is gone, not now
            raise
        finally:
            if limit is not None:
                limit.release()

    async def _outcome(self, task: Any, python_func: str, plugin_timeout: int | None) -> Attempt:
        """The started task's ``Attempt``; a task that does not answer in time, or does not end after its
        answer, is killed first (its worker runs nothing else: it is still in this task)."""
        try:
            deadline = None if plugin_timeout is None else plugin_timeout + ANSWER_GRACE
            outcome: Attempt = await asyncio.wait_for(_next(task), deadline)
        except TimeoutError:
            await self._kill(task, python_func, "no answer")
            return Attempt(PluginStatus.FAILURE, f"timed out after {plugin_timeout}s")
        if not await self._ended(task, END_WAIT):  # False at once when the worker says LINGERING
            await self._kill(task, python_func, "still running after its answer")
        return outcome

    def _stop_cancelled(self, task: Any, python_func: str, *, started: bool, limit: asyncio.Semaphore | None) -> None:
        """Stop a cancelled call's task, and give its concurrency slot back once the task is gone.

        A task not seen to start is cancelled without force: a forced cancel of a task still queued
        kills the worker it was pushed to, which may be finishing another call (ray#30760), and that
        call would fail as a crashed worker. Only if it is still there ``ANSWER_GRACE`` later (it was
        running after all, in a thread no interrupt stops) is it killed."""
        ray.cancel(task, force=started)

        async def release_when_gone() -> None:
            try:
                if not started and not await self._drained(task, ANSWER_GRACE):
                    await self._kill(task, python_func, "cancelled, still running")
                elif started and not await self._drained(task, KILL_WAIT):
                    log.warning("ray_task_kill_unconfirmed", plugin=python_func, waited=KILL_WAIT)
            finally:
                if limit is not None:
                    limit.release()

        stopping = asyncio.get_running_loop().create_task(release_when_gone())
        self._stopping.add(stopping)
        stopping.add_done_callback(self._stopping.discard)

    @staticmethod
    async def _drained(task: Any, within: float) -> bool:
        """Whether the task ends (or fails) within ``within`` seconds, whatever it still yields meanwhile."""
        try:
            async with asyncio.timeout(within):
                while True:
                    await _next(task)
        except (StopAsyncIteration, RayError):
            return True
        except TimeoutError:
            return False

    async def _ended(self, task: Any, within: float) -> bool:
        """Whether the task ends within ``within`` seconds (an error is an end too)."""
        try:
            await asyncio.wait_for(_next(task), within)
        except StopAsyncIteration:
            return True
        except TimeoutError:
            return False
        except RayError:
            return True
        return False  # it yielded LINGERING (or more than it should): still running

    async def _kill(self, task: Any, python_func: str, why: str) -> None:
        log.warning("ray_task_killed", plugin=python_func, reason=why)
        ray.cancel(task, force=True)
        if not await self._drained(task, KILL_WAIT):
            log.warning("ray_task_kill_unconfirmed", plugin=python_func, waited=KILL_WAIT)

    async def aclose(self) -> None:
        """Wait for cancelled calls' tasks to be gone, then leave the cluster if ``open`` joined it
        (the cluster itself keeps running)."""
        if self._stopping:
            await asyncio.gather(*self._stopping, return_exceptions=True)
        if self._owns_connection and ray.is_initialized():
            await asyncio.to_thread(ray.shutdown)
