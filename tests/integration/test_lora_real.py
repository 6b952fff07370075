"""LoRA policies on a real vLLM (CPU, fp32, ``--enable-lora``): an update while a call on the old version runs.

One server, one test (a start costs about a minute on 2 cores). What it shows: a call on v1 in flight while v2
is published finishes exactly as v1 alone would have (the same tokens), the next call is v2's, v1 is unloaded
afterwards, each adapter samples other tokens than the base, and base calls through the zero adapter are the
base's (the vLLM CPU batching bug is what the zero adapter avoids).
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import numpy as np

from devtools.lora_adapter import build_adapter
from rollout_proxy.engines.base import SamplingParams
from rollout_proxy.engines.fleet import Fleet, FleetSettings
from rollout_proxy.engines.policies import ZERO_SERVED, Policies
from rollout_proxy.engines.sampling import Sampled, sample
from rollout_proxy.engines.vllm_http import VLLMEngine
from tests.integration.conftest import VLLMServers

ASK = [{"role": "user", "content": "Name three colours of the rainbow."}]
LONG = SamplingParams(max_tokens=40, temperature=1.0, top_p=1.0, top_k=0, seed=1234)
SHORT = SamplingParams(max_tokens=12, temperature=1.0, top_p=1.0, top_k=0, seed=1234)


def tokens(sampled: Sampled) -> list[int]:
    return sampled.completion.output_ids.tolist()


async def test_an_adapter_update_under_a_call_in_flight(vllm_servers: VLLMServers, tmp_path: Path, tokenizer_dir):
    server = vllm_servers.get("dense_lora")
    v1 = str(build_adapter(tokenizer_dir, tmp_path / "v1", targets=("q_proj", "v_proj"), seed=1, std=0.05))
    v2 = str(build_adapter(tokenizer_dir, tmp_path / "v2", targets=("q_proj", "v_proj"), seed=2, std=0.05))
    engine = VLLMEngine(server.base_url, bound_completions=False)
    fleet = Fleet([engine], FleetSettings(probe_interval=60.0, control_timeout=120.0))
    policies = Policies(fleet)
    await fleet.start()
    try:
        prompt = await engine.tokenize_messages(ASK, tools=None, add_generation_prompt=True, chat_template_kwargs=None)
        base = await sample(fleet, engine, prompt, LONG)
        await policies.register("pol", path=v1)
        assert {card.name for card in await engine.adapters()} == {ZERO_SERVED, "pol@v1"}
        alone = await sample(fleet, engine, prompt, LONG, policy="pol")
        assert tokens(alone) != tokens(base)  # the adapter changes what is sampled

        in_flight = asyncio.ensure_future(sample(fleet, engine, prompt, LONG, policy="pol"))
        await asyncio.sleep(1.0)
        started = time.perf_counter()
        published = await policies.publish("pol", v2)
        publish_seconds = time.perf_counter() - started
        assert published["version"] == 2 and published["failed"] == 0
        assert not in_flight.done()  # the update did not wait for it
        newer = await sample(fleet, engine, prompt, SHORT, policy="pol")
        assert newer.versions[0].version == 2 and tokens(newer) != tokens(alone)[: len(tokens(newer))]
        old = await in_flight
        assert old.versions[0].version == 1 and old.completion.finish_reason == "length"
        assert tokens(old) == tokens(alone)  # unchanged by the update under it
        np.testing.assert_allclose(old.completion.output_logprobs, alone.completion.output_logprobs, atol=1e-4)
        async with asyncio.timeout(30):
            while "pol@v1" in {card.name for card in await engine.adapters()}:  # noqa: ASYNC110
                await asyncio.sleep(0.1)

        through_zero = await sample(fleet, engine, prompt, LONG)
        assert tokens(through_zero) == tokens(base)  # the base, through the zero adapter
        np.testing.assert_allclose(through_zero.completion.output_logprobs, base.completion.output_logprobs, atol=1e-4)
        print(f"\n[lora] publish under load: {publish_seconds:.2f}s")
    finally:
        await policies.close()
        await fleet.close()
