"""The LoRA trainer's loop on the fake engine (run-time LoRA on, sampling with the tiny checkpoint and the
adapter a call names): each step's adapter is published as the policy's next version with no pause, the
engine samples with exactly the adapter the trainer wrote, old versions' directories go only once no engine
has them, and a trainer killed in any window of its step trains and publishes each step once."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import numpy as np
import pytest

from rollout_proxy.runner.job import LoRASection
from rollout_proxy.runner.runner import JobRunner
from rollout_proxy.sdk.transport import ProxyClient, ProxyRequestError
from rollout_proxy.state.feed import open_feed
from rollout_proxy.trainer.consumer import TrajectoryConsumer
from rollout_proxy.trainer.fleet import PolicyPublisher
from rollout_proxy.trainer.loop import (
    STATE,
    ReferenceTrainer,
    ResumePoint,
    TrainerState,
    publish_untrained,
    weights_dir,
)
from tests.harness import ADMIN_KEY
from tests.trainer.conftest import short_answer_job
from tests.trainer.test_restarts import Killed, pending, publish_steps, step_log

torch = pytest.importorskip("torch")
pytest.importorskip("peft")

from rollout_proxy.trainer.batch import BatchError, rollouts_of  # noqa: E402
from rollout_proxy.trainer.grpo import OPTIMIZER, GRPOConfig, GRPOLearner, LoRAConfig  # noqa: E402

POLICY = "grpo-lora"
#: each sequence scored alone, as the fake engine scores it: the trainer and the engine agree bit for bit
CONFIG = GRPOConfig(
    learning_rate=5e-2, micro_batch_tokens=1, lora=LoRAConfig(rank=8, alpha=16, target_modules=("q_proj", "v_proj"))
)


def loaded(fleet) -> dict[str, str]:
    """The engine's adapters now: served name -> directory."""
    return {name: adapter.path for name, adapter in fleet.engine.adapters.items()}


def every_loaded_adapter_has_its_files(fleet) -> bool:
    return all(Path(path, "adapter_config.json").is_file() for path in loaded(fleet).values())


def engine_logprobs(fleet, served: str, prompt: list[int], tokens: list[int]) -> list[float]:
    """What the engine's weights give ``tokens`` after ``prompt`` on a call naming ``served`` (the adapter's
    directory it loaded under that name, on the base; the zero adapter samples as the base)."""
    path = loaded(fleet)[served]
    return fleet.weights.score(prompt, tokens, adapter=None if served == "base@zero" else path)


