"""The runner's summary (reward spread, advantages), its per-step plot, and the viewer's address."""

from __future__ import annotations

import asyncio
import struct
import time
from pathlib import Path

import numpy as np
import pytest
from aiohttp import web

from rollout_proxy.embedded import BackgroundServer
from rollout_proxy.runner.grading import grpo_advantages
from rollout_proxy.runner.plot import write_step_plot
from rollout_proxy.runner.progress import JobProgress
from rollout_proxy.runner.runner import viewer_address
from rollout_proxy.sdk import Trajectory
from tests.conftest import free_port


def trajectory(prompt: int, generated: int) -> Trajectory:
    weights = [0.0] * prompt + [1.0] * generated
    return Trajectory(
        total_token_ids=list(range(prompt + generated)),
        total_loss_weight=weights,
        total_token_logprobs=[-0.5 * w for w in weights],
        turns=1,
    )


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", data[16:24])


def progress_of_two_steps() -> JobProgress:
    progress = JobProgress(total=3, enabled=False)
    # step 0: one mixed group, one where every rollout got the same reward (no signal)
    for rewards in ([1.0, 0.0], [0.5, 0.5]):
        progress.sample_done(
            [trajectory(10, 4), trajectory(10, 6)], rewards, step=0, advantages=grpo_advantages(rewards)
        )
    # step 1: token-level custom advantages
    progress.sample_done(
        [trajectory(8, 2), trajectory(8, 2)], [1.0, 0.5], step=1, advantages=[[0.0] * 8 + [2.0, 2.0], [-1.0] * 10]
    )
    return progress


def test_summary_shows_the_reward_spread_and_which_groups_carry_a_signal():
    progress = progress_of_two_steps()
    summary = progress.summary(job_id="j", steps=2, elapsed=1.0, drift=0, forks=0, step_metrics={})
    rewards = [1.0, 0.0, 0.5, 0.5, 1.0, 0.5]
    assert summary.mean_reward == pytest.approx(np.mean(rewards))
    assert (summary.reward_min, summary.reward_max) == (0.0, 1.0)
    assert summary.reward_std == pytest.approx(np.std(rewards))
    assert summary.groups_graded == 3 and summary.groups_with_signal == 2
    first, second = summary.steps_stats
    assert (first.tokens, first.trained_tokens, second.tokens, second.trained_tokens) == (60, 20, 20, 4)
    grpo = abs(grpo_advantages([1.0, 0.0])[0])
    assert summary.mean_abs_advantage == pytest.approx(np.mean([grpo, grpo, 0.0, 0.0, 0.4, 1.0]))
    text = summary.render()
    assert "(min 0.0000, max 1.0000, std " in text
    assert (
        f"2 of 3 group(s) with rewards that differ (non-zero advantages), mean |advantage| {summary.mean_abs_advantage:.4f}"
        in text
    )
    assert "  step 0 " in text and "  step 1 " in text  # one line per step when there are several
    assert summary.to_json()["steps_stats"][1]["trained_tokens"] == 4


def test_a_single_reward_group_has_no_signal():
    progress = JobProgress(total=1, enabled=False)
    progress.sample_done([trajectory(4, 4)] * 3, [1.0] * 3, advantages=grpo_advantages([1.0] * 3))
    summary = progress.summary(job_id="j", steps=1, elapsed=1.0, drift=0, forks=0, step_metrics={})
    assert summary.groups_with_signal == 0 and summary.mean_abs_advantage == 0.0 and summary.reward_std == 0.0
    assert "0 of 1 group(s)" in summary.render() and "step 0" not in summary.render()


@pytest.mark.parametrize(
    ("feed", "shown"),
    [("redis://:hunter2@r:6379/0", "redis://:***@r:6379/0"), ("jsonl:out/j/feed.jsonl", "jsonl:out/j/feed.jsonl")],
)
def test_the_summary_names_its_feed_without_a_password(feed, shown):
    summary = JobProgress(total=1, enabled=False).summary(
        job_id="j", steps=1, elapsed=1.0, drift=0, forks=0, step_metrics={}
    )
    summary.feed = feed
    assert f"  feed          {shown}\n" in summary.render() + "\n" and "hunter2" not in summary.render()


def test_the_plot_is_a_png_of_the_steps(tmp_path):
    steps = progress_of_two_steps().steps()
    path = write_step_plot(steps, tmp_path / "out" / "job" / "steps.png", title="job")
    assert path.is_file() and png_size(path) == (800, 600)


# -- the viewer's address ---------------------------------------------------------------------------


def stub(routes: dict[str, float]) -> BackgroundServer:
    """A server answering GET on each path after that many seconds; anything else 404."""

    def app() -> web.Application:
        application = web.Application()
        for path, delay in routes.items():

            async def answer(request: web.Request, delay: float = delay) -> web.Response:
                await asyncio.sleep(delay)
                return web.Response(text="<html></html>", content_type="text/html")

            application.router.add_get(path, answer)
        return application

    return BackgroundServer(app)


async def test_viewer_address_when_the_proxy_serves_it():
    with stub({"/ui": 0.0}) as served, stub({"/healthz": 0.0}) as not_served:
        assert await viewer_address(served.url, "key") == f"{served.url}/ui"
        assert await viewer_address(not_served.url, "key") == ""


async def test_viewer_address_of_a_gone_or_hanging_proxy_is_empty_and_bounded():
    assert await viewer_address(f"http://127.0.0.1:{free_port()}", "key") == ""
    with stub({"/ui": 5.0}) as hanging:
        started = time.monotonic()
        assert await viewer_address(hanging.url, "key", within=0.5) == ""
        assert time.monotonic() - started < 4.0  # not the 5 s the proxy would take
