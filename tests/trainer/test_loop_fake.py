"""The reference trainer in the loop on the fake engine: runner → proxy → feed → trainer → reload → runner.

The fake engine samples its scripted short answers with the tiny checkpoint's logprobs (``tiny.py``),
so the trainer's logprobs and the recorded ones agree bit for bit when the trainer scores each
sequence alone: any wrong token, loss mask or version on the way shows as a mismatch.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import pytest

from rollout_proxy.trainer.batch import Rollout, TrainSequence, rollouts_of
from rollout_proxy.trainer.grpo import GRPOConfig, GRPOLearner
from rollout_proxy.trainer.mismatch import mismatch_report
from tests.runner.test_summary_plot import png_size
from tests.trainer.conftest import run_loop, short_answer_job

pytest.importorskip("torch")


async def test_every_trained_token_matches_the_engine_bit_for_bit_and_follows_each_reload(
    tiny_fleet, redis_url, tiny_checkpoint, tmp_path
):
    job = short_answer_job(samples=4, generations=4, steps=3, training_loop={"max_staleness": 0})
    learner = GRPOLearner(tiny_checkpoint, GRPOConfig(learning_rate=3e-2, micro_batch_tokens=1))
    run = await run_loop(tiny_fleet.proxy, redis_url, job, learner, tmp_path, steps=3)

    records = run.trainer.records
    assert [(r["step"], r["trained_version"], r["version"], r["groups"]) for r in records] == [
        (0, 0, 1, 4),
        (1, 1, 2, 4),
        (2, 2, 3, 4),
    ]
    for record in records:
        mismatch = record["mismatch"]
        assert mismatch["current"]["tokens"] == record["trained_tokens"] > 0
        assert mismatch["current"]["max_abs"] == 0.0  # the same weights, the same arithmetic: exact
        assert mismatch["current"]["over"] == 0 and mismatch["current"]["k3"] == 0.0
        assert mismatch["other_version"]["tokens"] == 0 and mismatch["unversioned"] == 0
        assert set(mismatch["by_version"]) == {str(record["trained_version"])}
        assert record["metrics"]["grad_norm"] > 0  # rewards differ within groups: there was a gradient
    # every update reached the engine: it loaded each checkpoint the trainer wrote, in order
    assert tiny_fleet.weights.loaded[1:] == [r["weights"] for r in records]
    assert run.summary.groups_published == 12

    # the tokens sampled after a reload are the new weights', not the old ones': step 2 (version 2),
    # scored by the starting weights, is off by far more than rounding
    step2 = [r for group in await run.groups(redis_url, step=2) for r in rollouts_of(group)]
    old = GRPOLearner(tiny_checkpoint, GRPOConfig(micro_batch_tokens=1)).score(step2)
    stale = mismatch_report(old, trainer_version=2, threshold=1e-2)
    assert stale.current.tokens == records[2]["trained_tokens"]
    assert stale.current.over_share > 0.9 and stale.current.mean_abs > 0.1
    again = GRPOLearner(Path(records[1]["weights"]), GRPOConfig(micro_batch_tokens=1)).score(step2)
    assert mismatch_report(again, trainer_version=2, threshold=1e-2).current.max_abs == 0.0

    # what it wrote: a line per step, the metrics of the last, the plot, its state, the newest two checkpoints
    assert [json.loads(line) for line in (tmp_path / "steps.jsonl").read_text().splitlines()] == records
    metrics = (tmp_path / "metrics.prom").read_text()
    assert (
        "rollout_trainer_step 2.0" in metrics
        and 'rollout_trainer_mismatch_max_abs{kind="current",version="2"} 0.0' in metrics
    )
    assert png_size(tmp_path / "steps.png") == (800, 600)
    assert json.loads((tmp_path / "state.json").read_text())["version"] == 3
    assert sorted(p.name for p in (tmp_path / "weights").iterdir()) == ["v000002", "v000003"]


async def test_padded_micro_batches_agree_to_float32_rounding(tiny_fleet, redis_url, tiny_checkpoint, tmp_path):
    """Several sequences per forward (the default): padding changes the matrix shapes the same weights are
    multiplied in, so the sums round differently: within a few float32 ulps of |logprob| ≈ 10-20 (2e-6)."""
    job = short_answer_job(samples=4, generations=4, steps=1, training_loop={"max_staleness": 0})
    learner = GRPOLearner(tiny_checkpoint, GRPOConfig(learning_rate=3e-2, micro_batch_tokens=4096))
    run = await run_loop(tiny_fleet.proxy, redis_url, job, learner, tmp_path, steps=1)
    [record] = run.trainer.records
    assert record["metrics"]["micro_batches"] == 1  # all 16 sequences in one padded batch
    assert record["mismatch"]["current"]["tokens"] == record["trained_tokens"] > 0
    assert record["mismatch"]["current"]["max_abs"] <= 1e-5


async def test_a_shifted_loss_mask_is_caught(tiny_fleet, redis_url, tiny_checkpoint, tmp_path):
    """Recorded one token off (mask and logprobs shifted together, as an off-by-one in the recorder would):
    nearly every trained token is far over the threshold."""
    job = short_answer_job(samples=4, generations=2, steps=1, training_loop={"max_staleness": 0})
    learner = GRPOLearner(tiny_checkpoint, GRPOConfig(learning_rate=0.0, micro_batch_tokens=1))
    run = await run_loop(tiny_fleet.proxy, redis_url, job, learner, tmp_path, steps=1)
    rollouts = [r for group in await run.groups(redis_url) for r in rollouts_of(group)]
    honest = mismatch_report(learner.score(rollouts), trainer_version=0, threshold=1e-2)
    assert honest.current.max_abs == 0.0 and honest.current.tokens > 0

    for shift in (1, -1):
        shifted = [_shifted(rollout, shift) for rollout in rollouts]
        report = mismatch_report(learner.score(shifted), trainer_version=0, threshold=1e-2)
        assert report.current.tokens > 0
        assert report.current.over_share > 0.9 and not report.ok
        assert abs(report.worst[0].delta) > 1.0


class SlowLearner(GRPOLearner):
    """A step that takes a second: the next step's rollouts (a few ms each) finish before the pause."""

    def train_step(self, rollouts):
        time.sleep(1.0)
        return super().train_step(rollouts)


