"""Streaming benchmark: time to first token and per-chunk overhead, rollout-proxy vs the engine direct.

    python -m bench.streaming_ttft [--rounds 200] [--delays 0,0.16] [--out out/bench]

One fake vLLM engine process (``load_tests.engine --policy fixed``: the same 16-token reply, its
``--delay`` spread over the tokens, so 0.16 s is a 10 ms decode step) and one ``rollout-proxy
serve`` (memory store) in front of it, each its own process. Every round, in turn (the order
alternates): *direct* streams ``POST /v1/completions`` (``stream: true``, the proxy's own prompt
token ids, ``return_token_ids``, ``logprobs: 0``) from the engine; *proxy* streams a Chat
Completions turn (``stream: true``) of one session from the proxy, which renders the bridge,
streams the same completion from the engine, parses and relays it, and records the turn. Per
target it reports:

  TTFT p50 / p99    request sent to the first event that adds text (the engine's ``text``, the chat
                    chunk's content or reasoning): the first character a user could see, not the
                    first chunk (a parser holding text sends chunks with tokens and no content)
  gap p50           between two text-adding events (a decode step plus the relay's share)
  total p50         request sent to the end of the stream (the proxy records the turn before its end)
  not streamed p50  the same turn without streaming, request to answer (the proxy's own per-turn work
                    is in both: TTFT overhead minus this overhead is what streaming adds)

and the proxy's differences to direct. Writes ``streaming_ttft.json`` under ``--out``. A benchmark,
not a test: the published run is on docs/benchmarks/streaming_ttft.md.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

from bench.harness import OUT, Services, free_port, rotated, start_engine, write_report

ADMIN_KEY = "bench-admin-key"
QUESTION = [{"role": "user", "content": "What is the answer?"}]


def engine_text(choice: dict[str, Any]) -> str:
    """What an engine's ``/v1/completions`` chunk adds to the text."""
    return choice.get("text") or ""


def chat_text(choice: dict[str, Any]) -> str:
    """What a Chat Completions chunk adds to the message a client shows (answer or reasoning)."""
    delta = choice.get("delta") or {}
    return (delta.get("content") or "") + (delta.get("reasoning_content") or "")


async def timed_stream(
    http: aiohttp.ClientSession, url: str, body: dict[str, Any], token: str | None, text: Any
) -> dict:
    """Send, read the SSE stream, note when each event that adds text arrived (``text`` reads a choice): a
    chunk that carries tokens but no text yet (held by a parser) does not count."""
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    started = time.perf_counter()
    arrivals: list[float] = []
    buffer = b""
    async with http.post(url, json=body, headers=headers) as response:
        assert response.status == 200, await response.text()
        async for data in response.content.iter_any():
            buffer += data
            *events, buffer = buffer.split(b"\n\n")
            now = time.perf_counter()
            for event in events:
                payload = event.split(b"data: ", 1)[-1]
                if not payload.startswith(b"{"):
                    continue
                choices = json.loads(payload).get("choices") or []
                if choices and text(choices[0]):
                    arrivals.append(now)
    ended = time.perf_counter()
    gaps = [b - a for a, b in itertools.pairwise(arrivals)]
    return {"ttft": arrivals[0] - started, "gaps": gaps, "total": ended - started, "chunks": len(arrivals)}


async def timed_plain(http: aiohttp.ClientSession, url: str, body: dict[str, Any], token: str | None) -> float:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    started = time.perf_counter()
    async with http.post(url, json=body, headers=headers) as response:
        assert response.status == 200, await response.text()
        await response.read()
    return time.perf_counter() - started


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


