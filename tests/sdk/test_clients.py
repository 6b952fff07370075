"""Client wrappers: pointed at the session, GenerationConfig refused before sending."""

from __future__ import annotations

import asyncio
import contextlib
import time

import openai
import pytest

from rollout_proxy.sdk import (
    ChatCompletionSample,
    GenerationParameterError,
    InferenceProxy,
    Mode,
    ProxyRequestError,
    RolloutApiError,
    wrap_async_client_inplace,
    wrap_client_inplace,
    wrap_responses_async_client_inplace,
    wrap_responses_client_inplace,
)
from tests.harness import ADMIN_KEY
from tests.sdk.conftest import SLOW_APPEND_SECONDS, Relay, Stack

SAMPLE = ChatCompletionSample(messages=[{"role": "user", "content": "Hi"}], max_new_tokens=32)
MESSAGES = [{"role": "user", "content": "Hi"}]


@pytest.mark.parametrize(
    "kwargs",
    [
        {"temperature": 0.1},
        {"top_p": 0.5},
        {"n": 2},
        {"max_tokens": 5},
        {"extra_body": {"top_k": 4}},
        {"extra_body": {"max_new_tokens": 4}},
        {"extra_body": {"thinking": {"type": "enabled"}}},
    ],
)
def test_wrapped_chat_refuses_generation_config_before_sending(stack: Stack, kwargs):
    proxy = stack.session(SAMPLE)
    client = wrap_client_inplace(openai.OpenAI(base_url="http://nowhere.invalid/v1", api_key="x"), proxy)
    assert str(client.base_url).rstrip("/") == proxy.url and client.api_key == proxy.jwt_token
    with pytest.raises(GenerationParameterError, match="GenerationConfig"):
        client.chat.completions.create(model="m", messages=MESSAGES, **kwargs)
    assert stack.fake.completions == []  # nothing reached the engine


async def test_wrapped_async_clients(stack: Stack):
    proxy = stack.session(SAMPLE)
    chat = wrap_async_client_inplace(openai.AsyncOpenAI(base_url="http://nowhere.invalid/v1", api_key="x"), proxy)
    reply = await chat.chat.completions.create(model="m", messages=MESSAGES)
    assert proxy.messages[-1]["content"] == reply.choices[0].message.content
    responses = wrap_responses_async_client_inplace(
        openai.AsyncOpenAI(base_url="http://nowhere.invalid/v1", api_key="x"), proxy
    )
    with pytest.raises(GenerationParameterError):
        await responses.responses.create(model="m", input="Hi", max_output_tokens=4)
    answer = await responses.responses.create(model="m", input="Hello again")
    assert proxy.messages[-1]["content"] == answer.output_text
    assert [m["content"] for m in proxy.messages] == ["Hi", "Hello again", answer.output_text]


def test_wrapped_sync_responses_track_branches(stack: Stack):
    proxy = stack.session(SAMPLE)
    client = wrap_responses_client_inplace(openai.OpenAI(base_url="http://nowhere.invalid/v1", api_key="x"), proxy)
    first = client.responses.create(model="m", input="one")
    branch = client.responses.create(model="m", input="two", previous_response_id=first.id)
    other = client.responses.create(model="m", input="three", previous_response_id=first.id)
    assert [m["content"] for m in proxy.messages] == ["Hi", "one", first.output_text, "three", other.output_text]
    assert proxy._histories[branch.id][-2]["content"] == "two"


def test_group_rollout_clients_refuse_chat(stack: Stack):
    proxy = stack.session(SAMPLE, n_sample=2)
    proxy.group = True
    with pytest.raises(RolloutApiError, match="must use the Responses API"):
        proxy.rollout_client().chat.completions.create(model="m", messages=MESSAGES)


