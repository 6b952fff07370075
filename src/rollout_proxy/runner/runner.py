"""Drive a job: steps of samples through rollouts and graders onto the trainer feed.

Samples go in batches of ``batch_size`` (one batch = one step); a step's samples run
together (each rollout plugin within its ``Runtime`` limits), and the step is
published when all its groups are graded. Group ids are stable
(``job/step/sample``), so a resumed job skips what it already published. What a
plugin's status means lives in ``retries``; calling the proxy in ``admin``; rollouts
in ``rollouts``; grading in ``grading``; the feed in ``publish``; waiting for the
trainer's policy version and stale groups (``max_staleness``) in ``staleness``; a harness as the
rollout (started per rollout, its working directory removed once graded) in ``harness``. This module only
orders them and keeps the progress and the summary (with the per-step plot, written
next to a JSONL feed or in ``OUTPUT_DIR/<job id>/``, and the proxy's viewer address).
"""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog

from rollout_proxy.runner.admin import AdminClient
from rollout_proxy.runner.distill import opd_advantages
from rollout_proxy.runner.executor import InProcessExecutor, PluginExecutor
from rollout_proxy.runner.grading import Graders, aggregate_metrics
from rollout_proxy.runner.harness import HarnessRollout
from rollout_proxy.runner.job import JobConfig
from rollout_proxy.runner.plot import PLOT_NAME, write_step_plot
from rollout_proxy.runner.plugins import load_graders, load_rollout
from rollout_proxy.runner.progress import JobProgress, JobSummary
from rollout_proxy.runner.publish import GradedGroup, StepPublisher
from rollout_proxy.runner.retries import JobFailed, SampleDropped, gather_first_error
from rollout_proxy.runner.rollouts import Rollouts
from rollout_proxy.runner.staleness import StalenessGate
from rollout_proxy.sdk.local import load_samples
from rollout_proxy.sdk.transport import ProxyClient, ProxyUnreachable
from rollout_proxy.state.feed import Feed, JsonlFeed

__all__ = ["JobFailed", "JobRunner", "SampleDropped"]

log = structlog.get_logger(__name__)

#: the proxy's trajectory viewer (served by the proxy, admin key)
VIEWER_PATH = "/ui"

Batch = list[tuple[int, dict[str, Any]]]


@dataclass(slots=True)
class RunParts:
    """What one run of a job works with (its proxy connection and progress bar included)."""

    rollouts: Rollouts
    graders: Graders
    publisher: StepPublisher
    progress: JobProgress
    staleness: StalenessGate | None = None  # the job's max_staleness: steps wait for policy versions


