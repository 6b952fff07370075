"""Fuzzing the proxy's own API from its live OpenAPI document (schemathesis; bounded, seeded).

A proxy over the fake engine (memory store, the Qwen3-style template, a JSONL feed holding
one group) answers schemathesis's requests for every operation of ``/openapi.json``: the
documented examples, boundary cases, and positive and negative bodies, parameters and
headers. Credentials are valid most of the time (the admin key, or a fresh session's
token) and otherwise missing, garbage, forged, expired or of the wrong kind; ids in paths
and bodies are sometimes real. Every answer must pass schemathesis's checks (no 5xx, a
documented status, content type, headers and schema) and ours: an error is OpenAI's error
body, as JSON.

The server runs on its own event loop in a thread: schemathesis calls it synchronously.
Hypothesis is derandomized and schemathesis seeded, so CI replays the same requests.
"""

from __future__ import annotations

import asyncio
import functools
import random
import string
import threading
import time
import zlib
from collections.abc import Callable, Iterator
from contextlib import AsyncExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jwt
import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.core.parameters import ParameterLocation

from devtools.fake_engine import FakeEngine, FakeEngineServer
from rollout_proxy.engines import control
from rollout_proxy.proxy import keys
from rollout_proxy.proxy.auth import AUDIENCE
from rollout_proxy.proxy.openapi import build_document
from rollout_proxy.state.feed import JsonlFeed
from rollout_proxy.wire.feed import FeedGroup
from rollout_proxy.wire.trajectory import Trajectory
from tests.conftest import TEMPLATES
from tests.harness import ADMIN_KEY, WEATHER_TOOL, ProxyHarness

SEED = 20240611
#: generated examples per operation (fuzzing phase); the examples and coverage phases add the
#: documented bodies and ~1,500 boundary cases. The whole module takes ~35 s on 2 cores.
MAX_EXAMPLES = 25
USER = [{"role": "user", "content": "What is the weather in Paris?"}]

#: The Anthropic Messages bodies nest many bounded lists (content blocks in every message, a tool result's
#: blocks, system blocks, tools, stop sequences): their coverage phase (each list past its bound, every
#: field left out or mistyped) took over 4 minutes on 2 cores; the fuzzing phase's negative bodies reach the
#: same refusals, so these two operations run the examples and fuzzing phases only.
MESSAGES_FUZZ: dict[str, Any] = {"include-path-regex": "^/v1/messages", "phases": {"coverage": {"enabled": False}}}

CONFIG = schemathesis.Config.from_dict(
    {
        "seed": SEED,
        "generation": {"mode": "all", "max-examples": MAX_EXAMPLES, "deterministic": True, "database": "none"},
        "phases": {"stateful": {"enabled": False}},  # no OpenAPI links: ``dress`` feeds real ids in instead
        "checks": {
            # A schema-valid body may still be refused with a 400 by design: a generation setting
            # the session pins, messages the chat template cannot render, a prompt past the
            # context, a feed cursor the feed never gave out. No schema states those.
            "positive_data_acceptance": {"enabled": False},
            # A body past the size limit (a generated list past maxItems, say) is refused with its 413.
            "negative_data_rejection": {
                "expected-statuses": [400, 401, 403, 404, 405, 406, 409, 413, 415, 422, 428, 429, "5XX"]
            },
        },
        "operations": [
            # Unknown query parameters are ignored, as OpenAI does; they are not invalid input.
            {"include-path": "/v1/feed", "generation": {"allow-extra-parameters": False}},
            MESSAGES_FUZZ,
        ],
        "output": {"sanitization": {"enabled": False}},  # test-only keys: failures print a runnable curl
    }
)


def policy(prompt_ids: list[int]) -> str:
    """Replies of every shape the parsers turn into views: plain, reasoning, a tool call."""
    return (
        "It is sunny.",
        "<think>\nThe user asks about Paris.\n</think>\n\nSunny, 21 degrees.",
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
    )[len(prompt_ids) % 3]


@dataclass
class Fresh:
    """A session for an example to use; its first Responses API turn is made when first asked for."""

    live: LiveProxy
    session_id: str
    token: str

    @functools.cached_property
    def response_id(self) -> str:
        body = {"model": "policy", "input": USER[0]["content"]}
        return str(self.live.post("/v1/responses", body, self.token)["id"])


