"""The proxy's CPU per turn of a Codex-shaped conversation, turn 100 against turn 2: Responses, chat and the
Messages API side by side, alone and interleaved with a subagent and side calls, against this tree and
(``--baseline``) another checkout.

    python -m bench.resent_input [--turns 100] [--sessions 8] [--rounds 3] [--apis responses,chat,messages]
                                 [--cases main,interleaved] [--stores memory,redis] [--baseline CHECKOUT]
                                 [--out out/bench]

Codex CLI resends its whole history on every turn (``store: false``, no ``previous_response_id``): at its
first turn ~27 KB of JSON, a 17.7k-character developer prompt and a second developer message, its
environment context, the task, 12 tools (one a namespace) and ``web_search``; every turn streams
(``stream: true``). This builds that conversation from Codex's own first request
(``tests/fixtures/harnesses/codex-0.171.0/responses-turn1-stock-config.json``) and grows it as Codex
does: each turn echoes the answer's output items back and adds the next input (here a user message;
the engine double's ``fixed`` reply is text). The same conversation as Chat Completions (the developer
messages, the tools in chat form, streamed) and as Claude Code sends the Messages API (the developer
prompt as system blocks, the tools with ``input_schema``, the newest message's ``cache_control`` mark
moving each turn, streamed) run beside it.

Two cases: ``main``, the conversation alone; ``interleaved``, as a harness's session sends it: after each
main turn a subagent's turn (another system prompt and task, the same tools; a new subagent every
``SUBAGENT_TURNS`` turns) and a side call (a title request on Responses and chat, a ``count_tokens`` on the
Messages API; new text each time), so a session sends far more lists than the proxy keeps for it. Only the
main turns are measured.

``--sessions`` sessions take turn k together (lock step) against one ``rollout-proxy serve`` process
per store (``--stores``: memory, and Redis on a private redis-server) in front of the engine double (``load_tests.engine``, 0 ms); each turn's CPU is the proxy
process's, read from the scheduler's nanosecond counters (``bench.harness.cpu_seconds``), per session, the
median over ``--rounds`` rounds. ``--baseline CHECKOUT`` starts a second proxy from another checkout
(``git worktree add /tmp/rp-main main``: its ``src`` first on ``PYTHONPATH``, the same interpreter and
engine) and runs every case against both; each round runs every (proxy, store, API, case) once, in an order
rotated round by round (``bench.harness.rotated``). Reported per run: the CPU per turn over turns 2-6 and
over the last five, their ratio, and the least-squares line through every turn read at turn 2 and at the
last (the goal: turn 100 at most 1.2x turn 2). Writes ``resent_input.json`` under ``--out``. A benchmark,
not a test.
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

from bench.harness import (
    OUT,
    ROOT,
    Services,
    baseline_env,
    comma_choices,
    cpu_line,
    cpu_seconds,
    free_port,
    markdown_table,
    revision,
    rotated,
    start_engine,
    start_redis,
    write_report,
)

ADMIN_KEY = "bench-admin-key"

FIXTURE = ROOT / "tests" / "fixtures" / "harnesses" / "codex-0.171.0" / "responses-turn1-stock-config.json"
TEMPLATE = ROOT / "devtools" / "templates" / "qwen3_style.jinja"

APIS = ("responses", "chat", "messages")
CASES = ("main", "interleaved")
STORES = ("memory", "redis")
#: main turns each subagent lives; then the next one starts (a new conversation)
SUBAGENT_TURNS = 10
SUBAGENT_PROMPT = (
    "You are a file-search subagent of a coding agent. Find where the code the task names lives: search the "
    "repository with the tools you have, read only what you need, and answer with the paths and one line on "
    "each. Do not edit files. Do not run the tests. Stop as soon as you can answer.\n"
) * 8
TITLE_PROMPT = "Write a title of 3 to 7 words for the conversation the user's message starts. Answer with it alone."


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


def text_item(role: str, text: str) -> dict[str, Any]:
    kind = "output_text" if role == "assistant" else "input_text"
    return {"type": "message", "role": role, "content": [{"type": kind, "text": text}]}


class Conversation:
    """One conversation of a session (Codex's main one, or a subagent's: ``items`` given), sent as Responses
    input items, as chat messages, or as the Messages API's messages the way Claude Code sends them (the
    system in blocks with a cache mark, the newest message's last block marked too, so every turn's body
    differs from the last one's there)."""

    def __init__(self, api: str, index: int, token: str, base: str, items: list[dict[str, Any]] | None = None) -> None:
        first = codex_first_body()
        first["prompt_cache_key"] = f"bench-{index}"
        self.api, self.index, self.token, self.base = api, index, token, base
        self.body = first
        self.input: list[dict[str, Any]] = copy.deepcopy(first["input"] if items is None else items)
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

    def subagent(self, task: str) -> Conversation:
        """A subagent of this session: its own system prompt and task, the same tools."""
        items = [text_item("developer", SUBAGENT_PROMPT), text_item("user", task)]
        return Conversation(self.api, self.index, self.token, self.base, items)

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

    def side_call(self, text: str) -> tuple[str, bytes]:
        """A harness's call beside the conversation, a new list each time: a title request (Responses, chat),
        a ``count_tokens`` (the Messages API)."""
        if self.api == "responses":
            body = {"model": "policy", "input": [text_item("developer", TITLE_PROMPT), text_item("user", text)]}
            return f"{self.base}/v1/responses", orjson.dumps({**body, "store": False})
        if self.api == "messages":
            body = {"model": "policy", "messages": [{"role": "user", "content": [{"type": "text", "text": text}]}]}
            return f"{self.base}/v1/messages/count_tokens", orjson.dumps(body)
        messages = [{"role": "system", "content": TITLE_PROMPT}, {"role": "user", "content": text}]
        return f"{self.base}/v1/chat/completions", orjson.dumps({"model": "policy", "messages": messages})

    def answered(self, events: list[dict[str, Any]], k: int) -> None:
        """The answer echoed back as its client would, then the next user turn."""
        user = f"Turn {k}: go on."
        if self.api == "responses":
            completed = next(event for event in events if event.get("type") == "response.completed")
            self.input += completed["response"]["output"]
            self.input.append(text_item("user", user))
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


