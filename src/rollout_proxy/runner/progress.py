"""What a running job shows: a live bar, then a summary."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from tqdm.auto import tqdm

from rollout_proxy.sdk.types import Trajectory


@dataclass
class JobSummary:
    job_id: str
    steps: int
    samples_done: int
    samples_dropped: int
    samples_resumed: int
    failed_attempts: int
    groups_published: int
    trajectories: int
    turns: int
    tokens: int
    trained_tokens: int
    mean_logprob: float
    mean_reward: float
    drift: int
    forks: int
    elapsed: float
    step_metrics: dict[int, dict[str, dict[str, float]]] = field(default_factory=dict)
    feed: str = ""

    def render(self) -> str:
        lines = [
            f"job {self.job_id}: {self.steps} step(s) in {self.elapsed:.1f}s",
            f"  samples       {self.samples_done} graded, {self.samples_dropped} dropped, {self.samples_resumed} already published, "
            f"{self.failed_attempts} failed attempt(s) retried",
            f"  trajectories  {self.trajectories} ({self.turns} turns), {self.groups_published} group(s) published",
            f"  tokens        {self.tokens} total, {self.trained_tokens} trained (loss weight 1)",
            f"  mean logprob  {self.mean_logprob:.4f} per trained token",
            f"  mean reward   {self.mean_reward:.4f}",
            f"  drift         {self.drift} prompt(s) differing from the recorded tokens, {self.forks} fork(s)",
        ]
        if self.feed:
            lines.append(f"  feed          {self.feed}")
        return "\n".join(lines)

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__)


class JobProgress:
    """Counters behind the bar: done / dropped, tokens per second, mean reward."""

    def __init__(self, *, total: int, enabled: bool = True) -> None:
        self._bar = tqdm(total=total, desc="samples", unit="sample", disable=not enabled, dynamic_ncols=True)
        self._started = time.monotonic()
        self.done = self.dropped = self.resumed = self.failed_attempts = self.groups = 0
        self.trajectories = self.turns = self.tokens = self.trained = 0
        self._logprob_sum = 0.0
        self._rewards: list[float] = []

    def _refresh(self) -> None:
        elapsed = max(time.monotonic() - self._started, 1e-9)
        postfix = {
            "done": self.done,
            "dropped": self.dropped,
            "failed": self.failed_attempts,
            "tok/s": f"{self.trained / elapsed:.1f}",
        }
        if self._rewards:
            postfix["reward"] = f"{sum(self._rewards) / len(self._rewards):.3f}"
        self._bar.set_postfix(postfix)

    def sample_done(self, trajectories: list[Trajectory], rewards: list[float]) -> None:
        self.done += 1
        for trajectory in trajectories:
            weights = trajectory.loss_weight()
            self.trajectories += 1
            self.turns += trajectory.turns or 0
            self.tokens += len(weights)
            self.trained += int(weights.sum())
            self._logprob_sum += float(np.dot(trajectory.token_logprobs(), weights)) if len(weights) else 0.0
        self._rewards += rewards
        self._bar.update(1)
        self._refresh()

    def sample_dropped(self) -> None:
        self.dropped += 1
        self._bar.update(1)
        self._refresh()

    def sample_resumed(self) -> None:
        self.resumed += 1
        self._bar.update(1)

    def attempt_failed(self) -> None:
        self.failed_attempts += 1
        self._refresh()

    def published(self, new: bool) -> None:
        self.groups += int(new)

    def close(self) -> None:
        self._bar.close()

    def summary(self, *, job_id: str, steps: int, elapsed: float, drift: int, forks: int, step_metrics) -> JobSummary:
        return JobSummary(
            job_id=job_id,
            steps=steps,
            samples_done=self.done,
            samples_dropped=self.dropped,
            samples_resumed=self.resumed,
            failed_attempts=self.failed_attempts,
            groups_published=self.groups,
            trajectories=self.trajectories,
            turns=self.turns,
            tokens=self.tokens,
            trained_tokens=self.trained,
            mean_logprob=self._logprob_sum / self.trained if self.trained else 0.0,
            mean_reward=sum(self._rewards) / len(self._rewards) if self._rewards else 0.0,
            drift=drift,
            forks=forks,
            elapsed=elapsed,
            step_metrics=step_metrics,
        )
