"""A rollout of many conversations, trained by the reference trainer: every sequence, every token once.

One harness-owned session (``retry: keep``) through the real proxy, on the fake engine sampling with
the tiny checkpoint's logprobs (``tiny.py``): the main agent's turn, a subagent (its own conversation,
labelled), the main agent's second turn, an edit (a rewrite inside that second turn: it shares the first
turn), a compaction (a rewrite at the summary), retried, and continued from the retry. Exported, finished
naming no responses, published on the Redis feed, the trainer's batch holds every sequence of the export
with the tokens it trains, the learner scores each of them exactly, and ``steps.jsonl`` counts them.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from devtools.fake_engine import FakeEngine, FakeEngineServer
from rollout_proxy.sdk.transport import ProxyClient
from rollout_proxy.state.feed import open_feed
from rollout_proxy.trainer.batch import BatchError, micro_batches, rollouts_of, trained_tokens
from rollout_proxy.trainer.consumer import TrajectoryConsumer
from rollout_proxy.trainer.fleet import FleetDriver
from rollout_proxy.trainer.loop import ReferenceTrainer
from rollout_proxy.trainer.mismatch import mismatch_report
from rollout_proxy.wire.feed import FeedGroup
from rollout_proxy.wire.trajectory import Trajectory
from tests.conftest import TEMPLATES
from tests.harness import ADMIN_KEY, ProxyHarness, Session

pytest.importorskip("torch")

SYSTEM = {"role": "system", "content": "You are the main agent."}
TASK = {"role": "user", "content": "Fix the failing test."}
SUB = [
    {"role": "system", "content": "You are a search subagent."},
    {"role": "user", "content": "Find where the test lives."},
]
SAYS = {"role": "user", "content": "The subagent says tests/test_x.py."}
SUMMARY = {"role": "user", "content": "Summary so far: the test is in tests/test_x.py."}


@dataclass
class Scenario:
    proxy: ProxyHarness
    engine: FakeEngine
    session: Session
    turns: dict[str, str]
    export: dict[str, Any]
    main: Trajectory  # the finish's one trajectory, the others as its branches


def assistant(completion: Any) -> dict[str, Any]:
    return {"role": "assistant", "content": completion.choices[0].message.content}


@pytest.fixture
async def tiny_proxy(tokenizer_dir: Path, tiny_checkpoint: Path) -> AsyncIterator[tuple[ProxyHarness, FakeEngine]]:
    from tests.trainer.tiny import EngineWeights

    engine = FakeEngine(tokenizer_dir, chat_template=TEMPLATES["qwen3_style"], model=EngineWeights(tiny_checkpoint))
    async with FakeEngineServer(engine) as url, ProxyHarness.running(engine_urls=[url], fake=engine) as proxy:
        yield proxy, engine


async def run_rollout(proxy: ProxyHarness, engine: FakeEngine, retry: str) -> Scenario:
    status, body = await proxy.request(
        "POST", "/v1/sessions", json={"sample": {}, "generation": {"max_new_tokens": 64}, "retry": retry}
    )
    assert status == 201, body
    session = Session(client=proxy.client(body["base_url"], body["api_key"]), **body)
    chat = session.client.chat.completions
    engine.queue(
        "Let me look.",
        "tests/test_x.py",
        "I will edit it.",
        "Edited, then on.",
        "Compacted once.",
        "Compacted again.",
        "Continuing after the summary.",
    )
    main1 = await chat.create(model="m", messages=[SYSTEM, TASK])
    sub = await chat.create(model="m", messages=SUB, extra_headers={"X-Rollout-Branch": "subagent"})
    main2 = await chat.create(model="m", messages=[SYSTEM, TASK, assistant(main1), SAYS])
    rewritten = {"role": "assistant", "content": "I will rewrite the test instead."}  # an edited history
    edit = await chat.create(
        model="m", messages=[SYSTEM, TASK, assistant(main1), SAYS, rewritten, {"role": "user", "content": "Go on."}]
    )
    compacted = [SYSTEM, TASK, SUMMARY]
    compact = await chat.create(model="m", messages=compacted, metadata={"rollout_branch": "compaction"})
    again = await chat.create(model="m", messages=compacted, metadata={"rollout_branch": "compaction"})  # a retry
    after = await chat.create(model="m", messages=[*compacted, assistant(again), {"role": "user", "content": "Go on."}])
    names = ("main1", "sub", "main2", "edit", "compact", "again", "after")
    turns = dict(zip(names, (c.id for c in (main1, sub, main2, edit, compact, again, after)), strict=True))
    status, export = await proxy.request("GET", f"/v1/sessions/{session.session_id}/rollout")
    assert status == 200, export
    status, finished = await proxy.request(
        "POST", f"/v1/sessions/{session.session_id}/finish", json={"status": "success"}
    )
    assert status == 200, finished
    (main,) = [Trajectory.model_validate(t) for t in finished["trajectories"]]
    return Scenario(proxy, engine, session, turns, export, main)


def feed_group(
    main: Trajectory, advantage: Any, *, kind: str = "grpo", group_id: str = "job/step-0/sample-0"
) -> FeedGroup:
    group = FeedGroup(
        group_id=group_id,
        job_id="job",
        step=0,
        sample_index=0,
        trajectories=[main],
        rewards=[1.0],
        advantages=[advantage],
        advantage_kind=kind,
        step_groups=1,
    )
    return FeedGroup.model_validate_json(group.model_dump_json())  # as the feed stores it


async def test_every_sequence_of_the_export_is_trained_sequence_for_sequence(tiny_proxy, tiny_checkpoint):
    from rollout_proxy.trainer.grpo import GRPOConfig, GRPOLearner

    run = await run_rollout(*tiny_proxy, retry="keep")
    export, turns = run.export, run.turns
    sampled = sum(len(generation.tokens) for generation in run.engine.generations)
    # the export: five sequences, every token the engine sampled trained in exactly one (the retry kept)
    assert len(export["sequences"]) == 5 and export["sampled_tokens"] == export["trained_tokens"] == sampled
    assert {s["leaf"]: s["branch"]["kind"] for s in export["sequences"]} == {
        turns["after"]: "retry",
        turns["sub"]: "new_conversation",
        turns["main2"]: "new_conversation",
        turns["edit"]: "rewrite",
        turns["compact"]: "rewrite",
    }
    edit = next(s for s in export["sequences"] if s["leaf"] == turns["edit"])
    assert (
        edit["response_ids"][0] == turns["main1"]
        and 0 < sum(edit["total_loss_weight"]) < edit["usage"]["completion_tokens"]
    )  # it shares the main agent's first turn, which another sequence trains

    [rollout] = rollouts_of(feed_group(run.main, 0.5))
    assert len(rollout.sequences) == 5 and (rollout.dropped_sequences, rollout.dropped_tokens) == (0, 0)
    for sequence, want in zip(rollout.sequences, export["sequences"], strict=True):
        weights = np.asarray(want["total_loss_weight"])
        assert sequence.response_id == want["leaf"] and sequence.branch == want["branch"]["kind"]
        assert sequence.token_ids.tolist() == want["total_token_ids"]
        assert sequence.trained.tolist() == (weights > 0).tolist()
        assert sequence.sampling_logprobs.tolist() == np.asarray(want["total_token_logprobs"], np.float32).tolist()
        assert (rollout.advantages(sequence)[sequence.trained] == 0.5).all()
    assert trained_tokens([rollout]) == export["trained_tokens"] == sampled
    batches = micro_batches([rollout], max_tokens=4096)
    assert sorted(ref.sequence for batch in batches for ref in batch.rows) == [0, 1, 2, 3, 4]
    assert sum(int(batch.loss_weight.sum()) for batch in batches) == export["trained_tokens"]

    # the learner scores every trained token of every sequence, each where it was sampled, exactly
    learner = GRPOLearner(tiny_checkpoint, GRPOConfig(learning_rate=1e-2, micro_batch_tokens=1))
    step = learner.train_step([rollout])
    assert step.metrics["micro_batches"] == 5.0 and step.metrics["grad_norm"] > 0
    scored = {part.sequence: part for part in step.scored}
    assert sorted(scored) == [0, 1, 2, 3, 4]
    for index, sequence in enumerate(rollout.sequences):
        part = scored[index]
        assert part.positions.tolist() == np.flatnonzero(sequence.trained).tolist()
        assert part.response_id == sequence.response_id and part.branch == sequence.branch
    report = mismatch_report(step.scored, trainer_version=0, threshold=1e-2)
    assert report.current.tokens == export["trained_tokens"] and report.other_version.tokens == 0
    assert report.current.max_abs <= 1e-5  # the engine's logprobs are these weights' (float32 rounding apart)
    assert {(w.sequence, w.response_id) for w in report.worst} <= {
        (i, s.response_id) for i, s in enumerate(rollout.sequences)
    }


async def test_per_token_advantages_are_taken_per_sequence(tiny_proxy):
    run = await run_rollout(*tiny_proxy, retry="keep")
    rows = [[float(k)] * len(s.total_token_ids or []) for k, s in enumerate(run.main.sequences())]
    group = feed_group(run.main, rows, kind="tok")
    [rollout] = rollouts_of(group)
    assert [rollout.advantages(s)[0] for s in rollout.sequences] == [0.0, 1.0, 2.0, 3.0, 4.0]
    assert [advantage for _, _, advantage in group.sequence_advantages()] == rows
    with pytest.raises(BatchError, match=r"rollout 0: a flat list of \d+ per-token advantages for a rollout of 5"):
        rollouts_of(feed_group(run.main, rows[0], kind="tok"))


@pytest.mark.parametrize("retry", ["keep", "drop"])
async def test_the_trainer_records_every_sequence_and_the_dropped_retries(
    tiny_proxy, tiny_checkpoint, redis_url, tmp_path, retry
):
    """Through the feed, ``TrajectoryConsumer`` and the reference trainer's step: ``steps.jsonl`` counts what
    the export counted (with ``retry: drop`` the compaction not continued is dropped: in no sequence)."""
    from rollout_proxy.trainer.grpo import GRPOConfig, GRPOLearner

    proxy, _ = tiny_proxy
    run = await run_rollout(*tiny_proxy, retry=retry)
    stream = f"train-{secrets.token_hex(4)}"
    feed = await open_feed(redis_url, stream=stream)
    try:
        await feed.publish(feed_group(run.main, 1.0))
    finally:
        await feed.close()
    learner = GRPOLearner(tiny_checkpoint, GRPOConfig(micro_batch_tokens=1))
    async with (
        ProxyClient(proxy.url, ADMIN_KEY) as admin,
        TrajectoryConsumer(redis_url, stream=stream, block_ms=100, stop_when_idle=True) as consumer,
    ):
        driver = FleetDriver(admin)
        trainer = ReferenceTrainer(
            learner, consumer, driver, tmp_path, version=await driver.version(), log=lambda _: None
        )
        [record] = await trainer.run(1)
    assert json.loads((tmp_path / "steps.jsonl").read_text()) == record
    export = run.export
    dropped = [s for s in export["sequences"] if s["dropped"]]
    assert record["rollouts"] == 1 and record["sequences"] == len(export["sequences"]) - len(dropped)
    assert record["trained_tokens"] == export["trained_tokens"] == record["mismatch"]["current"]["tokens"]
    assert record["dropped_sequences"] == len(dropped) == (1 if retry == "drop" else 0)
    assert record["dropped_tokens"] == export["dropped_tokens"]
    assert record["trained_tokens"] + record["dropped_tokens"] == export["sampled_tokens"]
    assert record["mismatch"]["current"]["max_abs"] <= 1e-5
