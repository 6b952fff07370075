"""The mismatch report: its numbers, the split by version, and its Prometheus text."""

from __future__ import annotations

import dataclasses
import json
import math

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from rollout_proxy.trainer.batch import NO_VERSION
from rollout_proxy.trainer.mismatch import MetricsFile, MismatchReport, MismatchStats, ScoredSequence, mismatch_report


def scored(trainer: list[float], sampler: list[float], versions: list[int], group: str = "g") -> ScoredSequence:
    n = len(trainer)
    return ScoredSequence(
        group_id=group,
        rollout=0,
        sequence=0,
        positions=np.arange(10, 10 + n),
        token_ids=np.arange(500, 500 + n),
        versions=np.asarray(versions),
        trainer=np.asarray(trainer, np.float32),
        sampler=np.asarray(sampler, np.float32),
    )


def test_stats_are_max_mean_k3_and_the_share_over_the_threshold():
    delta = np.asarray([0.0, 0.001, -0.02, 0.5])
    stats = MismatchStats.of(delta, threshold=0.01)
    assert stats.tokens == 4 and stats.max_abs == 0.5 and stats.over == 2 and stats.over_share == 0.5
    assert stats.mean_abs == pytest.approx((0.001 + 0.02 + 0.5) / 4)
    assert stats.k3 == pytest.approx(np.mean(np.exp(delta) - 1 - delta))
    assert stats.k3 >= 0 and MismatchStats.of(np.zeros(3), 0.01).k3 == 0.0
    assert MismatchStats.of(np.zeros(0), 0.01) == MismatchStats()


def test_tokens_are_split_by_version_and_other_versions_are_counted_apart():
    report = mismatch_report(
        [
            scored([-1.0, -2.0, -3.0], [-1.0, -2.0, -3.0001], [4, 4, 4]),  # the trainer's version: tiny Δ
            scored([-1.0, -2.0], [-1.5, -2.5], [3, 3], group="h"),  # one version behind: policy moved
            scored([-1.0], [-1.0], [NO_VERSION], group="h"),
        ],
        trainer_version=4,
        threshold=1e-2,
    )
    assert report.trainer_version == 4 and report.tokens == 6
    assert report.current.tokens == 3 and report.current.over == 0 and report.ok
    assert report.current.max_abs == pytest.approx(1e-4, rel=0.05)
    assert report.other_version.tokens == 3 and report.other_version.over == 2 and report.unversioned == 1
    assert sorted(report.by_version) == [NO_VERSION, 3, 4]
    assert report.by_version[3].mean_abs == pytest.approx(0.5)
    assert [w.version for w in report.worst] == [4, 4, 4]  # only the trainer's own version's tokens
    assert report.worst[0].position == 12 and report.worst[0].token_id == 502
    as_dict = report.as_dict()
    assert as_dict["by_version"]["3"]["over"] == 2 and as_dict["worst"][0]["delta"] == pytest.approx(1e-4, rel=0.05)
    # a restart rebuilds it from its JSON (state.json's intent) for metrics.prom: the same report
    assert MismatchReport.from_dict(json.loads(json.dumps(as_dict))) == report


def test_worst_names_the_sequence_within_its_rollout():
    """A rollout's sequences (its main one, a subagent's): the worst token says which, by index, leaf and kind."""
    main = scored([-1.0, -2.0], [-1.0, -2.0], [0, 0])
    subagent = dataclasses.replace(
        main,
        sequence=1,
        sampler=np.asarray([-1.0, -2.5], np.float32),
        response_id="resp_sub",
        branch="new_conversation",
    )
    report = mismatch_report([main, subagent], trainer_version=0, threshold=1e-2)
    worst = report.worst[0]
    assert (worst.rollout, worst.sequence, worst.response_id, worst.branch) == (0, 1, "resp_sub", "new_conversation")
    assert report.as_dict()["worst"][0]["response_id"] == "resp_sub" and report.tokens == 4


def test_a_mismatch_on_the_trainer_version_fails_the_report():
    report = mismatch_report([scored([-1.0, -2.0], [-1.0, -2.3], [0, 0])], trainer_version=0, threshold=1e-2)
    assert not report.ok and report.current.over == 1 and report.worst[0].delta == pytest.approx(0.3)
    with pytest.raises(ValueError, match="threshold"):
        mismatch_report([], trainer_version=0, threshold=math.nan)
    empty = mismatch_report([], trainer_version=0, threshold=1e-2)
    assert empty.tokens == 0 and empty.ok


def test_the_metrics_file_is_prometheus_text_with_the_latest_step_and_running_totals(tmp_path):
    metrics = MetricsFile(tmp_path / "metrics.prom")
    report = mismatch_report(
        [scored([-1.0, -2.0], [-1.0, -2.5], [2, 2]), scored([-1.0], [-1.2], [1])], trainer_version=2, threshold=1e-2
    )
    metrics.write(step=7, version=3, report=report, metrics={"loss": 0.25, "reward_mean": 0.5, "bad": math.nan})
    metrics.write(step=8, version=4, report=report, metrics={"loss": 0.125, "reward_mean": 0.75})
    samples = {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families((tmp_path / "metrics.prom").read_text())
        for sample in family.samples
    }
    assert samples[("rollout_trainer_mismatch_max_abs", (("kind", "current"), ("version", "2")))] == 0.5
    assert samples[("rollout_trainer_mismatch_tokens", (("kind", "other_version"), ("version", "1")))] == 1
    assert samples[("rollout_trainer_mismatch_over_threshold_ratio", (("kind", "current"), ("version", "2")))] == 0.5
    assert samples[("rollout_trainer_step", ())] == 8 and samples[("rollout_trainer_policy_version", ())] == 4
    assert samples[("rollout_trainer_loss", ())] == 0.125
    assert samples[("rollout_trainer_trained_tokens_total", ())] == 6  # 3 a step, two steps
    assert samples[("rollout_trainer_mismatched_tokens_total", ())] == 2
    assert samples[("rollout_trainer_other_version_tokens_total", ())] == 2
    assert not any(name == "rollout_trainer_bad" for name, _ in samples)


def test_the_tokens_of_sequences_with_images_are_also_reported_on_their_own():
    report = mismatch_report(
        [
            scored([-1.0, -2.0], [-1.0, -2.0], [4, 4]),
            dataclasses.replace(scored([-1.0, -2.0], [-1.2, -2.0], [4, 4]), images=2),
            dataclasses.replace(scored([-1.0], [-1.5], [3]), images=1),  # another version: not in it
        ],
        trainer_version=4,
        threshold=1e-2,
    )
    assert report.current.tokens == 4 and report.with_images.tokens == 2
    assert report.with_images.max_abs == pytest.approx(0.2) and report.with_images.over == 1
    assert MismatchReport.from_dict(json.loads(json.dumps(report.as_dict()))) == report
    # a report written before the field reads back with none
    old = {name: value for name, value in report.as_dict().items() if name != "with_images"}
    assert MismatchReport.from_dict(old).with_images == MismatchStats()