async def post(http: aiohttp.ClientSession, token: str, url: str, body: bytes, what: str) -> bytes:
    headers = {"Authorization": f"Bearer {token}", "Content-Type": "application/json"}
    async with http.post(url, data=body, headers=headers) as response:
        raw = await response.read()
        if response.status != 200:
            raise SystemExit(f"{what}: {response.status} {raw[:300]!r}")
    return raw


async def turn(http: aiohttp.ClientSession, conversation: Conversation, k: int) -> None:
    url, body = conversation.request()
    raw = await post(http, conversation.token, url, body, f"{conversation.api} turn {k}")
    events = [orjson.loads(line[6:]) for line in raw.split(b"\n") if line.startswith(b"data: {")]
    conversation.answered(events, k)


class Session:
    """A session's main conversation, and (interleaved) its subagent and side calls between main turns."""

    def __init__(self, main: Conversation, interleaved: bool) -> None:
        self.main, self.interleaved = main, interleaved
        self.subagent: Conversation | None = None

    async def between(self, http: aiohttp.ClientSession, k: int) -> None:
        """After main turn ``k``: the subagent's turn (a new subagent every ``SUBAGENT_TURNS``), a side call."""
        if not self.interleaved:
            return
        if k % SUBAGENT_TURNS == 0:
            self.subagent = self.main.subagent(f"Find the code that turn {k} of the task is about.")
        assert self.subagent is not None
        await turn(http, self.subagent, k)
        url, body = self.main.side_call(f"[session {self.main.index}] Turn {k}: go on.")
        await post(http, self.main.token, url, body, f"{self.main.api} side call {k}")


async def lockstep(
    http: aiohttp.ClientSession, base: str, pid: int, api: str, case: str, sessions: int, turns: int
) -> list[float]:
    """Every session takes main turn k together (then, interleaved, the calls between); the proxy's CPU
    seconds per session for each main turn."""
    running = []
    for index in range(sessions):
        body = {"generation": {"max_new_tokens": 16}}
        async with http.post(f"{base}/v1/sessions", json=body, headers={"Authorization": f"Bearer {ADMIN_KEY}"}) as r:
            created = await r.json()
        running.append(Session(Conversation(api, index, created["api_key"], base), case == "interleaved"))
    cpu = []
    for k in range(turns):
        before = cpu_seconds(pid)
        await asyncio.gather(*(turn(http, session.main, k) for session in running))
        cpu.append((cpu_seconds(pid) - before) / sessions)
        await asyncio.gather(*(session.between(http, k) for session in running))
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


def start_proxy(
    services: Services, name: str, engine_url: str, env: dict[str, str] | None = None, store: str = "memory"
) -> tuple[int, str]:
    """A ``rollout-proxy serve`` on ``store`` (``memory`` or a Redis URL): (its pid, its URL)."""
    port = free_port()
    argv = [sys.executable, "-m", "rollout_proxy", "serve", "--port", str(port), "--engine", engine_url]
    argv += ["--store", store, "--admin-key", ADMIN_KEY, "--chat-template", str(TEMPLATE), "--log-level", "warning"]
    argv += ["--log-format", "json", "--session-ttl", "3600"]
    proxy = services.start(name, argv, env=env)
    base = f"http://127.0.0.1:{port}"
    services.wait_http(name, f"{base}/readyz")
    return proxy.pid, base


