"""The reference learner: one GRPO / PPO-clip step per job step, PyTorch on the CPU, Hugging Face weights in fp32.

A reference, not a framework: it shows what the recorded tokens are for, and checks them.
Per trained token t of a step (loss weight w > 0, advantage A of its rollout, recorded sampling
logprob μ = the old policy), with the trainer's logprob π = log π_θ(token t | tokens < t):

    r          = exp(π − μ)                                  importance ratio to the sampler
    surrogate  = min(r·A, clip(r, 1 − ε_low, 1 + ε_high)·A)   PPO-clip
    surrogate  = max(surrogate, C·A)  where A < 0             the weight is truncated at C ("dual clip")
    loss_t     = −surrogate + β·(exp(ρ − π) − (ρ − π) − 1)    optional k3 KL to the reference ρ (β > 0)
    loss       = Σ_t w·loss_t / Σ_t w                          a mean over the step's trained tokens

then one AdamW step (gradients clipped to ``max_grad_norm``). A tied input/output embedding (SmolLM2's)
is not trained by default: vLLM 0.32's in-place ``reload_weights`` loads the new embedding but keeps
the tied ``lm_head``'s old copy (its log says ``ParallelLMHead: Failed to load weights``), which the
mismatch report showed as 0.02-0.04 nats on every token after the first reload
(``freeze_tied_embeddings=False`` trains it, for engines that reload it). The same forward gives the mismatch
report's trainer logprobs: ``π`` before the update, for every trained token. Temperature: the
logits are divided by it, as the engine did before reporting processed logprobs (at 1, raw and
processed are the same); top-p / top-k truncation is not reproduced (run them at 1 / 0).

A checkpoint it saves is an HF directory with the optimizer's state beside the weights
(``optimizer.pt``: AdamW's moments and step count, the name vLLM's loader and transformers skip);
a learner loaded from it goes on where that one was, with its own learning rate and weight decay.

With ``lora`` (``LoRAConfig``) it trains a LoRA adapter of the model with peft instead: the base weights
are frozen, the optimizer holds the adapter's parameters only, and a checkpoint is the adapter as vLLM
loads it (``adapter_config.json``, ``adapter_model.safetensors``; the base embedding is never copied in)
with ``optimizer.pt`` beside it. The KL reference is then the base itself (the adapter switched off), and
a tied embedding needs no freezing: vLLM applies an adapter of it exactly.

Logprobs are computed over padded micro-batches (``batch.micro_batches``) and only at the
columns with a trained token (``logits_to_keep``): the vocabulary projection of prompt
positions is never made. Needs ``rollout-proxy[train]`` (torch, transformers).
"""

from __future__ import annotations

import shutil
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

from rollout_proxy.trainer.batch import BatchError, PaddedBatch, Rollout, micro_batches
from rollout_proxy.trainer.loop import LearnerStep
from rollout_proxy.trainer.mismatch import ScoredSequence
from rollout_proxy.trainer.vision import VISION_MODEL_TYPES, VisionInputs, model_type

#: the optimizer's state in a checkpoint's directory (HF Trainer's name: engines loading the weights skip it)
OPTIMIZER = "optimizer.pt"

#: the adapter's config in a LoRA checkpoint (what tells one from a full-weight checkpoint)
ADAPTER_CONFIG = "adapter_config.json"

#: files of the source checkpoint copied next to the new weights, so each one is a whole HF checkpoint
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "vocab.json",
    "merges.txt",
    "processor_config.json",  # a vision-language model's image processor (``vision.VisionInputs``)
    "preprocessor_config.json",
)


@dataclass(frozen=True, slots=True)
class LoRAConfig:
    """The adapter a LoRA learner trains (``engines.adapters.lora_problems`` says what vLLM serves)."""

    rank: int
    alpha: int
    target_modules: tuple[str, ...]

    def peft(self) -> Any:
        from peft import LoraConfig

        # no dropout (its logprobs must be the engine's), no bias, DoRA or modules_to_save: vLLM serves none
        return LoraConfig(
            r=self.rank,
            lora_alpha=self.alpha,
            target_modules=list(self.target_modules),
            lora_dropout=0.0,
            bias="none",
            task_type="CAUSAL_LM",
        )


