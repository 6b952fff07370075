"""The main job (the README's first command): a real rollout with a learning signal, on this machine.

Sets up what is missing (engine venv, checkpoints), starts vLLM (CPU) on a free port and
a rollout-proxy (in-process store) in front of it, and runs the bundled short-answer job
with the rollout runner: English questions the bundled SmolLM2-135M answers right some of
the time, graded by checking the answer, so rollouts of one question disagree and GRPO
advantages are not zero. Writes the feed, the trajectories (JSONL) and a per-step plot
under OUT/<run>/, prints a summary, and stops everything it started, or, with
--keep-running, keeps the proxy and vLLM up so the trajectories just recorded can be
browsed in the proxy's viewer (the URL and admin key are printed; Ctrl-C stops).

    python -m devtools.demo [--job short-answer|weather|codex|swe|FILE] [--engine vllm|fake]
        [--samples N] [--generations N] [--steps N] [--out DIR] [--keep-running]
        --train [--steps N] [--lr LR] [--seed N]     # the reference trainer between the steps (train_demo)
        --train --lora [...]                         # ... training a LoRA adapter, published with no pause

``--job codex`` runs Codex CLI (``codex exec``) as the rollout harness on small file-reading tasks, ``--job
swe`` on small bug fixes graded by their tests (the runner's harness rollouts: ``runner.harness``); npm and
the pinned Codex are installed on first use (apt, then the npm registry). ``--engine fake`` runs any job on
the in-process fake engine instead of vLLM (seconds, no engine venv: the codex job's fake policy is a
scripted shell agent, the swe job's one that fixes every other rollout, other jobs get the fake's default
sentences). ``--train`` runs the short-answer job on vLLM with the reference trainer between its steps
(redis-server for its feed is installed with apt on first use); ``--train --lora`` runs it as a GRPOLoRA job:
the trainer trains a LoRA adapter of the frozen model and publishes each step's adapter as the next version of
the LoRA policy the job's sessions sample, the engines never paused (docs/policies.md).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import secrets
import shlex
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from importlib import resources
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any

from devtools import engine_env
from devtools.vllm_server import VLLMServer

if TYPE_CHECKING:
    from aiohttp import web

    from rollout_proxy.runner.job import JobConfig

TEMPLATE = Path(__file__).parent / "templates" / "qwen3_style.jinja"
#: the bundled jobs, by the name ``--job`` takes
JOBS = {
    "short-answer": "short_answer_job.yaml",
    "weather": "weather_job.yaml",
    "codex": "codex_job.yaml",
    "swe": "swe_job.yaml",
}
#: the bundled jobs whose rollout is Codex CLI
CODEX_JOBS = ("codex", "swe")
ENGINES = ("vllm", "fake")
#: tokens of context the engine gets: Codex's first prompt alone is ~7k tokens (instructions and tools)
CONTEXT = {"codex": 8192, "swe": 8192}
#: what `codex exec` is given on vLLM: its sub-agent tools and web search left out of its requests (~6.8k tokens)
CODEX_ON_VLLM = '-c features.multi_agent=false -c web_search="disabled"'


def log(message: str) -> None:
    print(f"[demo] {message}", file=sys.stderr, flush=True)


def write_trajectories(feed_path: Path, out: Path) -> int:
    """One trajectory per line, with its group's reward and advantage."""
    count = 0
    with feed_path.open() as groups, out.open("w") as lines:
        for line in groups:
            group = json.loads(line)["data"]
            for trajectory, reward, advantage in zip(
                group["trajectories"], group["rewards"], group["advantages"], strict=True
            ):
                record = {"group_id": group["group_id"], "reward": reward, "advantage": advantage, **trajectory}
                lines.write(json.dumps(record, ensure_ascii=False) + "\n")
                count += 1
    return count


def load_job(name: str, *, samples: int | None, generations: int | None, steps: int | None) -> JobConfig:
    """A bundled job by name (or a job file), with the command line's sizes."""
    from rollout_proxy.runner import JobConfig

    if name in JOBS:
        with resources.as_file(resources.files("rollout_proxy.examples") / JOBS[name]) as job_file:
            job = JobConfig.load(job_file)
    else:
        job = JobConfig.load(name)
    hyper = job.hyperparameters
    hyper.batch_size = samples or hyper.batch_size
    hyper.num_generations = generations or hyper.num_generations
    hyper.num_steps = steps or hyper.num_steps
    return job