class LiveProxy:
    """The proxy and the fake engine, served from a thread; setup calls go over HTTP too."""

    def __init__(self, tokenizer_dir: Path, feed_path: Path) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="fuzzed-proxy", daemon=True)
        self.stack = AsyncExitStack()
        self.tokenizer_dir = tokenizer_dir
        self.feed_path = feed_path
        self.http = requests.Session()
        self.url = ""
        self.shared: Fresh | None = None  # the session of examples that only read
        self.stranger: Fresh | None = None  # another session, whose token must open nothing here
        self.harness: ProxyHarness | None = None

    def run(self, coroutine: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout=120)

    def __enter__(self) -> LiveProxy:
        self.thread.start()
        self.harness = self.run(self._start())
        self.url = self.harness.url
        self.shared, self.stranger = self.fresh(), self.fresh()
        assert self.shared.response_id and self.stranger.response_id
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.http.close()
        self.run(self.stack.aclose())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=30)
        self.loop.close()

    async def _start(self) -> ProxyHarness:
        engine = FakeEngine(self.tokenizer_dir, chat_template=TEMPLATES["qwen3_style"], policy=policy)
        engine_url = await self.stack.enter_async_context(FakeEngineServer(engine))
        await JsonlFeed(self.feed_path).publish(feed_group())
        return await self.stack.enter_async_context(
            ProxyHarness.running(engine_urls=[engine_url], fake=engine, feed=f"jsonl:{self.feed_path}")
        )

    def post(self, path: str, body: dict[str, Any], token: str) -> dict[str, Any]:
        answer = self.http.post(self.url + path, json=body, headers={"Authorization": f"Bearer {token}"}, timeout=30)
        assert answer.status_code in (200, 201), (path, answer.status_code, answer.text)
        return answer.json()

    def fresh(self) -> Fresh:
        created = self.post(
            "/v1/sessions",
            {"sample": {"messages": USER, "tools": [WEATHER_TOOL]}, "generation": {"max_new_tokens": 32}},
            ADMIN_KEY,
        )
        return Fresh(self, session_id=created["session_id"], token=created["api_key"])

    def unpause(self) -> None:
        """Resume the engines if an example paused them (at the version they are at)."""
        assert self.harness is not None
        fleet = self.harness.app[keys.ENGINES]
        if fleet.paused:
            self.run(control.resume(fleet, fleet.version))

    def forged(self, kind: str, session_id: str) -> str:
        """Tokens that must fail: expired, signed with another secret, for another audience, no subject."""
        assert self.harness is not None
        secret = self.harness.app[keys.SETTINGS].token_secret
        now = int(time.time())
        claims: dict[str, Any] = {"sub": session_id, "aud": AUDIENCE, "exp": now + 3600}
        if kind == "expired":
            claims["exp"] = now - 60
        elif kind == "audience":
            claims["aud"] = "someone-else"
        elif kind == "subject":
            claims["sub"] = 12345
        elif kind == "secret":
            secret = b"not-the-proxy-secret-but-long-enough-for-hs256"
        return jwt.encode(claims, secret, algorithm="HS256")


def feed_group() -> FeedGroup:
    trajectory = Trajectory(
        response_id="resp_00000000000000000000000000000000",
        session_id="sess_0000000000000000",
        messages=[*USER, {"role": "assistant", "content": "Sunny."}],
        total_token_ids=[1, 2, 3],
        total_loss_weight=[0.0, 1.0, 1.0],
        total_token_logprobs=[0.0, -0.5, -0.25],
    )
    return FeedGroup(
        group_id="group-1",
        job_id="job-1",
        step=0,
        sample_index=0,
        trajectories=[trajectory],
        rewards=[1.0],
        advantages=[0.0],
        advantage_kind="grpo",
    )


CREDENTIALS = ("valid",) * 5 + ("none", "garbage", "forged", "wrong")
GARBAGE = ("Bearer", "Bearer ", "Basic dGVzdDp0ZXN0", "bearer x.y.z", f"Token {ADMIN_KEY}", ADMIN_KEY, "Bearer \u00e9")
FORGED = ("expired", "audience", "subject", "secret")


def schemes(case: schemathesis.Case) -> list[str]:
    return [name for entry in case.operation.definition.raw.get("security", []) for name in entry]


def case_random(case: schemathesis.Case) -> random.Random:
    """Choices that depend on the case alone, so a failing case replays (and shrinks) the same."""
    headers = {key: value for key, value in (case.headers or {}).items() if key.lower() != "authorization"}
    body = case.body if isinstance(case.body, (dict, list, str, bytes, int, float)) else None  # NotSet: no body
    seen = repr((case.method, case.path, case.path_parameters, case.query, headers, body))
    return random.Random(zlib.crc32(seen.encode("utf-8", "backslashreplace")) ^ SEED)