@dataclass(frozen=True, slots=True)
class GRPOConfig:
    learning_rate: float = 2e-5
    clip_low: float = 0.2  # ε_low
    clip_high: float = 0.2  # ε_high (larger values: DAPO's "clip higher")
    ratio_cap: float = 3.0  # C: a token's importance weight counts for at most this much (A < 0)
    kl_coef: float = 0.0  # β; > 0 keeps a frozen copy of the starting weights as the reference
    max_grad_norm: float = 1.0
    weight_decay: float = 0.0
    micro_batch_tokens: int = 4096  # rows × longest row per forward/backward
    temperature: float = 1.0  # the sampling temperature (processed logprobs divide the logits by it)
    #: keep a tied input/output embedding as it is: vLLM 0.32's in-place reload does not update a tied lm_head
    freeze_tied_embeddings: bool = True
    seed: int = 0
    lora: LoRAConfig | None = None  # train this adapter of the model, the base frozen; None: the full weights

    def __post_init__(self) -> None:
        if self.learning_rate < 0 or self.micro_batch_tokens < 1 or self.temperature <= 0:
            raise ValueError("learning_rate >= 0, micro_batch_tokens >= 1 and temperature > 0 are required")
        if not 0 <= self.clip_low < 1 or self.clip_high < 0 or self.ratio_cap <= 1 or self.kl_coef < 0:
            raise ValueError("0 <= clip_low < 1, clip_high >= 0, ratio_cap > 1 and kl_coef >= 0 are required")


def load_policy(model_dir: str | Path) -> Any:
    """An HF causal LM in fp32, in eval mode (no dropout: its logprobs must be the engine's); a vision-language
    one (``VISION_MODEL_TYPES``, by its config's ``model_type``) as an image-text-to-text model."""
    auto = AutoModelForImageTextToText if model_type(model_dir) in VISION_MODEL_TYPES else AutoModelForCausalLM
    model = auto.from_pretrained(str(model_dir), dtype=torch.float32)
    model.eval()
    return model


