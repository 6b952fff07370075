"""The main job (the README's first command): a real rollout, end to end, on this machine.

Sets up what is missing (engine venv, checkpoints), starts vLLM on a free port,
runs the bundled weather job through rollout-proxy (in-process store) with the
rollout runner, writes the trajectories to a JSONL file, prints a summary, and
stops everything it started.

    python -m rollout_proxy.devtools.demo [--out DIR] [--samples N] [--generations N]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from importlib import resources
from pathlib import Path

from rollout_proxy.devtools import engine_env
from rollout_proxy.devtools.vllm_server import VLLMServer

TEMPLATE = Path(__file__).parent / "templates" / "qwen3_style.jinja"


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


async def run_demo(out_dir: Path, samples: int, generations: int, engine_url: str) -> None:
    from rollout_proxy.runner import JobConfig, run_job

    with resources.as_file(resources.files("rollout_proxy.examples") / "weather_job.yaml") as job_file:
        job = JobConfig.load(job_file)
    job.hyperparameters.batch_size = samples
    job.hyperparameters.num_generations = generations
    run_id = f"{job.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    feed_path = (out_dir / run_id / "feed.jsonl").resolve()
    summary = await run_job(
        job, engines=[engine_url], feed=f"jsonl:{feed_path}", job_id=run_id, progress=sys.stderr.isatty()
    )
    trajectories_path = out_dir / run_id / "trajectories.jsonl"
    written = write_trajectories(feed_path, trajectories_path)
    print()
    print(summary.render())
    print(f"  trajectories  {written} written to {trajectories_path.resolve()}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="out", help="output directory (default: ./out)")
    parser.add_argument("--samples", type=int, default=4, help="samples from the bundled dataset (default 4)")
    parser.add_argument("--generations", type=int, default=2, help="rollouts per sample (default 2)")
    args = parser.parse_args(argv)
    from rollout_proxy.logs import configure_logging

    configure_logging("console" if sys.stderr.isatty() else "json", "warning")
    started = time.monotonic()
    log("checking the engine venv and the checkpoints (first run: a few minutes)")
    engine_env.setup()
    server = VLLMServer("dense", chat_template=TEMPLATE, tool_parser="hermes", die_with_parent=True)
    try:
        log("starting vLLM (about a minute)")
        url = server.start(timeout=600)
        asyncio.run(run_demo(Path(args.out), args.samples, args.generations, url))
    finally:
        server.stop()
        log(f"stopped vLLM; done in {time.monotonic() - started:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
