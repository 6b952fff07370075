"""The reference trainer's loop: feed → one step → new weights → fleet → acknowledgement.

Per job step it:

1. collects the step's groups from the feed (``TrajectoryConsumer``; ``step_groups`` says how many);
2. trains on them (the ``Learner``, in a thread: the loop keeps serving its connections) and
   builds the mismatch report from the same forward pass;
3. writes the new weights (``OUT/weights/v<version>/``, an HF checkpoint), then pauses the fleet,
   reloads them into every paused vLLM and resumes at the next ``policy_version``
   (``FleetDriver``): the runner, waiting for that version (``max_staleness``), starts its next step;
4. records the step (``OUT/steps.jsonl``, ``OUT/metrics.prom``, ``OUT/steps.png``,
   ``OUT/state.json``), then acknowledges the groups.

A trainer killed anywhere before 4 gets the step's groups again (they stay pending in the
feed's consumer group: redelivered to the same consumer name, claimed by another after
``claim_idle_ms``). ``state.json`` names the groups of the last step trained and the weights of
the version it made, so a trainer restarted after its resume acknowledges those groups without
training on them twice, and starts from the weights the fleet serves. torch-free: the learner
brings it.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from rollout_proxy.trainer.batch import BatchError, Rollout, dropped_counts, rollouts_of, trained_tokens
from rollout_proxy.trainer.consumer import TrajectoryConsumer
from rollout_proxy.trainer.fleet import FleetDriver
from rollout_proxy.trainer.mismatch import DEFAULT_THRESHOLD, MetricsFile, ScoredSequence, mismatch_report
from rollout_proxy.trainer.plot import PLOT_NAME, write_training_plot
from rollout_proxy.wire.feed import FeedEntry

STEP_LOG = "steps.jsonl"
METRICS = "metrics.prom"
STATE = "state.json"
WEIGHTS = "weights"


@dataclass
class LearnerStep:
    """What a learner's step gives back: every trained token scored (before the update), and its metrics."""

    scored: list[ScoredSequence]
    metrics: dict[str, float]


class Learner(Protocol):
    def train_step(self, rollouts: Sequence[Rollout]) -> LearnerStep:
        """One update on these rollouts (blocking)."""
        ...

    def save(self, directory: Path) -> None:
        """The current weights as a checkpoint the engines can load (blocking)."""
        ...


@dataclass
class TrainerState:
    """What a restarted trainer needs: the version its last update made, its weights, the groups it trained on."""

    version: int
    weights: str | None = None
    step: int | None = None
    group_ids: list[str] = field(default_factory=list)

    @classmethod
    def load(cls, path: Path) -> TrainerState | None:
        try:
            return cls(**json.loads(path.read_text()))
        except FileNotFoundError:
            return None

    def save(self, path: Path) -> None:
        staging = path.with_suffix(".tmp")
        staging.write_text(json.dumps(asdict(self), indent=2))
        os.replace(staging, path)


def weights_dir(out_dir: Path, version: int) -> Path:
    return out_dir / WEIGHTS / f"v{version:06d}"


def say(message: str) -> None:
    print(f"[trainer] {message}", file=sys.stderr, flush=True)


