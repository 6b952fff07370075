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
from rollout_proxy.state.connection import is_redis_url
from rollout_proxy.trainer.batch import BatchError
from rollout_proxy.trainer.consumer import TrajectoryConsumer
from rollout_proxy.trainer.fleet import FleetDriver, FleetUpdateFailed
from rollout_proxy.trainer.loop import ReferenceTrainer, ResumeConflict, ResumePoint, say
from rollout_proxy.trainer.mismatch import DEFAULT_THRESHOLD


def parser() -> argparse.ArgumentParser:
    parse = argparse.ArgumentParser(
        prog="python -m rollout_proxy.trainer",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    where = parse.add_argument_group("where")
    where.add_argument("--proxy", required=True, help="the proxy's URL (its admin API pauses and resumes the fleet)")
    where.add_argument(
        "--admin-key",
        default=os.environ.get("ROLLOUT_PROXY_ADMIN_KEY"),
        help="the proxy's admin key (default: $ROLLOUT_PROXY_ADMIN_KEY)",
    )
    where.add_argument("--feed", required=True, help="the job's Redis feed: redis://HOST:PORT/DB")
    where.add_argument("--stream", default="trajectories", help="the feed's stream (the job's proxy.feed_stream)")
    where.add_argument("--consumer", default="trainer-0", help="this trainer's name in the feed's consumer group")
    where.add_argument(
        "--claim-idle-ms",
        type=int,
        default=60_000,
        help="take over groups another consumer left unacknowledged this long (a trainer that died)",
    )
    where.add_argument(
        "--model",
        required=True,
        help="the HF checkpoint the fleet serves now (the scripts' dense SmolLM2-135M: model_dense in `python -m "
        "devtools.engine_env paths`); a restarted trainer starts from its own checkpoint in OUT/weights "
        "instead (the fleet's version, or the one of a step it was putting on the fleet) when it wrote that one",
    )
    where.add_argument("--out", required=True, help="output directory: step log, metrics, weights, state")
    where.add_argument(
        "--steps",
        type=int,
        help="stop after this many steps recorded (a step a restart finishes counts; default: run until stopped)",
    )
    learn = parse.add_argument_group("the step")
    learn.add_argument("--lr", type=float, default=2e-5, help="AdamW learning rate (default 2e-5)")
    learn.add_argument("--clip-low", type=float, default=0.2, help="PPO clip below 1 (default 0.2)")
    learn.add_argument("--clip-high", type=float, default=0.2, help="PPO clip above 1 (default 0.2)")
    learn.add_argument(
        "--ratio-cap",
        type=float,
        default=3.0,
        help="a token's importance weight counts for at most this much (negative advantages; default 3)",
    )
    learn.add_argument("--kl-coef", type=float, default=0.0, help="k3 KL to the starting weights (default 0: off)")
    learn.add_argument("--max-grad-norm", type=float, default=1.0, help="gradient clipping (default 1.0)")
    learn.add_argument(
        "--temperature",
        type=float,
        default=1.0,
        help="the job's sampling temperature (the engine's processed logprobs are of logits / temperature)",
    )
    learn.add_argument(
        "--micro-batch-tokens",
        type=int,
        default=4096,
        help="rows x longest row per forward/backward (memory; default 4096)",
    )
    learn.add_argument(
        "--train-tied-embeddings",
        action="store_true",
        help="train a tied input/output embedding too (off by default: vLLM 0.32's in-place reload keeps the "
        "tied lm_head's old copy, which the mismatch report shows on every token; docs/training.md)",
    )
    learn.add_argument("--seed", type=int, default=0)
    learn.add_argument("--threads", type=int, help="torch's CPU threads (default: torch's choice)")
    check = parse.add_argument_group("the mismatch report and the fleet")
    check.add_argument(
        "--mismatch-threshold",
        type=float,
        default=DEFAULT_THRESHOLD,
        help=f"|trainer - sampling logprob| over this (nats) counts a token as mismatched (default {DEFAULT_THRESHOLD:g})",
    )
    check.add_argument("--pause-mode", choices=["keep", "wait", "abort"], default="keep")
    check.add_argument(
        "--reload-timeout", type=float, default=600.0, help="seconds each engine may take to reload (default 600)"
    )
    check.add_argument(
        "--keep-weights",
        type=int,
        default=2,
        help="checkpoints kept in OUT/weights, each with its optimizer state (default 2; the fleet's is always kept)",
    )
    return parse


async def train(args: argparse.Namespace) -> int:
    from rollout_proxy.trainer.grpo import GRPOConfig, GRPOLearner, OptimizerStateMismatch

    config = GRPOConfig(
        learning_rate=args.lr,
        clip_low=args.clip_low,
        clip_high=args.clip_high,
        ratio_cap=args.ratio_cap,
        kl_coef=args.kl_coef,
        max_grad_norm=args.max_grad_norm,
        micro_batch_tokens=args.micro_batch_tokens,
        temperature=args.temperature,
        freeze_tied_embeddings=not args.train_tied_embeddings,
        seed=args.seed,
    )
    out = Path(args.out)
    await asyncio.to_thread(out.mkdir, parents=True, exist_ok=True)
    async with (
        ProxyClient(args.proxy, args.admin_key, timeout=args.reload_timeout + 120.0) as proxy,
        TrajectoryConsumer(
            args.feed, stream=args.stream, consumer=args.consumer, claim_idle_ms=args.claim_idle_ms
        ) as feed,
    ):
        fleet = FleetDriver(proxy, pause_mode=args.pause_mode, reload_timeout=args.reload_timeout)
        start = await ResumePoint.read(fleet, out)
        version, model = start.version, start.weights or Path(args.model)
        if start.weights is None and start.state is not None:
            say(f"the fleet is at version {version}, whose weights this trainer did not write: starting from {model}")
        if not (model / "config.json").is_file():
            say(f"no checkpoint in {model}: build it with `python -m devtools.engine_env setup`")
            return 2
        if start.finishing is not None:
            say(f"finishing step {start.finishing.step} (its update to version {start.finishing.version}) first")
        say(f"loading {model} (fp32) for the fleet's version {version}")
        try:
            learner = await asyncio.to_thread(GRPOLearner, model, config, reference_dir=Path(args.model))
        except OptimizerStateMismatch as exc:
            say(str(exc))
            return 2
        if learner.optimizer_steps:
            say(f"AdamW goes on from its state in {model}: {learner.optimizer_steps} update(s) in")
        say(f"reading graded groups from {args.feed}, stream {args.stream!r}, as consumer {args.consumer!r}")
        trainer = ReferenceTrainer(
            learner,
            feed,
            fleet,
            out,
            version=version,
            threshold=args.mismatch_threshold,
            keep_weights=args.keep_weights,
            state=start.state,
        )
        await trainer.run(args.steps)
    say(f"done: {len(trainer.records)} update(s), fleet at version {trainer.version}; step log {out / 'steps.jsonl'}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if not args.admin_key:
        parser().error("--admin-key (or $ROLLOUT_PROXY_ADMIN_KEY) is required: pause and resume are admin calls")
    if args.steps is not None and args.steps < 1:
        parser().error("--steps must be at least 1")
    if not is_redis_url(args.feed):
        parser().error(
            f"--feed {args.feed!r}: the trainer reads a Redis feed (redis://HOST:PORT/DB), as the job publishes"
        )
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
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        return asyncio.run(train(args))
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
