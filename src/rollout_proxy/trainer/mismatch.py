"""The mismatch report: the trainer's logprob of every trained token against the engine's.

Per trained token, Δ = trainer logprob − recorded sampling logprob. Over a set of tokens the
report gives max |Δ|, mean |Δ|, the k3 estimate of KL(sampler ‖ trainer) (mean of
``exp(Δ) − 1 − Δ``: unbiased under the sampler's tokens, never negative) and the share of tokens
with |Δ| over a threshold. The tokens are split by the policy version that sampled them; those
whose version is the trainer's (the weights it scores them with) measure the
training–inference mismatch proper, and any other version is counted apart: there Δ includes
the policy's own change (``max_staleness`` > 0, a stale group) and is no mismatch. A token with
no recorded version counts apart too. A wrong token, a loss mask shifted by one or a logprob
recorded under other weights all show up as |Δ| far over the threshold on the trainer's own
version. Tokens of sequences with images are also reported on their own (``with_images``, the trainer's
version only): their inputs were rebuilt from the image bytes, which text tokens do not exercise. numpy only.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from rollout_proxy.trainer.batch import NO_VERSION

#: |Δ| above which a token counts as mismatched (nats); fp32 on the same weights stays far below
DEFAULT_THRESHOLD = 1e-2
#: how many of the worst tokens the report names
WORST = 5


@dataclass(frozen=True, slots=True)
class MismatchStats:
    tokens: int = 0
    max_abs: float = 0.0
    mean_abs: float = 0.0
    k3: float = 0.0  # mean of exp(Δ) - 1 - Δ: the k3 estimate of KL(sampler || trainer)
    over: int = 0  # tokens with |Δ| > threshold
    over_share: float = 0.0

    @classmethod
    def of(cls, delta: np.ndarray, threshold: float) -> MismatchStats:
        if not len(delta):
            return cls()
        delta = delta.astype(np.float64)
        magnitude = np.abs(delta)
        over = int((magnitude > threshold).sum())
        k3 = np.expm1(np.clip(delta, -50.0, 50.0)) - delta
        return cls(
            tokens=len(delta),
            max_abs=float(magnitude.max()),
            mean_abs=float(magnitude.mean()),
            k3=float(k3.mean()),
            over=over,
            over_share=over / len(delta),
        )


@dataclass(frozen=True, slots=True)
class WorstToken:
    """One of the step's largest |Δ|: where it is, and both logprobs."""

    group_id: str
    rollout: int
    sequence: int  # its index within the rollout (``Trajectory.sequences()``: 0 is the main one)
    position: int  # in the sequence's token ids
    token_id: int
    version: int
    trainer: float
    sampler: float
    response_id: str | None = None  # the sequence's leaf, where known
    branch: str | None = None  # where the sequence leaves the tree (``branch.kind``), where known

    @property
    def delta(self) -> float:
        return self.trainer - self.sampler


@dataclass(frozen=True, slots=True)
class ScoredSequence:
    """One sequence's trained tokens as scored: where they are, their versions, both logprobs (aligned arrays)."""

    group_id: str
    rollout: int
    sequence: int
    positions: np.ndarray  # int64
    token_ids: np.ndarray  # int64
    versions: np.ndarray  # int64
    trainer: np.ndarray  # float32: the trainer's logprobs
    sampler: np.ndarray  # float32: the recorded sampling logprobs
    response_id: str | None = None  # the sequence's leaf (``TrainSequence.response_id``)
    branch: str | None = None  # its branch kind (``TrainSequence.branch``)
    images: int = 0  # how many images the sequence holds (``TrainSequence.images``)


@dataclass(frozen=True)
class MismatchReport:
    threshold: float
    #: the version of the weights the trainer scored the tokens with
    trainer_version: int
    #: tokens sampled at ``trainer_version``: the training–inference mismatch
    current: MismatchStats
    #: tokens sampled at any other version (or with none recorded): counted apart
    other_version: MismatchStats
    unversioned: int
    by_version: dict[int, MismatchStats]
    worst: list[WorstToken] = field(default_factory=list)  # on the trainer's version, largest |Δ| first
    #: the ``current`` tokens of sequences with images (their vision inputs rebuilt from the entry's bytes)
    with_images: MismatchStats = field(default_factory=MismatchStats)

    @property
    def tokens(self) -> int:
        return self.current.tokens + self.other_version.tokens

    @property
    def ok(self) -> bool:
        """No token of the trainer's own version over the threshold."""
        return self.current.over == 0

    def as_dict(self) -> dict[str, Any]:
        return {
            "threshold": self.threshold,
            "trainer_version": self.trainer_version,
            "tokens": self.tokens,
            "current": asdict(self.current),
            "other_version": asdict(self.other_version),
            "unversioned": self.unversioned,
            "by_version": {str(version): asdict(stats) for version, stats in sorted(self.by_version.items())},
            "worst": [{**asdict(token), "delta": token.delta} for token in self.worst],
            "with_images": asdict(self.with_images),
        }

    @classmethod
    def from_dict(cls, fields: dict[str, Any]) -> MismatchReport:
        """The report ``as_dict`` gave (a step's line in steps.jsonl, or state.json's intent)."""
        return cls(
            threshold=fields["threshold"],
            trainer_version=fields["trainer_version"],
            current=MismatchStats(**fields["current"]),
            other_version=MismatchStats(**fields["other_version"]),
            unversioned=fields["unversioned"],
            by_version={int(version): MismatchStats(**stats) for version, stats in fields["by_version"].items()},
            worst=[
                WorstToken(**{name: value for name, value in token.items() if name != "delta"})
                for token in fields["worst"]
            ],
            with_images=MismatchStats(**fields.get("with_images", {})),  # absent from reports written before it
        )


