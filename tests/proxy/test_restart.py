"""The response tree lives in Redis: a conversation survives a proxy restart."""

from __future__ import annotations

from tests.harness import ProxyHarness

USER = [{"role": "user", "content": "Count to three."}]


async def test_conversation_continues_after_restart(fake_engine, redis_url):
    fake_engine.queue("One, two, three.", "Four, five.")
    async with ProxyHarness.running(engine_urls=[fake_engine.url], store=None, store_url=redis_url) as first_proxy:
        session = await first_proxy.create_session(USER)
        first = await session.client.chat.completions.create(model="m", messages=USER)
    # the first proxy process is gone; a new one starts on the same Redis with the same admin key
    async with ProxyHarness.running(engine_urls=[fake_engine.url], store=None, store_url=redis_url) as second_proxy:
        client = second_proxy.client(second_proxy.url + "/v1", session.api_key)
        history = [*USER, first.choices[0].message.model_dump(), {"role": "user", "content": "Go on."}]
        second = await client.chat.completions.create(model="m", messages=history)
        previous = fake_engine.prompts[0] + first.choices[0].model_extra["token_ids"]
        assert fake_engine.prompts[1][: len(previous)] == previous
        trajectory = await second_proxy.trajectory(second.id)
        assert trajectory["turns"] == 2 and trajectory["forks"] == []
        assert trajectory["total_token_ids"] == fake_engine.prompts[1] + second.choices[0].model_extra["token_ids"]