def test_update_state_from_messages_returns_an_extendable_id(stack: Stack):
    proxy = stack.session(SAMPLE)
    client = proxy.rollout_client()
    first = client.chat.completions.create(model="m", messages=MESSAGES)
    injected = proxy.update_state_from_messages(
        [{"role": "user", "content": "Other model?"}, {"role": "assistant", "content": "External answer."}],
        previous_response_id=first.id,
    )
    assert injected.startswith("resp_")
    follow = client.responses.create(model="m", input="Continue.", previous_response_id=injected)
    status, trajectory = stack.request("GET", f"/v1/responses/{follow.id}/trajectory")
    assert status == 200 and trajectory["turns"] == 2
    assert [m["content"] for m in trajectory["messages"]][-3:-1] == ["External answer.", "Continue."]


def test_training_mode_inference_proxy_opens_a_session(stack: Stack):
    proxy = InferenceProxy(SAMPLE, url=stack.url, jwt_token=ADMIN_KEY, mode=Mode.Training)
    reply = proxy.rollout_client().chat.completions.create(model="m", messages=MESSAGES)
    finished = proxy.finish({"status": "success", "extra": {"k": 1}})
    (trajectory,) = finished["trajectories"]
    assert trajectory["response_id"] == reply.id and trajectory["extra"] == {"k": 1}
    assert stack.fake.completions[-1]["max_tokens"] == 32  # the sample's GenerationConfig, pinned by the session


class LoopGaps:
    """The longest stretch the running event loop went without running a ticker task on it.

    A coroutine that awaits its I/O lets the ticker run every few milliseconds; one that
    blocks the loop shows as a single gap as long as the block (measured up to the exit too,
    since a blocked ticker cannot record its own gap).
    """

    TICK = 0.01

    async def __aenter__(self) -> LoopGaps:
        self.largest = 0.0
        self.started = self._last = time.perf_counter()
        self._ticker = asyncio.create_task(self._tick())
        await asyncio.sleep(0)  # the ticker runs before the measured code
        return self

    async def _tick(self) -> None:
        while True:
            await asyncio.sleep(self.TICK)
            self._note(time.perf_counter())

    def _note(self, now: float) -> None:
        self.largest = max(self.largest, now - self._last)
        self._last = now

    async def __aexit__(self, *exc_info: object) -> None:
        now = time.perf_counter()
        self._note(now)
        self.elapsed = now - self.started
        self._ticker.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._ticker


async def test_async_state_update_does_not_block_the_loop(stack: Stack, slow_relay: Relay):
    proxy = stack.session(SAMPLE, via=slow_relay.url)  # appended messages answer after SLOW_APPEND_SECONDS
    client = proxy.async_rollout_client()
    first = await client.chat.completions.create(model="m", messages=MESSAGES)
    async with LoopGaps() as gaps:
        injected = await proxy.aupdate_state_from_messages(
            [{"role": "user", "content": "Again?"}], previous_response_id=first.id
        )
    assert gaps.elapsed >= SLOW_APPEND_SECONDS  # the answer was slow...
    assert gaps.largest < 0.2  # ...and the plugin's loop kept running all along
    assert [m["content"] for m in proxy.messages] == ["Hi", first.choices[0].message.content, "Again?"]
    status, trajectory = stack.request("GET", f"/v1/responses/{injected}/trajectory")
    assert status == 200 and trajectory["messages"][-1]["content"] == "Again?"
    with pytest.raises(ProxyRequestError, match="404"):
        await proxy.aupdate_state_from_messages(
            [{"role": "user", "content": "x"}], previous_response_id="resp_" + "0" * 32
        )
    await proxy.aclose()


async def test_a_blocking_state_update_would_show_as_a_long_gap(stack: Stack, slow_relay: Relay):
    """The measurement above can fail: the sync update, called on the loop, stalls it for the whole answer."""
    proxy = stack.session(SAMPLE, via=slow_relay.url)
    first = proxy.rollout_client().chat.completions.create(model="m", messages=MESSAGES)
    async with LoopGaps() as gaps:
        injected = proxy.update_state_from_messages([{"role": "user", "content": "Again?"}], first.id)
    assert gaps.largest >= 0.4
    assert proxy._histories[injected][-1]["content"] == "Again?"
    proxy.close()
