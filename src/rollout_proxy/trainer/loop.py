"""The reference trainer's loop: feed → one step → new weights → fleet → acknowledgement.

Per job step it:

1. collects the step's groups from the feed (``TrajectoryConsumer``; ``step_groups`` says how many);
2. trains on them (the ``Learner``, in a thread: the loop keeps serving its connections) and
   builds the mismatch report from the same forward pass;
3. writes the new weights and the optimizer's state (``OUT/weights/v<version>/``, an HF
   checkpoint), then records the step's **intent** in ``OUT/state.json`` (the version it makes,
   its checkpoint, its groups and feed entries, its ``steps.jsonl`` line so far) before it pauses the
   fleet, reloads the weights into every paused vLLM and resumes at the next ``policy_version``
   (``FleetDriver``): the runner, waiting for that version (``max_staleness``), starts its next step;
4. records the step (``OUT/steps.jsonl``, ``OUT/metrics.prom``, ``OUT/steps.png``, then
   ``OUT/state.json`` without the intent), then acknowledges the groups.

A LoRA trainer does the same with its adapter (``OUT/weights/v<version>/``: the adapter vLLM loads and its
optimizer state) and its policy's version: step 3 publishes the adapter as the policy's next version
(``PolicyPublisher``) instead of the pause and reload, and the intent, the restart and the record are the
same with the policy's version for the fleet's.

Exactly once, wherever the trainer is killed (``ResumePoint`` reads what a restart starts from,
``ReferenceTrainer.run`` finishes an intended step first): before its intent is on disk the step
left nothing behind (its groups stay pending in the feed's consumer group and are trained again
from the weights the fleet serves); with an intent and the fleet still at the version it trained at,
the update is made again with the saved checkpoint (the groups are not trained again); with the
fleet at the intent's version the update was made and only the record is written (``steps.jsonl``
gets its line once); after the record the restart acknowledges the step's entries by id. Either
way it goes on from that checkpoint and the optimizer state beside it. torch-free: the learner
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
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from rollout_proxy.trainer.batch import BatchError, Rollout, dropped_counts, rollouts_of, trained_tokens
from rollout_proxy.trainer.consumer import TrajectoryConsumer
from rollout_proxy.trainer.fleet import PolicyPublisher
from rollout_proxy.trainer.mismatch import (
    DEFAULT_THRESHOLD,
    MetricsFile,
    MismatchReport,
    ScoredSequence,
    mismatch_report,
)
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
        """The current weights as a checkpoint the engines can load, with what training resumes from
        (the optimizer's state), all or nothing (blocking)."""
        ...


class Update(Protocol):
    """What putting a step's weights on the fleet did (``FleetUpdate``, ``AdapterPublish``)."""

    @property
    def previous(self) -> int: ...
    @property
    def version(self) -> int: ...
    @property
    def reloaded(self) -> list[str]: ...
    @property
    def paused_s(self) -> float: ...
    def timing(self) -> dict[str, float]: ...
    def problems(self) -> list[str]: ...


class Publisher(Protocol):
    """How a step's weights reach the engines: a full-weight update of the base (``FleetDriver``) or an
    adapter version of a LoRA policy (``PolicyPublisher``)."""

    @property
    def policy(self) -> str: ...
    async def version(self) -> int: ...
    async def update(self, weights: Path | None) -> Update: ...
    async def in_use(self) -> set[int] | None:
        """Versions whose files an engine may still read (None: unknown now)."""
        ...


class ResumeConflict(RuntimeError):
    """state.json and the fleet disagree in a way the trainer cannot settle alone."""


@dataclass
class StepIntent:
    """A step trained and saved whose fleet update may be under way (state.json's write-ahead record)."""

    step: int
    trained_version: int  # the fleet's version it trained at
    version: int  # the version its update makes
    weights: str  # its checkpoint, the optimizer's state beside the weights
    group_ids: list[str]
    entry_ids: list[str]  # its feed entries (acknowledged by id once it is recorded)
    record: dict[str, Any]  # its steps.jsonl line as far as it is known before the fleet update


@dataclass
class TrainerState:
    """state.json: the last step recorded (the version its update made, its checkpoint, its groups and feed
    entries) and the step whose fleet update is under way (``intent``), if any."""

    version: int
    weights: str | None = None
    step: int | None = None
    group_ids: list[str] = field(default_factory=list)
    entry_ids: list[str] = field(default_factory=list)
    intent: StepIntent | None = None

    @classmethod
    def load(cls, path: Path) -> TrainerState | None:
        try:
            fields = json.loads(path.read_text())
        except FileNotFoundError:
            return None
        intent = fields.pop("intent", None)
        return cls(**fields, intent=StepIntent(**intent) if intent is not None else None)

    def save(self, path: Path) -> None:
        """Written beside ``path`` and renamed over it: a reader (a restart) sees the old state or the new one."""
        staging = path.with_suffix(".tmp")
        staging.write_text(json.dumps(asdict(self), indent=2))
        os.replace(staging, path)


def weights_dir(out_dir: Path, version: int) -> Path:
    return out_dir / WEIGHTS / f"v{version:06d}"


def has_checkpoint(directory: Path | str) -> bool:
    """A whole model's checkpoint or an adapter's (a LoRA trainer's)."""
    return (Path(directory) / "config.json").is_file() or (Path(directory) / "adapter_config.json").is_file()


@dataclass(frozen=True)
class ResumePoint:
    """Where a (re)started trainer begins: the fleet's version, state.json, and the checkpoint of its own
    to load (None: none of its own matches the fleet; start from the one it was given)."""

    version: int
    state: TrainerState | None
    weights: Path | None

    @classmethod
    async def read(cls, fleet: Publisher, out_dir: Path) -> ResumePoint:
        version = await fleet.version()
        state = await asyncio.to_thread(TrainerState.load, out_dir / STATE)
        return cls(version, state, resume_weights(state, version, out_dir))

    @property
    def finishing(self) -> StepIntent | None:
        """The intended step this start finishes (its update made again, or only recorded)."""
        return self.state.intent if self.state is not None else None


def resume_weights(state: TrainerState | None, fleet_version: int, out_dir: Path) -> Path | None:
    """The checkpoint to start from: an intended step's (its update under way or made: its groups are trained
    in it), else the trainer's own checkpoint of the fleet's version; None when it has none.

    ResumeConflict when an intent's update may or may not have reached the fleet (the fleet is at neither its
    version nor the one it trained at: someone else moved it), or its checkpoint is gone."""
    intent = state.intent if state is not None else None
    if intent is not None:
        if fleet_version not in (intent.trained_version, intent.version):
            raise ResumeConflict(
                f"state.json has step {intent.step}'s update from version {intent.trained_version} to "
                f"{intent.version} under way, but the fleet is at version {fleet_version}: someone else moved it, "
                f"so whether this update reached the engines is unknown. Put the fleet back at one of those "
                f"versions, or move {out_dir / STATE} away to start over from --model (the step's groups, still "
                f"pending on the feed, are then trained again)"
            )
        if not has_checkpoint(intent.weights):
            raise ResumeConflict(
                f"state.json has step {intent.step}'s update to version {intent.version} under way, but its "
                f"checkpoint {intent.weights} is gone"
            )
        return Path(intent.weights)
    if state is not None and state.version == fleet_version and state.weights and has_checkpoint(state.weights):
        return Path(state.weights)
    own = weights_dir(out_dir, fleet_version)
    return own if has_checkpoint(own) else None


async def publish_untrained(learner: Learner, publisher: PolicyPublisher, out_dir: Path) -> int:
    """A LoRA policy's first version: the learner's adapter before any step (B = 0: it samples as the base),
    saved as ``OUT/weights/v000001`` and registered with the proxy; the policy's version. A trainer killed in
    between saves it again at its restart (the policy still has no version) or trains on from it (it has)."""
    first = weights_dir(out_dir, 1)
    await asyncio.to_thread(learner.save, first)
    return (await publisher.update(first)).version


def say(message: str) -> None:
    print(f"[trainer] {message}", file=sys.stderr, flush=True)


class ReferenceTrainer:
    def __init__(
        self,
        learner: Learner,
        feed: TrajectoryConsumer,
        fleet: Publisher,
        out_dir: Path,
        *,
        version: int,
        threshold: float = DEFAULT_THRESHOLD,
        keep_weights: int = 2,
        state: TrainerState | None = None,
        log: Callable[[str], None] = say,
    ) -> None:
        """``version``: the fleet's policy version now. The learner's weights are the ones it serves, or,
        where ``state`` has an intent, that intent's checkpoint (``ResumePoint``)."""
        self.learner = learner
        self.feed = feed
        self.fleet = fleet
        self.out_dir = out_dir
        self.version = version
        self.threshold = threshold
        self.keep_weights = max(keep_weights, 1)
        self.log = log
        self.records: list[dict[str, Any]] = []
        #: the last step recorded (the intent of a step under way is written over it, then replaces it)
        self.state = replace(state) if state is not None else TrainerState(version)
        #: the groups the last update trained on (from state.json): acknowledged again, not retrained
        self._done = set(state.group_ids) if state is not None and state.version <= version else set()
        self._metrics = MetricsFile(out_dir / METRICS)
        self._since = time.monotonic()
        self._restarted = state is not None

    async def run(self, steps: int | None = None) -> list[dict[str, Any]]:
        """Train until ``steps`` steps are recorded (None: until the feed ends, or forever); a step that a
        restart finishes (``state.intent``) comes first and counts."""
        if self._restarted:
            self._restarted = False
            await self._resume()
        if steps is not None and len(self.records) >= steps:
            return self.records
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

    async def _resume(self) -> None:
        """After a restart: finish the step state.json intended (its update made again when the fleet is still
        at the version it trained at, else only recorded), or acknowledge the last recorded step's entries."""
        intent = self.state.intent
        if intent is None:
            for entry_id in self.state.entry_ids:  # a kill between the record and the acknowledgement
                await self.feed.ack(entry_id)
            return
        if self.version == intent.trained_version:
            self.log(
                f"step {intent.step}: trained before the restart, its update to version {intent.version} not made: "
                f"updating the fleet with {intent.weights}"
            )
            started = time.monotonic()
            update = await self.fleet.update(Path(intent.weights))
            await self._record(intent, update, started, restarted=True)
        elif self.version == intent.version:
            self.log(
                f"step {intent.step}: trained and put on the fleet (version {intent.version}) before the restart: "
                "recording it"
            )
            await self._record(intent, None, time.monotonic(), restarted=True)
        else:
            raise ResumeConflict(
                f"step {intent.step}'s update to version {intent.version} is under way but the fleet is at "
                f"{self.version}"
            )

    async def train_step(self, step: int, entries: list[FeedEntry]) -> dict[str, Any]:
        entries = sorted(entries, key=lambda e: e.group.sample_index)
        groups = [entry.group for entry in entries]
        waited = time.monotonic() - self._since
        # a LoRA trainer trains its policy's own samples only: a sequence another policy sampled is refused
        policy = None if self.fleet.policy == "base" else self.fleet.policy
        rollouts = [rollout for group in groups for rollout in rollouts_of(group, policy=policy)]
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
        group_ids = [g.group_id for g in groups]
        record: dict[str, Any] = {
            "step": step,
            "time": time.time(),
            "trained_version": self.version,
            "version": self.version + 1,
            "groups": len(groups),
            "group_ids": group_ids,
            "stale_groups": sum(g.stale for g in groups),
            "rollouts": len(rollouts),
            "sequences": sum(len(r.sequences) for r in rollouts),
            "trained_tokens": trained_tokens(rollouts),
            **dropped_counts(rollouts),  # the retries the export dropped: in no sequence
            "reward": _spread(rewards),
            "mismatch": report.as_dict(),
            "metrics": result.metrics,
            "policy": self.fleet.policy,
            "weights": str(target),
            "engines_reloaded": [],
            "timing": {"wait_s": waited, "train_s": trained_at - started, "save_s": saved_at - trained_at},
        }
        intent = StepIntent(
            step=step,
            trained_version=self.version,
            version=self.version + 1,
            weights=str(target),
            group_ids=group_ids,
            entry_ids=[entry.id for entry in entries],
            record=record,
        )
        await asyncio.to_thread(self._save_state, replace(self.state, intent=intent))  # before the fleet moves
        update = await self.fleet.update(target)
        record = await self._record(intent, update, started, report)
        current = report.current
        self.log(
            f"step {step}: mismatch on version {intent.trained_version}: max |Δ| {current.max_abs:.3g}, mean "
            f"{current.mean_abs:.3g}, k3 {current.k3:.3g} over {current.tokens} token(s), {current.over} over "
            f"{self.threshold:g}; {report.other_version.tokens} token(s) of other versions; loss "
            f"{result.metrics.get('loss', float('nan')):.4f}; trained in {trained_at - started:.1f}s, fleet at "
            f"version {self.version} after {update.paused_s:.1f}s paused"
        )
        return record

    async def _record(
        self,
        intent: StepIntent,
        update: Update | None,
        started: float,
        report: MismatchReport | None = None,
        *,
        restarted: bool = False,
    ) -> dict[str, Any]:
        """The step's line, metrics and plot, then state.json without the intent, then the acknowledgements.
        ``update``: None when a restart found it made (its timings are then unknown: null); ``restarted``: a
        restart finishes the step (its line may be written already)."""
        record = {**intent.record, "timing": dict(intent.record["timing"])}
        timing = record["timing"]
        if update is not None:
            if update.version != intent.version:
                self.log(
                    f"the fleet was at version {update.previous}, not {intent.trained_version}: someone else moved it"
                )
            for problem in update.problems():
                self.log(problem)
            record["version"], record["engines_reloaded"] = update.version, update.reloaded
            timing.update(update.timing())
        else:
            record["engines_reloaded"] = None
            timing.update(dict.fromkeys(_update_timings(self.fleet), None))
        timing["step_s"] = time.monotonic() - started if update is not None else None
        if restarted:
            record["finished_after_restart"] = True
        self.version = record["version"]
        if report is None:
            report = MismatchReport.from_dict(record["mismatch"])
        await asyncio.to_thread(self._write, record, report, restarted)
        committed = TrainerState(self.version, intent.weights, intent.step, intent.group_ids, intent.entry_ids)
        await asyncio.to_thread(self._save_state, committed)
        for entry_id in intent.entry_ids:
            await self.feed.ack(entry_id)
        self._done = set(intent.group_ids)
        self.records.append(record)
        await self._prune()
        self._since = time.monotonic()
        return record

    def _save_state(self, state: TrainerState) -> None:
        self.out_dir.mkdir(parents=True, exist_ok=True)
        state.save(self.out_dir / STATE)
        self.state = state

    def _write(self, record: dict[str, Any], report: MismatchReport, restarted: bool) -> None:
        """``restarted``: the step's line may be there already (a kill between it and state.json), or cut
        short (a kill inside the write): written once, whole."""
        self.out_dir.mkdir(parents=True, exist_ok=True)
        log_path = self.out_dir / STEP_LOG
        if not restarted or not _logged(log_path, record):
            with log_path.open("a") as log:
                log.write(json.dumps(record) + "\n")
        numbers = {f"reward_{k}": v for k, v in record["reward"].items()}
        numbers.update({k: float(v) for k, v in record["metrics"].items()})
        self._metrics.write(record["step"], self.version, report, numbers)
        try:
            write_training_plot([*self.records, record], self.out_dir / PLOT_NAME)
        except Exception as exc:  # a plot that cannot be drawn never stops training
            self.log(f"could not draw {PLOT_NAME}: {exc!r}")

    async def _prune(self) -> None:
        """Keep the newest ``keep_weights`` checkpoints (each with its optimizer state), never the one the fleet
        serves nor, for a LoRA policy, one an engine still has loaded or a call still uses (none at all while
        that is unknown); remove what a save killed half-way left (its staging directory)."""
        in_use = await self.fleet.in_use()
        if in_use is None:
            self.log("which adapter versions the engines still use is unknown now: none deleted this step")
            return
        await asyncio.to_thread(self._prune_files, in_use)

    def _prune_files(self, in_use: set[int]) -> None:
        root = self.out_dir / WEIGHTS
        if not root.is_dir():
            return
        for staging in root.glob(".v*"):
            shutil.rmtree(staging, ignore_errors=True)
        kept = sorted((p for p in root.iterdir() if p.is_dir() and p.name.startswith("v")), reverse=True)
        served = Path(self.state.weights) if self.state.weights else None  # the last step recorded made it
        for old in kept[self.keep_weights :]:
            if served is not None and old.resolve() == served.resolve():
                continue
            if old.name[1:].isdigit() and int(old.name[1:]) in in_use:
                continue
            shutil.rmtree(old, ignore_errors=True)


def _update_timings(fleet: Publisher) -> tuple[str, ...]:
    """The timing fields of a step's update (null in a step a restart found made)."""
    if isinstance(fleet, PolicyPublisher):
        return ("pause_s", "publish_s", "resume_s")
    return ("pause_s", "reload_s", "resume_s")


def _logged(log_path: Path, record: dict[str, Any]) -> bool:
    """Whether the step log's last line is ``record``'s step (same step, groups and weights); a last line cut
    short by a kill is removed."""
    try:
        text = log_path.read_bytes()
    except FileNotFoundError:
        return False
    if text and not text.endswith(b"\n"):
        whole = text.rfind(b"\n") + 1
        with log_path.open("r+b") as log:
            log.truncate(whole)
        text = text[:whole]
    lines = text.splitlines()
    if not lines:
        return False
    last = json.loads(lines[-1])
    return all(last.get(key) == record[key] for key in ("step", "group_ids", "weights"))


def _spread(values: np.ndarray) -> dict[str, float]:
    if not len(values):
        return {"mean": float("nan"), "std": float("nan"), "min": float("nan"), "max": float("nan")}
    return {
        "mean": float(values.mean()),
        "std": float(values.std()),
        "min": float(values.min()),
        "max": float(values.max()),
    }
