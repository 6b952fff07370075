"""The proxy's CPU per turn of a Codex-shaped conversation, turn 100 against turn 2: Responses, chat and the
Messages API side by side.

    python -m bench.resent_input [--turns 100] [--sessions 8] [--rounds 3] [--out out/bench]

Codex CLI resends its whole history on every turn (``store: false``, no ``previous_response_id``): at its
first turn ~27 KB of JSON, a 17.7k-character developer prompt and a second developer message, its
environment context, the task, 12 tools (one a namespace) and ``web_search``; every turn streams
(``stream: true``). This builds that conversation from Codex's own first request
(``tests/fixtures/harnesses/codex-0.171.0/responses-turn1-stock-config.json``) and grows it as Codex
does: each turn echoes the answer's output items back and adds the next input (here a user message;
the engine double's ``fixed`` reply is text). The same conversation as Chat Completions (the developer
messages, the tools in chat form, streamed) and as Claude Code sends the Messages API (the developer
prompt as system blocks, the tools with ``input_schema``, the newest message's ``cache_control`` mark
moving each turn, streamed) run beside it. ``--sessions`` sessions take turn k
together (lock step) against one ``rollout-proxy serve`` process (memory store) in front of the engine
double (``load_tests.engine``, 0 ms); each turn's CPU is the proxy process's, read from the scheduler's
nanosecond counters (``bench.harness.cpu_seconds``), per session, the median over ``--rounds``
rounds (the two APIs alternate round by round). Reported per API: the CPU per turn over turns 2-6 and
over the last five, their ratio, and the least-squares line through every turn read at turn 2 and at
the last (the goal: turn 100 at most 1.2x turn 2). Writes ``resent_input.json`` under ``--out``. A
benchmark, not a test.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from bench.harness import OUT, ROOT, Services, cpu_line, cpu_seconds, free_port, rotated, start_engine, write_report

ADMIN_KEY = "bench-admin-key"

FIXTURE = ROOT / "tests" / "fixtures" / "harnesses" / "codex-0.171.0" / "responses-turn1-stock-config.json"
TEMPLATE = ROOT / "devtools" / "templates" / "qwen3_style.jinja"


def codex_first_body() -> dict[str, Any]:
    return json.loads(FIXTURE.read_text())["body"]


def chat_tools(tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Codex's function tools (a namespace's members too) in Chat Completions form."""
    functions = []
    for tool in tools:
        members = tool["tools"] if tool["type"] == "namespace" else [tool] if tool["type"] == "function" else []
        for member in members:
            spec = {key: member[key] for key in ("name", "description", "parameters") if key in member}
            functions.append({"type": "function", "function": spec})
    return functions


def as_message(item: dict[str, Any]) -> dict[str, Any]:
    return {"role": item["role"], "content": "\n".join(part["text"] for part in item["content"])}


