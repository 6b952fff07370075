"""How chat requests find their parent: extensions, resamples, history rewrites."""

from __future__ import annotations

from rollout_proxy.proxy import keys
from tests.harness import ProxyHarness

USER = [{"role": "user", "content": "Tell me a fact."}]


async def test_history_rewrite_forks_and_is_recorded(proxy: ProxyHarness):
    fake = proxy.fake
    fake.queue("Water boils at 100C.", "Another one?", "Ice melts at 0C.")
    session = await proxy.create_session(USER)
    first = await session.client.chat.completions.create(model="m", messages=USER)
    history = [*USER, first.choices[0].message.model_dump(), {"role": "user", "content": "More."}]
    second = await session.client.chat.completions.create(model="m", messages=history)
    # the plugin edits what the model said in turn 1, then continues
    rewritten = [*USER, {"role": "assistant", "content": "Water boils at 90C."}, {"role": "user", "content": "More."}]
    forked = await session.client.chat.completions.create(model="m", messages=rewritten)

    trajectory = await proxy.trajectory(forked.id)
    assert trajectory["forks"] == [{"response_id": forked.id, "diverged_from": first.id, "at_message": 1}]
    # the rewritten assistant message is prompt (weight 0), never spliced onto turn 1's tokens
    assert trajectory["turns"] == 1
    assert "Water boils at 90C." in fake.decode(trajectory["total_token_ids"])
    assert "Water boils at 100C." not in fake.decode(trajectory["total_token_ids"])
    assert proxy.app[keys.METRICS].value("forks_total", api="chat") == 1
    # the original branch is untouched
    original = await proxy.trajectory(second.id)
    assert original["forks"] == [] and original["turns"] == 2


async def test_same_prompt_twice_makes_siblings_without_a_fork(proxy: ProxyHarness):
    session = await proxy.create_session(USER)
    one = await session.client.chat.completions.create(model="m", messages=USER)
    two = await session.client.chat.completions.create(model="m", messages=USER)
    first, second = await proxy.trajectory(one.id), await proxy.trajectory(two.id)
    assert first["forks"] == second["forks"] == []
    assert proxy.fake.prompts[0] == proxy.fake.prompts[1]


async def test_turn_cut_by_length_is_closed_with_an_untrained_end_of_turn(proxy: ProxyHarness):
    fake = proxy.fake
    fake.queue("This answer is far too long to fit in the few tokens the session allows.", "Short.")
    session = await proxy.create_session(USER, max_new_tokens=5)
    first = await session.client.chat.completions.create(model="m", messages=USER)
    assert first.choices[0].finish_reason == "length"
    output = first.choices[0].model_extra["token_ids"]
    assert len(output) == 5 and output[-1] != fake.eos_id
    history = [*USER, first.choices[0].message.model_dump(), {"role": "user", "content": "Go on."}]
    second = await session.client.chat.completions.create(model="m", messages=history)
    prompt = fake.prompts[1]
    boundary = len(fake.prompts[0]) + len(output)
    assert prompt[:boundary] == fake.prompts[0] + output
    assert prompt[boundary] == fake.eos_id
    trajectory = await proxy.trajectory(second.id)
    assert trajectory["total_loss_weight"][boundary] == 0.0


async def test_sampled_tokens_are_kept_even_when_text_would_tokenize_differently(proxy: ProxyHarness):
    fake = proxy.fake
    canonical = fake.encode("Hello world")
    spelled = [token for char in "Hello world" for token in fake.encode(char)]
    assert spelled != canonical and fake.decode(spelled) == "Hello world"
    fake.queue(spelled, "Fine.")
    session = await proxy.create_session(USER)
    first = await session.client.chat.completions.create(model="m", messages=USER)
    assert first.choices[0].message.content == "Hello world"
    history = [*USER, first.choices[0].message.model_dump(), {"role": "user", "content": "And?"}]
    second = await session.client.chat.completions.create(model="m", messages=history)
    start = len(fake.prompts[0])
    assert fake.prompts[1][start : start + len(spelled)] == spelled
    trajectory = await proxy.trajectory(second.id)
    assert trajectory["total_token_ids"][start : start + len(spelled)] == spelled


async def test_malformed_tool_call_stays_text_and_is_counted(proxy: ProxyHarness):
    proxy.fake.queue('<tool_call>\n{"name": "get_weather", "arguments": {"city": \n</tool_call>')
    session = await proxy.create_session(USER)
    reply = await session.client.chat.completions.create(model="m", messages=USER)
    assert reply.choices[0].message.tool_calls is None
    assert "<tool_call>" in reply.choices[0].message.content
    assert reply.choices[0].finish_reason == "stop"
    assert proxy.app[keys.METRICS].value("tool_parse_total", outcome="malformed") == 1
