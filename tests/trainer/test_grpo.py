"""The learner's pieces: the logprobs it computes, the PPO-clip loss, one step, the checkpoint it writes."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from rollout_proxy.trainer.batch import Rollout, TrainSequence, micro_batches  # noqa: E402
from rollout_proxy.trainer.grpo import (  # noqa: E402
    GRPOConfig,
    GRPOLearner,
    OptimizerStateMismatch,
    load_policy,
    policy_loss,
    token_logprobs,
)
from rollout_proxy.trainer.mismatch import mismatch_report  # noqa: E402


def rollout(index: int, ids: list[int], trained_from: int, advantage: float, logprobs=None) -> Rollout:
    n = len(ids)
    weight = np.zeros(n, np.float32)
    weight[trained_from:] = 1.0
    recorded = np.zeros(n, np.float32) if logprobs is None else np.asarray(logprobs, np.float32)
    return Rollout(
        "g", index, 0.0, advantage, (TrainSequence(np.asarray(ids), weight, recorded, np.zeros(n, np.int64)),)
    )


def test_logprobs_at_the_trained_columns_are_the_full_forward_pass_ones(tiny_checkpoint):
    model = load_policy(tiny_checkpoint)
    rollouts = [rollout(0, [1, 50, 60, 70, 80, 2], 3, 1.0), rollout(1, [1, 90, 91, 2], 2, 1.0)]
    [batch] = micro_batches(rollouts, max_tokens=100)
    with torch.no_grad():
        chosen, entropy = token_logprobs(model, batch)
        full = torch.log_softmax(model(input_ids=torch.from_numpy(batch.input_ids)).logits, dim=-1)
    lo, hi = batch.trained_span
    assert (lo, hi) == (2, 6) and chosen.shape == (2, 4)
    for row, ids in enumerate(batch.input_ids):
        for column in range(lo, hi):
            if batch.loss_weight[row, column] > 0:  # the logit at t - 1 predicts token t
                expected = full[row, column - 1, ids[column]]
                assert float(chosen[row, column - lo]) == pytest.approx(float(expected), abs=1e-5)
    assert (entropy > 0).all() and (entropy <= np.log(49152) + 1e-3).all()
    with torch.no_grad():  # at temperature 2 the logits are halved before the softmax
        warm, _ = token_logprobs(model, batch, temperature=2.0)
        halved = torch.log_softmax(model(input_ids=torch.from_numpy(batch.input_ids)).logits / 2.0, dim=-1)
    assert float(warm[0, 1]) == pytest.approx(float(halved[0, 2, batch.input_ids[0, 3]]), abs=1e-5)


def test_the_loss_is_ppo_clip_with_the_importance_weight_truncated():
    config = GRPOConfig(clip_low=0.2, clip_high=0.2, ratio_cap=3.0)
    old = torch.zeros(5)
    logprobs = torch.log(torch.tensor([1.0, 1.5, 0.5, 5.0, 5.0])).requires_grad_(True)
    advantages = torch.tensor([1.0, 1.0, -1.0, -1.0, 1.0])
    loss, sums = policy_loss(logprobs, old, advantages, torch.ones(5), config)
    # per token: -min(rA, clip(r)A), with the negative side bounded by C*A
    expected = [-1.0, -1.2, 0.8, 3.0, -1.2]
    assert float(loss.detach()) == pytest.approx(sum(expected))
    loss.backward()
    # the gradient flows only where the unclipped, untruncated ratio is what counts
    assert logprobs.grad.tolist() == pytest.approx([-1.0, 0.0, 0.0, 0.0, 0.0])
    assert sums["clipped"] == 3.0 and sums["capped"] == 1.0
    masked, _ = policy_loss(logprobs, old, advantages, torch.tensor([1.0, 0.0, 0.0, 0.0, 0.0]), config)
    assert float(masked.detach()) == pytest.approx(-1.0)  # untrained tokens count for nothing


def test_the_kl_term_is_k3_to_the_reference():
    config = GRPOConfig(kl_coef=0.5)
    logprobs, reference = torch.tensor([-1.0, -2.0]), torch.tensor([-1.0, -1.0])
    loss, sums = policy_loss(logprobs, logprobs.clone(), torch.zeros(2), torch.ones(2), config, reference)
    gap = reference - logprobs
    assert float(loss) == pytest.approx(float(0.5 * (torch.exp(gap) - gap - 1).sum()))
    assert sums["kl_ref"] == pytest.approx(float((torch.exp(gap) - gap - 1).sum()))


def test_a_step_makes_the_better_rollout_likelier_and_reports_its_own_logprobs(tiny_checkpoint, tmp_path):
    learner = GRPOLearner(tiny_checkpoint, GRPOConfig(learning_rate=1e-2, micro_batch_tokens=64))
    good, bad = [1, 10, 11, 12, 300, 301, 2], [1, 10, 11, 12, 400, 401, 2]
    rollouts = [rollout(0, good, 4, 1.0), rollout(1, bad, 4, -1.0)]
    before = learner.score(rollouts)
    recorded = [
        rollout(i, ids, 4, adv, logprobs=np.concatenate([np.zeros(4), s.trainer]))
        for i, (ids, adv, s) in enumerate(zip([good, bad], [1.0, -1.0], before, strict=True))
    ]
    step = learner.train_step(recorded)
    # the step scored every trained token with the weights before its update: the recorded ones, exactly
    report = mismatch_report(step.scored, trainer_version=0, threshold=1e-6)
    assert report.current.tokens == 6 and report.current.max_abs <= 1e-6
    assert step.metrics["grad_norm"] > 0 and step.metrics["ratio_mean"] == pytest.approx(1.0, abs=1e-5)
    after = learner.score(rollouts)
    assert after[0].trainer.sum() > before[0].trainer.sum()  # advantage +1: likelier
    assert after[1].trainer.sum() < before[1].trainer.sum()  # advantage -1: less likely

    learner.save(tmp_path / "v1")
    assert (tmp_path / "v1" / "config.json").is_file() and (tmp_path / "v1" / "model.safetensors").is_file()
    assert not list(tmp_path.glob(".v1.*"))  # the staging directory was renamed into place
    reloaded = GRPOLearner(tmp_path / "v1", GRPOConfig(micro_batch_tokens=64)).score(rollouts)
    assert all(np.array_equal(a.trainer, b.trainer) for a, b in zip(after, reloaded, strict=True))


def test_zero_advantages_move_nothing_but_every_token_is_still_checked(tiny_checkpoint):
    learner = GRPOLearner(tiny_checkpoint, GRPOConfig(learning_rate=1e-2))
    rollouts = [rollout(0, [1, 5, 6, 7, 2], 2, 0.0), rollout(1, [1, 5, 8, 2], 2, 0.0)]
    before = learner.score(rollouts)
    step = learner.train_step(rollouts)
    assert sum(len(s.trainer) for s in step.scored) == 5 and step.metrics["loss"] == 0.0
    after = learner.score(rollouts)
    assert all(np.array_equal(a.trainer, b.trainer) for a, b in zip(before, after, strict=True))


@pytest.mark.parametrize(
    "bad",
    [{"learning_rate": -1.0}, {"clip_low": 1.0}, {"ratio_cap": 1.0}, {"kl_coef": -0.1}, {"temperature": 0.0}],
)
def test_a_config_that_cannot_train_is_refused(bad):
    with pytest.raises(ValueError, match="required"):
        GRPOConfig(**bad)


@pytest.mark.parametrize("freeze", [True, False])
def test_a_tied_embedding_is_kept_unless_asked(tiny_checkpoint, freeze):
    """vLLM 0.32's in-place reload keeps a tied lm_head's old copy, so by default the trainer does not train it."""
    learner = GRPOLearner(tiny_checkpoint, GRPOConfig(learning_rate=1e-2, freeze_tied_embeddings=freeze))
    embedding = learner.model.get_input_embeddings().weight
    assert learner.model.get_output_embeddings().weight is embedding  # tied
    before, body = embedding.detach().clone(), learner.model.model.layers[0].mlp.up_proj.weight.detach().clone()
    learner.train_step([rollout(0, [1, 10, 11, 300, 2], 3, 1.0), rollout(1, [1, 10, 11, 400, 2], 3, -1.0)])
    assert torch.equal(embedding.detach(), before) == freeze and learner.frozen_embeddings == freeze
    assert not torch.equal(learner.model.model.layers[0].mlp.up_proj.weight.detach(), body)


def optimizer_moments(learner: GRPOLearner) -> list[dict[str, torch.Tensor]]:
    """AdamW's state per trained parameter, in order: exp_avg, exp_avg_sq, step."""
    return [learner.optimizer.state[p] for p in learner.optimizer.param_groups[0]["params"]]