def anthropic_tools(tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The same functions as the Messages API's custom tools (``input_schema``)."""
    return [
        {"name": spec["name"], "description": spec.get("description", ""), "input_schema": spec.get("parameters", {})}
        for spec in (tool["function"] for tool in chat_tools(tools))
    ]


class Conversation:
    """One session's Codex-shaped conversation, sent as Responses input items, as chat messages, or as the
    Messages API's messages the way Claude Code sends them (the system in blocks with a cache mark, the
    newest message's last block marked too, so every turn's body differs from the last one's there)."""

    def __init__(self, api: str, index: int, token: str, base: str) -> None:
        first = codex_first_body()
        first["prompt_cache_key"] = f"bench-{index}"
        self.api, self.token, self.base = api, token, base
        self.body = first
        self.input: list[dict[str, Any]] = copy.deepcopy(first["input"])
        self.input[-1]["content"][0]["text"] = f"[session {index}] " + self.input[-1]["content"][0]["text"]
        self.messages = [as_message(item) for item in self.input]
        self.tools = chat_tools(first["tools"])
        system = "\n".join(message["content"] for message in self.messages if message["role"] == "developer")
        self.system = [{"type": "text", "text": system, "cache_control": {"type": "ephemeral"}}]
        self.anthropic = [
            {"role": "user", "content": [{"type": "text", "text": message["content"]}]}
            for message in self.messages
            if message["role"] == "user"
        ]
        self.anthropic_tools = anthropic_tools(first["tools"])

    def request(self) -> tuple[str, bytes]:
        if self.api == "responses":
            body = {**self.body, "input": self.input}
            return f"{self.base}/v1/responses", orjson.dumps(body)
        if self.api == "messages":
            marked = copy.deepcopy(self.anthropic[-1])
            marked["content"][-1]["cache_control"] = {"type": "ephemeral"}
            body = {
                "model": "policy",
                "max_tokens": 16,
                "system": self.system,
                "messages": [*self.anthropic[:-1], marked],
                "tools": self.anthropic_tools,
                "stream": True,
            }
            return f"{self.base}/v1/messages", orjson.dumps(body)
        body = {"model": "policy", "messages": self.messages, "tools": self.tools, "stream": True}
        return f"{self.base}/v1/chat/completions", orjson.dumps(body)

    def answered(self, events: list[dict[str, Any]], k: int) -> None:
        """The answer echoed back as its client would, then the next user turn."""
        user = f"Turn {k}: go on."
        if self.api == "responses":
            completed = next(event for event in events if event.get("type") == "response.completed")
            self.input += completed["response"]["output"]
            self.input.append({"type": "message", "role": "user", "content": [{"type": "input_text", "text": user}]})
        elif self.api == "messages":
            text = "".join(
                event["delta"].get("text") or ""
                for event in events
                if event.get("type") == "content_block_delta" and event["delta"].get("type") == "text_delta"
            )
            self.anthropic += [
                {"role": "assistant", "content": [{"type": "text", "text": text}]},
                {"role": "user", "content": [{"type": "text", "text": user}]},
            ]
        else:
            text = "".join(
                choice["delta"].get("content") or "" for event in events for choice in event.get("choices") or []
            )
            self.messages += [{"role": "assistant", "content": text}, {"role": "user", "content": user}]


async def turn(http: aiohttp.ClientSession, conversation: Conversation, k: int) -> None:
    url, body = conversation.request()
    headers = {"Authorization": f"Bearer {conversation.token}", "Content-Type": "application/json"}
    async with http.post(url, data=body, headers=headers) as response:
        raw = await response.read()
        if response.status != 200:
            raise SystemExit(f"{conversation.api} turn {k}: {response.status} {raw[:300]!r}")
    events = [orjson.loads(line[6:]) for line in raw.split(b"\n") if line.startswith(b"data: {")]
    conversation.answered(events, k)


async def lockstep(
    http: aiohttp.ClientSession, base: str, pid: int, api: str, sessions: int, turns: int
) -> list[float]:
    """Every session takes turn k together; the proxy's CPU seconds per session for each turn."""
    conversations = []
    for index in range(sessions):
        body = {"generation": {"max_new_tokens": 16}}
        async with http.post(f"{base}/v1/sessions", json=body, headers={"Authorization": f"Bearer {ADMIN_KEY}"}) as r:
            created = await r.json()
        conversations.append(Conversation(api, index, created["api_key"], base))
    cpu = []
    for k in range(turns):
        before = cpu_seconds(pid)
        await asyncio.gather(*(turn(http, conversation, k) for conversation in conversations))
        cpu.append((cpu_seconds(pid) - before) / sessions)
    return cpu


def summary(cpu: list[float]) -> dict[str, float]:
    first = statistics.fmean(cpu[1:6])
    last = statistics.fmean(cpu[-5:])
    at_two, at_last = cpu_line(cpu)
    return {
        "turn_2_ms": first * 1e3,
        "last_ms": last * 1e3,
        "ratio": last / first,
        "line_turn_2_ms": at_two,
        "line_last_ms": at_last,
        "line_ratio": at_last / at_two,
    }


async def run(args: argparse.Namespace) -> dict[str, Any]:
    services = Services(Path(tempfile.mkdtemp(prefix="rp-bench-input-")))
    try:
        _, engine_url = start_engine(services, extra=["--chat-template", str(TEMPLATE)])
        port = free_port()
        argv = [sys.executable, "-m", "rollout_proxy", "serve", "--port", str(port), "--engine", engine_url]
        argv += ["--admin-key", ADMIN_KEY, "--chat-template", str(TEMPLATE), "--log-level", "warning"]
        argv += ["--log-format", "json", "--session-ttl", "3600"]
        proxy = services.start("proxy", argv)
        base = f"http://127.0.0.1:{port}"
        services.wait_http("proxy", f"{base}/readyz")
        by_api: dict[str, list[list[float]]] = {"responses": [], "chat": [], "messages": []}
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as http:
            for api in by_api:  # warm: tokenizer, local rendering decided, connections
                await lockstep(http, base, proxy.pid, api, 2, 3)
            for round_index in range(args.rounds):
                for api in rotated(list(by_api), round_index):
                    by_api[api].append(await lockstep(http, base, proxy.pid, api, args.sessions, args.turns))
                    print(f"  round {round_index + 1}/{args.rounds}: {api} done", flush=True)
    finally:
        services.stop()
    report: dict[str, Any] = {"settings": {k: v for k, v in vars(args).items() if k != "out"}, "apis": {}}
    for api, rounds in by_api.items():
        median = [statistics.median(values) for values in zip(*rounds, strict=True)]
        report["apis"][api] = {"cpu_per_turn": median, **summary(median)}
    return report


def table(report: dict[str, Any]) -> str:
    turns = report["settings"]["turns"]
    lines = [
        f"| API | CPU/turn, turns 2-6 | turns {turns - 4}-{turns} | ratio | line at 2 | line at {turns} | line ratio |",
        "|---|---|---|---|---|---|---|",
    ]
    for api, data in report["apis"].items():
        lines.append(
            f"| {api} | {data['turn_2_ms']:.2f} ms | {data['last_ms']:.2f} ms | {data['ratio']:.2f}x | "
            f"{data['line_turn_2_ms']:.2f} ms | {data['line_last_ms']:.2f} ms | {data['line_ratio']:.2f}x |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--turns", type=int, default=100, help="turns per conversation (default 100)")
    parser.add_argument("--sessions", type=int, default=8, help="sessions in lock step (default 8)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds per API, alternating (default 3)")
    parser.add_argument("--out", type=Path, default=OUT, help="where the JSON goes (default out/bench)")
    args = parser.parse_args(argv)
    report = asyncio.run(run(args))
    write_report(args.out / "resent_input.json", report, "bench.resent_input", argv)
    print(table(report))


if __name__ == "__main__":
    main()