async def phase(engine_url: str, proxy_url: str, rounds: int) -> dict[str, Any]:
    async with aiohttp.ClientSession() as http:
        body = {"sample": {"messages": QUESTION}, "generation": {"max_new_tokens": 64}}
        async with http.post(
            f"{proxy_url}/v1/sessions", json=body, headers={"Authorization": f"Bearer {ADMIN_KEY}"}
        ) as r:
            session = await r.json()
        chat = f"{proxy_url}/v1/chat/completions"
        token = session["api_key"]
        async with http.post(chat, json={"messages": QUESTION}, headers={"Authorization": f"Bearer {token}"}) as r:
            prompt = (await r.json())["prompt_token_ids"]  # the warm-up, and the prompt direct is sent
        async with http.get(f"{engine_url}/v1/models") as r:
            model = (await r.json())["data"][0]["id"]
        direct_body = {
            "model": model,
            "prompt": prompt,
            "max_tokens": 64,
            "stream": True,
            "return_token_ids": True,
            "logprobs": 0,
        }
        proxy_body = {"messages": QUESTION, "stream": True}
        results: dict[str, list[dict]] = {"direct": [], "proxy": []}
        plain: dict[str, list[float]] = {"direct": [], "proxy": []}  # the same turns not streamed, for context
        for index in range(rounds):
            for name in rotated(["direct", "proxy"], index):
                if name == "direct":
                    results[name].append(
                        await timed_stream(http, f"{engine_url}/v1/completions", direct_body, None, engine_text)
                    )
                    plain[name].append(
                        await timed_plain(http, f"{engine_url}/v1/completions", {**direct_body, "stream": False}, None)
                    )
                else:
                    results[name].append(await timed_stream(http, chat, proxy_body, token, chat_text))
                    plain[name].append(await timed_plain(http, chat, {"messages": QUESTION}, token))
    summary: dict[str, Any] = {}
    for name, runs in results.items():
        summary[name] = {
            "ttft_p50_ms": 1000 * pct([run["ttft"] for run in runs], 0.5),
            "ttft_p99_ms": 1000 * pct([run["ttft"] for run in runs], 0.99),
            "gap_p50_ms": 1000 * pct([gap for run in runs for gap in run["gaps"]], 0.5),
            "gap_mean_ms": 1000 * statistics.fmean([gap for run in runs for gap in run["gaps"]] or [float("nan")]),
            "total_p50_ms": 1000 * pct([run["total"] for run in runs], 0.5),
            "chunks": statistics.fmean(run["chunks"] for run in runs),
            "not_streamed_p50_ms": 1000 * pct(plain[name], 0.5),
        }
    summary["proxy_minus_direct"] = {
        key: summary["proxy"][key] - summary["direct"][key] for key in summary["direct"] if key.endswith("_ms")
    }
    return summary


KEYS = ("ttft_p50_ms", "ttft_p99_ms", "gap_p50_ms", "gap_mean_ms", "total_p50_ms", "not_streamed_p50_ms")


def table(report: dict[str, Any]) -> str:
    lines = [
        "| engine step | target | TTFT p50 | TTFT p99 | gap p50 | gap mean | total p50 | not streamed p50 |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for delay, summary in report["phases"].items():
        for name in ("direct", "proxy", "proxy_minus_direct"):
            row = summary[name]
            label = "proxy − direct" if name == "proxy_minus_direct" else name
            cells = [f"{row[key]:+.2f}" if name == "proxy_minus_direct" else f"{row[key]:.2f}" for key in KEYS]
            lines.append(f"| {delay} | {label} | " + " | ".join(f"{cell} ms" for cell in cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--delays", default="0,0.16", help="engine seconds per 16-token completion, comma-separated")
    parser.add_argument("--out", type=Path, default=OUT, help="where the JSON goes (default out/bench)")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    services = Services(Path(tempfile.mkdtemp(prefix="rp-stream-bench-", dir=args.out)))
    report: dict[str, Any] = {"phases": {}}
    try:
        for delay in (float(value) for value in args.delays.split(",")):
            _, engine_url = start_engine(services, name=f"engine-{delay:g}", delay=delay)
            proxy_port = free_port()
            proxy_url = f"http://127.0.0.1:{proxy_port}"
            argv_proxy = [sys.executable, "-m", "rollout_proxy", "serve", "--port", str(proxy_port)]
            argv_proxy += ["--engine", engine_url, "--store", "memory", "--admin-key", ADMIN_KEY]
            services.start(f"proxy-{delay:g}", [*argv_proxy, "--log-level", "warning", "--log-format", "json"])
            services.wait_http(f"proxy-{delay:g}", f"{proxy_url}/readyz")
            step = f"{delay / 16 * 1000:g} ms"
            report["phases"][step] = asyncio.run(phase(engine_url, proxy_url, args.rounds))
            services.stop_one(f"proxy-{delay:g}")
            services.stop_one(f"engine-{delay:g}")
    finally:
        services.stop()
    report["settings"] = {"rounds": args.rounds, "cpus": os.cpu_count(), "load_average": os.getloadavg()}
    write_report(args.out / "streaming_ttft.json", report, "bench.streaming_ttft", argv)
    print(table(report))
    print(f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}; {args.rounds} rounds per engine step")


if __name__ == "__main__":
    main()
