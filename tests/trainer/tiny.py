"""A tiny Llama (SmolLM2's vocabulary, one layer, random weights) that the fake engine samples with.

The fake engine's own logprobs are a hash of (position, token, version), which no model gives; with
``EngineWeights`` set as its ``model`` the scripted tokens get this checkpoint's logprobs instead,
computed by the trainer's own code (``grpo.token_logprobs`` over a one-sequence batch) on the
prompt and the planned tokens, and ``/collective_rpc reload_weights`` loads the trainer's new
checkpoint into it. A trainer that scores each sequence alone (``micro_batch_tokens=1``) therefore
agrees with the engine bit for bit, by construction, while the tokens, the loss mask, the logprobs
and the versions it compares come through the whole proxy → trajectory → runner → feed path.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from rollout_proxy.trainer.batch import Rollout, TrainSequence, micro_batches
from rollout_proxy.trainer.grpo import load_policy, token_logprobs

VOCAB = 49152  # SmolLM2's tokenizer, which the fake engine uses


def build_tiny_checkpoint(directory: Path, *, seed: int = 0) -> Path:
    """Random weights, spread wide (initializer_range 0.5): logprobs from about -5 to -20, so a token
    scored at the wrong position or under other weights is off by nats, not by rounding."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        initializer_range=0.5,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
    )
    LlamaForCausalLM(config).save_pretrained(directory)
    return directory


class EngineWeights:
    """The fake engine's ``FakeModel``: the checkpoint loaded now; ``frozen`` ignores reloads (a broken
    update: the engine keeps its old weights while the proxy gives it the new version)."""

    def __init__(self, checkpoint: Path) -> None:
        self.model = load_policy(checkpoint)
        self.loaded = [str(checkpoint)]
        self.frozen = False
        self._adapters: dict[str, object] = {}  # directory -> the weights with that adapter (peft)

    def score(self, prompt: Sequence[int], tokens: Sequence[int], adapter: str | None = None) -> list[float]:
        """With ``adapter`` (a LoRA adapter's directory, as a call naming it on vLLM): the weights with it."""
        if adapter is None:
            return score(self.model, prompt, tokens)
        if adapter not in self._adapters:
            from peft import PeftModel

            self._adapters[adapter] = PeftModel.from_pretrained(load_policy(self.loaded[-1]), adapter).eval()
        return score(self._adapters[adapter], prompt, tokens)

    def reload(self, weights_path: str) -> None:
        if not self.frozen:
            self.model = load_policy(weights_path)
            self.loaded.append(weights_path)
            self._adapters.clear()


def score(model: object, prompt: Sequence[int], tokens: Sequence[int]) -> list[float]:
    """``model``'s logprob of each of ``tokens`` after ``prompt``, as the trainer computes it."""
    ids = np.asarray([*prompt, *tokens], dtype=np.int64)
    weight = np.zeros(len(ids), dtype=np.float32)
    weight[len(prompt) :] = 1.0
    sequence = TrainSequence(ids, weight, np.zeros(len(ids), np.float32), np.zeros(len(ids), np.int64))
    [batch] = micro_batches([Rollout("score", 0, 0.0, 0.0, (sequence,))], max_tokens=1)
    with torch.no_grad():
        logprobs, _ = token_logprobs(model, batch)
    return [float(value) for value in logprobs[0]]