async def test_each_step_is_published_as_the_next_version_and_the_engine_samples_exactly_that_adapter(
    tiny_lora_fleet, redis_url, tiny_checkpoint, tmp_path
):
    stream = f"lora-{os.getpid()}-{id(tmp_path)}"
    learner = GRPOLearner(tiny_checkpoint, CONFIG)
    said: list[str] = []
    async with (
        ProxyClient(tiny_lora_fleet.proxy.url, ADMIN_KEY) as admin,
        TrajectoryConsumer(redis_url, stream=stream, block_ms=100) as feed,
    ):
        publisher = PolicyPublisher(admin, POLICY)
        assert await publisher.version() == 0  # not registered yet
        assert await publish_untrained(learner, publisher, tmp_path) == 1
        assert loaded(tiny_lora_fleet)[f"{POLICY}@v1"] == str(weights_dir(tmp_path, 1))
        groups = await publish_steps(tiny_lora_fleet, redis_url, stream, samples=2, steps=2, policy=POLICY)
        trainer = ReferenceTrainer(learner, feed, publisher, tmp_path, version=1, keep_weights=1, log=said.append)
        records = await trainer.run(2)
        view = await admin.aget(f"/v1/admin/policies/{POLICY}")
        fleet = await admin.aget("/v1/admin/engines")

    assert [r["version"] for r in records] == [2, 3] and [r["trained_version"] for r in records] == [1, 2]
    assert view["version"] == 3 and view["path"] == str(weights_dir(tmp_path, 3))
    assert fleet["policy_version"] == 0 and not fleet["paused"]  # the base untouched, nothing paused
    for record in records:
        assert record["policy"] == POLICY and len(record["engines_reloaded"]) == 1
        assert record["timing"]["pause_s"] == 0.0 and record["timing"]["publish_s"] > 0
        assert "reload_s" not in record["timing"]
    # one load per version, under a new served name each, never in place
    loads = [
        body["lora_name"] for path, body in tiny_lora_fleet.engine.adapter_calls if path == "/v1/load_lora_adapter"
    ]
    assert [name for name in loads if name.startswith(POLICY)] == [f"{POLICY}@v1", f"{POLICY}@v2", f"{POLICY}@v3"]
    assert not any(body.get("load_inplace") for _, body in tiny_lora_fleet.engine.adapter_calls)
    assert sum((await pending(redis_url, stream)).values()) == 0 and len(groups) == 4

    # the engine's logprobs under the newest version are the trainer's with its adapter, bit for bit
    rollouts = [rollout for group in groups for rollout in rollouts_of(group, policy=POLICY)]
    for rollout in rollouts[:2]:
        [scored] = learner.score([rollout])
        ids = rollout.sequences[0].token_ids
        start = int(scored.positions[0])
        theirs = engine_logprobs(tiny_lora_fleet, f"{POLICY}@v3", list(ids[:start]), list(ids[start:]))
        assert np.array_equal(np.asarray(theirs, np.float32)[: len(scored.trainer)], scored.trainer)
    base = engine_logprobs(tiny_lora_fleet, "base@zero", list(ids[:start]), list(ids[start:]))
    assert not np.array_equal(np.asarray(base, np.float32)[: len(scored.trainer)], scored.trainer)  # it learned

    # the version before is retired on the engine; every directory an engine has is still there
    for _ in range(100):
        if f"{POLICY}@v2" not in loaded(tiny_lora_fleet):
            break
        await asyncio.sleep(0.05)
    assert {name for name in loaded(tiny_lora_fleet) if name.startswith(POLICY)} == {f"{POLICY}@v3"}
    assert every_loaded_adapter_has_its_files(tiny_lora_fleet)
    assert not weights_dir(tmp_path, 1).exists()  # retired and unloaded before step 2's record
    assert (weights_dir(tmp_path, 3) / OPTIMIZER).is_file()


class InUse:
    """A publisher whose engines hold the given versions (None: unknown)."""

    policy = POLICY

    def __init__(self, versions: set[int] | None) -> None:
        self.versions = versions

    async def in_use(self) -> set[int] | None:
        return self.versions


@pytest.mark.parametrize(
    "in_use, kept", [(set(), ["v000005"]), ({2, 4}, ["v000002", "v000004", "v000005"]), (None, None)]
)
async def test_an_adapter_directory_goes_only_once_no_engine_has_it(tmp_path, in_use, kept):
    """keep_weights 1: the newest (the policy's) stays; an older one stays while an engine still has it loaded
    or a call holds it, and all stay while that is unknown (an engine re-reads an evicted adapter from its
    directory, and vLLM's engine dies if it is gone)."""
    for version in range(1, 6):
        weights_dir(tmp_path, version).mkdir(parents=True)
    trainer = ReferenceTrainer(None, None, InUse(in_use), tmp_path, version=5, keep_weights=1, log=lambda _: None)  # type: ignore[arg-type]
    await trainer._prune()
    left = sorted(p.name for p in (tmp_path / "weights").iterdir())
    assert left == (kept if kept is not None else [f"v{v:06d}" for v in range(1, 6)])


