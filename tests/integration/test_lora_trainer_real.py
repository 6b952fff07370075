"""The LoRA trainer against a real vLLM (CPU, fp32, ``--enable-lora``): a step published and sampled, every
trained token checked.

The proxy in front of one LoRA vLLM (``dense_lora``: SmolLM2-135M, ``--max-lora-rank 16``); the trainer's
learner (peft, rank 8 on every linear layer of the blocks) and its publisher (the proxy's policies API).
Version 1 is the untrained adapter; calls naming the policy sample it; one GRPO step on them; the adapter
saved and published as version 2 with no pause; calls sample version 2. The mismatch report compares the
trainer's logprob of every sampled token, with its adapter, against vLLM's sampling logprob: before the step
on version 1's tokens (the step's own report), after it on version 2's.

Tolerance ``TOLERANCE`` (nats, max over every token): the same as the full-weight path
(``test_trainer_real``), for the same reason: both sides compute in fp32 but not the same way (vLLM's CPU
kernels and its LoRA ops, which add ``x A^T B^T · alpha/r`` as gathers and einsums, against transformers'
eager ops with peft's LoRA layers), with other summation orders over 30 layers and a 49,152-token softmax.
Measured for the research (docs/policies.md): peft's fp32 forward within 4e-5 of vLLM's LoRA logprobs, so the
bound leaves a factor of 25. What it must catch is far above it: the untrained adapter scores version 2's
tokens off by more than the bound (the step moved the adapter measurably), and a wrong adapter, a token
scored at the wrong position or a logprob of other weights is off by nats.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from devtools.engine_env import checkpoint_paths
from rollout_proxy.engines.base import SamplingParams
from rollout_proxy.engines.sampling import Sampled, sample
from rollout_proxy.proxy import keys
from rollout_proxy.sdk.transport import ProxyClient
from rollout_proxy.trainer.fleet import PolicyPublisher
from rollout_proxy.trainer.loop import publish_untrained, weights_dir
from rollout_proxy.trainer.mismatch import mismatch_report
from tests.harness import ADMIN_KEY, ProxyHarness
from tests.integration.conftest import VLLMServers

torch = pytest.importorskip("torch")
pytest.importorskip("peft")

from rollout_proxy.engines.adapters import DEFAULT_LORA_MODULES  # noqa: E402
from rollout_proxy.trainer.batch import Rollout, TrainSequence  # noqa: E402
from rollout_proxy.trainer.grpo import GRPOConfig, GRPOLearner, LoRAConfig  # noqa: E402

#: max |trainer − vLLM| logprob over every sampled token, fp32, the adapter on both sides (module doc)
TOLERANCE = 1e-3
POLICY = "grpo-lora"
ASK = [{"role": "user", "content": "Name three colours of the rainbow."}]
CONFIG = GRPOConfig(learning_rate=1e-2, lora=LoRAConfig(rank=8, alpha=16, target_modules=DEFAULT_LORA_MODULES))


def params(seed: int) -> SamplingParams:
    return SamplingParams(max_tokens=10, temperature=1.0, top_p=1.0, top_k=0, seed=seed)


def rollout(index: int, prompt: np.ndarray, sampled: Sampled, advantage: float) -> Rollout:
    """One sampled call as a rollout: its tokens trained, with vLLM's logprobs and the version that sampled them."""
    output = sampled.completion.output_ids.astype(np.int64)
    ids = np.concatenate([prompt.astype(np.int64), output])
    weight = np.zeros(len(ids), np.float32)
    weight[len(prompt) :] = 1.0
    logprobs = np.zeros(len(ids), np.float32)
    logprobs[len(prompt) :] = sampled.completion.output_logprobs
    versions = np.full(len(ids), -1, np.int64)
    versions[len(prompt) :] = sampled.versions[0].version
    return Rollout("real", index, advantage, advantage, (TrainSequence(ids, weight, logprobs, versions),))


async def test_a_lora_step_published_and_sampled_on_vllm_matches_the_trainer(vllm_servers: VLLMServers, tmp_path):
    server = vllm_servers.get("dense_lora")
    dense = checkpoint_paths()["dense"]
    learner = GRPOLearner(dense, CONFIG)
    async with (
        ProxyHarness.running(engine_urls=[server.base_url], engine_health_timeout=5.0) as proxy,
        ProxyClient(proxy.url, ADMIN_KEY, timeout=300.0) as admin,
    ):
        fleet = proxy.app[keys.ENGINES]
        [member] = fleet.members.values()
        engine = member.client
        prompt = await engine.tokenize_messages(ASK, tools=None, add_generation_prompt=True, chat_template_kwargs=None)
        publisher = PolicyPublisher(admin, POLICY)
        assert await publish_untrained(learner, publisher, tmp_path) == 1

        first = [await sample(fleet, engine, prompt, params(seed), policy=POLICY) for seed in range(4)]
        assert {s.versions[0].version for s in first} == {1}
        rollouts = [rollout(i, prompt, s, 1.0 if i % 2 else -1.0) for i, s in enumerate(first)]
        step = learner.train_step(rollouts)
        before = mismatch_report(step.scored, trainer_version=1, threshold=TOLERANCE)
        assert before.current.tokens == sum(len(s.completion.output_ids) for s in first) > 0
        assert before.current.max_abs < TOLERANCE, before.worst

        learner.save(weights_dir(tmp_path, 2))
        published = await publisher.update(weights_dir(tmp_path, 2))
        assert (published.version, published.reloaded, published.failed) == (2, [member.url], [])
        assert f"{POLICY}@v2" in {card.name for card in await engine.adapters()}
        second = [await sample(fleet, engine, prompt, params(seed), policy=POLICY) for seed in range(4)]
        assert {s.versions[0].version for s in second} == {2}
        after_rollouts = [rollout(i, prompt, s, 0.0) for i, s in enumerate(second)]
        after = mismatch_report(learner.score(after_rollouts), trainer_version=2, threshold=TOLERANCE)
        assert after.current.tokens > 0 and after.current.max_abs < TOLERANCE, after.worst

        untrained = GRPOLearner(dense, CONFIG, adapter_dir=weights_dir(tmp_path, 1))
        stale = mismatch_report(untrained.score(after_rollouts), trainer_version=2, threshold=TOLERANCE)
        assert stale.current.max_abs > TOLERANCE  # the step moved the adapter: version 2 is not version 1
    print(
        "\n[lora trainer real] "
        + json.dumps(
            {
                "version_1": {"tokens": before.current.tokens, "max_abs": before.current.max_abs},
                "version_2": {"tokens": after.current.tokens, "max_abs": after.current.max_abs},
                "untrained_on_version_2": {"max_abs": stale.current.max_abs, "mean_abs": stale.current.mean_abs},
                "publish_s": published.publish_s,
            }
        )
    )