class DemoProxy:
    """A rollout-proxy on its own thread in front of the engine, serving the feed and the viewer."""

    def __init__(self, engine_url: str, feed_url: str, job: JobConfig, **overrides: Any) -> None:
        from rollout_proxy.app import create_app
        from rollout_proxy.embedded import BackgroundServer
        from rollout_proxy.settings import Settings

        self.admin_key = secrets.token_urlsafe(24)
        settings = Settings(
            engines=(engine_url,),
            store=job.proxy.store,
            admin_key=self.admin_key,
            tool_parser=job.proxy.tool_parser,
            reasoning_parser=job.proxy.reasoning_parser,
            feed=feed_url,
            feed_stream=job.proxy.feed_stream,
            chat_template=str(TEMPLATE),  # what vLLM was started with: the proxy renders bridge tokens alike
            log_level="warning",
            **overrides,
        )
        self._server = BackgroundServer(lambda: create_app(settings))
        self.url = ""

    def start(self) -> str:
        self.url = self._server.start()
        return self.url

    def stop(self) -> None:
        self._server.stop()


async def run_demo(job: JobConfig, out_dir: Path, proxy: DemoProxy, feed_path: Path, run_id: str) -> None:
    from rollout_proxy.runner import run_job

    summary = await run_job(
        job,
        proxy_url=proxy.url,
        admin_key=proxy.admin_key,
        feed=f"jsonl:{feed_path}",
        job_id=run_id,
        output_dir=out_dir,
        progress=sys.stderr.isatty(),
    )
    trajectories_path = feed_path.parent / "trajectories.jsonl"
    written = await asyncio.to_thread(write_trajectories, feed_path, trajectories_path)
    print()
    print(summary.render())
    print(f"  trajectories  {written} written to {trajectories_path}")


