"""``./scripts/demo.sh --train``: the short-answer job for N steps with the reference trainer between them.

What it starts, all on 127.0.0.1 and stopped at the end: a redis-server (the feed, a Redis Stream
the trainer reads with a consumer group; installed with apt on first use: ``devtools.apt``), vLLM (CPU, fp32 dense SmolLM2-135M, dev mode: pause,
resume, ``reload_weights``), a rollout-proxy in front of it, the reference trainer
(``python -m rollout_proxy.trainer``, its own process) and the rollout runner with
``training_loop.max_staleness: 0``: step k rolls out with the weights trained on steps 0..k-1.
Every step the trainer checks its logprob of every trained token against vLLM's (the mismatch
report) before it trains.

Writes under OUT/<run>/: ``steps.png`` (reward and mismatch per step), ``rollouts.png`` (the
runner's per-step plot), ``feed.jsonl`` and ``trajectories.jsonl``, and ``trainer/`` (its log,
``steps.jsonl``, ``metrics.prom``, the last checkpoint). A benchmark, not a test: docs/training.md
gives a measured run.

With ``--lora`` (``lora_job``) the job is a ``GRPOLoRA`` job (``job.yaml`` in the run's directory): its
sessions sample the LoRA policy ``short-answer-lora``, vLLM serves adapters (``--enable-lora``, run-time
loading), and the trainer (``--job job.yaml``) trains a rank-16 adapter of the frozen base and publishes each
step's adapter as the policy's next version, the fleet never paused (docs/policies.md gives a measured run).
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from devtools import apt, engine_env
from devtools.vllm_server import VLLMServer

if TYPE_CHECKING:
    from rollout_proxy.runner.job import JobConfig

#: the demo's sizes: 8 questions x 4 rollouts a step, 8 steps; a learning rate that moves a 135M model in that
STEPS, SAMPLES, GENERATIONS, LEARNING_RATE = 8, 8, 4, 2e-5
#: the LoRA demo's adapter: its policy, its rank (alpha twice that), the engines' LoRA slots; and a learning rate
#: that moves it in 8 steps (an adapter starts at zero and changes a rank-16 slice: far more than the weights' lr)
LORA_POLICY, LORA_RANK, LORA_SLOTS, LORA_LEARNING_RATE = "short-answer-lora", 16, 4, 5e-4
#: |delta| that counts as a mismatch in the demo's report: fp32 on the same weights measured ~2e-5
THRESHOLD = 1e-3
#: the GRPOLoRA job file the demo writes in its run's directory (the trainer's --job)
JOB_FILE = "job.yaml"


def log(message: str) -> None:
    print(f"[train-demo] {message}", file=sys.stderr, flush=True)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class RedisProcess:
    """A private redis-server (no persistence) for the feed, stopped by ``stop``."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.process: subprocess.Popen[bytes] | None = None
        self.url = ""

    def start(self, timeout: float = 10.0) -> str:
        binary = apt.ensure_command("redis-server", why="the training demo's feed (a Redis Stream)")
        port = free_port()
        self.workdir.mkdir(parents=True, exist_ok=True)
        args = ["--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
        self.process = subprocess.Popen(
            [binary, *args, "--dir", str(self.workdir)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                    self.url = f"redis://127.0.0.1:{port}/0"
                    return self.url
            except OSError:
                time.sleep(0.05)
        self.stop()
        raise SystemExit("redis-server did not start")

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            self.process.wait(timeout=10)
        self.process = None


@dataclass
class TrainDemo:
    job: JobConfig
    out: Path
    learning_rate: float = LEARNING_RATE
    seed: int = 0

    def trainer_command(self, proxy_url: str, admin_key: str, feed: str, run_dir: Path) -> list[str]:
        """The trainer's command line; for a GRPOLoRA job, ``--job`` with its file in ``run_dir`` (the adapter to
        train and the policy to publish, as the runner's sessions sample it)."""
        lora = ["--job", str(run_dir / JOB_FILE)] if self.job.lora is not None else []
        return [
            sys.executable,
            "-m",
            "rollout_proxy.trainer",
            "--proxy",
            proxy_url,
            "--admin-key",
            admin_key,
            "--feed",
            feed,
            "--stream",
            self.job.proxy.feed_stream,
            "--model",
            str(engine_env.checkpoint_paths()["dense"]),
            "--out",
            str(run_dir / "trainer"),
            "--steps",
            str(self.job.hyperparameters.num_steps),
            "--lr",
            str(self.learning_rate),
            "--temperature",
            str(self.job.hyperparameters.temperature),
            "--seed",
            str(self.seed),
            "--mismatch-threshold",
            str(THRESHOLD),
            "--keep-weights",
            "1",
            *lora,
        ]

    def engine(self) -> VLLMServer:
        """vLLM (CPU) in dev mode; for a GRPOLoRA job serving adapters up to its rank, loaded at run time."""
        from devtools.demo import TEMPLATE

        lora = self.job.lora
        return VLLMServer(
            "dense",
            chat_template=TEMPLATE,
            tool_parser="hermes",
            dev_mode=True,
            extra_args=["--seed", str(self.seed)],
            die_with_parent=True,
            lora=lora is not None,
            max_lora_rank=lora.rank if lora is not None else LORA_RANK,
            max_loras=LORA_SLOTS,
        )

    def run(self) -> Path:
        """Everything, in order; the run's directory. Stops whatever it started, also on failure."""
        from devtools.demo import DemoProxy

        run_id = f"{self.job.name}-train-{time.strftime('%Y%m%d-%H%M%S')}"
        run_dir = self.out.resolve() / run_id
        run_dir.mkdir(parents=True, exist_ok=True)
        started = time.monotonic()
        redis = RedisProcess(run_dir / "redis")
        if self.job.lora is not None:
            write_job_file(self.job, run_dir / JOB_FILE)
        server = self.engine()
        proxy: DemoProxy | None = None
        trainer: subprocess.Popen[bytes] | None = None
        try:
            feed = redis.start()
            log(f"starting vLLM in dev mode{' serving LoRA adapters' if self.job.lora else ''} (about a minute)")
            engine_url = server.start(timeout=600)
            # probes, and the first batch on a new adapter, may wait while the trainer has both cores: a slow
            # answer is not a dead engine
            proxy = DemoProxy(engine_url, feed, self.job, engine_health_timeout=10.0, engine_hang_timeout=60.0)
            proxy.start()
            trainer_log = run_dir / "trainer.log"
            log(f"starting the trainer (log: {trainer_log})")
            with trainer_log.open("wb") as output:
                trainer = subprocess.Popen(
                    self.trainer_command(proxy.url, proxy.admin_key, feed, run_dir),
                    stdout=output,
                    stderr=subprocess.STDOUT,
                    env={**os.environ, "PYTHONUNBUFFERED": "1"},
                )
            summary = asyncio.run(self._run_job(proxy, feed, run_id))
            log("the job is done; waiting for the trainer's last step")
            code = trainer.wait(timeout=3600)
            if code != 0:
                raise SystemExit(f"the trainer failed (exit {code}); see {trainer_log}")
            asyncio.run(self._write_outputs(feed, run_dir))
            self._report(summary, run_dir, time.monotonic() - started)
        finally:
            if trainer is not None and trainer.poll() is None:
                trainer.terminate()
                trainer.wait(timeout=30)
            if proxy is not None:
                proxy.stop()
            server.stop()
            redis.stop()
            log(f"stopped everything; done in {(time.monotonic() - started) / 60:.1f} min")
        return run_dir

    async def _run_job(self, proxy: Any, feed: str, run_id: str) -> Any:
        from rollout_proxy.runner import run_job

        return await run_job(
            self.job,
            proxy_url=proxy.url,
            admin_key=proxy.admin_key,
            feed=feed,
            job_id=run_id,
            output_dir=self.out.resolve(),
            progress=sys.stderr.isatty(),
        )

    async def _write_outputs(self, feed_url: str, run_dir: Path) -> None:
        """The feed as JSONL (what the demo without --train writes), its trajectories, and the plots."""
        from devtools.demo import write_trajectories
        from rollout_proxy.state.feed import open_feed
        from rollout_proxy.trainer.plot import write_training_plot

        feed = await open_feed(feed_url, stream=self.job.proxy.feed_stream)
        try:
            entries = await feed.read(limit=100_000)
        finally:
            await feed.close()
        with (run_dir / "feed.jsonl").open("w") as lines:
            for entry in entries:
                record = {"id": entry.id, "group_id": entry.group_id, "data": entry.group.model_dump(mode="json")}
                lines.write(json.dumps(record, ensure_ascii=False) + "\n")
        write_trajectories(run_dir / "feed.jsonl", run_dir / "trajectories.jsonl")
        runner_plot = run_dir / "steps.png"
        if runner_plot.exists():
            runner_plot.replace(run_dir / "rollouts.png")
        write_training_plot(trainer_records(run_dir), run_dir / "steps.png", title=run_dir.name)

    def _report(self, summary: Any, run_dir: Path, seconds: float) -> None:
        records = trainer_records(run_dir)
        print()
        print(summary.render())
        print(render_training(records, seconds))
        print(f"  plot          {run_dir / 'steps.png'} (reward and mismatch per step; rollouts.png: the runner's)")
        print(f"  trainer       {run_dir / 'trainer'} (steps.jsonl, metrics.prom, the last weights) and trainer.log")


def trainer_records(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "trainer" / "steps.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def render_training(records: list[dict[str, Any]], seconds: float) -> str:
    """The training's lines of the summary: reward first and last, the mismatch per step, the time per step."""
    if not records:
        return "training      no step trained"
    rewards = [r["reward"]["mean"] for r in records]
    half = max(len(records) // 4, 1)
    lines = [
        f"training      {len(records)} step(s): reward {rewards[0]:.3f} at the first step, {rewards[-1]:.3f} at the "
        f"last (mean of the first {half}: {sum(rewards[:half]) / half:.3f}, of the last {half}: "
        f"{sum(rewards[-half:]) / half:.3f}); {seconds / 60 / len(records):.1f} min per step in all",
    ]
    worst = max(r["mismatch"]["current"]["max_abs"] for r in records)
    wrong = sum(r["mismatch"]["other_version"]["tokens"] for r in records)
    tokens = sum(r["mismatch"]["tokens"] for r in records)
    lines.append(
        f"  mismatch    max |trainer - vLLM logprob| {worst:.2g} over {tokens} trained tokens; {wrong} token(s) of "
        "another version than the trainer's"
    )
    for r in records:
        current, timing = r["mismatch"]["current"], r["timing"]
        if "publish_s" in timing:  # a LoRA policy's version: published with no pause
            update = f"adapter published in {timing['publish_s']:.1f}s, fleet not paused"
        else:
            update = f"fleet paused {timing['pause_s'] + timing['reload_s'] + timing['resume_s']:.1f}s"
        lines.append(
            f"  step {r['step']:<6} reward {r['reward']['mean']:.4f} (std {r['reward']['std']:.3f}), "
            f"{current['tokens']} tokens at version {r['trained_version']}: max |Δ| {current['max_abs']:.2g}, "
            f"mean {current['mean_abs']:.2g}, {current['over']} over {r['mismatch']['threshold']:g}; "
            f"train {timing['train_s']:.0f}s, {update}"
        )
    return "\n".join(lines)


def train_job(job: JobConfig, *, steps: int | None, samples: int | None, generations: int | None) -> JobConfig:
    """The job at the training demo's sizes, each step waiting for the weights trained on the one before."""
    from rollout_proxy.runner.job import TrainingLoop

    hyper = job.hyperparameters
    hyper.num_steps = steps or STEPS
    hyper.batch_size = samples or SAMPLES
    hyper.num_generations = generations or GENERATIONS
    job.training_loop = TrainingLoop(max_staleness=0, version_wait=3600.0)
    return job


def lora_job(job: JobConfig, *, policy: str = LORA_POLICY, rank: int = LORA_RANK) -> JobConfig:
    """``job`` as a GRPOLoRA job (docs/policies.md): a rank-``rank`` adapter on every linear layer of the
    blocks, its sessions on the LoRA policy ``policy``; checked as a job file is."""
    from rollout_proxy.runner.job import JobConfig

    raw = job.model_dump(mode="json", exclude_none=True)
    raw.update(name=f"{job.name}-lora", customization_type="GRPOLoRA", lora={"policy": policy, "rank": rank})
    return JobConfig.parse(raw, base_dir=job.base_dir, source=f"{job.name} with --lora")


def write_job_file(job: JobConfig, path: Path) -> Path:
    """``job`` as a job file (its datasets by absolute path): what the trainer's ``--job`` reads."""
    import yaml

    raw = job.model_dump(mode="json", exclude_none=True)
    raw["data"]["training_set"]["local_files"] = [str(file) for file in job.dataset_files()]
    path.write_text(yaml.safe_dump(raw, sort_keys=False, allow_unicode=True))
    return path
