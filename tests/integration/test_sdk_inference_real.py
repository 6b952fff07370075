"""The SDK's local-debug mode straight against vLLM (no proxy): InferenceProxy and test_with_dataset."""

from __future__ import annotations

from importlib import resources

from rollout_proxy.examples.async_weather_rollout import demo_rollout
from rollout_proxy.examples.group_rollout import demo_group_rollout
from rollout_proxy.examples.weather_reward import weather_reward
from rollout_proxy.examples.weather_rollout import demo_rollout as sync_demo_rollout
from rollout_proxy.sdk import ChatCompletionSample, InferenceProxy, Mode, PluginContext, PluginStatus, test_with_dataset
from tests.integration.conftest import RecordingRelay

SAMPLE = ChatCompletionSample(
    messages=[{"role": "user", "content": "What is the weather in Paris?"}],
    max_new_tokens=20,
    temperature=0.7,
    top_p=0.9,
    top_k=20,
)


async def test_inference_mode_single_rollout(relay: RecordingRelay):
    proxy = InferenceProxy(SAMPLE, url=relay.url + "/v1", jwt_token="EMPTY", mode=Mode.Inference)
    result = await demo_rollout(PluginContext(is_mock=True), proxy, SAMPLE)
    assert result.status == PluginStatus.SUCCESS
    assert proxy.messages[0]["content"] == "What is the weather in Paris?"
    assert proxy.messages[-1]["role"] == "assistant"
    assert proxy.finish_reason in ("stop", "length", "tool_calls") and proxy.usage["completion_tokens"] > 0
    _path, body = next(item for item in relay.requests if item[0] == "/v1/chat/completions")
    # no proxy pins them here: the SDK applies the sample's GenerationConfig itself
    assert (body["temperature"], body["top_p"], body["max_tokens"], body["top_k"]) == (0.7, 0.9, 20, 20)
    assert relay.completions == []  # nothing went through a rollout-proxy


async def test_inference_mode_group_rollout_replays_branches(relay: RecordingRelay):
    proxy = InferenceProxy(
        SAMPLE, url=relay.url + "/v1", jwt_token="EMPTY", mode=Mode.Inference, group=True, model="smollm2"
    )
    result = await demo_group_rollout(PluginContext(is_mock=True), proxy, SAMPLE, n_sample=3)
    assert result.status == PluginStatus.SUCCESS and len(result.responses) == 3
    sent = [body for path, body in relay.requests if path == "/v1/responses"]
    assert len(sent) == 3 and all("previous_response_id" not in body for body in sent)
    assert all(body["model"] == "smollm2" and body["max_output_tokens"] == 20 for body in sent)
    # the branches carry their parent's conversation, replayed client-side
    first_answer = proxy._histories[result.responses[0].id][-1]["content"]
    for body in sent[1:]:
        contents = [item.get("content") for item in body["input"]]
        assert contents[:3] == ["What is the weather in Paris?", "人之初", first_answer]
    assert [m["content"] for m in proxy._histories[result.responses[2].id]][-2] == "苟不教"


async def test_with_dataset_against_vllm(relay: RecordingRelay):
    dataset = resources.files("rollout_proxy.examples") / "data" / "weather.jsonl"
    rewards = await test_with_dataset(
        str(dataset),
        sync_demo_rollout,
        weather_reward,
        "EMPTY",
        base_url=relay.url + "/v1",
        limit=3,
        max_concurrent=3,
        n_sample=1,
        top_p=1.0,
        temperature=1.0,
        max_new_tokens=48,
        progress=False,
    )
    assert len(rewards) == 3 and all(0.0 <= reward <= 1.0 for reward in rewards)
    chats = [body for path, body in relay.requests if path == "/v1/chat/completions"]
    assert len(chats) >= 3 and all(body["temperature"] == 1.0 and body["top_p"] == 1.0 for body in chats)