def wait_for_ctrl_c(proxy: DemoProxy) -> None:
    """Keep the proxy (and vLLM) up until Ctrl-C or SIGTERM."""
    stop = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stop.set()

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    print()
    print("The proxy and vLLM keep running. Open the trajectories just recorded in the viewer:")
    print(f"  {proxy.url}/ui#key={proxy.admin_key}")
    print(f"  (viewer {proxy.url}/ui, admin key {proxy.admin_key})")
    print("Ctrl-C stops both.", flush=True)
    try:
        while not stop.wait(0.5):
            pass
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def demo_on(
    engine_url: str,
    job: JobConfig,
    out: Path,
    *,
    keep_running: bool = False,
    wait: Callable[[DemoProxy], None] = wait_for_ctrl_c,
) -> Path:
    """The job through a proxy on ``engine_url``; its output directory. The proxy stops at the end,
    or, with ``keep_running``, when ``wait`` returns (Ctrl-C / SIGTERM)."""
    run_id = f"{job.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    out_dir = out.resolve()
    feed_path = out_dir / run_id / "feed.jsonl"
    started = time.monotonic()
    proxy = DemoProxy(engine_url, f"jsonl:{feed_path}", job)
    proxy.start()
    try:
        asyncio.run(run_demo(job, out_dir, proxy, feed_path, run_id))
        log(f"job done in {time.monotonic() - started:.0f}s")
        if keep_running:
            wait(proxy)
        else:
            print("  (the proxy stops now; ./scripts/demo.sh --keep-running keeps it, to browse these in the viewer)")
    finally:
        proxy.stop()
        log("stopped the proxy")
    return feed_path.parent


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="./scripts/demo.sh", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--job",
        default="short-answer",
        help="a bundled job (short-answer, the default: a learning signal; weather: the seed's tool-calling "
        "agent; codex: Codex CLI reading files; swe: Codex CLI fixing bugs, graded by their tests) or a job file",
    )
    parser.add_argument(
        "--engine",
        choices=ENGINES,
        default="vllm",
        help="vllm (the default: a real vLLM on CPU, set up on first use) or fake (the in-process fake engine: "
        "seconds; the codex job's fake policy is a scripted shell agent)",
    )
    parser.add_argument("--samples", type=int, help="samples per step (default: the job's batch_size, 8)")
    parser.add_argument("--generations", type=int, help="rollouts per sample (default: the job's, 4)")
    parser.add_argument("--steps", type=int, help="steps (default: the job's num_steps, 2)")
    parser.add_argument("--out", default="out", help="output directory (default: ./out)")
    parser.add_argument(
        "--keep-running",
        action="store_true",
        help="after the job, keep the proxy and vLLM running to browse the trajectories in the viewer (/ui); "
        "prints its URL and admin key; Ctrl-C stops",
    )
    parser.add_argument(
        "--train",
        action="store_true",
        help="train between the steps: the reference GRPO trainer (torch, CPU) on vLLM's weights, reloaded each "
        "step (8 steps of 8 samples x 4 rollouts unless given; steps.png: reward and mismatch per step)",
    )
    parser.add_argument(
        "--lora",
        action="store_true",
        help="with --train: train a LoRA adapter instead of the full weights (rank 16 on every linear layer, peft): "
        "the job becomes a GRPOLoRA job whose sessions sample the LoRA policy short-answer-lora, vLLM serves "
        "adapters (--enable-lora), and each step's adapter is published as the policy's next version with no pause "
        "(docs/policies.md)",
    )
    parser.add_argument(
        "--lr", type=float, help="with --train: the trainer's learning rate (default 2e-5; with --lora 5e-4)"
    )
    parser.add_argument("--seed", type=int, default=0, help="with --train: the trainer's and vLLM's seed (default 0)")
    args = parser.parse_args(argv)
    if args.train and args.keep_running:
        parser.error("--train and --keep-running do not go together (the trainer's fleet stops with the job)")
    if args.train and args.engine == "fake":
        parser.error("--train trains the weights vLLM serves: it runs on --engine vllm only")
    if args.lora and not args.train:
        parser.error("--lora says what --train trains (a LoRA adapter): give --train too")
    from rollout_proxy.logs import configure_logging

    configure_logging("console" if sys.stderr.isatty() else "json", "warning")
    job = load_job(args.job, samples=args.samples, generations=args.generations, steps=args.steps)
    started = time.monotonic()
    if args.job in CODEX_JOBS:
        from devtools.harnesses import ensure_codex

        log("checking Codex CLI (first run: installs npm with apt, then Codex from the npm registry)")
        os.environ.setdefault("ROLLOUT_PROXY_CODEX", str(ensure_codex()))  # what the job's harness runs
    if args.engine == "fake":
        with fake_engine(job=args.job) as engine_url:
            demo_on(engine_url, job, Path(args.out), keep_running=args.keep_running)
        log(f"done in {time.monotonic() - started:.0f}s")
        return 0
    harness = job.custom_rl_pipeline.rollout.harness
    if args.job in CODEX_JOBS and harness is not None:  # Codex's default prompt (~9.4k tokens) overflows SmolLM2's 8k
        harness.args = [*harness.args, *shlex.split(CODEX_ON_VLLM)]
    if args.train:  # before the engine's minutes of set-up: the feed's server (apt, first run only)
        from devtools import apt

        apt.ensure_command("redis-server", why="the training demo's feed (a Redis Stream)")
    log("checking the engine venv and the checkpoints (first run: a few minutes)")
    engine_env.setup()
    if args.train:
        from devtools import train_demo

        job = train_demo.train_job(job, steps=args.steps, samples=args.samples, generations=args.generations)
        if args.lora:
            job = train_demo.lora_job(job)
        lr = (train_demo.LORA_LEARNING_RATE if args.lora else train_demo.LEARNING_RATE) if args.lr is None else args.lr
        train_demo.TrainDemo(job, Path(args.out), learning_rate=lr, seed=args.seed).run()
        return 0
    server = VLLMServer(
        "dense",
        chat_template=TEMPLATE,
        tool_parser="hermes",
        die_with_parent=True,
        max_model_len=CONTEXT.get(args.job, 2048),
    )
    try:
        log("starting vLLM (about a minute)")
        engine_url = server.start(timeout=600)
        demo_on(engine_url, job, Path(args.out), keep_running=args.keep_running)
    finally:
        server.stop()
        log(f"stopped vLLM; done in {time.monotonic() - started:.0f}s")
    return 0


def swe_solutions() -> dict[str, dict[str, str]]:
    """The bundled SWE job's tasks and their reference fixes (what its scripted fake policy writes)."""
    dataset = resources.files("rollout_proxy.examples") / "data" / "swe_tasks.jsonl"
    records = [json.loads(line)["extra"] for line in dataset.read_text().splitlines() if line.strip()]
    return {record["task"]: record["solution"] for record in records}


@contextlib.contextmanager
def fake_engine(*, job: str) -> Iterator[str]:
    """The fake engine (SmolLM2's tokenizer, the template vLLM would get) served on a thread; its URL. The
    Codex jobs get a scripted policy (a shell agent; for ``swe``, one that writes the fix every other time)."""
    from devtools.fake_engine import FakeEngine
    from devtools.scripted_agent import shell_agent, swe_agent
    from rollout_proxy.embedded import BackgroundServer

    tokenizer = engine_env.ensure_checkpoints()["dense"]
    solutions = swe_solutions() if job == "swe" else {}

    def app() -> web.Application:
        engine = FakeEngine(tokenizer, chat_template=TEMPLATE.read_text(), max_model_len=32768)
        if job == "swe":
            engine.policy = swe_agent(engine, solutions)
        elif job == "codex":
            engine.policy = shell_agent(engine)
        return engine.app()

    log("starting the fake engine")
    with BackgroundServer(app) as server:
        yield server.url


if __name__ == "__main__":
    sys.exit(main())