def _shifted(rollout: Rollout, shift: int) -> Rollout:
    sequences = []
    for s in rollout.sequences:
        weight, logprobs = np.roll(s.loss_weight, shift), np.roll(s.sampling_logprobs, shift)
        weight[0] = 0.0  # what rolled around the ends is not a token of the reply
        if shift < 0:
            weight[shift:] = 0.0
        sequences.append(TrainSequence(s.token_ids, weight, logprobs, np.roll(s.versions, shift)))
    return Rollout(rollout.group_id, rollout.index, rollout.reward, rollout.advantage, tuple(sequences))


async def test_an_engine_that_kept_its_old_weights_is_caught(tiny_fleet, redis_url, tiny_checkpoint, tmp_path):
    """The reload did nothing (the engine kept its weights) but the fleet resumed at the new version: the
    tokens of step 1 say version 1, and their logprobs are not version 1's."""
    tiny_fleet.weights.frozen = True
    job = short_answer_job(samples=4, generations=4, steps=2, training_loop={"max_staleness": 0})
    learner = GRPOLearner(tiny_checkpoint, GRPOConfig(learning_rate=3e-2, micro_batch_tokens=1))
    run = await run_loop(tiny_fleet.proxy, redis_url, job, learner, tmp_path, steps=2)
    first, second = run.trainer.records
    assert first["mismatch"]["current"]["max_abs"] == 0.0  # version 0: the weights both started from
    assert second["mismatch"]["by_version"].keys() == {"1"}  # recorded as version 1 ...
    assert second["mismatch"]["current"]["over"] / second["mismatch"]["current"]["tokens"] > 0.9  # ... wrongly
    assert second["mismatch"]["worst"][0]["version"] == 1


async def test_tokens_of_an_older_version_are_counted_apart(tiny_fleet, redis_url, tiny_checkpoint, tmp_path):
    """max_staleness 1: step 1 rolls out at version 0 while step 0 trains, so the trainer (at version 1 for
    step 1) scores version-0 tokens: counted apart, not as a mismatch, while its own version's are exact."""
    job = short_answer_job(samples=4, generations=4, steps=3, training_loop={"max_staleness": 1})
    learner = SlowLearner(tiny_checkpoint, GRPOConfig(learning_rate=3e-2, micro_batch_tokens=1))
    run = await run_loop(tiny_fleet.proxy, redis_url, job, learner, tmp_path, steps=3)
    records = run.trainer.records
    assert [r["trained_version"] for r in records] == [0, 1, 2]
    other = sum(r["mismatch"]["other_version"]["tokens"] for r in records)
    assert other > 0  # some tokens were sampled one version behind the trainer
    for record in records:
        mismatch = record["mismatch"]
        assert mismatch["current"]["max_abs"] == 0.0  # whatever the trainer's own version sampled: exact
        assert mismatch["current"]["tokens"] + mismatch["other_version"]["tokens"] == record["trained_tokens"]
        behind = {int(v) for v in mismatch["by_version"]} - {record["trained_version"]}
        assert behind <= {record["trained_version"] - 1}  # never more than max_staleness behind
        if mismatch["other_version"]["tokens"]:
            assert mismatch["other_version"]["max_abs"] > 1e-2  # the policy moved: that is no mismatch of ours
