"""Locust users of a rollout-proxy: what an RL job does to it, as HTTP with the OpenAI SDK's JSON.

- ``ToolAgent``: a multi-turn tool agent over Chat Completions (session, question, tool call,
  tool result, answer, next question, ..., finish), resending its whole history each turn as
  the openai SDK does; every trajectory it finishes is checked for tokens and loss weights.
- ``GroupRollout``: a group over the Responses API: a first response and branches of it through
  ``previous_response_id`` (two forks of the first, one extension of a fork), finished with the
  responses to emit, then published to the trainer feed as the runner does (GRPO advantages).
- ``Trainer`` (one): pages ``GET /v1/feed?after=CURSOR`` as a trainer polls for groups.
- ``StreamingAgent``: Chat Completions with ``stream: true``; a proxy that answers 400 for
  ``stream`` (not supported yet) makes it log that once and stop, without counting a failure.

Run through ``python -m load_tests`` (which starts a proxy, or takes ``--url``); the settings
come from the environment it sets: ``LOAD_ADMIN_KEY``, ``LOAD_FEED`` (where to publish groups:
``redis://...`` or ``jsonl:PATH``; unset: groups are not published), ``LOAD_TURNS``.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import threading
from pathlib import Path
from typing import Any

from locust import FastHttpUser, between, constant, events, task
from locust.exception import RescheduleTask, StopUser

from rollout_proxy.wire.feed import FeedGroup

ADMIN_KEY = os.environ.get("LOAD_ADMIN_KEY", "")
FEED = os.environ.get("LOAD_FEED", "")
TURNS = int(os.environ.get("LOAD_TURNS", "3"))
CITIES = ["Paris", "Berlin", "Lisbon", "Oslo", "Cairo", "Lima", "Seoul", "Quito"]
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
MAX_TOOL_ROUNDS = 3  # tool calls answered per question before the agent moves on
log = logging.getLogger("load_tests")
counter = itertools.count()


def weather(city: str) -> str:
    return json.dumps({"city": city, "condition": "sunny", "temperature": 10 + len(city)})


def echo(message: dict[str, Any]) -> dict[str, Any]:
    """The assistant message as the openai SDK sends it back (``model_dump(exclude_none=True)``)."""
    return {key: value for key, value in message.items() if value is not None and value != []}


def grpo(rewards: list[float]) -> list[float]:
    mean = sum(rewards) / len(rewards)
    std = (sum((r - mean) ** 2 for r in rewards) / len(rewards)) ** 0.5
    return [(r - mean) / (std + 1e-6) for r in rewards]


class ProxyUser(FastHttpUser):
    """Session set-up and checked JSON calls, shared by the users below."""

    abstract = True
    network_timeout = 120.0
    connection_timeout = 30.0

    def call(
        self, name: str, path: str, body: dict[str, Any] | None = None, *, token: str, method: str = "POST"
    ) -> dict[str, Any]:
        """One request; anything but a 2xx JSON object is a failure (the task ends)."""
        headers = {"Authorization": f"Bearer {token}"}
        with self.client.request(method, path, name=name, json=body, headers=headers, catch_response=True) as response:
            if not 200 <= (response.status_code or 0) < 300:
                response.failure(f"{response.status_code}: {(response.text or '')[:300]}")
                raise RescheduleTask()
            try:
                answer = response.json()
            except ValueError:
                response.failure(f"not JSON: {(response.text or '')[:300]}")
                raise RescheduleTask() from None
            if not isinstance(answer, dict):
                response.failure("not a JSON object")
                raise RescheduleTask()
            return answer

    def open_session(self, messages: list[dict[str, Any]], **sample: Any) -> tuple[str, str]:
        body = {"sample": {"messages": messages, **sample}, "generation": {"max_new_tokens": 64}}
        session = self.call("POST /v1/sessions", "/v1/sessions", body, token=ADMIN_KEY)
        return session["session_id"], session["api_key"]

    def finish(self, session_id: str, **result: Any) -> dict[str, Any]:
        """As the runner does, with the admin key."""
        return self.call(
            "POST /v1/sessions/{id}/finish",
            f"/v1/sessions/{session_id}/finish",
            {"status": "success", **result},
            token=ADMIN_KEY,
        )


def checked_trajectories(user: ProxyUser, answer: dict[str, Any], expected: int) -> list[dict[str, Any]]:
    """A finish answer carries ``expected`` trajectories, each with aligned tokens and some trained ones."""
    trajectories = answer.get("trajectories") or []
    problems = []
    if len(trajectories) != expected:
        problems.append(f"{len(trajectories)} trajectories, expected {expected}")
    for trajectory in trajectories:
        ids, weights = trajectory.get("total_token_ids") or [], trajectory.get("total_loss_weight") or []
        if not ids or len(ids) != len(weights) or not any(weights):
            problems.append(f"trajectory with {len(ids)} tokens, {len(weights)} weights, {sum(weights)} trained")
    if problems:
        user.environment.events.request.fire(
            request_type="CHECK",
            name="trajectories",
            response_time=0,
            response_length=0,
            exception=AssertionError("; ".join(problems)),
            context={},
        )
        raise RescheduleTask()
    return trajectories


class ToolAgent(ProxyUser):
    weight = 4
    wait_time = between(0.0, 0.2)

    @task
    def rollout(self) -> None:
        cities = iter(itertools.cycle(CITIES[next(counter) % len(CITIES) :] + CITIES))
        messages: list[dict[str, Any]] = [
            {"role": "system", "content": "You answer weather questions with the get_weather tool."},
            {"role": "user", "content": f"What is the weather in {next(cities)}?"},
        ]
        session_id, token = self.open_session(messages, tools=[WEATHER_TOOL])
        for question in range(TURNS):
            if question:
                messages.append({"role": "user", "content": f"And in {next(cities)}?"})
            for _ in range(MAX_TOOL_ROUNDS):
                message = self.chat(messages, token)
                messages.append(echo(message))
                calls = message.get("tool_calls") or []
                if not calls:
                    break
                for call in calls:
                    city = json.loads(call["function"]["arguments"] or "{}").get("city", "Paris")
                    messages.append({"role": "tool", "tool_call_id": call["id"], "content": weather(city)})
        checked_trajectories(self, self.finish(session_id), 1)

    def chat(self, messages: list[dict[str, Any]], token: str) -> dict[str, Any]:
        """One turn: the assistant message."""
        body = {"model": "policy", "messages": messages}
        reply = self.call("POST /v1/chat/completions", "/v1/chat/completions", body, token=token)
        return dict(reply["choices"][0]["message"])


class FeedWriter:
    """Publishes groups to the trainer feed as the runner does (idempotent by group id); one per process."""

    def __init__(self, url: str) -> None:
        self._lock = threading.Lock()  # gevent's, under locust: publishes from greenlets one at a time
        self._redis: Any = None
        self._path: Path | None = None
        if url.startswith("jsonl:"):
            self._path = Path(url.removeprefix("jsonl:"))
            self._count = len(self._path.read_bytes().splitlines()) if self._path.exists() else 0
        elif url:
            import redis

            from rollout_proxy.state.keys import feed_published_key, feed_stream_key
            from rollout_proxy.state.redis_feed import _PUBLISH

            self._redis = redis.Redis.from_url(url)
            self._script = self._redis.register_script(_PUBLISH)
            self._keys = [feed_stream_key("trajectories"), feed_published_key("trajectories")]

    def publish(self, group: FeedGroup) -> None:
        with self._lock:
            if self._redis is not None:
                self._script(keys=self._keys, args=[group.group_id, group.model_dump_json()])
            elif self._path is not None:
                self._count += 1
                record = {"id": str(self._count), "group_id": group.group_id, "data": group.model_dump(mode="json")}
                with self._path.open("a") as out:
                    out.write(json.dumps(record) + "\n")


feed_writer = FeedWriter(FEED)


class GroupRollout(ProxyUser):
    weight = 2
    wait_time = between(0.0, 0.2)

    @task
    def rollout(self) -> None:
        index = next(counter)
        question = f"What is the weather in {CITIES[index % len(CITIES)]}?"
        session_id, token = self.open_session([{"role": "user", "content": question}], n_sample=3)

        def respond(text: str, previous: str | None = None) -> str:
            body: dict[str, Any] = {"model": "policy", "input": [{"role": "user", "content": text}]}
            if previous is not None:
                body["previous_response_id"] = previous
            answer = self.call("POST /v1/responses", "/v1/responses", body, token=token)
            return answer["id"]

        first = respond(question)
        fork_a = respond("Say it in one word.", first)
        fork_b = respond("And tomorrow in Oslo?", first)
        deeper = respond("And in Lima?", fork_a)
        chosen = [fork_a, fork_b, deeper]
        answer = self.finish(session_id, responses=[{"id": response_id} for response_id in chosen])
        trajectories = checked_trajectories(self, answer, len(chosen))
        if FEED:
            rewards = [float(i % 2) for i in range(len(trajectories))]
            group = FeedGroup.model_validate(
                {
                    "group_id": session_id,
                    "job_id": "load-test",
                    "step": 0,
                    "sample_index": index,
                    "sample": {"messages": [{"role": "user", "content": question}]},
                    "trajectories": trajectories,
                    "rewards": rewards,
                    "advantages": grpo(rewards),
                    "advantage_kind": "grpo",
                }
            )
            feed_writer.publish(group)


class Trainer(ProxyUser):
    fixed_count = 1
    wait_time = constant(0.5)

    def on_start(self) -> None:
        self.cursor: str | None = None
        self.groups = 0

    @task
    def poll(self) -> None:
        path = "/v1/feed?limit=100" + (f"&after={self.cursor}" if self.cursor else "")
        headers = {"Authorization": f"Bearer {ADMIN_KEY}"}
        with self.client.get(path, name="GET /v1/feed?after=", headers=headers, catch_response=True) as response:
            if response.status_code == 404 and "feed" in (response.text or ""):
                response.success()
                log.warning("the proxy serves no trainer feed (--feed): the trainer user stops")
                raise StopUser()
            if response.status_code != 200:
                response.failure(f"{response.status_code}: {(response.text or '')[:300]}")
                return
            page = response.json()
            for entry in page["entries"]:
                group = entry["data"]
                if not group["trajectories"] or len(group["advantages"]) != len(group["trajectories"]):
                    response.failure(f"feed entry {entry['id']} is not a graded group")
                    return
            self.groups += len(page["entries"])
            self.cursor = page["next"]

    def on_stop(self) -> None:
        log.info("trainer read %d group(s) from the feed", self.groups)


class StreamingAgent(ToolAgent):
    """The tool agent with ``stream: true``: its message is assembled from the chunks' deltas."""

    weight = 1
    unsupported = False  # set once the proxy refused stream=true; no more streaming users start

    def on_start(self) -> None:
        if StreamingAgent.unsupported:
            raise StopUser()

    def chat(self, messages: list[dict[str, Any]], token: str) -> dict[str, Any]:
        body = {"model": "policy", "messages": messages, "stream": True}
        headers = {"Authorization": f"Bearer {token}"}
        name = "POST /v1/chat/completions stream"
        with self.client.post(
            "/v1/chat/completions", name=name, json=body, headers=headers, catch_response=True
        ) as response:  # the time locust records runs to the stream's end
            text = response.text or ""
            if response.status_code == 400 and '"stream"' in text:
                response.success()  # not a failure of the load: the proxy does not stream yet
                if not StreamingAgent.unsupported:
                    log.warning("the proxy answers 400 to stream=true (not supported yet): streaming users skipped")
                StreamingAgent.unsupported = True
                raise StopUser()
            if response.status_code != 200:
                response.failure(f"{response.status_code}: {text[:300]}")
                raise RescheduleTask()
            try:
                return self.assemble(text)
            except (ValueError, KeyError, TypeError) as exc:
                response.failure(f"a malformed stream: {exc!r}")
                raise RescheduleTask() from None

    @staticmethod
    def assemble(text: str) -> dict[str, Any]:
        """Server-sent chunks as the assistant message (content and tool-call deltas joined); ends with [DONE]."""
        content: list[str] = []
        calls: dict[int, dict[str, Any]] = {}
        done = False
        for line in text.splitlines():
            if not line.startswith("data:"):
                continue
            data = line.removeprefix("data:").strip()
            if data == "[DONE]":
                done = True
                continue
            for choice in json.loads(data).get("choices") or []:
                delta = choice.get("delta") or {}
                content.append(delta.get("content") or "")
                for part in delta.get("tool_calls") or []:
                    call = calls.setdefault(
                        part["index"], {"id": "", "type": "function", "function": {"name": "", "arguments": ""}}
                    )
                    call["id"] = part.get("id") or call["id"]
                    function = part.get("function") or {}
                    call["function"]["name"] += function.get("name") or ""
                    call["function"]["arguments"] += function.get("arguments") or ""
        if not done:
            raise ValueError("the stream did not end with data: [DONE]")
        message: dict[str, Any] = {"role": "assistant", "content": "".join(content) or None}
        if calls:
            message["tool_calls"] = [calls[index] for index in sorted(calls)]
        return message


@events.test_stop.add_listener
def _summary(environment: Any, **kwargs: Any) -> None:
    if StreamingAgent.unsupported:
        log.warning("streaming: skipped (the proxy answers 400 to stream=true)")
