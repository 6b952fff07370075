"""The fake vLLM engine as a process of its own, for the load tests and the benchmarks.

    python -m load_tests.engine --port 8000 [--delay 0.05] [--policy tools|fixed] [--chat-template FILE]

``devtools.fake_engine`` speaks vLLM's wire format; this adds what a load needs:

- a policy: ``tools`` (call the weather tool on a user question, state the tool's answer after a
  tool result: a multi-turn tool agent) or ``fixed`` (the same short reply, costing nothing);
- vLLM's ``POST /v1/chat/completions`` (render, tokenize, sample, answer a chat completion), which
  the fake does not serve: what a client calls without the proxy (the benchmark's "direct"
  column) and what LiteLLM forwards to;
- the fake's request log, kept for tests, cleared every few seconds so memory stays flat.

It prints ``ready <url>`` on stdout once it listens, and stops on SIGTERM/SIGINT.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import secrets
import signal
import time
from pathlib import Path
from typing import Any

from aiohttp import web

from devtools.fake_engine import FakeEngine

#: the reply of the ``fixed`` policy: 16 tokens with SmolLM2's tokenizer, EOS included
FIXED_REPLY = "The answer is forty-two, and that is all I will say about it."
TEMPLATES = Path(__file__).resolve().parents[1] / "devtools" / "templates"
#: the chat template with tool support the load tests use (the engine and the proxy are given the same file)
TOOL_TEMPLATE = TEMPLATES / "qwen3_style.jinja"
BACKLOG = 2048


def tool_policy(engine: FakeEngine) -> Any:
    """Call ``get_weather`` for the place a user asks about; after a tool result, say what it said."""

    def policy(prompt_ids: list[int]) -> str:
        turns = engine.decode(prompt_ids[-400:]).split("<|im_start|>")
        last = turns[-2] if len(turns) > 1 else ""
        result = re.search(r"<tool_response>\n(.*?)\n</tool_response>", last, re.DOTALL)
        if result:
            try:
                weather = json.loads(result.group(1))
                return f"It is {weather['condition']} in {weather['city']}, {weather['temperature']} degrees."
            except (ValueError, KeyError, TypeError):
                return "The weather service did not answer."
        words = last.removesuffix("<|im_end|>\n").rstrip("?!. \n").split()
        city = words[-1] if words else "Paris"
        call = json.dumps({"name": "get_weather", "arguments": {"city": city}})
        return f"<tool_call>\n{call}\n</tool_call>"

    return policy


def fixed_policy(engine: FakeEngine) -> Any:
    reply = [*engine.encode(FIXED_REPLY), engine.eos_id]
    return lambda prompt_ids: reply


POLICIES = {"tools": tool_policy, "fixed": fixed_policy}


def chat_completions(engine: FakeEngine) -> Any:
    """vLLM's chat route on the fake: the whole history rendered and tokenized on every call, as vLLM does."""

    async def handle(request: web.Request) -> web.Response:
        payload = await request.json()
        text = engine.render(payload["messages"], tools=payload.get("tools"), add_generation_prompt=True)
        prompt = engine.tokenizer.encode(text, add_special_tokens=False)
        reply = engine.policy(list(prompt))
        sampled = engine.encode(reply) if isinstance(reply, str) else list(reply)
        max_tokens = int(payload.get("max_tokens") or payload.get("max_completion_tokens") or 16)
        finish = "length" if len(sampled) > max_tokens else "stop"
        sampled = [token for token in sampled[:max_tokens] if token != engine.eos_id]
        for _ in sampled if engine.delay else ():  # paced per token, as the fake's /v1/completions is
            await asyncio.sleep(engine.delay / len(sampled))
        message: dict[str, Any] = {
            "role": "assistant",
            "content": engine.decode(sampled),
            "tool_calls": [],
            "reasoning_content": None,
        }
        return web.json_response(
            {
                "id": "chatcmpl-" + secrets.token_hex(8),
                "object": "chat.completion",
                "created": int(time.time()),
                "model": engine.model_name,
                "choices": [
                    {"index": 0, "message": message, "logprobs": None, "finish_reason": finish, "stop_reason": None}
                ],
                "usage": {
                    "prompt_tokens": len(prompt),
                    "completion_tokens": len(sampled),
                    "total_tokens": len(prompt) + len(sampled),
                },
            }
        )

    return handle


async def serve(args: argparse.Namespace) -> None:
    from devtools.engine_env import ensure_checkpoints

    tokenizer = args.tokenizer or ensure_checkpoints()["dense"]
    template = args.chat_template.read_text() if args.chat_template else None
    engine = FakeEngine(
        tokenizer, chat_template=template, model_name=args.model, max_model_len=args.max_model_len, delay=args.delay
    )
    engine.policy = POLICIES[args.policy](engine)
    app = engine.app()
    app.router.add_post("/v1/chat/completions", chat_completions(engine))
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    # uvicorn's (vLLM's) listen backlog: a burst of 1,024 new connections is not dropped at accept
    site = web.TCPSite(runner, "127.0.0.1", args.port, backlog=BACKLOG)
    await site.start()
    url = f"http://127.0.0.1:{runner.addresses[0][1]}"
    print(f"ready {url}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    while not stop.is_set():
        engine.completions.clear()  # the fake's log for tests: not what is measured here
        engine.generations.clear()
        engine.generate_requests.clear()  # their images' data URLs too
        if engine.images is not None:
            engine.images.received.clear()
        try:
            async with asyncio.timeout(2.0):
                await stop.wait()
        except TimeoutError:
            pass
    await runner.cleanup()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m load_tests.engine", description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, default=0, help="port to listen on (default: a free one)")
    parser.add_argument("--delay", type=float, default=0.0, help="seconds each completion takes (default 0)")
    parser.add_argument("--policy", choices=sorted(POLICIES), default="tools", help="what it answers (default tools)")
    parser.add_argument("--chat-template", type=Path, help="Jinja chat template (default: the tokenizer's own)")
    parser.add_argument("--tokenizer", type=Path, help="tokenizer directory (default: the SmolLM2 checkpoint)")
    parser.add_argument("--model", default="fake-smollm2", help="served model name")
    parser.add_argument("--max-model-len", type=int, default=32768, help="context length (default 32768)")
    asyncio.run(serve(parser.parse_args(argv)))


if __name__ == "__main__":
    main()