def dress(case: schemathesis.Case, live: LiveProxy) -> dict[str, str]:
    """Credentials and ids for one example: mostly valid, sometimes missing, garbage, forged or wrong.

    Answers the ``Authorization`` header to send on top of the generated one: sent explicitly,
    it also tells schemathesis's ``ignored_auth`` check to probe the operation without it and
    with an invalid one. A case that schemathesis made negative in its headers (``Authorization``
    left out on purpose, say) is sent as generated.
    """
    if case.meta is not None and case.meta.is_negative_at(ParameterLocation.HEADER):
        return {}
    rng = case_random(case)
    accepted = schemes(case)
    assert live.shared is not None and live.stranger is not None
    shared, stranger = live.shared, live.stranger
    negative = case.meta is not None and case.meta.generation.mode.is_negative
    # an example that may write gets a session of its own, made only when it needs one; one that
    # only reads, or must be refused, shares one (a refused request changes nothing)
    reads = case.method.upper() == "GET" or negative
    fresh: Callable[[], Fresh] = (lambda: shared) if reads else functools.cache(live.fresh)
    who = rng.choice(CREDENTIALS)
    authorization: str | None = None
    if who == "valid" and accepted:
        use_session = "sessionToken" in accepted and ("adminKey" not in accepted or rng.random() < 0.5)
        authorization = f"Bearer {fresh().token if use_session else ADMIN_KEY}"
    elif who == "none":  # schemathesis then holds the case negative: it must be refused
        case.headers = {key: value for key, value in (case.headers or {}).items() if key.lower() != "authorization"}
    elif who == "garbage":
        garbage = "".join(rng.choice(string.printable[:95]) for _ in range(rng.randrange(1, 80)))
        authorization = rng.choice((*GARBAGE, garbage.strip() or "x"))
    elif who == "forged":
        authorization = f"Bearer {live.forged(rng.choice(FORGED), shared.session_id)}"
    elif who == "wrong":  # the other kind of credential, or another session's token
        authorization = f"Bearer {ADMIN_KEY if accepted == ['sessionToken'] else stranger.token}"
    if accepted and not negative and rng.random() < 0.5:  # a negative case keeps its ids: it must be refused
        use_real_ids(case, fresh)
    return {} if authorization is None else {"Authorization": authorization}


def use_real_ids(case: schemathesis.Case, fresh: Callable[[], Fresh]) -> None:
    params = case.path_parameters or {}
    if "session_id" in params:
        params["session_id"] = fresh().session_id
    if "response_id" in params:
        params["response_id"] = fresh().response_id
    if isinstance(case.body, dict) and "previous_response_id" in case.body:
        case.body["previous_response_id"] = fresh().response_id
    if isinstance(case.body, dict) and isinstance(case.body.get("responses"), list):
        case.body["responses"] = [{"id": fresh().response_id}]


def openai_error_body(ctx: Any, response: schemathesis.Response, case: schemathesis.Case) -> bool | None:
    """Every error is ``{"error": {"message", "type", "param", "code"}}`` as application/json; on the
    Anthropic Messages routes, Anthropic's ``{"type": "error", "error": {"type", "message"}}``."""
    if response.status_code < 400 or case.operation.path == "/readyz":  # not ready is an answer, not an error
        return None
    content_type = (response.headers.get("content-type") or [""])[0]
    assert content_type.startswith("application/json"), f"{response.status_code} with Content-Type {content_type!r}"
    body = response.json()
    if case.operation.path.startswith("/v1/messages"):
        assert isinstance(body, dict) and set(body) == {"type", "error"} and body["type"] == "error", body
        error = body["error"]
        assert isinstance(error, dict) and {"type", "message"} <= set(error) <= {"type", "message", "param", "code"}
        assert isinstance(error["message"], str) and error["message"] and isinstance(error["type"], str), error
        assert response.headers.get("x-should-retry"), "an Anthropic error says whether to retry"
        return True
    assert isinstance(body, dict) and set(body) == {"error"}, body
    error = body["error"]
    assert isinstance(error, dict) and set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"] and isinstance(error["type"], str), error
    return True


@pytest.fixture(scope="module")
def live(tokenizer_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveProxy]:
    with LiveProxy(tokenizer_dir, tmp_path_factory.mktemp("feed") / "feed.jsonl") as proxy:
        served = proxy.http.get(f"{proxy.url}/openapi.json", timeout=30)
        assert served.status_code == 200 and served.json() == schema.raw_schema
        yield proxy


# Loaded when the module is imported, so each operation is a test of its own (schemathesis's
# fixture-loaded schemas do not run under pytest 9.2); the ``live`` fixture checks that the
# served document is this one.
schema = schemathesis.openapi.from_dict(build_document(), config=CONFIG)


@schema.parametrize()
@settings(
    max_examples=MAX_EXAMPLES,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=list(HealthCheck),
    print_blob=True,
)
def test_fuzz(case: schemathesis.Case, live: LiveProxy) -> None:
    authorization = dress(case, live)
    try:
        response = case.call(base_url=live.url, session=live.http, headers=authorization, timeout=30)
        case.validate_response(response, headers=authorization, additional_checks=[openai_error_body])
    finally:
        live.unpause()  # a fuzzed pause must not hold every later example's turns
