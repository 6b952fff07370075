"""The rollout runner: a job file in, graded groups on the trainer feed out.

rollout-proxy run JOB.yaml                  # or, from Python:
summary = await run_job(JobConfig.load("JOB.yaml"))
rollout-proxy run JOB.yaml --ray HOST:PORT  # plugin calls as Ray tasks (or ``ray:`` in the job file)

A job's rollout is a plugin or a harness the runner starts per rollout (Codex CLI, Claude Code,
mini-swe-agent, any command: ``runner.harness``).
"""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import Sequence
from pathlib import Path

from rollout_proxy.runner.executor import PluginExecutor, open_executor, with_ray_address
from rollout_proxy.runner.harness import HarnessRollout
from rollout_proxy.runner.job import JobConfig, JobError
from rollout_proxy.runner.progress import JobSummary
from rollout_proxy.runner.retries import JobFailed
from rollout_proxy.runner.runner import JobRunner
from rollout_proxy.settings import DEFAULT_ENGINE, Settings
from rollout_proxy.state.feed import open_feed

__all__ = ["JobConfig", "JobError", "JobFailed", "JobRunner", "JobSummary", "run_job"]

EMBEDDED_VIEWER_NOTE = (
    "served while the job ran; this in-process proxy stops with it. To browse afterwards, run the job against "
    "`rollout-proxy serve` with --proxy-url, or the demo with ./scripts/demo.sh --keep-running"
)


def default_feed(job: JobConfig, output_dir: str | Path | None) -> str:
    return f"jsonl:{Path(output_dir or job.proxy.output_dir).resolve() / job.name / 'feed.jsonl'}"


async def run_job(
    job: JobConfig,
    *,
    proxy_url: str | None = None,
    admin_key: str | None = None,
    engines: Sequence[str] | None = None,
    store: str | None = None,
    feed: str | None = None,
    output_dir: str | Path | None = None,
    job_id: str | None = None,
    progress: bool = True,
    ray: str | None = None,
) -> JobSummary:
    """Run ``job`` through ``proxy_url``, or through a proxy started here (its own thread).

    With ``ray`` (an address; or the job's ``ray`` section) plugin calls run as Ray tasks."""
    job = with_ray_address(job, ray)
    if job.custom_rl_pipeline.rollout.harness is not None:  # its program is there, before anything starts
        HarnessRollout(job.custom_rl_pipeline.rollout.harness, base_dir=job.base_dir)
    if proxy_url is None and job.training_loop.max_staleness is not None:
        raise JobError(
            "training_loop.max_staleness waits for a trainer to resume the fleet with new policy versions, and "
            "no trainer can reach a proxy started in-process: run the job against one with --proxy-url and "
            "--admin-key (docs/training-loop.md)"
        )
    if proxy_url is None and job.lora is not None:
        raise JobError(
            "customization_type: GRPOLoRA samples with the adapter its trainer publishes on the proxy, and no "
            "trainer can reach a proxy started in-process: run the job against one with --proxy-url and "
            "--admin-key, engines started with LoRA (docs/policies.md)"
        )
    feed_url = feed or job.proxy.feed or default_feed(job, output_dir)
    runner_feed = await open_feed(feed_url, stream=job.proxy.feed_stream)
    embedded = None
    executor: PluginExecutor | None = None
    try:
        executor = await open_executor(job)
        if proxy_url is None:
            from rollout_proxy.app import create_app
            from rollout_proxy.embedded import BackgroundServer

            admin_key = secrets.token_urlsafe(24)
            settings = Settings(
                engines=tuple(engines or job.proxy.engines or (DEFAULT_ENGINE,)),
                store=store or job.proxy.store,
                admin_key=admin_key,
                tool_parser=job.proxy.tool_parser,
                reasoning_parser=job.proxy.reasoning_parser,
                feed=feed_url,
                feed_stream=job.proxy.feed_stream,
                teachers=";".join(f"{name}={','.join(t.engines)}" for name, t in job.proxy.teachers.items()),
                teacher_templates=";".join(
                    f"{name}={t.chat_template}" for name, t in job.proxy.teachers.items() if t.chat_template
                ),
            )
            embedded = BackgroundServer(lambda: create_app(settings))
            proxy_url = await asyncio.to_thread(embedded.start)
        elif not admin_key:
            raise ValueError("an external proxy needs its admin key")
        runner = JobRunner(
            job,
            proxy_url=proxy_url,
            admin_key=admin_key,
            feed=runner_feed,
            job_id=job_id,
            progress=progress,
            output_dir=output_dir,
            executor=executor,
        )
        summary = await runner.run()
        summary.feed = feed_url
        if embedded is not None and summary.viewer:
            summary.viewer_note = EMBEDDED_VIEWER_NOTE
        return summary
    finally:
        if executor is not None:
            await executor.aclose()
        await runner_feed.close()
        if embedded is not None:
            await asyncio.to_thread(embedded.stop)