def token_logprobs(
    model: Any, batch: PaddedBatch, *, temperature: float = 1.0, vision: VisionInputs | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """log π(token t | tokens < t) and the entropy of π there, for the columns ``batch.trained_span``:
    two (rows, hi − lo) tensors (column j is token lo + j). Differentiable when grad is enabled.
    A batch with images needs ``vision`` (the model's): its pixels go in beside the ids."""
    lo, hi = batch.trained_span
    if hi <= lo:
        empty = torch.zeros((len(batch.rows), 0), dtype=torch.float32)
        return empty, empty
    input_ids = torch.from_numpy(batch.input_ids[:, :hi])  # later tokens change no logit of a trained one
    attention_mask = torch.from_numpy(batch.attention_mask[:, :hi])
    keep = torch.arange(lo - 1, hi - 1)  # the logits at t - 1 predict token t
    extra: dict[str, torch.Tensor] = {}
    if batch.has_images:
        if vision is None:
            raise BatchError("a sequence with images, and a model that takes none (its config's model_type)")
        extra = vision.inputs(batch, hi)
    logits = model(
        input_ids=input_ids, attention_mask=attention_mask, logits_to_keep=keep, use_cache=False, **extra
    ).logits
    logits = logits.float()
    if temperature != 1.0:
        logits = logits / temperature
    logp = torch.log_softmax(logits, dim=-1)
    targets = input_ids[:, lo:hi].unsqueeze(-1)
    chosen = logp.gather(-1, targets).squeeze(-1)
    entropy = -(logp.exp() * logp).sum(dim=-1)
    return chosen, entropy


def policy_loss(
    logprobs: torch.Tensor,
    sampling_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    weights: torch.Tensor,
    config: GRPOConfig,
    reference_logprobs: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The summed (not yet averaged) loss over the weighted tokens, and sums for the step's metrics."""
    log_ratio = torch.clamp(logprobs - sampling_logprobs, max=20.0)  # a floor logprob (-9999) must not overflow
    ratio = torch.exp(log_ratio)
    unclipped = ratio * advantages
    clipped = torch.clamp(ratio, 1.0 - config.clip_low, 1.0 + config.clip_high) * advantages
    surrogate = torch.minimum(unclipped, clipped)
    capped = torch.where(advantages < 0, torch.maximum(surrogate, config.ratio_cap * advantages), surrogate)
    per_token = -capped
    kl = torch.zeros_like(logprobs)
    if reference_logprobs is not None:
        gap = reference_logprobs - logprobs
        kl = torch.exp(gap) - gap - 1.0
        per_token = per_token + config.kl_coef * kl
    trained = weights > 0
    with torch.no_grad():
        sums = {
            "clipped": float(((clipped < unclipped) & trained).sum()),
            "capped": float(((capped != surrogate) & trained).sum()),
            "ratio": float((ratio * weights).sum()),
            "kl_ref": float((kl * weights).sum()),
        }
    return (per_token * weights).sum(), sums


class OptimizerStateMismatch(ValueError):
    """A checkpoint's optimizer state is of other trained parameters than this learner's."""


def is_adapter(directory: str | Path) -> bool:
    """Whether ``directory`` is a LoRA checkpoint (an adapter) rather than a whole model."""
    return (Path(directory) / ADAPTER_CONFIG).is_file()


def _with_adapter(model: Any, lora: LoRAConfig, adapter_dir: Path | None) -> Any:
    """``model`` (frozen) with ``lora`` trainable on it: a new adapter, or ``adapter_dir``'s (of the same settings)."""
    from peft import PeftModel, get_peft_model

    if adapter_dir is None:
        return get_peft_model(model, lora.peft())
    peft_model = PeftModel.from_pretrained(model, str(adapter_dir), is_trainable=True)
    saved: Any = peft_model.peft_config["default"]  # a LoraConfig
    found = (saved.r, saved.lora_alpha, tuple(sorted(saved.target_modules or ())))
    wanted = (lora.rank, lora.alpha, tuple(sorted(lora.target_modules)))
    if found != wanted:
        raise OptimizerStateMismatch(
            f"{adapter_dir} is an adapter of rank {found[0]}, alpha {found[1]} on {', '.join(found[2])}, not rank "
            f"{wanted[0]}, alpha {wanted[1]} on {', '.join(wanted[2])}: train on with its settings "
            "(--lora-rank, --lora-alpha, --target-modules), or start a new policy"
        )
    return peft_model


class GRPOLearner:
    """The policy, its optimizer and (with ``kl_coef``) a frozen reference; ``train_step`` is blocking."""

    def __init__(
        self,
        model_dir: str | Path,
        config: GRPOConfig | None = None,
        *,
        reference_dir: str | Path | None = None,
        adapter_dir: str | Path | None = None,
    ) -> None:
        """Loads ``model_dir`` and, where it has one (a checkpoint this learner saved), its optimizer state.
        ``reference_dir``: the KL reference's weights (default ``model_dir``; a restarted trainer keeps the
        weights it started from). With ``config.lora``: ``model_dir`` is the base, and ``adapter_dir`` the
        adapter to train on from (with its optimizer state, where it has one); None: a new adapter (its B
        zero: it starts as the base)."""
        self.config = config or GRPOConfig()
        torch.manual_seed(self.config.seed)
        lora = self.config.lora
        if lora is None and adapter_dir is not None:
            raise ValueError("an adapter is trained by a LoRA learner (GRPOConfig.lora)")
        self.source = Path(adapter_dir if adapter_dir is not None else model_dir)
        self.model = load_policy(model_dir)
        self.vision = (
            VisionInputs(model_dir, self.model.config) if model_type(model_dir) in VISION_MODEL_TYPES else None
        )
        if lora is not None:
            self.model = _with_adapter(self.model, lora, Path(adapter_dir) if adapter_dir is not None else None)
            self.model.eval()
        has_reference = self.config.kl_coef > 0 and lora is None  # with LoRA: the base, the adapter switched off
        self.reference = load_policy(reference_dir or model_dir) if has_reference else None
        if self.reference is not None:
            self.reference.requires_grad_(False)
        #: the tied embedding is not trained: the engine would keep serving its old copy as its lm_head
        self.frozen_embeddings = (
            lora is None
            and bool(getattr(self.model.config, "tie_word_embeddings", False))
            and self.config.freeze_tied_embeddings
        )
        if self.frozen_embeddings:
            self.model.get_input_embeddings().weight.requires_grad_(False)
        model_config = self.model.config
        pad = getattr(model_config, "pad_token_id", None)
        self.pad_id = int(pad if pad is not None else getattr(model_config, "eos_token_id", 0) or 0)
        self.optimizer = torch.optim.AdamW(
            [p for p in self.model.parameters() if p.requires_grad],
            lr=self.config.learning_rate,
            weight_decay=self.config.weight_decay,
        )
        if (self.source / OPTIMIZER).is_file():
            self.load_optimizer(self.source / OPTIMIZER)

    @property
    def optimizer_steps(self) -> int:
        """How many updates AdamW's moments have seen (0: a fresh optimizer)."""
        steps = [state["step"] for state in self.optimizer.state.values() if "step" in state]
        return int(max(steps)) if steps else 0

    def load_optimizer(self, path: Path) -> None:
        """AdamW's moments and step count from ``path``; the learning rate and weight decay stay this config's."""
        saved = torch.load(path, map_location="cpu", weights_only=True)
        try:
            self.optimizer.load_state_dict(saved)
        except ValueError as exc:
            raise OptimizerStateMismatch(
                f"{path} is the optimizer state of other trained parameters ({exc}); was the checkpoint trained "
                "with the tied embedding trained or frozen otherwise (--train-tied-embeddings)?"
            ) from exc
        for group in self.optimizer.param_groups:
            group["lr"], group["weight_decay"] = self.config.learning_rate, self.config.weight_decay

    def score(self, rollouts: Sequence[Rollout]) -> list[ScoredSequence]:
        """The trainer's logprob of every trained token, without training (no gradients)."""
        scored = []
        with torch.no_grad():
            for batch in micro_batches(rollouts, max_tokens=self.config.micro_batch_tokens, pad_id=self.pad_id):
                logprobs, _ = token_logprobs(self.model, batch, temperature=self.config.temperature, vision=self.vision)
                scored += _scored(rollouts, batch, logprobs)
        return scored

    def train_step(self, rollouts: Sequence[Rollout]) -> LearnerStep:
        started = time.monotonic()
        batches = micro_batches(rollouts, max_tokens=self.config.micro_batch_tokens, pad_id=self.pad_id)
        total_weight = float(sum(batch.loss_weight.sum() for batch in batches))
        self.optimizer.zero_grad(set_to_none=True)
        scored: list[ScoredSequence] = []
        sums = {"loss": 0.0, "clipped": 0.0, "capped": 0.0, "ratio": 0.0, "kl_ref": 0.0, "entropy": 0.0}
        for batch in batches:
            lo, hi = batch.trained_span
            logprobs, entropy = token_logprobs(
                self.model, batch, temperature=self.config.temperature, vision=self.vision
            )
            weights = torch.from_numpy(batch.loss_weight[:, lo:hi])
            reference = self._reference_logprobs(batch)
            loss, batch_sums = policy_loss(
                logprobs,
                torch.from_numpy(batch.sampling_logprobs[:, lo:hi]),
                torch.from_numpy(batch.advantages[:, lo:hi]),
                weights,
                self.config,
                reference,
            )
            if total_weight > 0:
                (loss / total_weight).backward()
            sums["loss"] += float(loss.detach())
            sums["entropy"] += float((entropy.detach() * weights).sum())
            for name, value in batch_sums.items():
                sums[name] += value
            scored += _scored(rollouts, batch, logprobs.detach())
        grad_norm = 0.0
        if total_weight > 0:
            parameters = [p for p in self.model.parameters() if p.grad is not None]
            grad_norm = float(torch.nn.utils.clip_grad_norm_(parameters, self.config.max_grad_norm))
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        per_token = max(total_weight, 1.0)
        metrics = {
            "loss": sums["loss"] / per_token,
            "clip_fraction": sums["clipped"] / per_token,
            "capped_fraction": sums["capped"] / per_token,
            "ratio_mean": sums["ratio"] / per_token,
            "entropy": sums["entropy"] / per_token,
            "grad_norm": grad_norm,
            "micro_batches": float(len(batches)),
            "padded_tokens": float(sum(batch.input_ids.size for batch in batches)),
            "train_s": time.monotonic() - started,
        }
        if self.config.kl_coef > 0:
            metrics["kl_ref"] = sums["kl_ref"] / per_token
        return LearnerStep(scored=scored, metrics=metrics)

    def _reference_logprobs(self, batch: PaddedBatch) -> torch.Tensor | None:
        """The KL reference's logprobs (None without ``kl_coef``): the starting weights, or the base under LoRA."""
        if self.config.kl_coef <= 0:
            return None
        with torch.no_grad():
            if self.reference is not None:
                return token_logprobs(self.reference, batch, temperature=self.config.temperature, vision=self.vision)[0]
            with self.model.disable_adapter():
                return token_logprobs(self.model, batch, temperature=self.config.temperature, vision=self.vision)[0]

    def save(self, directory: Path) -> None:
        """The current weights as an HF checkpoint (safetensors, the source's config and tokenizer), or under
        LoRA the adapter as vLLM loads it, and the optimizer's state (``optimizer.pt``), written beside
        ``directory`` and renamed into place: a reader never sees half of one, nor weights without their
        optimizer state."""
        directory.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{directory.name}.", dir=directory.parent))
        try:
            if self.config.lora is not None:  # the base embedding is never copied in (vLLM skips it anyway)
                self.model.save_pretrained(staging, save_embedding_layers=False)
            else:
                self.model.save_pretrained(staging)
            torch.save(self.optimizer.state_dict(), staging / OPTIMIZER)
            for name in TOKENIZER_FILES if self.config.lora is None else ():
                if (self.source / name).is_file() and not (staging / name).exists():
                    shutil.copy2(self.source / name, staging / name)
            staging.chmod(0o755)
            if directory.exists():  # a checkpoint of an attempt that died before its intent: moved aside whole
                replaced = Path(tempfile.mkdtemp(prefix=f".{directory.name}.", dir=directory.parent))
                directory.rename(replaced / directory.name)
                shutil.rmtree(replaced)
            staging.rename(directory)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise


def _scored(rollouts: Sequence[Rollout], batch: PaddedBatch, logprobs: torch.Tensor) -> list[ScoredSequence]:
    """Each row's trained tokens, with the trainer's and the sampler's logprobs."""
    lo, hi = batch.trained_span
    values = logprobs.numpy().astype(np.float32)
    out = []
    for row, ref in enumerate(batch.rows):
        columns = np.flatnonzero(batch.loss_weight[row, lo:hi] > 0)
        positions = lo + columns
        sequence = rollouts[ref.rollout].sequences[ref.sequence]
        out.append(
            ScoredSequence(
                group_id=rollouts[ref.rollout].group_id,
                rollout=rollouts[ref.rollout].index,
                sequence=ref.sequence,
                positions=positions.astype(np.int64),
                token_ids=batch.input_ids[row, positions],
                versions=batch.versions[row, positions],
                trainer=values[row, columns],
                sampler=batch.sampling_logprobs[row, positions],
                response_id=sequence.response_id,
                branch=sequence.branch,
                images=len(sequence.images),
            )
        )
    return out
