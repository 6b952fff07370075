"""A recorded weather session for the viewer's tests: tool calls, a tool result, a fork, a grade.

Through the official openai client, as a plugin would: turn 1 calls ``get_weather``, the tool
answers, turn 2 calls it again, turn 3 answers in words; then the plugin rewrites turn 1's
reply and asks again (a fork), and appends a message the policy did not generate (an injected
node). The session is finished with the three-turn trajectory, which a "runner" grades onto
the trainer feed this proxy serves.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import openai

from rollout_proxy.state.feed import Feed
from rollout_proxy.wire.feed import FeedGroup
from rollout_proxy.wire.trajectory import Trajectory
from tests.harness import WEATHER_TOOL, ProxyHarness

USER = [{"role": "user", "content": "What is the weather in Paris and in Lyon?"}]
JOB = "job-weather"
CALL_PARIS = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
CALL_LYON = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Lyon"}}\n</tool_call>'
ANSWER = "Paris is sunny at 21 C and Lyon is cloudy at 17 C."
FORKED = "I will check with the tool after all."
REWARD, ADVANTAGE = 0.75, 0.5


@dataclass
class Recorded:
    session_id: str
    turns: list[str]  # the three turns' response ids
    forked: str
    injected: str
    trajectory: dict[str, Any]  # the finished trajectory, as the finish answered it


def tool_result(call: Any, text: str) -> dict[str, Any]:
    return {"role": "tool", "tool_call_id": call.id, "content": text}


async def open_session(harness: ProxyHarness, *, job: str = JOB, step: int = 0) -> tuple[str, openai.AsyncOpenAI]:
    """A session as the runner opens one (its job and step in the context); its id and a plugin's client."""
    body = {
        "sample": {"messages": USER, "tools": [WEATHER_TOOL]},
        "generation": {"max_new_tokens": 64},
        "context": {"model_customization_job_id": job, "current_training_step": step},
    }
    status, created = await harness.request("POST", "/v1/sessions", json=body)
    assert status == 201, created
    return created["session_id"], harness.client(created["base_url"], created["api_key"])


async def record(harness: ProxyHarness, *, feed: Feed | None = None, job: str = JOB, step: int = 0) -> Recorded:
    fake = harness.fake
    assert fake is not None
    fake.queue(CALL_PARIS, CALL_LYON, ANSWER, FORKED)
    session_id, client = await open_session(harness, job=job, step=step)
    first = await client.chat.completions.create(model="policy", messages=USER, tools=[WEATHER_TOOL])
    call = first.choices[0].message.tool_calls[0]
    history = [*USER, first.choices[0].message.model_dump(exclude_none=True), tool_result(call, "sunny, 21 C")]
    second = await client.chat.completions.create(model="policy", messages=history, tools=[WEATHER_TOOL])
    call = second.choices[0].message.tool_calls[0]
    history += [second.choices[0].message.model_dump(exclude_none=True), tool_result(call, "cloudy, 17 C")]
    third = await client.chat.completions.create(model="policy", messages=history, tools=[WEATHER_TOOL])
    assert third.choices[0].message.content == ANSWER
    # the plugin rewrites turn 1's reply: a fork, recorded with where it diverged
    rewritten = [
        *USER,
        {"role": "assistant", "content": "Probably sunny."},
        {"role": "user", "content": "Check, please."},
    ]
    forked = await client.chat.completions.create(model="policy", messages=rewritten, tools=[WEATHER_TOOL])
    status, appended = await harness.request(
        "POST",
        f"/v1/sessions/{session_id}/messages",
        json={"messages": [{"role": "user", "content": "Thanks!"}], "previous_response_id": forked.id},
    )
    assert status == 201, appended
    status, finished = await harness.request(
        "POST",
        f"/v1/sessions/{session_id}/finish",
        json={"status": "success", "responses": [{"id": third.id}], "extra": {"note": "graded below"}},
    )
    assert status == 200, finished
    (trajectory,) = finished["trajectories"]
    if feed is not None:
        await feed.publish(
            FeedGroup(
                group_id=f"{job}/step-{step}/sample-0",
                job_id=job,
                step=step,
                sample_index=0,
                trajectories=[Trajectory.model_validate(trajectory)],
                rewards=[REWARD],
                advantages=[ADVANTAGE],
                advantage_kind="seq",
            )
        )
    return Recorded(
        session_id=session_id,
        turns=[first.id, second.id, third.id],
        forked=forked.id,
        injected=appended["response_id"],
        trajectory=trajectory,
    )
