"""``update_state_from_messages`` sends a fresh ``Idempotency-Key`` per call, so a resend
of one call (by a transport or a retrying caller) makes one node, never two."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from rollout_proxy.embedded import BackgroundServer
from rollout_proxy.sdk import ChatCompletionSample
from tests.sdk.conftest import Stack

SAMPLE = ChatCompletionSample(messages=[{"role": "user", "content": "Hi"}], max_new_tokens=32)
MESSAGES = [{"role": "user", "content": "Hi"}]
HOP_BY_HOP = {"host", "content-length", "transfer-encoding", "connection"}


@dataclass
class Recorder:
    """A relay in front of the stack that keeps every appended-messages request as sent."""

    target: str
    appends: list[tuple[dict[str, str], bytes]] = field(default_factory=list)

    def app(self) -> web.Application:
        async def forward(request: web.Request) -> web.Response:
            headers = {name: value for name, value in request.headers.items() if name.lower() not in HOP_BY_HOP}
            body = await request.read()
            if request.method == "POST" and request.path.endswith("/messages"):
                self.appends.append((headers, body))
            async with (
                aiohttp.ClientSession() as http,
                http.request(request.method, self.target + request.path_qs, data=body, headers=headers) as answer,
            ):
                return web.Response(status=answer.status, body=await answer.read(), content_type=answer.content_type)

        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", forward)
        return app


@pytest.fixture
def recorder(stack: Stack) -> Iterator[tuple[Recorder, str]]:
    recorder = Recorder(stack.url)
    server = BackgroundServer(recorder.app, loop=stack.server.loop)
    url = server.start()
    yield recorder, url
    server.stop()


def resend(stack: Stack, url: str, sent: tuple[dict[str, str], bytes]) -> tuple[int, Any]:
    """A request exactly as it was sent, straight to the stack."""
    headers, body = sent
    return stack.http.send("POST", url, content=body, headers=headers)


def test_each_call_sends_its_own_key_and_a_resend_makes_no_second_node(stack: Stack, recorder):
    relay, relay_url = recorder
    proxy = stack.session(SAMPLE, via=relay_url)
    first = proxy.rollout_client().chat.completions.create(model="m", messages=MESSAGES)
    one = proxy.update_state_from_messages([{"role": "user", "content": "Tool says 1"}], previous_response_id=first.id)
    two = proxy.update_state_from_messages([{"role": "user", "content": "Tool says 1"}], previous_response_id=first.id)
    assert one != two  # two calls are two appends, even with the same messages
    keys = [headers["Idempotency-Key"] for headers, _ in relay.appends]
    assert len(keys) == 2 and len(set(keys)) == 2
    assert all(uuid.UUID(key).version == 4 for key in keys)
    # the first call's request, sent again as it was: the same answer, no new node
    messages_url = f"{stack.url}/v1/sessions/{proxy.session_id}/messages"
    status, again = resend(stack, messages_url, relay.appends[0])
    assert status == 201 and again["response_id"] == one
    proxy.close()


async def test_the_async_call_sends_a_key_too(stack: Stack, recorder):
    relay, relay_url = recorder
    proxy = stack.session(SAMPLE, via=relay_url)
    first = await proxy.async_rollout_client().chat.completions.create(model="m", messages=MESSAGES)
    await proxy.aupdate_state_from_messages([{"role": "user", "content": "Later"}], previous_response_id=first.id)
    ((headers, _body),) = relay.appends
    assert uuid.UUID(headers["Idempotency-Key"]).version == 4
    await proxy.aclose()