def mismatch_report(scored: Iterable[ScoredSequence], *, trainer_version: int, threshold: float) -> MismatchReport:
    """The report over every trained token of a step."""
    parts = list(scored)
    if not math.isfinite(threshold) or threshold < 0:
        raise ValueError(f"the mismatch threshold must be a finite number >= 0, got {threshold}")

    def joined(name: str, dtype: type) -> np.ndarray:
        arrays = [getattr(part, name) for part in parts]
        return np.concatenate(arrays).astype(dtype) if arrays else np.zeros(0, dtype=dtype)

    trainer = joined("trainer", np.float32).astype(np.float64)
    sampler = joined("sampler", np.float32).astype(np.float64)  # both as float32, as recorded and computed
    versions = joined("versions", np.int64)
    imaged = (
        np.concatenate([np.full(len(part.trainer), part.images > 0) for part in parts]) if parts else np.zeros(0, bool)
    )
    delta = trainer - sampler
    current = versions == trainer_version
    by_version = {
        int(version): MismatchStats.of(delta[versions == version], threshold) for version in np.unique(versions)
    }
    return MismatchReport(
        threshold=threshold,
        trainer_version=trainer_version,
        current=MismatchStats.of(delta[current], threshold),
        other_version=MismatchStats.of(delta[~current], threshold),
        unversioned=int((versions == NO_VERSION).sum()),
        by_version=by_version,
        worst=_worst(parts, trainer_version),
        with_images=MismatchStats.of(delta[current & imaged], threshold),
    )


def _worst(parts: Sequence[ScoredSequence], trainer_version: int) -> list[WorstToken]:
    candidates = []
    for part in parts:
        delta = np.abs(part.trainer.astype(np.float64) - part.sampler.astype(np.float64))
        delta[part.versions != trainer_version] = -1.0
        for index in np.argsort(-delta, kind="stable")[:WORST]:
            if delta[index] < 0:
                break
            candidates.append(
                (
                    float(delta[index]),
                    WorstToken(
                        part.group_id,
                        part.rollout,
                        part.sequence,
                        int(part.positions[index]),
                        int(part.token_ids[index]),
                        int(part.versions[index]),
                        float(part.trainer[index]),
                        float(part.sampler[index]),
                        part.response_id,
                        part.branch,
                    ),
                )
            )
    candidates.sort(key=lambda item: -item[0])
    return [token for _, token in candidates[:WORST]]


class MetricsFile:
    """The trainer's numbers in Prometheus' text format, rewritten after every step (atomically: a
    node-exporter textfile collector, or anything that scrapes a file, reads a whole one).

    Gauges describe the latest step; ``*_total`` counters add up over the trainer's life."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._totals: dict[str, float] = {}

    def write(self, step: int, version: int, report: MismatchReport, metrics: dict[str, float]) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, write_to_textfile

        registry = CollectorRegistry(auto_describe=True)
        fields = (  # metric suffix, MismatchStats field, help
            ("max_abs", "max_abs", "max |trainer logprob - sampling logprob| over the latest step's trained tokens"),
            ("mean_abs", "mean_abs", "mean |trainer logprob - sampling logprob| over the latest step's trained tokens"),
            ("k3", "k3", "k3 estimate of KL(sampler || trainer) per trained token, the latest step"),
            (
                "over_threshold_ratio",
                "over_share",
                "share of the latest step's trained tokens with |delta| > threshold",
            ),
            ("tokens", "tokens", "trained tokens in the latest step"),
        )
        for suffix, attribute, help_text in fields:
            gauge = Gauge(f"rollout_trainer_mismatch_{suffix}", help_text, ["version", "kind"], registry=registry)
            for sampled_by, stats in sorted(report.by_version.items()):
                kind = "current" if sampled_by == report.trainer_version else "other_version"
                gauge.labels(version=str(sampled_by), kind=kind).set(getattr(stats, attribute))
        Gauge("rollout_trainer_mismatch_threshold", "the |delta| threshold in nats", registry=registry).set(
            report.threshold
        )
        Gauge("rollout_trainer_step", "the job step trained on last", registry=registry).set(step)
        Gauge("rollout_trainer_policy_version", "the version the fleet was resumed at", registry=registry).set(version)
        for name, value in sorted(metrics.items()):
            if math.isfinite(value):
                Gauge(f"rollout_trainer_{name}", f"the latest step's {name}", registry=registry).set(value)
        for name, add in (
            ("trained_tokens", report.tokens),
            ("mismatched_tokens", report.current.over),
            ("other_version_tokens", report.other_version.tokens),
            ("steps", 1),
        ):
            self._totals[name] = self._totals.get(name, 0.0) + add
            Counter(
                f"rollout_trainer_{name}", f"{name.replace('_', ' ')} over the trainer's life", registry=registry
            ).inc(self._totals[name])
        self.path.parent.mkdir(parents=True, exist_ok=True)
        write_to_textfile(str(self.path), registry)