def assert_same_state(a: GRPOLearner, b: GRPOLearner) -> None:
    moments_a, moments_b = optimizer_moments(a), optimizer_moments(b)
    assert len(moments_a) == len(moments_b) > 0
    for state_a, state_b in zip(moments_a, moments_b, strict=True):
        assert sorted(state_a) == sorted(state_b) == ["exp_avg", "exp_avg_sq", "step"]
        assert all(torch.equal(state_a[name], state_b[name]) for name in state_a)  # exactly
    for (name, p), (_, q) in zip(a.model.named_parameters(), b.model.named_parameters(), strict=True):
        assert torch.equal(p, q), name


def test_a_checkpoint_carries_adamw_and_a_learner_loaded_from_it_goes_on_exactly(tiny_checkpoint, tmp_path):
    """A restart loads the checkpoint its last step saved: AdamW's moments and step count come back exactly, so
    its next step is the one the trainer would have taken had it not stopped."""
    config = GRPOConfig(learning_rate=1e-2, micro_batch_tokens=64)
    first = [rollout(0, [1, 10, 11, 300, 2], 3, 1.0), rollout(1, [1, 10, 11, 400, 2], 3, -1.0)]
    second = [rollout(0, [1, 20, 21, 500, 2], 3, -1.0), rollout(1, [1, 20, 21, 600, 2], 3, 1.0)]
    learner = GRPOLearner(tiny_checkpoint, config)
    assert learner.optimizer_steps == 0
    learner.train_step(first)
    learner.save(tmp_path / "v1")
    assert (tmp_path / "v1" / "optimizer.pt").is_file() and learner.optimizer_steps == 1

    restored = GRPOLearner(tmp_path / "v1", config)
    assert restored.optimizer_steps == 1
    assert_same_state(learner, restored)  # the state before the "crash", exactly
    learner.train_step(second)
    restored.train_step(second)
    assert_same_state(learner, restored)  # and the next step is the same step
    assert learner.optimizer_steps == restored.optimizer_steps == 2

    # what a restart without the optimizer's state would do: AdamW afresh, another step
    (tmp_path / "v1" / "optimizer.pt").unlink()
    afresh = GRPOLearner(tmp_path / "v1", config)
    afresh.train_step(second)
    assert afresh.optimizer_steps == 1
    body = "model.layers.0.mlp.up_proj.weight"
    assert not torch.equal(dict(afresh.model.named_parameters())[body], dict(learner.model.named_parameters())[body])


