"""The loop end to end with a harness as the rollout: runner → harness → proxy → Redis feed → reference trainer.

One step of the bundled SWE job (``examples/swe_job.yaml``) with a command harness in Codex's place
(``tests/runner/harness_agents/fix_agent.py``: a planner subagent, then a coder over two turns, through the
openai SDK), on the fake engine sampling with the tiny checkpoint (``tiny.py``), graded by the sample's tests
in the harness's working directory, published on a Redis stream and trained by the reference trainer. Each
rollout is two sequences (the coder's conversation and the planner's); every token the engine sampled must be
trained exactly once, in the sequence the proxy's export puts it in, and scored as the engine did.

Scored exactly when each sequence is one model call (the coder answers once): the trainer then computes each
sequence as the engine did (``micro_batch_tokens=1``). When the coder's conversation has two turns, the engine
scored its first turn over that turn's prompt alone and the trainer scores the whole conversation in one
forward pass: the same arithmetic over longer matrices rounds differently (float32: measured 1.9e-6 here),
while a token scored at the wrong position is off by nats.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from importlib import resources
from pathlib import Path
from typing import Any

import pytest
import yaml

from devtools.fake_engine import FakeEngine, FakeEngineServer
from rollout_proxy.engines.vllm_http import is_routing_probe
from rollout_proxy.runner import JobConfig
from rollout_proxy.trainer.batch import rollouts_of
from rollout_proxy.trainer.grpo import GRPOConfig, GRPOLearner
from tests.conftest import TEMPLATES
from tests.harness import ProxyHarness
from tests.runner.harness_plugins import AGENTS, fixer_policy, solutions
from tests.trainer.conftest import run_loop

pytest.importorskip("torch")


@pytest.fixture
async def swe_fleet(tokenizer_dir: Path, tiny_checkpoint: Path) -> AsyncIterator[tuple[ProxyHarness, FakeEngine]]:
    from tests.trainer.tiny import EngineWeights

    engine = FakeEngine(tokenizer_dir, chat_template=TEMPLATES["qwen3_style"], model=EngineWeights(tiny_checkpoint))
    engine.policy = fixer_policy(engine, solutions())
    async with FakeEngineServer(engine) as url, ProxyHarness.running(engine_urls=[url]) as proxy:
        yield proxy, engine


def swe_job_with_a_command_harness(turns: int) -> JobConfig:
    with resources.as_file(resources.files("rollout_proxy.examples") / "swe_job.yaml") as path:
        raw = yaml.safe_load(path.read_text())
        base_dir = path.parent
    raw["custom_rl_pipeline"]["rollout"]["harness"] = {
        "name": "command",
        "command": ["{python}", str(AGENTS / "fix_agent.py"), "{task}"],
        "env": {"FIX_AGENT_TURNS": str(turns)},
    }
    raw["training_loop"] = {"max_staleness": 0, "version_wait": 60, "poll_interval": 0.05}
    return JobConfig.parse(raw, base_dir=base_dir)


def sequence_key(token_ids: Any, loss_weight: Any) -> tuple[tuple[int, ...], tuple[float, ...]]:
    return tuple(int(t) for t in token_ids), tuple(float(w) for w in loss_weight)


@pytest.mark.parametrize(("turns", "rounding"), [(1, 0.0), (2, 1e-5)])
async def test_a_harness_step_trains_every_sampled_token_of_every_sequence_once(
    swe_fleet, redis_url, tiny_checkpoint, tmp_path, turns, rounding
):
    proxy, engine = swe_fleet
    job = swe_job_with_a_command_harness(turns)
    learner = GRPOLearner(tiny_checkpoint, GRPOConfig(learning_rate=3e-2, micro_batch_tokens=1))
    run = await run_loop(proxy, redis_url, job, learner, tmp_path, steps=1)
    [record] = run.trainer.records
    groups = await run.groups(redis_url)
    assert record["groups"] == len(groups) == 3 and run.summary.samples_done == 3

    # the export of each rollout's session: its sequences, each sampled token trained in exactly one
    sampled = sum(len(g.tokens) for g in engine.generations if not is_routing_probe(g.payload))
    exported_trained = 0
    for group in groups:
        assert sorted(group.rewards) == [0.0, 1.0]  # the fix passes the sample's tests, the rewritten test does not
        for rollout, trajectory in zip(rollouts_of(group), group.trajectories, strict=True):
            status, export = await proxy.request("GET", f"/v1/sessions/{trajectory.session_id}/rollout")
            assert status == 200, export
            kept = [sequence for sequence in export["sequences"] if not sequence["dropped"]]
            assert len(kept) == 2  # the coder's conversation and the planner's
            assert [m["role"] for m in kept[0]["messages"]][-1] == "assistant" and kept[0]["main"]
            assert kept[0]["turns"] == turns and kept[1]["branch"]["kind"] == "new_conversation"
            assert export["trained_tokens"] == export["sampled_tokens"] - export["dropped_tokens"]
            exported_trained += export["trained_tokens"]
            # what the trainer trains for this rollout: the export's sequences, sequence for sequence
            assert len(rollout.sequences) == len(kept)
            trained = sorted(sequence_key(s.token_ids, s.loss_weight) for s in rollout.sequences)
            assert trained == sorted(sequence_key(s["total_token_ids"], s["total_loss_weight"]) for s in kept)
            assert sum(int(s.trained.sum()) for s in rollout.sequences) == export["trained_tokens"]
    assert exported_trained == sampled  # no retry here: every sampled token is trained

    # the trainer's step: those tokens, scored exactly as the engine sampled them, the reward recorded
    assert record["trained_tokens"] == sampled
    assert (record["rollouts"], record["sequences"]) == (6, 12)  # 3 samples x 2 rollouts, 2 sequences each
    assert record["dropped_sequences"] == record["dropped_tokens"] == 0
    assert record["mismatch"]["current"]["tokens"] == sampled and record["mismatch"]["current"]["max_abs"] <= rounding
    assert record["mismatch"]["other_version"]["tokens"] == 0 and record["mismatch"]["unversioned"] == 0
    assert record["reward"]["mean"] == pytest.approx(0.5) and record["metrics"]["grad_norm"] > 0
    lines = [json.loads(line) for line in (tmp_path / "steps.jsonl").read_text().splitlines()]
    assert lines == [record]