async def run(args: argparse.Namespace) -> dict[str, Any]:
    trees = {"this": ROOT} | ({"baseline": args.baseline} if args.baseline else {})
    envs = {name: None if name == "this" else baseline_env(tree) for name, tree in trees.items()}
    revisions = {name: revision(tree) for name, tree in trees.items()}  # what each proxy starts from
    targets = [
        (proxy, store, api, case)
        for proxy in trees
        for store in args.stores
        for api in args.apis
        for case in args.cases
    ]
    cpu: dict[tuple[str, str, str, str], list[list[float]]] = {target: [] for target in targets}
    services = Services(Path(tempfile.mkdtemp(prefix="rp-bench-input-")))
    try:
        _, engine_url = start_engine(services, extra=["--chat-template", str(TEMPLATE)])
        stores = {store: start_redis(services) if store == "redis" else store for store in args.stores}
        started = {
            (name, store): start_proxy(services, f"proxy-{name}-{store}", engine_url, env, stores[store])
            for name, env in envs.items()
            for store in args.stores
        }
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as http:
            for pid, base in started.values():  # warm: tokenizer, local rendering decided, connections
                for api in args.apis:
                    await lockstep(http, base, pid, api, "interleaved", 2, 3)
            for round_index in range(args.rounds):
                for target in rotated(targets, round_index):
                    pid, base = started[target[:2]]
                    cpu[target].append(await lockstep(http, base, pid, *target[2:], args.sessions, args.turns))
                    print(f"  round {round_index + 1}/{args.rounds}: {' '.join(target)} done", flush=True)
    finally:
        services.stop()
    settings = {key: value for key, value in vars(args).items() if key not in ("out", "baseline")}
    report: dict[str, Any] = {
        "settings": settings,
        "proxies": {name: {"revision": revisions[name]} for name in trees},
        "runs": [],
    }
    for (proxy, store, api, case), rounds in cpu.items():
        median = [statistics.median(values) for values in zip(*rounds, strict=True)]
        run = {"proxy": proxy, "store": store, "api": api, "case": case, "cpu_per_turn": median}
        report["runs"].append({**run, **summary(median)})
    return report


def table(report: dict[str, Any]) -> str:
    turns = report["settings"]["turns"]
    header = ["API", "case", "store", "proxy", "CPU/turn, turns 2-6", f"turns {turns - 4}-{turns}", "ratio"]
    header += ["line at 2", f"line at {turns}", "line ratio"]
    revisions = {name: proxy["revision"] for name, proxy in report["proxies"].items()}
    rows = [
        [
            run["api"],
            run["case"],
            run.get("store", "memory"),  # runs saved before there was a choice: memory
            f"{run['proxy']} ({revisions[run['proxy']]})",
            f"{run['turn_2_ms']:.2f} ms",
            f"{run['last_ms']:.2f} ms",
            f"{run['ratio']:.2f}x",
            f"{run['line_turn_2_ms']:.2f} ms",
            f"{run['line_last_ms']:.2f} ms",
            f"{run['line_ratio']:.2f}x",
        ]
        for run in sorted(
            report["runs"],
            key=lambda run: (
                APIS.index(run["api"]),
                CASES.index(run["case"]),
                STORES.index(run.get("store", "memory")),
                run["proxy"] != "this",
            ),
        )
    ]
    return markdown_table(header, rows)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--turns", type=int, default=100, help="main turns per conversation (default 100)")
    parser.add_argument("--sessions", type=int, default=8, help="sessions in lock step (default 8)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds, each target once, rotated (default 3)")
    parser.add_argument("--apis", type=comma_choices(APIS), default=list(APIS), help="default responses,chat,messages")
    parser.add_argument("--cases", type=comma_choices(CASES), default=list(CASES), help="default main,interleaved")
    parser.add_argument(
        "--stores", type=comma_choices(STORES), default=["memory"], help="memory and/or redis (default memory)"
    )
    parser.add_argument(
        "--baseline", type=Path, help="another checkout (e.g. a git worktree of main), run side by side"
    )
    parser.add_argument("--out", type=Path, default=OUT, help="where the JSON goes (default out/bench)")
    args = parser.parse_args(argv)
    if args.turns < 7:
        parser.error("--turns: at least 7 (turns 2-6 are the first five measured)")
    report = asyncio.run(run(args))
    write_report(args.out / "resent_input.json", report, "bench.resent_input", argv)
    print(table(report))


if __name__ == "__main__":
    main()
