"""``InferenceProxy``: one class per mode, a lazily opened training session, proxies that close what they made."""

from __future__ import annotations

import asyncio
import socket

import openai
import pytest

from rollout_proxy.sdk import (
    ChatCompletionSample,
    InferenceProxy,
    Mode,
    ProxyUnreachable,
    RolloutInferenceProxy,
)
from rollout_proxy.sdk.proxy import LocalInferenceProxy, TrainingInferenceProxy
from tests.harness import ADMIN_KEY
from tests.sdk.conftest import Relay, Stack

SAMPLE = ChatCompletionSample(messages=[{"role": "user", "content": "Hi"}], max_new_tokens=32)
MESSAGES = [{"role": "user", "content": "Hi"}]


def unreachable_url() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{sock.getsockname()[1]}/v1"


@pytest.mark.parametrize(
    "mode, kind",
    [
        (None, LocalInferenceProxy),
        (Mode.Inference, LocalInferenceProxy),
        ("inference", LocalInferenceProxy),
        (Mode.Training, TrainingInferenceProxy),
        ("training", TrainingInferenceProxy),
    ],
)
def test_the_mode_picks_the_class(mode, kind):
    options = {} if mode is None else {"mode": mode}
    proxy = InferenceProxy(SAMPLE, url="http://127.0.0.1:9/v1", jwt_token="k", **options)
    assert type(proxy) is kind
    assert isinstance(proxy, InferenceProxy) and isinstance(proxy, RolloutInferenceProxy)
    assert proxy.mode is (Mode(mode) if mode is not None else Mode.Inference)
    assert proxy.sample is SAMPLE and proxy.group is False


def test_a_mode_class_refuses_the_other_mode():
    assert type(TrainingInferenceProxy(SAMPLE, url="http://127.0.0.1:9", jwt_token="k")) is TrainingInferenceProxy
    with pytest.raises(ValueError, match="LocalInferenceProxy runs in inference mode, not training"):
        LocalInferenceProxy(SAMPLE, url="http://127.0.0.1:9", jwt_token="k", mode=Mode.Training)


async def test_training_proxy_does_no_io_until_first_need():
    url = unreachable_url()
    proxy = InferenceProxy(SAMPLE, url=url, jwt_token=ADMIN_KEY, mode=Mode.Training)  # nothing listens: no raise
    client = proxy.async_rollout_client()  # no I/O either
    assert not proxy.is_open
    with pytest.raises(ProxyUnreachable, match="creating a session failed"):
        await client.chat.completions.create(model="m", messages=MESSAGES)  # the first create opens it
    with pytest.raises(ProxyUnreachable):
        await proxy.aupdate_state_from_messages([{"role": "user", "content": "x"}])
    with pytest.raises(ProxyUnreachable):
        proxy.open()
    assert not proxy.is_open
    await proxy.aclose()


def test_local_proxy_has_no_trajectories_to_finish():
    proxy = InferenceProxy(SAMPLE, url="http://127.0.0.1:9/v1", jwt_token="k")
    with pytest.raises(RuntimeError, match=r"needs Mode\.Training"):
        proxy.finish({"status": "success"})
    with pytest.raises(RuntimeError, match=r"needs Mode\.Training"):
        asyncio.run(proxy.afinish({"status": "success"}))
    assert proxy.update_state_from_messages(MESSAGES) == "local_0"  # kept here, no endpoint involved


async def test_training_proxy_opens_one_session_without_blocking_and_afinishes(stack: Stack, relay: Relay):
    async with InferenceProxy(SAMPLE, url=relay.url, jwt_token=ADMIN_KEY, mode=Mode.Training, n_sample=3) as proxy:
        proxy.group = True  # what @group_rollout sets
        client = proxy.async_rollout_client()
        assert relay.seen == [] and not proxy.is_open
        answers = await asyncio.gather(*(client.responses.create(model="m", input=f"Try {i}") for i in range(3)))
        assert relay.seen == ["POST /v1/sessions"]  # concurrent first calls opened one session
        assert proxy.is_open and str(client.base_url).rstrip("/") == proxy.url
        injected = await proxy.aupdate_state_from_messages(
            [{"role": "user", "content": "Noted."}], previous_response_id=answers[0].id
        )
        assert proxy._histories[injected][-1]["content"] == "Noted."
        finished = await proxy.afinish({"status": "success", "responses": [{"id": a.id} for a in answers]})
    assert relay.seen == ["POST /v1/sessions", f"POST /v1/sessions/{proxy.session_id}/finish"]
    assert [t["response_id"] for t in finished["trajectories"]] == [a.id for a in answers]
    assert stack.fake.completions[-1]["max_tokens"] == 32  # the sample's GenerationConfig, pinned by the session
    assert client.is_closed()  # closed with the proxy


def test_sync_proxy_closes_its_clients(stack: Stack):
    with stack.session(SAMPLE) as proxy:
        client = proxy.rollout_client()
        client.chat.completions.create(model="m", messages=MESSAGES)
        assert isinstance(client, openai.OpenAI) and not client.is_closed()
    assert client.is_closed()
