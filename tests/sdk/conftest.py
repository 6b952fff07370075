"""The SDK against a real proxy and the fake engine, both on their own background loop.

Plugins may block their event loop (sync clients, sync state updates); in
production the proxy is another process, so here it runs on another thread's loop.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from rollout_proxy.app import create_app
from rollout_proxy.devtools.fake_engine import FakeEngine
from rollout_proxy.embedded import BackgroundLoop, BackgroundServer, serve_app
from rollout_proxy.sdk import ChatCompletionSample, RolloutInferenceProxy
from rollout_proxy.sdk.proxy import session_body
from rollout_proxy.settings import Settings
from tests.conftest import TEMPLATES
from tests.harness import ADMIN_KEY


@dataclass
class Stack:
    fake: FakeEngine
    url: str
    server: BackgroundServer

    def request(self, method: str, path: str, body: Any = None, token: str = ADMIN_KEY) -> tuple[int, Any]:
        import urllib.error
        import urllib.request

        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(
            self.url + path,
            data=data,
            method=method,
            headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(request, timeout=30) as answer:
                return answer.status, json.loads(answer.read())
        except urllib.error.HTTPError as exc:
            return exc.code, json.loads(exc.read())

    def session(self, sample: ChatCompletionSample, *, n_sample: int | None = None) -> RolloutInferenceProxy:
        """A rollout session, handed to the plugin as the runner would."""
        status, created = self.request("POST", "/v1/sessions", session_body(sample, n_sample=n_sample))
        assert status == 201, created
        return RolloutInferenceProxy(created["base_url"], created["api_key"], sample=sample)

    def finish(self, proxy: RolloutInferenceProxy, result: dict[str, Any]) -> dict[str, Any]:
        status, body = self.request("POST", f"/v1/sessions/{proxy.session_id}/finish", result)
        assert status == 200, body
        return body


@pytest.fixture
def stack(tokenizer_dir: Path) -> Iterator[Stack]:
    loop = BackgroundLoop("test-stack")
    fake = FakeEngine(tokenizer_dir, chat_template=TEMPLATES["qwen3_style"])
    fake_runner, fake_url = loop.run(serve_app(fake.app()))
    server = BackgroundServer(lambda: create_app(Settings(engines=(fake_url,), admin_key=ADMIN_KEY)), loop=loop)
    server.start()
    yield Stack(fake=fake, url=server.url, server=server)
    server.stop()
    loop.run(fake_runner.cleanup())
    loop.close()
