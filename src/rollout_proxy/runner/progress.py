"""What a running job shows: a live bar, then a summary (and, per step, the numbers a plot shows)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
from tqdm.auto import tqdm

from rollout_proxy.sdk.types import Trajectory
from rollout_proxy.state.connection import shown_url

#: an advantage this close to 0 carries no learning signal (GRPO's rewards were all equal)
SIGNAL_EPSILON = 1e-9


@dataclass
class StepStats:
    """One step's rewards, tokens and advantages: a row of the summary's table and a point of the plot."""

    step: int
    trajectories: int = 0
    tokens: int = 0
    trained_tokens: int = 0
    rewards: list[float] = field(default_factory=list)
    groups: int = 0
    groups_with_signal: int = 0
    abs_advantages: list[float] = field(default_factory=list)

    @property
    def reward_mean(self) -> float:
        return float(np.mean(self.rewards)) if self.rewards else 0.0

    @property
    def reward_min(self) -> float:
        return float(np.min(self.rewards)) if self.rewards else 0.0

    @property
    def reward_max(self) -> float:
        return float(np.max(self.rewards)) if self.rewards else 0.0

    @property
    def reward_std(self) -> float:
        return float(np.std(self.rewards)) if self.rewards else 0.0

    def to_json(self) -> dict[str, Any]:
        row = {k: v for k, v in asdict(self).items() if k not in ("rewards", "abs_advantages")}
        row.update(
            reward_mean=self.reward_mean,
            reward_min=self.reward_min,
            reward_max=self.reward_max,
            reward_std=self.reward_std,
            mean_abs_advantage=float(np.mean(self.abs_advantages)) if self.abs_advantages else 0.0,
        )
        return row


def _abs_advantage(advantage: Any) -> float:
    """|advantage| of one trajectory: a sequence-level value, or the mean over a token-level row."""
    if isinstance(advantage, Sequence):
        return float(np.mean(np.abs(np.asarray(advantage, dtype=np.float64)))) if len(advantage) else 0.0
    return abs(float(advantage))


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
    reward_min: float = 0.0
    reward_max: float = 0.0
    reward_std: float = 0.0
    groups_graded: int = 0
    #: groups whose advantages are not all zero (GRPO: rewards differed within the group)
    groups_with_signal: int = 0
    mean_abs_advantage: float = 0.0
    steps_stats: list[StepStats] = field(default_factory=list)
    plot: str = ""
    #: the proxy's trajectory viewer, when the proxy the job used serves one
    viewer: str = ""
    #: said next to the viewer's address when that proxy is gone with the job
    viewer_note: str = ""
    #: the job's training_loop.max_staleness (None: steps did not wait for policy versions)
    max_staleness: int | None = None
    stale_dropped: int = 0  # groups not published: older than max_staleness allows
    stale_kept: int = 0  # groups published with stale=true (stale_groups: keep)
    version_wait: float = 0.0  # seconds steps waited for the fleet's policy version

    def render(self) -> str:
        lines = [
            f"job {self.job_id}: {self.steps} step(s) in {self.elapsed:.1f}s",
            f"  samples       {self.samples_done} graded, {self.samples_dropped} dropped, {self.samples_resumed} already published, "
            f"{self.failed_attempts} failed attempt(s) retried",
            f"  trajectories  {self.trajectories} ({self.turns} turns), {self.groups_published} group(s) published",
            f"  tokens        {self.tokens} total, {self.trained_tokens} trained (loss weight 1)",
            f"  mean logprob  {self.mean_logprob:.4f} per trained token",
            f"  mean reward   {self.mean_reward:.4f} (min {self.reward_min:.4f}, max {self.reward_max:.4f}, "
            f"std {self.reward_std:.4f})",
            f"  advantages    {self.groups_with_signal} of {self.groups_graded} group(s) with rewards that differ "
            f"(non-zero advantages), mean |advantage| {self.mean_abs_advantage:.4f}",
            f"  drift         {self.drift} prompt(s) differing from the recorded tokens, {self.forks} fork(s)",
        ]
        if self.max_staleness is not None:
            lines.append(
                f"  staleness     max {self.max_staleness} version(s): {self.stale_dropped} stale group(s) dropped, "
                f"{self.stale_kept} kept (marked stale), {self.version_wait:.1f}s waiting for policy versions"
            )
        if len(self.steps_stats) > 1:
            lines += [f"  step {s.step:<8} {_step_line(s)}" for s in self.steps_stats]
        if self.feed:
            lines.append(f"  feed          {shown_url(self.feed)}")  # a Redis feed's password masked
        if self.plot:
            lines.append(f"  plot          {self.plot}")
        if self.viewer:
            lines.append(f"  viewer        {self.viewer}" + (f" ({self.viewer_note})" if self.viewer_note else ""))
        return "\n".join(lines)

    def to_json(self) -> dict[str, Any]:
        data = dict(self.__dict__)
        data["steps_stats"] = [stats.to_json() for stats in self.steps_stats]
        return data


def _step_line(stats: StepStats) -> str:
    return (
        f"reward {stats.reward_mean:.4f} (min {stats.reward_min:.4f}, max {stats.reward_max:.4f}, "
        f"std {stats.reward_std:.4f}), {stats.tokens} tokens, {stats.trained_tokens} trained, "
        f"{stats.groups_with_signal}/{stats.groups} group(s) with signal"
    )


class JobProgress:
    """Counters behind the bar: done / dropped, tokens per second, mean reward."""

    def __init__(self, *, total: int, enabled: bool = True) -> None:
        self._bar = tqdm(total=total, desc="samples", unit="sample", disable=not enabled, dynamic_ncols=True)
        self._started = time.monotonic()
        self.done = self.dropped = self.resumed = self.failed_attempts = self.groups = 0
        self.trajectories = self.turns = self.tokens = self.trained = 0
        self._logprob_sum = 0.0
        self._rewards: list[float] = []
        self._steps: dict[int, StepStats] = {}

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

    def sample_done(
        self,
        trajectories: list[Trajectory],
        rewards: list[float],
        *,
        step: int = 0,
        advantages: Sequence[Any] = (),
    ) -> None:
        """A graded group: its trajectories, rewards and (per trajectory) advantages, counted in its step."""
        self.done += 1
        stats = self._steps.setdefault(step, StepStats(step))
        for trajectory in trajectories:
            weights = trajectory.loss_weight()
            self.trajectories += 1
            self.turns += trajectory.turns or 0
            self.tokens += len(weights)
            self.trained += int(weights.sum())
            self._logprob_sum += float(np.dot(trajectory.token_logprobs(), weights)) if len(weights) else 0.0
            stats.trajectories += 1
            stats.tokens += len(weights)
            stats.trained_tokens += int(weights.sum())
        self._rewards += rewards
        stats.rewards += rewards
        magnitudes = [_abs_advantage(advantage) for advantage in advantages]
        stats.groups += 1
        stats.groups_with_signal += int(any(m > SIGNAL_EPSILON for m in magnitudes))
        stats.abs_advantages += magnitudes
        self._bar.update(1)
        self._refresh()

    def steps(self) -> list[StepStats]:
        return [self._steps[step] for step in sorted(self._steps)]

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

    def waiting(self, version: int | None) -> None:
        """The bar says which policy version the next step waits for (None: it stopped waiting)."""
        self._bar.set_description("samples" if version is None else f"waiting for policy version {version}")

    def close(self) -> None:
        self._bar.close()

    def summary(self, *, job_id: str, steps: int, elapsed: float, drift: int, forks: int, step_metrics) -> JobSummary:
        stats = self.steps()
        rewards = np.asarray(self._rewards, dtype=np.float64)
        magnitudes = [m for s in stats for m in s.abs_advantages]
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
            reward_min=float(rewards.min()) if rewards.size else 0.0,
            reward_max=float(rewards.max()) if rewards.size else 0.0,
            reward_std=float(rewards.std()) if rewards.size else 0.0,
            groups_graded=sum(s.groups for s in stats),
            groups_with_signal=sum(s.groups_with_signal for s in stats),
            mean_abs_advantage=float(np.mean(magnitudes)) if magnitudes else 0.0,
            steps_stats=stats,
        )
