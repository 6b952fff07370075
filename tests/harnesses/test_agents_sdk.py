"""The OpenAI Agents SDK 0.24.0, unmodified: an ``Agent`` without ``model=`` (the SDK's default model and
its default settings: ``reasoning: {"effort": "none"}``, ``verbosity: "low"``), a function tool, on the
Responses and the Chat Completions models, with ``Runner.run`` and ``Runner.run_streamed``, and Responses
chaining by ``auto_previous_response_id``. Tracing is off (``RunConfig(tracing_disabled=True)``): nothing
leaves the process but the model calls, to the session.
"""

from __future__ import annotations

import openai
import pytest
from agents import Agent, OpenAIProvider, RunConfig, Runner, function_tool

from devtools.fake_engine import FakeEngine
from rollout_proxy.proxy import keys
from tests.harness import ProxyHarness
from tests.harnesses.conftest import assert_exact, open_session, session_trajectory

TASK = "What is the weather in Paris?"
INSTRUCTIONS = "You answer weather questions with the get_weather tool."
CALL = (
    "<think>\nCheck the tool.\n</think>\n\n"
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
)
ANSWER = "It is 18C and sunny in Paris."


@function_tool
def get_weather(city: str) -> str:
    """Current weather for a city."""
    return f"18C and sunny in {city}"


MODES = {
    "responses": {"responses": True, "streamed": False, "chained": False},
    "responses_chained": {"responses": True, "streamed": False, "chained": True},
    "responses_streamed": {"responses": True, "streamed": True, "chained": True},
    "chat": {"responses": False, "streamed": False, "chained": False},
    "chat_streamed": {"responses": False, "streamed": True, "chained": False},
}


@pytest.mark.parametrize("sample", [None, [{"role": "user", "content": TASK}]], ids=["no_sample", "task_sample"])
@pytest.mark.parametrize("mode", list(MODES))
async def test_agent_tool_round_trip_is_recorded_exactly(proxy: ProxyHarness, fake: FakeEngine, mode, sample):
    how = MODES[mode]
    session = await open_session(proxy, sample)
    fake.queue(CALL, ANSWER)
    client = openai.AsyncOpenAI(base_url=session["base_url"], api_key=session["api_key"], max_retries=0)
    try:
        agent = Agent(name="weather", instructions=INSTRUCTIONS, tools=[get_weather])  # the SDK's default model
        config = RunConfig(
            model_provider=OpenAIProvider(openai_client=client, use_responses=how["responses"]),
            tracing_disabled=True,
        )
        options = {"run_config": config, "auto_previous_response_id": how["chained"]}
        if how["streamed"]:
            result = Runner.run_streamed(agent, TASK, **options)
            events = [event.type async for event in result.stream_events()]
            assert "raw_response_event" in events
        else:
            result = await Runner.run(agent, TASK, **options)
    finally:
        await client.close()
    assert result.final_output == ANSWER
    trajectory = await session_trajectory(proxy, session)
    assert_exact(trajectory, fake, task=TASK, turns=2)
    messages = trajectory["messages"]
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "tool", "assistant"]
    assert messages[0]["content"] == INSTRUCTIONS  # the instructions first, the sample not added again
    path = await proxy.app[keys.STORE].get_path(session["session_id"], trajectory["response_id"])
    assert len(path) == 2 and path[1].parent_id == path[0].id and path[1].fork is None
    if how["chained"]:
        assert path[1].meta["previous_response_id"] == path[0].id
    assert all("client_sampling" not in node.meta for node in path)  # effort none, verbosity low: no-ops