@pytest.mark.parametrize("where", ["before-the-publish", "after-the-publish", "saving"])
async def test_a_lora_trainer_killed_in_its_step_trains_and_publishes_it_once(
    tiny_lora_fleet, redis_url, tiny_checkpoint, tmp_path, monkeypatch, where
):
    """Killed with the step trained and its intent written but the adapter not published (the restart
    publishes the intent's adapter: the groups are not trained again), with it published but the step not
    recorded (the restart records it: no second version), or inside the save (no intent: trained again)."""
    stream = f"lora-crash-{where}-{os.getpid()}-{id(tmp_path)}"
    learner = GRPOLearner(tiny_checkpoint, CONFIG)
    said: list[str] = []
    async with ProxyClient(tiny_lora_fleet.proxy.url, ADMIN_KEY) as admin:
        publisher = PolicyPublisher(admin, POLICY)
        await publish_untrained(learner, publisher, tmp_path)
        await publish_steps(tiny_lora_fleet, redis_url, stream, samples=2, policy=POLICY)
        publish = publisher.update
        if where == "saving":
            save = learner.save

            def save_then_die(directory: Path) -> None:
                save(directory)
                raise Killed("the trainer died with its adapter written, before its intent")

            monkeypatch.setattr(learner, "save", save_then_die)
        else:

            async def die_around_the_publish(weights: Path | None):
                if where == "after-the-publish":
                    await publish(weights)
                raise Killed(f"the trainer died {where.replace('-', ' ')}")

            monkeypatch.setattr(publisher, "update", die_around_the_publish)
        async with TrajectoryConsumer(redis_url, stream=stream, block_ms=100) as feed:
            crashing = ReferenceTrainer(learner, feed, publisher, tmp_path, version=1, log=said.append)
            with pytest.raises(Killed):
                await crashing.run(1)
        monkeypatch.undo()
        assert await pending(redis_url, stream) == {"trainer-0": 2}
        state = TrainerState.load(tmp_path / STATE)
        assert (state is None) == (where == "saving")
        assert await publisher.version() == (2 if where == "after-the-publish" else 1)

        # the restart, as the CLI starts: the policy's version, state.json, the adapter to go on from
        async with TrajectoryConsumer(redis_url, stream=stream, block_ms=100, stop_when_idle=True) as feed:
            start = await ResumePoint.read(publisher, tmp_path)
            assert start.version == (2 if where == "after-the-publish" else 1)
            adapter = start.weights
            assert adapter == (weights_dir(tmp_path, 1) if where == "saving" else weights_dir(tmp_path, 2))
            restarted = GRPOLearner(tiny_checkpoint, CONFIG, adapter_dir=adapter)
            assert restarted.optimizer_steps == (0 if where == "saving" else 1)  # AdamW where it was
            trainer = ReferenceTrainer(
                restarted, feed, publisher, tmp_path, version=start.version, state=start.state, log=said.append
            )
            await trainer.run()
        assert await publisher.version() == 2  # the step's adapter published once
    [record] = step_log(tmp_path)
    assert record["version"] == 2 and record["policy"] == POLICY
    assert record.get("finished_after_restart", False) == (where != "saving")
    assert sum("training at version" in line for line in said) == (2 if where == "saving" else 1)
    assert sum((await pending(redis_url, stream)).values()) == 0
    loads = [
        body["lora_name"] for path, body in tiny_lora_fleet.engine.adapter_calls if path == "/v1/load_lora_adapter"
    ]
    assert loads.count(f"{POLICY}@v2") == 1
    final = TrainerState.load(tmp_path / STATE)
    assert final is not None and final.intent is None and final.version == 2


async def test_a_grpolora_job_runs_end_to_end_and_its_sessions_sample_each_new_version(
    tiny_lora_fleet, redis_url, tiny_checkpoint, tmp_path
):
    """The runner (a GRPOLoRA job, max_staleness 0) and the LoRA trainer together: step k's sessions sample
    version k + 1 of the job's policy, each trained token's version is it, and the trainer's logprobs with its
    adapter equal the engine's sampling ones."""
    job = short_answer_job(samples=2, generations=2, steps=3, training_loop={"max_staleness": 0})
    job.customization_type = "GRPOLoRA"
    job.lora = LoRASection(policy=POLICY, rank=8, target_modules=["q_proj", "v_proj"])
    job.proxy.policy = POLICY
    stream = f"lora-e2e-{os.getpid()}"
    runner_feed = await open_feed(redis_url, stream=stream)
    learner = GRPOLearner(tiny_checkpoint, CONFIG)
    async with (
        ProxyClient(tiny_lora_fleet.proxy.url, ADMIN_KEY) as admin,
        TrajectoryConsumer(redis_url, stream=stream, block_ms=100) as feed,
    ):
        publisher = PolicyPublisher(admin, POLICY)
        runner = JobRunner(
            job, proxy_url=tiny_lora_fleet.proxy.url, admin_key=ADMIN_KEY, feed=runner_feed, progress=False
        )
        try:
            async with asyncio.timeout(300), asyncio.TaskGroup() as tasks:
                ran = tasks.create_task(runner.run())  # waits for the policy's first version
                await asyncio.sleep(0.2)
                version = await publish_untrained(learner, publisher, tmp_path)
                trainer = ReferenceTrainer(learner, feed, publisher, tmp_path, version=version, log=lambda _: None)
                tasks.create_task(trainer.run(3))
            groups = [entry.group for entry in await runner_feed.read(limit=100)]
        finally:
            await runner_feed.close()
    assert ran.result().steps == 3 and [r["version"] for r in trainer.records] == [2, 3, 4]
    for group in groups:
        spans = [span for t in group.trajectories for s in t.sequences() for span in s.policy_versions]
        assert spans and {(span.policy, span.version) for span in spans} == {(POLICY, group.step + 1)}
    for record in trainer.records:
        mismatch = record["mismatch"]
        assert mismatch["other_version"]["tokens"] == 0 and mismatch["current"]["tokens"] > 0
        assert mismatch["current"]["max_abs"] == 0.0  # scored alone, as the engine scores: bit for bit
    assert every_loaded_adapter_has_its_files(tiny_lora_fleet)


