"""``python -m rollout_proxy.trainer``: the reference GRPO trainer (a reference, not a framework).

Reads a job's graded groups from the Redis feed, takes one GRPO / PPO-clip step per job step on
a Hugging Face checkpoint in fp32 on the CPU (torch), checks the trainer's logprob of every
trained token against the recorded sampling logprob (the mismatch report), writes the new
weights, and puts them on the fleet: pause through the proxy, vLLM's ``reload_weights`` on every
paused engine, resume at the next policy version. Run it beside a job with
``training_loop.max_staleness`` (docs/training.md):

    python -m rollout_proxy.trainer --proxy http://127.0.0.1:8080 --admin-key KEY \\
        --feed redis://127.0.0.1:6379/0 --model CHECKPOINT --out out/trainer [--steps N] [--lr 2e-5]

With ``--lora-rank R --policy NAME`` it trains a LoRA adapter of the checkpoint instead (peft; the base
frozen) and publishes each step's adapter as the proxy's LoRA policy NAME's next version, with no pause;
a policy with no version yet is registered with the untrained adapter as version 1 (docs/policies.md).

Writes OUT/steps.jsonl (a JSON line per step: rewards, loss, the mismatch report, timings),
OUT/metrics.prom (Prometheus text), OUT/steps.png (reward and mismatch per step),
OUT/weights/v<version>/ (the newest --keep-weights checkpoints, each with its optimizer state) and
OUT/state.json (what a restarted trainer resumes from: killed anywhere, it trains each group once
and goes on with AdamW where it was). Needs ``pip install 'rollout-proxy[train]'`` (torch, transformers, peft).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from rollout_proxy.errors import StoreUnavailable
from rollout_proxy.sdk.transport import ProxyClient, ProxyRequestError
from rollout_proxy.trainer.batch import BatchError
from rollout_proxy.trainer.consumer import TrajectoryConsumer
from rollout_proxy.trainer.fleet import FleetDriver, FleetUpdateFailed, PolicyPublisher
from rollout_proxy.trainer.loop import (
    Publisher,
    ReferenceTrainer,
    ResumeConflict,
    ResumePoint,
    has_checkpoint,
    publish_untrained,
    say,
    weights_dir,
)
from rollout_proxy.trainer.settings import TrainerSettings


def parser() -> argparse.ArgumentParser:
    """The trainer's flags: ``TrainerSettings``' fields (each also ``ROLLOUT_PROXY_TRAINER_<NAME>``)."""
    parse = argparse.ArgumentParser(
        prog="python -m rollout_proxy.trainer",
        description=__doc__,
        epilog="Every option also reads ROLLOUT_PROXY_TRAINER_<OPTION>, but the admin key: ROLLOUT_PROXY_ADMIN_KEY; "
        "flags win.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    TrainerSettings.add_arguments(parse)
    return parse


async def train(settings: TrainerSettings) -> int:
    from rollout_proxy.trainer.grpo import GRPOConfig, GRPOLearner, LoRAConfig, OptimizerStateMismatch

    lora = None
    if settings.lora_rank is not None:
        lora = LoRAConfig(rank=settings.lora_rank, alpha=settings.alpha, target_modules=settings.target_modules)
    config = GRPOConfig(
        learning_rate=settings.lr,
        clip_low=settings.clip_low,
        clip_high=settings.clip_high,
        ratio_cap=settings.ratio_cap,
        kl_coef=settings.kl_coef,
        max_grad_norm=settings.max_grad_norm,
        micro_batch_tokens=settings.micro_batch_tokens,
        temperature=settings.temperature,
        freeze_tied_embeddings=not settings.train_tied_embeddings,
        seed=settings.seed,
        lora=lora,
    )
    out = await asyncio.to_thread(Path(settings.out).resolve)  # absolute: the engines read adapters by path
    await asyncio.to_thread(out.mkdir, parents=True, exist_ok=True)
    async with (
        ProxyClient(settings.proxy, settings.admin_key, timeout=settings.reload_timeout + 120.0) as proxy,
        TrajectoryConsumer(
            settings.feed, stream=settings.stream, consumer=settings.consumer, claim_idle_ms=settings.claim_idle_ms
        ) as feed,
    ):
        fleet: Publisher
        if settings.policy is not None:
            fleet = PolicyPublisher(proxy, settings.policy)
        else:
            fleet = FleetDriver(proxy, pause_mode=settings.pause_mode, reload_timeout=settings.reload_timeout)
        start = await ResumePoint.read(fleet, out)
        version, model = start.version, start.weights or Path(settings.model)
        if lora is not None:
            model = Path(settings.model)
        elif start.weights is None and start.state is not None:
            say(f"the fleet is at version {version}, whose weights this trainer did not write: starting from {model}")
        if not (model / "config.json").is_file():
            say(f"no checkpoint in {model}: build it with `python -m devtools.engine_env setup`")
            return 2
        if start.finishing is not None:
            say(f"finishing step {start.finishing.step} (its update to version {start.finishing.version}) first")
        try:
            if isinstance(fleet, PolicyPublisher):
                adapter = await lora_start(fleet, start)
                say(
                    f"loading {model} (fp32) with {adapter or 'a new adapter'} for policy {fleet.policy}'s version {version}"
                )
                learner = await asyncio.to_thread(GRPOLearner, model, config, adapter_dir=adapter)
            else:
                say(f"loading {model} (fp32) for the fleet's version {version}")
                learner = await asyncio.to_thread(GRPOLearner, model, config, reference_dir=Path(settings.model))
        except OptimizerStateMismatch as exc:
            say(str(exc))
            return 2
        if isinstance(fleet, PolicyPublisher) and version == 0:
            version = await publish_untrained(learner, fleet, out)
            say(
                f"registered policy {fleet.policy} with the untrained adapter ({weights_dir(out, 1)}) as version {version}"
            )
        if learner.optimizer_steps:
            say(f"AdamW goes on from its state in {model}: {learner.optimizer_steps} update(s) in")
        say(
            f"reading graded groups from {settings.feed}, stream {settings.stream!r}, as consumer {settings.consumer!r}"
        )
        trainer = ReferenceTrainer(
            learner,
            feed,
            fleet,
            out,
            version=version,
            threshold=settings.mismatch_threshold,
            keep_weights=settings.keep_weights,
            state=start.state,
        )
        await trainer.run(settings.steps)
    where = "fleet" if settings.policy is None else f"policy {settings.policy}"
    say(f"done: {len(trainer.records)} update(s), {where} at version {trainer.version}; step log {out / 'steps.jsonl'}")
    return 0


async def lora_start(publisher: PolicyPublisher, start: ResumePoint) -> Path | None:
    """The adapter a LoRA trainer trains on from: its own of the policy's version (or of the step it was
    publishing), else the one the policy serves now; None: a new one (the policy has no version yet).
    ResumeConflict where the trainer recorded versions the proxy does not have."""
    if start.weights is not None:
        return start.weights
    if start.version == 0:
        if start.state is not None and start.state.version > 0:
            raise ResumeConflict(
                f"the proxy has no version of policy {publisher.policy}, but this trainer recorded version "
                f"{start.state.version} ({start.state.weights}): register it again with that adapter (POST "
                '/v1/admin/policies {"name", "path"} then each version up to it), or move state.json away to '
                "start a new adapter"
            )
        return None
    path = await publisher.current_path()
    if path is None or not await asyncio.to_thread(has_checkpoint, path):
        raise ResumeConflict(
            f"policy {publisher.policy} is at version {start.version}, whose adapter ({path}) this trainer did not "
            "write and cannot read here: run it where that directory is, or name another --policy"
        )
    say(
        f"policy {publisher.policy} is at version {start.version}, whose adapter this trainer did not write: "
        f"training on from {path}"
    )
    return Path(path)


def main(argv: Sequence[str] | None = None) -> int:
    options = parser().parse_args(argv)
    try:
        settings = TrainerSettings.from_env(**vars(options))
    except ValueError as exc:
        parser().error(str(exc))
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the checkpoint is on disk: nothing is downloaded
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        import torch
        import transformers

        if settings.lora_rank is not None:
            import peft  # noqa: F401
    except ImportError as exc:
        say(
            f"the trainer needs torch and transformers, and peft for LoRA ({exc}): pip install 'rollout-proxy[train]' "
            "(a CPU build: docs/training.md says how to pick CPU or CUDA)"
        )
        return 2
    transformers.utils.logging.disable_progress_bar()  # "Loading weights" bars at every load and save
    if settings.threads:
        torch.set_num_threads(settings.threads)
    try:
        return asyncio.run(train(settings))
    except KeyboardInterrupt:
        return 130
    except (ProxyRequestError, StoreUnavailable, BatchError, FleetUpdateFailed, ResumeConflict) as exc:
        # the proxy refused or is unreachable, Redis is down, a group cannot be trained on, an engine did not
        # reload, state.json and the fleet disagree: said in words; whatever was not acknowledged stays on the
        # feed for the next start
        say(f"stopped: {exc}")
        return 1


if __name__ == "__main__":
    sys.exit(main())
