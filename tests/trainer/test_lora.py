"""The learner's LoRA mode on the tiny checkpoint: only the adapter trains, a checkpoint is what vLLM loads
(checked as the proxy checks it before any engine), and a learner loaded from one goes on exactly."""

from __future__ import annotations

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("peft")

from rollout_proxy.engines.adapters import read_adapter  # noqa: E402
from rollout_proxy.trainer.batch import micro_batches  # noqa: E402
from rollout_proxy.trainer.grpo import (  # noqa: E402
    GRPOConfig,
    GRPOLearner,
    LoRAConfig,
    OptimizerStateMismatch,
    is_adapter,
    load_policy,
    token_logprobs,
)
from rollout_proxy.trainer.mismatch import mismatch_report  # noqa: E402
from tests.trainer.test_grpo import assert_same_state, rollout  # noqa: E402
from tests.trainer.tiny import score  # noqa: E402

LORA = LoRAConfig(rank=8, alpha=16, target_modules=("q_proj", "v_proj", "up_proj", "down_proj"))
FIRST = [rollout(0, [1, 10, 11, 12, 300, 301, 2], 4, 1.0), rollout(1, [1, 10, 11, 12, 400, 401, 2], 4, -1.0)]
SECOND = [rollout(0, [1, 20, 21, 500, 2], 3, -1.0), rollout(1, [1, 20, 21, 600, 2], 3, 1.0)]


def lora_config(**fields) -> GRPOConfig:
    return GRPOConfig(**{"learning_rate": 1e-2, "micro_batch_tokens": 64, "lora": LORA, **fields})


def recorded(learner: GRPOLearner, rollouts):
    """``rollouts`` with the learner's own logprobs as the sampling ones (an engine serving its weights)."""
    scored = learner.score(rollouts)
    out = []
    for r, s in zip(rollouts, scored, strict=True):
        [sequence] = r.sequences
        logprobs = np.zeros(len(sequence.token_ids), np.float32)
        logprobs[s.positions] = s.trainer
        out.append(rollout(r.index, list(sequence.token_ids), int(s.positions[0]), r.advantage, logprobs))
    return out


def test_only_the_adapter_trains_and_a_new_one_starts_as_the_base(tiny_checkpoint):
    learner = GRPOLearner(tiny_checkpoint, lora_config())
    base = load_policy(tiny_checkpoint)
    trained = {id(p) for group in learner.optimizer.param_groups for p in group["params"]}
    named = dict(learner.model.named_parameters())
    assert trained == {id(p) for name, p in named.items() if "lora_" in name}  # the optimizer: the adapter alone
    assert len(trained) == 2 * len(LORA.target_modules)  # A and B of each targeted module of the one layer
    assert not any(p.requires_grad for name, p in named.items() if "lora_" not in name)
    # B starts at zero: the untrained adapter scores every token as the base does
    start = learner.score(FIRST)
    for r, s in zip(FIRST, start, strict=True):
        ids = r.sequences[0].token_ids
        assert np.allclose(s.trainer, score(base, ids[:4], ids[4:]), atol=1e-6)

    frozen = {name: p.detach().clone() for name, p in named.items() if "lora_" not in name}
    step = learner.train_step(recorded(learner, FIRST))
    assert mismatch_report(step.scored, trainer_version=0, threshold=1e-6).current.max_abs <= 1e-6
    assert step.metrics["grad_norm"] > 0
    assert all(torch.equal(named[name], value) for name, value in frozen.items())  # the base did not move
    after = learner.score(FIRST)
    assert after[0].trainer.sum() > start[0].trainer.sum() and after[1].trainer.sum() < start[1].trainer.sum()


def test_a_checkpoint_is_the_adapter_vllm_loads_with_adamw_beside_it(tiny_checkpoint, tmp_path):
    learner = GRPOLearner(tiny_checkpoint, lora_config())
    learner.train_step(recorded(learner, FIRST))
    learner.save(tmp_path / "v000001")
    saved = tmp_path / "v000001"
    assert is_adapter(saved) and not is_adapter(tiny_checkpoint)
    assert {p.name for p in saved.iterdir()} >= {"adapter_config.json", "adapter_model.safetensors", "optimizer.pt"}
    assert not (saved / "config.json").exists() and not (saved / "model.safetensors").exists()  # no base weights
    config = json.loads((saved / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["lora_dropout"], config["bias"]) == (8, 16, 0.0, "none")
    assert not config.get("use_dora") and not config.get("modules_to_save")
    files = read_adapter(str(saved))  # the proxy's own check before it asks any engine to load it
    assert files.rank == 8 and sorted(files.target_modules) == sorted(LORA.target_modules)
    from safetensors.numpy import load_file

    tensors = load_file(saved / "adapter_model.safetensors")
    assert all(".lora_A." in name or ".lora_B." in name for name in tensors)
    assert "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight" in tensors  # peft's names, vLLM's
    assert tensors["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"].shape == (8, 16)


def test_a_learner_loaded_from_its_adapter_goes_on_exactly(tiny_checkpoint, tmp_path):
    config = lora_config()
    learner = GRPOLearner(tiny_checkpoint, config)
    learner.train_step(recorded(learner, FIRST))
    learner.save(tmp_path / "v1")
    restored = GRPOLearner(tiny_checkpoint, config, adapter_dir=tmp_path / "v1")
    assert restored.optimizer_steps == learner.optimizer_steps == 1
    assert_same_state(learner, restored)
    assert all(
        np.array_equal(a.trainer, b.trainer) for a, b in zip(learner.score(SECOND), restored.score(SECOND), strict=True)
    )
    learner.train_step(SECOND)
    restored.train_step(SECOND)
    assert_same_state(learner, restored)  # its next step is the same step


def test_an_adapter_of_other_settings_is_refused_in_words(tiny_checkpoint, tmp_path):
    learner = GRPOLearner(tiny_checkpoint, lora_config())
    learner.save(tmp_path / "v1")
    other = GRPOConfig(lora=LoRAConfig(rank=16, alpha=16, target_modules=LORA.target_modules))
    with pytest.raises(OptimizerStateMismatch, match=r"rank 8, alpha 16 on .* not rank 16"):
        GRPOLearner(tiny_checkpoint, other, adapter_dir=tmp_path / "v1")
    with pytest.raises(ValueError, match="LoRA learner"):
        GRPOLearner(tiny_checkpoint, GRPOConfig(), adapter_dir=tmp_path / "v1")


def test_the_kl_reference_under_lora_is_the_base(tiny_checkpoint):
    learner = GRPOLearner(tiny_checkpoint, lora_config(kl_coef=0.5))
    assert learner.reference is None  # no second copy: the adapter switched off is the base
    learner.train_step(recorded(learner, FIRST))  # the adapter moves away from the base
    step = learner.train_step(recorded(learner, FIRST))
    assert step.metrics["kl_ref"] > 0
    base = GRPOLearner(tiny_checkpoint, GRPOConfig(micro_batch_tokens=64))
    [batch] = micro_batches(FIRST, max_tokens=64, pad_id=learner.pad_id)
    reference = learner._reference_logprobs(batch)
    with torch.no_grad():
        expected, _ = token_logprobs(base.model, batch)
    assert reference is not None and torch.allclose(reference, expected, atol=1e-6)