class ReferenceTrainer:
    def __init__(
        self,
        learner: Learner,
        feed: TrajectoryConsumer,
        fleet: FleetDriver,
        out_dir: Path,
        *,
        version: int,
        threshold: float = DEFAULT_THRESHOLD,
        keep_weights: int = 2,
        state: TrainerState | None = None,
        log: Callable[[str], None] = say,
    ) -> None:
        """``version``: the policy version the learner's weights are served at now (the fleet's)."""
        self.learner = learner
        self.feed = feed
        self.fleet = fleet
        self.out_dir = out_dir
        self.version = version
        self.threshold = threshold
        self.keep_weights = max(keep_weights, 1)
        self.log = log
        self.records: list[dict[str, Any]] = []
        #: the groups the last update trained on (from state.json): acknowledged again, not retrained
        self._done = set(state.group_ids) if state is not None and state.version <= version else set()
        self._metrics = MetricsFile(out_dir / METRICS)
        self._since = time.monotonic()

    async def run(self, steps: int | None = None) -> list[dict[str, Any]]:
        """Train until ``steps`` updates are made (None: until the feed ends, or forever)."""
        pending: dict[int, dict[str, FeedEntry]] = defaultdict(dict)  # by entry id: a redelivery is one entry
        async for entry in self.feed:
            group = entry.group
            if group.group_id in self._done:
                self.log(f"{group.group_id}: trained on before the restart, acknowledged")
                await self.feed.ack(entry)
                continue
            if group.step_groups is None:
                raise BatchError(
                    f"{group.group_id}: no step_groups (how many groups its step has); publish with a runner that sets it"
                )
            waiting = pending[group.step]
            waiting[entry.id] = entry
            if len(waiting) >= group.step_groups:
                await self.train_step(group.step, list(pending.pop(group.step).values()))
                if steps is not None and len(self.records) >= steps:
                    break
        return self.records

    async def train_step(self, step: int, entries: list[FeedEntry]) -> dict[str, Any]:
        entries = sorted(entries, key=lambda e: e.group.sample_index)
        groups = [entry.group for entry in entries]
        waited = time.monotonic() - self._since
        rollouts = [rollout for group in groups for rollout in rollouts_of(group)]
        rewards = np.asarray([r.reward for r in rollouts], dtype=np.float64)
        self.log(
            f"step {step}: {len(groups)} group(s), {len(rollouts)} rollouts of {sum(len(r.sequences) for r in rollouts)} "
            f"sequences, {trained_tokens(rollouts)} trained "
            f"tokens, mean reward {rewards.mean() if len(rewards) else float('nan'):.4f}; training at version "
            f"{self.version}"
        )
        started = time.monotonic()
        result = await asyncio.to_thread(self.learner.train_step, rollouts)
        trained_at = time.monotonic()
        report = mismatch_report(result.scored, trainer_version=self.version, threshold=self.threshold)
        target = weights_dir(self.out_dir, self.version + 1)
        await asyncio.to_thread(self.learner.save, target)
        saved_at = time.monotonic()
        update = await self.fleet.update(target)
        if update.version != self.version + 1:
            self.log(f"the fleet was at version {update.previous}, not {self.version}: someone else moved it")
        if update.paused_failed:
            self.log(f"{len(update.paused_failed)} engine(s) did not pause (left out until re-admitted)")
        trained_version, self.version = self.version, update.version
        TrainerState(self.version, str(target), step, [g.group_id for g in groups]).save(self.out_dir / STATE)
        record = {
            "step": step,
            "time": time.time(),
            "trained_version": trained_version,
            "version": self.version,
            "groups": len(groups),
            "group_ids": [g.group_id for g in groups],
            "stale_groups": sum(g.stale for g in groups),
            "rollouts": len(rollouts),
            "sequences": sum(len(r.sequences) for r in rollouts),
            "trained_tokens": trained_tokens(rollouts),
            **dropped_counts(rollouts),  # the retries the export dropped: in no sequence
            "reward": _spread(rewards),
            "mismatch": report.as_dict(),
            "metrics": result.metrics,
            "weights": str(target),
            "engines_reloaded": update.reloaded,
            "timing": {
                "wait_s": waited,
                "train_s": trained_at - started,
                "save_s": saved_at - trained_at,
                "pause_s": update.pause_s,
                "reload_s": update.reload_s,
                "resume_s": update.resume_s,
                "step_s": time.monotonic() - started,
            },
        }
        await asyncio.to_thread(self._write, record, report)
        for entry in entries:
            await self.feed.ack(entry)
        self._done = {g.group_id for g in groups}
        self.records.append(record)
        await asyncio.to_thread(self._prune)
        current = report.current
        self.log(
            f"step {step}: mismatch on version {trained_version}: max |Δ| {current.max_abs:.3g}, mean "
            f"{current.mean_abs:.3g}, k3 {current.k3:.3g} over {current.tokens} token(s), {current.over} over "
            f"{self.threshold:g}; {report.other_version.tokens} token(s) of other versions; loss "
            f"{result.metrics.get('loss', float('nan')):.4f}; trained in {trained_at - started:.1f}s, fleet at "
            f"version {self.version} after {update.paused_s:.1f}s paused"
        )
        self._since = time.monotonic()
        return record

    def _write(self, record: dict[str, Any], report: Any) -> None:
        self.out_dir.mkdir(parents=True, exist_ok=True)
        with (self.out_dir / STEP_LOG).open("a") as log:
            log.write(json.dumps(record) + "\n")
        numbers = {f"reward_{k}": v for k, v in record["reward"].items()}
        numbers.update({k: float(v) for k, v in record["metrics"].items()})
        self._metrics.write(record["step"], self.version, report, numbers)
        try:
            write_training_plot([*self.records, record], self.out_dir / PLOT_NAME)
        except Exception as exc:  # a plot that cannot be drawn never stops training
            self.log(f"could not draw {PLOT_NAME}: {exc!r}")

    def _prune(self) -> None:
        """Keep the newest ``keep_weights`` checkpoints (the one the fleet serves among them)."""
        root = self.out_dir / WEIGHTS
        if not root.is_dir():
            return
        kept = sorted((p for p in root.iterdir() if p.is_dir() and p.name.startswith("v")), reverse=True)
        for old in kept[self.keep_weights :]:
            shutil.rmtree(old, ignore_errors=True)


def _spread(values: np.ndarray) -> dict[str, float]:
    if not len(values):
        return {"mean": float("nan"), "std": float("nan"), "min": float("nan"), "max": float("nan")}
    return {
        "mean": float(values.mean()),
        "std": float(values.std()),
        "min": float(values.min()),
        "max": float(values.max()),
    }