class JobRunner:
    """A job file's plugins and samples; ``run()`` takes them through the proxy once."""

    def __init__(
        self,
        job: JobConfig,
        *,
        proxy_url: str,
        admin_key: str,
        feed: Feed,
        job_id: str | None = None,
        progress: bool = True,
        output_dir: str | Path | None = None,
        executor: PluginExecutor | None = None,
    ) -> None:
        self.job = job
        self.executor = executor or InProcessExecutor()  # where plugin calls run: executor.py
        self.job_id = job_id or job.name
        self._proxy_url = proxy_url
        self._admin_key = admin_key
        self._feed = feed
        self._progress_enabled = progress
        self._output_dir = Path(output_dir or job.proxy.output_dir)
        harness = job.custom_rl_pipeline.rollout.harness
        self.harness = HarnessRollout(harness, base_dir=job.base_dir) if harness is not None else None
        self.rollout = self.harness.plugin() if self.harness is not None else load_rollout(job)
        self.graders = load_graders(job)
        self.records = [
            sample.model_dump(mode="json", exclude_none=True)
            for path in job.dataset_files()
            for sample in load_samples(path)
        ]
        if not self.records:
            raise ValueError("the training set has no samples")
        if self.harness is not None:
            self.harness.check_samples(self.records)
        self.progress: JobProgress | None = None

    def batches(self) -> list[Batch]:
        """``num_steps`` batches of ``batch_size`` (index, record), cycling through the records."""
        hyper = self.job.hyperparameters
        steps = hyper.num_steps or math.ceil(len(self.records) / hyper.batch_size)
        indices = range(steps * hyper.batch_size)
        pairs = [(index, self.records[index % len(self.records)]) for index in indices]
        return [pairs[start : start + hyper.batch_size] for start in range(0, len(pairs), hyper.batch_size)]

    def _parts(self, admin: AdminClient, progress: JobProgress) -> RunParts:
        return RunParts(
            rollouts=Rollouts(
                self.rollout,
                admin,
                job_id=self.job_id,
                on_failed_attempt=progress.attempt_failed,
                executor=self.executor,
                topk=self.job.opd.topk if self.job.opd is not None else 0,
                student_topk=self.job.opd.student_topk if self.job.opd is not None else 0,
                client_sampling=self.job.proxy.client_sampling,
                retry=self.job.proxy.retry,
                policy=self.job.proxy.policy,
            ),
            graders=Graders(self.graders, on_failed_attempt=progress.attempt_failed, executor=self.executor),
            publisher=StepPublisher(self._feed, self.job_id, on_published=progress.published),
            progress=progress,
            staleness=(
                StalenessGate(admin, self.job.training_loop, on_wait=progress.waiting, policy=self.job.proxy.policy)
                if self.job.training_loop.max_staleness is not None
                else None
            ),
        )

    async def _run_sample(self, parts: RunParts, step: int, index: int, record: dict[str, Any]) -> GradedGroup | None:
        """Roll out and grade one sample; None if it is dropped or already published."""
        group_id = f"{self.job_id}/step-{step}/sample-{index}"
        if await parts.publisher.published(group_id):
            parts.progress.sample_resumed()
            return None
        sample, context = self.job.sample(record), self.job.plugin_context(self.job_id, step)
        where = f"step {step} sample {index}"
        try:
            what = f"{where}: rollout {self.rollout.spec.name}"
            generations = self.job.hyperparameters.num_generations
            finished = await parts.rollouts.trajectories(what, sample, context, generations)
            trajectories = finished.trajectories
            try:
                grade = await parts.graders.grade_group(where, context, sample, trajectories)
            finally:  # what a harness left for the graders
                if self.harness is not None:
                    await self.harness.release(trajectories)
        except SampleDropped:
            parts.progress.sample_dropped()
            return None
        group = GradedGroup(
            step=step,
            index=index,
            group_id=group_id,
            sample=record,
            trajectories=trajectories,
            rewards=grade.rewards,
            grader_rewards=grade.grader_rewards,
            metrics=grade.metrics,
            custom=grade.custom,
            images=finished.images,
        )
        if self.job.opd is not None:  # the task advantage and the teacher's signal, per token
            group.custom = opd_advantages(trajectories, group.advantages(), self.job.opd)
        parts.progress.sample_done(trajectories, grade.rewards, step=step, advantages=group.advantages()[1])
        return group

    async def _run_step(self, parts: RunParts, step: int, batch: Batch) -> dict[str, dict[str, float]]:
        """A step's samples together, then its groups published; the step's grader metrics."""
        resumed = parts.progress.resumed
        results = await gather_first_error([self._run_sample(parts, step, index, record) for index, record in batch])
        graded = [group for group in results if group is not None]
        groups = graded if parts.staleness is None else await parts.staleness.sort(step, graded)
        await parts.publisher.publish_step(step, groups)
        if parts.staleness is not None:
            parts.staleness.step_done(on_feed=bool(groups) or parts.progress.resumed > resumed)
        metrics = aggregate_metrics(metric for group in graded for metric in group.metrics)
        log.info("step_published", step=step, groups=len(groups), metrics=metrics)
        return metrics

    async def run(self) -> JobSummary:
        """Every step in order; the summary, with the drift and forks the proxy counted."""
        batches = self.batches()
        self.progress = progress = JobProgress(total=sum(len(b) for b in batches), enabled=self._progress_enabled)
        started = time.monotonic()
        step_metrics: dict[int, dict[str, dict[str, float]]] = {}
        async with AdminClient(self._proxy_url, self._admin_key) as admin:
            parts = self._parts(admin, progress)
            try:
                if self.job.lora is not None:  # its sessions need the policy's first version (the trainer's)
                    loop = self.job.training_loop
                    progress.waiting(1)
                    await admin.until_lora_published(
                        self.job.lora.policy, within=loop.version_wait, poll=loop.poll_interval
                    )
                    progress.waiting(None)
                if parts.staleness is not None:
                    await parts.staleness.start()
                for step, batch in enumerate(batches):
                    if parts.staleness is not None:
                        await parts.staleness.before_step(step)
                    step_metrics[step] = await self._run_step(parts, step, batch)
            finally:
                progress.close()
                if self.harness is not None:
                    await self.harness.close()
            counters = await admin.counters()
        summary = progress.summary(
            job_id=self.job_id,
            steps=len(batches),
            elapsed=time.monotonic() - started,
            drift=int(counters.get("prompt_drift_total", 0)),
            forks=int(counters.get("forks_total", 0)),
            step_metrics=step_metrics,
        )
        if parts.staleness is not None:
            summary.max_staleness = parts.staleness.max_staleness
            summary.stale_dropped, summary.stale_kept = parts.staleness.stale.dropped, parts.staleness.stale.kept
            summary.version_wait = parts.staleness.waited
        summary.viewer = await viewer_address(self._proxy_url, self._admin_key)
        summary.plot = await self._plot(summary)
        return summary

    def plot_path(self) -> Path:
        """Next to a JSONL feed (the job's output), else ``OUTPUT_DIR/<job id>/``."""
        if isinstance(self._feed, JsonlFeed):
            return self._feed.path.parent / PLOT_NAME
        return (self._output_dir / self.job_id / PLOT_NAME).resolve()

    async def _plot(self, summary: JobSummary) -> str:
        """The per-step plot's path; a plot that cannot be drawn is logged, never a failed job."""
        if not summary.steps_stats:
            return ""
        try:
            path = await asyncio.to_thread(write_step_plot, summary.steps_stats, self.plot_path(), title=self.job_id)
        except Exception as exc:
            log.warning("step_plot_failed", error=repr(exc))
            return ""
        return str(path)


async def viewer_address(proxy_url: str, admin_key: str, *, within: float = 5.0) -> str:
    """``<proxy>/ui`` when the proxy serves its viewer (any answer but 404/405/5xx), else "".

    Asked once, after the job: a proxy that is gone or slow costs at most ``within`` seconds."""
    async with ProxyClient(proxy_url, admin_key, timeout=within) as http:
        try:
            status, _ = await http.asend("GET", VIEWER_PATH)
        except ProxyUnreachable:
            return ""
    return f"{proxy_url.rstrip('/')}{VIEWER_PATH}" if status < 500 and status not in (404, 405) else ""
