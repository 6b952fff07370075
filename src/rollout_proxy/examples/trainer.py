"""A minimal trainer around rollout-proxy: the whole loop, runner → feed → trainer → new version → runner.

    python -m rollout_proxy.examples.trainer --proxy http://127.0.0.1:8080 --admin-key KEY \\
        --feed redis://127.0.0.1:6379/0 [--pause-mode keep] [--weights DIR] [--steps N]

Per step of the job it:

1. reads the step's groups from the feed (``TrajectoryConsumer``; each group says how many
   its step has, ``step_groups``, so the trainer knows when the batch is complete);
2. "trains" on them: here it prints the rewards; yours takes a gradient step on
   ``total_token_ids`` / ``total_loss_weight`` / ``total_token_logprobs`` and the advantages
   (``python -m rollout_proxy.trainer``, the reference GRPO trainer, does: docs/training.md);
3. pauses the fleet (``POST /v1/admin/pause``: new turns queue in the proxy; ``keep`` freezes
   the calls in flight, ``wait`` lets them finish, ``abort`` cuts them and the proxy finishes them after);
4. loads the new weights into every paused engine: with ``--weights DIR`` a real vLLM
   (``VLLM_SERVER_DEV_MODE=1``) reloads the checkpoint in DIR through ``/collective_rpc``
   ``reload_weights``; without it only the version changes (what the fake engine's logprobs follow);
5. resumes with ``policy_version + 1`` (``POST /v1/admin/resume``): the proxy sets it on every
   engine, and the runner, waiting for that version (``max_staleness``), starts its next step;
6. acknowledges the groups. A trainer that dies before this gets them again (at least once).
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field

from rollout_proxy.engines.vllm_http import VLLMEngine
from rollout_proxy.sdk.transport import ProxyClient
from rollout_proxy.trainer import FeedEntry, TrajectoryConsumer

#: seconds one engine may take to reload a checkpoint in place (vLLM loads and copies every weight)
RELOAD_TIMEOUT_S = 300.0


@dataclass
class Update:
    """One weight update: the job step trained on, the version it produced, and when the fleet resumed."""

    step: int
    groups: int
    version: int
    paused_at: float  # time.monotonic()
    resumed_at: float


@dataclass
class ExampleTrainer:
    proxy: ProxyClient  # with the admin key
    feed: TrajectoryConsumer
    pause_mode: str = "keep"
    weights: str | None = None  # a checkpoint directory for vLLM's reload_weights; None: a version bump only
    train_seconds: float = 0.0  # how long the pretend optimizer step takes
    updates: list[Update] = field(default_factory=list)

    async def run(self, steps: int | None = None) -> list[Update]:
        """Train on ``steps`` steps (None: until the feed is closed or idle with ``stop_when_idle``)."""
        pending: dict[int, list[FeedEntry]] = defaultdict(list)
        async for entry in self.feed:
            group = entry.group
            if group.step_groups is None:
                raise ValueError(f"{group.group_id}: no step_groups; publish with a runner that sets it")
            pending[group.step].append(entry)
            if len(pending[group.step]) == group.step_groups:
                await self.train_step(group.step, pending.pop(group.step))
                if steps is not None and len(self.updates) >= steps:
                    break
        return self.updates

    async def train_step(self, step: int, entries: list[FeedEntry]) -> None:
        rewards = [reward for entry in entries for reward in entry.group.rewards]
        stale = sum(entry.group.stale for entry in entries)
        oldest = min(
            (e.group.oldest_policy_version for e in entries if e.group.oldest_policy_version is not None), default=None
        )
        print(
            f"step {step}: {len(entries)} group(s), mean reward {sum(rewards) / max(len(rewards), 1):.3f}, "
            f"oldest policy version {oldest}, {stale} marked stale"
        )
        await asyncio.sleep(self.train_seconds)  # ... your optimizer step goes here ...
        paused_at = time.monotonic()
        paused = await self.proxy.apost("/v1/admin/pause", {"mode": self.pause_mode}, what="pausing the fleet")
        version = int(paused["policy_version"]) + 1
        if paused["failed"]:  # the proxy marked them unhealthy: they stay out until re-admitted
            print(f"{paused['failed']} engine(s) did not pause: {[e for e in paused['engines'] if not e['ok']]}")
        if self.weights is not None:
            await self.reload([engine["url"] for engine in paused["engines"] if engine["state"] == "paused"])
        await self.proxy.apost("/v1/admin/resume", {"policy_version": version}, what="resuming the fleet")
        self.updates.append(Update(step, len(entries), version, paused_at, time.monotonic()))
        for entry in entries:
            await self.feed.ack(entry)
        print(f"step {step}: policy version {version}, fleet paused for {time.monotonic() - paused_at:.2f}s")

    async def reload(self, engine_urls: Sequence[str]) -> None:
        """vLLM's own reload path, on every paused engine at once.

        If any engine fails, the trainer stops with the fleet paused: an engine still holding the
        old weights must not be resumed at the new version (reload it, or remove it with
        ``DELETE /v1/admin/engines?url=``, then resume). The proxy's ``--pause-wait`` bounds the
        queued turns meanwhile."""
        clients = [VLLMEngine(url) for url in engine_urls]  # the product's engine client: its dev-mode calls
        try:
            results = await asyncio.gather(
                *(client.reload_weights(str(self.weights), within=RELOAD_TIMEOUT_S) for client in clients),
                return_exceptions=True,
            )
        finally:
            await asyncio.gather(*(client.close() for client in clients))
        failed = {url: repr(error) for url, error in zip(engine_urls, results, strict=True) if error is not None}
        if failed:
            raise RuntimeError(
                f"reloading {self.weights} failed on {len(failed)} engine(s), fleet left paused: {failed}"
            )


async def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--proxy", required=True, help="the proxy's URL")
    parser.add_argument("--admin-key", required=True)
    parser.add_argument("--feed", required=True, help="the job's Redis feed: redis://HOST:PORT/DB")
    parser.add_argument("--stream", default="trajectories", help="the feed's stream (the job's proxy.feed_stream)")
    parser.add_argument("--pause-mode", choices=["keep", "wait", "abort"], default="keep")
    parser.add_argument("--weights", help="checkpoint directory each vLLM engine reloads per step (default: none)")
    parser.add_argument("--steps", type=int, help="stop after this many updates (default: run until stopped)")
    parser.add_argument("--train-seconds", type=float, default=0.0, help="how long the pretend optimizer step takes")
    args = parser.parse_args(argv)
    async with (
        ProxyClient(args.proxy, args.admin_key, timeout=600.0) as proxy,
        TrajectoryConsumer(args.feed, stream=args.stream) as feed,
    ):
        trainer = ExampleTrainer(
            proxy, feed, pause_mode=args.pause_mode, weights=args.weights, train_seconds=args.train_seconds
        )
        await trainer.run(args.steps)


if __name__ == "__main__":
    asyncio.run(main())