async def test_a_lora_trainer_refuses_a_group_another_policy_sampled_and_publishes_nothing(
    tiny_lora_fleet, redis_url, tiny_checkpoint, tmp_path
):
    """Sessions on the base policy feed the step of a trainer of the LoRA policy: the trainer stops naming the
    group, the rollout and the policy that sampled it, before it trains; no version is published and the
    groups stay on the feed, unacknowledged."""
    stream = f"lora-other-{os.getpid()}-{id(tmp_path)}"
    learner = GRPOLearner(tiny_checkpoint, CONFIG)
    async with ProxyClient(tiny_lora_fleet.proxy.url, ADMIN_KEY) as admin:
        publisher = PolicyPublisher(admin, POLICY)
        await publish_untrained(learner, publisher, tmp_path)
        [first, _] = await publish_steps(tiny_lora_fleet, redis_url, stream, samples=2, policy="base")
        async with TrajectoryConsumer(redis_url, stream=stream, block_ms=100) as feed:
            trainer = ReferenceTrainer(learner, feed, publisher, tmp_path, version=1, log=lambda _: None)
            with pytest.raises(BatchError) as refused:
                await trainer.run(1)
        assert await publisher.version() == 1
    message = str(refused.value)
    assert f"group {first.group_id}, rollout 0" in message
    assert f"tokens sampled by policy 'base', not by {POLICY!r} that this trainer trains" in message
    assert not trainer.records and not (tmp_path / "steps.jsonl").exists()
    assert await pending(redis_url, stream) == {"trainer-0": 2}
    assert learner.optimizer_steps == 0


async def test_an_engine_that_hangs_keeps_every_adapter_directory(tiny_lora_fleet, tiny_checkpoint, tmp_path):
    """While an engine does not answer which adapters it has, no version's files go (it may still read any)."""
    learner = GRPOLearner(tiny_checkpoint, CONFIG)
    async with ProxyClient(tiny_lora_fleet.proxy.url, ADMIN_KEY) as admin:
        publisher = PolicyPublisher(admin, POLICY, engine_timeout=0.5)
        await publish_untrained(learner, publisher, tmp_path)
        assert await publisher.in_use() == {1}
        tiny_lora_fleet.engine.fault = "hang_all"
        try:
            assert await publisher.in_use() is None
        finally:
            tiny_lora_fleet.engine.fault = None


async def test_a_rank_the_engines_refuse_stops_the_trainer_in_words_and_changes_nothing(
    tiny_lora_fleet, tiny_checkpoint, tmp_path
):
    """The engine serves ranks up to 16: a rank-32 adapter is refused by the proxy in vLLM's words, the policy
    is not registered, and the trainer (which publishes its untrained adapter first) stops before any step."""
    wide = GRPOConfig(lora=LoRAConfig(rank=32, alpha=64, target_modules=("q_proj",)))
    learner = GRPOLearner(tiny_checkpoint, wide)
    async with ProxyClient(tiny_lora_fleet.proxy.url, ADMIN_KEY) as admin:
        publisher = PolicyPublisher(admin, POLICY)
        with pytest.raises(ProxyRequestError, match="LoRA rank 32 is greater than max_lora_rank 16") as refused:
            await publish_untrained(learner, publisher, tmp_path)
        assert refused.value.status == 400
        assert await publisher.version() == 0 and await publisher.view() is None
    assert not any(name.startswith(POLICY) for name in loaded(tiny_lora_fleet))
