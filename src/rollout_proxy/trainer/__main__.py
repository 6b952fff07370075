"""``python -m rollout_proxy.trainer``: the reference GRPO trainer (a reference, not a framework).

Reads a job's graded groups from the Redis feed, takes one GRPO / PPO-clip step per job step on
a Hugging Face checkpoint in fp32 on the CPU (torch), checks the trainer's logprob of every
trained token against the recorded sampling logprob (the mismatch report), writes the new
weights, and puts them on the fleet: pause through the proxy, vLLM's ``reload_weights`` on every
paused engine, resume at the next policy version. Run it beside a job with
``training_loop.max_staleness`` (docs/training.md):

    python -m rollout_proxy.trainer --proxy http://127.0.0.1:8080 --admin-key KEY \\
        --feed redis://127.0.0.1:6379/0 --model CHECKPOINT --out out/trainer [--steps N] [--lr 2e-5]

Writes OUT/steps.jsonl (a JSON line per step: rewards, loss, the mismatch report, timings),
OUT/metrics.prom (Prometheus text), OUT/steps.png (reward and mismatch per step),
OUT/weights/v<version>/ (the newest --keep-weights checkpoints, each with its optimizer state) and
OUT/state.json (what a restarted trainer resumes from: killed anywhere, it trains each group once
and goes on with AdamW where it was). Needs ``pip install 'rollout-proxy[train]'`` (torch, transformers).
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
from rollout_proxy.trainer.fleet import FleetDriver, FleetUpdateFailed
from rollout_proxy.trainer.loop import ReferenceTrainer, ResumeConflict, ResumePoint, say
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
    from rollout_proxy.trainer.grpo import GRPOConfig, GRPOLearner, OptimizerStateMismatch

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
    )
    out = Path(settings.out)
    await asyncio.to_thread(out.mkdir, parents=True, exist_ok=True)
    async with (
        ProxyClient(settings.proxy, settings.admin_key, timeout=settings.reload_timeout + 120.0) as proxy,
        TrajectoryConsumer(
            settings.feed, stream=settings.stream, consumer=settings.consumer, claim_idle_ms=settings.claim_idle_ms
        ) as feed,
    ):
        fleet = FleetDriver(proxy, pause_mode=settings.pause_mode, reload_timeout=settings.reload_timeout)
        start = await ResumePoint.read(fleet, out)
        version, model = start.version, start.weights or Path(settings.model)
        if start.weights is None and start.state is not None:
            say(f"the fleet is at version {version}, whose weights this trainer did not write: starting from {model}")
        if not (model / "config.json").is_file():
            say(f"no checkpoint in {model}: build it with `python -m devtools.engine_env setup`")
            return 2
        if start.finishing is not None:
            say(f"finishing step {start.finishing.step} (its update to version {start.finishing.version}) first")
        say(f"loading {model} (fp32) for the fleet's version {version}")
        try:
            learner = await asyncio.to_thread(GRPOLearner, model, config, reference_dir=Path(settings.model))
        except OptimizerStateMismatch as exc:
            say(str(exc))
            return 2
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
    say(f"done: {len(trainer.records)} update(s), fleet at version {trainer.version}; step log {out / 'steps.jsonl'}")
    return 0


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
    except ImportError as exc:
        say(
            f"the trainer needs torch and transformers ({exc}): pip install 'rollout-proxy[train]' (a CPU build: "
            "docs/training.md says how to pick CPU or CUDA)"
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