def test_a_restart_keeps_its_own_learning_rate_and_refuses_another_parameter_set(tiny_checkpoint, tmp_path):
    learner = GRPOLearner(tiny_checkpoint, GRPOConfig(learning_rate=1e-2))
    learner.train_step([rollout(0, [1, 10, 11, 300, 2], 3, 1.0), rollout(1, [1, 10, 11, 400, 2], 3, -1.0)])
    learner.save(tmp_path / "v1")
    slower = GRPOLearner(tmp_path / "v1", GRPOConfig(learning_rate=1e-4, weight_decay=0.1))
    assert [(g["lr"], g["weight_decay"]) for g in slower.optimizer.param_groups] == [(1e-4, 0.1)]
    assert slower.optimizer_steps == 1  # the moments are the checkpoint's, the hyperparameters this run's
    with pytest.raises(OptimizerStateMismatch, match=r"optimizer.pt is the optimizer state of other trained"):
        GRPOLearner(tmp_path / "v1", GRPOConfig(freeze_tied_embeddings=False))  # one more parameter trained


def test_the_kl_reference_is_the_weights_it_started_from(tiny_checkpoint, tmp_path):
    learner = GRPOLearner(tiny_checkpoint, GRPOConfig(learning_rate=1e-2))
    learner.train_step([rollout(0, [1, 10, 11, 300, 2], 3, 1.0), rollout(1, [1, 10, 11, 400, 2], 3, -1.0)])
    learner.save(tmp_path / "v1")
    restarted = GRPOLearner(tmp_path / "v1", GRPOConfig(kl_coef=0.1), reference_dir=tiny_checkpoint)
    start = load_policy(tiny_checkpoint)
    assert restarted.reference is not None
    for (name, p), (_, q) in zip(restarted.reference.named_parameters(), start.named_parameters(), strict=True):
        assert torch.equal(p, q), name
    assert not all(torch.equal(p, q) for p, q in zip(restarted.model.parameters(), start.parameters(), strict=True))
