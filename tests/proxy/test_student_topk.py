"""The policy's own top-k at sampling time (a session's ``top_logprobs``; OPD ``topk_type: student``).

The fake engine's distribution is a deterministic function of position and token (``fake_logprob``),
so every recorded row can be checked value for value: k ids best first, each with its logprob at that
position, and the sampled token, when among them, with the logprob it was sampled with.
"""

from __future__ import annotations

import numpy as np
import pytest

from devtools.fake_engine import fake_logprob
from rollout_proxy.wire.trajectory import Trajectory
from tests.harness import ProxyHarness

USER = [{"role": "user", "content": "Name a colour."}]


def check_rows(trajectory: Trajectory, k: int) -> None:
    arrays = trajectory.student_topk_arrays()
    assert arrays is not None
    ids, logprobs = arrays
    trained = np.flatnonzero(trajectory.loss_weight() > 0)
    assert ids.shape == logprobs.shape == (len(trained), k) and ids.dtype == np.int32 and logprobs.dtype == np.float32
    sampled = trajectory.token_logprobs()
    for row, position in enumerate(trained):
        assert logprobs[row].tolist() == pytest.approx([fake_logprob(int(position), int(t)) for t in ids[row]])
        assert np.all(np.diff(logprobs[row]) <= 0)
        token = trajectory.total_token_ids[position]
        if token in ids[row]:
            assert logprobs[row][ids[row].tolist().index(token)] == pytest.approx(sampled[position])


async def test_a_session_with_top_logprobs_records_the_policys_top_k_per_trained_token(proxy: ProxyHarness):
    assert proxy.fake is not None
    proxy.fake.queue("Blue.", "Green, then.")
    session = await proxy.create_session(USER, top_logprobs=3)
    first = await session.client.chat.completions.create(model="m", messages=USER, logprobs=True, top_logprobs=3)
    history = [*USER, first.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "Another"}]
    second = await session.client.chat.completions.create(model="m", messages=history)
    assert proxy.fake.completions[-1]["logprobs"] == 3 and proxy.fake.completions[-1]["return_tokens_as_token_ids"]
    trajectory = Trajectory.model_validate(await proxy.trajectory(second.id))
    check_rows(trajectory, 3)
    # the chat answer shows the same rows as OpenAI's top_logprobs
    content = first.choices[0].logprobs.content
    assert content is not None and all(len(entry.top_logprobs) == 3 for entry in content)
    ids, _ = trajectory.student_topk_arrays() or (None, None)
    assert ids is not None
    assert [top.token for top in content[0].top_logprobs] == [f"token_id:{t}" for t in ids[0]]


async def test_a_streamed_turn_records_the_same_rows(proxy: ProxyHarness):
    """Engines are not streamed from for such a session (one call, relayed as chunks): the rows are whole."""
    assert proxy.fake is not None
    proxy.fake.queue("Red and yellow.")
    session = await proxy.create_session(USER, top_logprobs=2)
    stream = await session.client.chat.completions.create(model="m", messages=USER, stream=True)
    chunks = [chunk async for chunk in stream]
    assert "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices) == "Red and yellow."
    assert not proxy.fake.completions[-1].get("stream")
    trajectory = Trajectory.model_validate(await proxy.trajectory(chunks[0].id))
    check_rows(trajectory, 2)


async def test_without_top_logprobs_nothing_more_is_asked_or_recorded(proxy: ProxyHarness):
    assert proxy.fake is not None
    proxy.fake.queue("Blue.")
    session = await proxy.create_session(USER)
    answer = await session.client.chat.completions.create(model="m", messages=USER)
    assert (
        proxy.fake.completions[-1]["logprobs"] == 0 and "return_tokens_as_token_ids" not in proxy.fake.completions[-1]
    )
    assert (await proxy.trajectory(answer.id))["student_topk"] is None
    status, body = await proxy.request(
        "POST",
        "/v1/chat/completions",
        json={"model": "m", "messages": USER, "logprobs": True, "top_logprobs": 2},
        token=session.api_key,
    )
    assert (
        status == 400
        and body["error"]["param"] == "top_logprobs"
        and "generation.top_logprobs" in body["error"]["message"]
    )


async def test_top_logprobs_past_the_bound_is_refused(proxy: ProxyHarness):
    status, body = await proxy.request(
        "POST", "/v1/sessions", json={"sample": {"messages": USER}, "generation": {"top_logprobs": 129}}
    )
    assert status == 400 and body["error"]["param"] == "generation.top_logprobs"


@pytest.mark.parametrize(
    ("path", "fields", "says"),
    [
        ("/v1/chat/completions", {"logprobs": True, "top_logprobs": -1}, "greater than or equal to 0"),
        ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 21}, "less than or equal to 20"),
        ("/v1/chat/completions", {"top_logprobs": 2}, "needs logprobs"),
        ("/v1/responses", {"top_logprobs": -1}, "greater than or equal to 0"),
        ("/v1/responses", {"top_logprobs": 21}, "less than or equal to 20"),
    ],
)
async def test_top_logprobs_is_validated_as_openai_does(proxy: ProxyHarness, path, fields, says):
    """OpenAI answers 400 for a top_logprobs outside 0..20 or without logprobs: so does the proxy, and
    nothing reaches the engine or the tree."""
    session = await proxy.create_session(USER)
    body = {"model": "m", **({"messages": USER} if "chat" in path else {"input": "Name a colour."}), **fields}
    status, answer = await proxy.request("POST", path, json=body, token=session.api_key)
    assert status == 400, answer
    assert answer["error"]["param"] == "top_logprobs" and says in answer["error"]["message"]
    assert proxy.fake is not None and proxy.fake.completions == []


async def test_an_engine_that_refuses_k_is_a_clear_error(proxy: ProxyHarness):
    """vLLM refuses more logprobs than its --max-logprobs: the client sees why, and nothing is recorded."""
    assert proxy.fake is not None
    proxy.fake.max_logprobs = 2
    session = await proxy.create_session(USER, top_logprobs=5)
    status, body = await proxy.request(
        "POST", "/v1/chat/completions", json={"model": "m", "messages": USER}, token=session.api_key
    )
    assert 400 <= status < 600 and status != 500, body
    assert "logprobs" in body["error"]["message"]
    status, _ = await proxy.request("GET", f"/v1/sessions/{session.session_id}/trajectory", token=session.api_key)
    assert status == 404
