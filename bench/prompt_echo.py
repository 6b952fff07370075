"""What checking the engine's echo of the prompt costs as the prompt grows: the two ways side by side.

    python bench/prompt_echo.py [--tokens 500,2000,8000,32000] [--rounds 7]

Every completion asks vLLM for ``return_token_ids``, and vLLM echoes the whole prompt as
``prompt_token_ids``; the proxy finds the echo of the prompt it sent as bytes and leaves it out of
the parse (``engines.vllm_http.PromptEcho``). It used to search the answer for the key and the whole
prompt at once (``bytes.find`` with a needle as long as the prompt); now it searches the short key
and compares the prompt once where it stands (``wire.json_bytes.value_at``). This builds vLLM's answer in the shape
of the fixture ``dense/completions_token_in.json`` (its keys and their order, compact JSON as vLLM
writes it) with a prompt of N tokens, checks both ways find the same place, then times the whole ``parse`` each way,
alternating round by round. A benchmark, not a test.
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path
from typing import Any

import numpy as np
import orjson

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT))  # bench: the side-by-side timer

from bench.side_by_side import alternate  # noqa: E402
from rollout_proxy.engines.vllm_http import _ECHO_KEY, PromptEcho, _loads  # noqa: E402
from rollout_proxy.wire.json_bytes import value_at  # noqa: E402

CALLS = 200  # per round and way


def answer(prompt: np.ndarray) -> bytes:
    """vLLM 0.32's answer to a token-in completion with ``return_token_ids`` (the keys and their order of the
    fixture ``dense/completions_token_in.json``), a 16-token output, compact JSON as vLLM writes it."""
    output = list(range(100, 116))
    choice = {
        "index": 0,
        "text": "Este-Lille, la capital de France, y otra vez.",
        "logprobs": {
            "text_offset": list(range(0, 48, 3)),
            "token_logprobs": [-1.2345678901234567] * 16,
            "tokens": [f"token_id:{token}" for token in output],
            "top_logprobs": None,
        },
        "finish_reason": "length",
        "stop_reason": None,
        "token_ids": output,
        "prompt_logprobs": None,
        "prompt_token_ids": prompt.tolist(),
        "routed_experts": None,
    }
    usage = {"prompt_tokens": len(prompt), "total_tokens": len(prompt) + 16, "completion_tokens": 16}
    return orjson.dumps(
        {
            "id": "cmpl-a9f35051f34f5eb0",
            "object": "text_completion",
            "created": 1795993729,
            "model": "smollm2",
            "choices": [choice],
            "service_tier": None,
            "system_fingerprint": "vllm-0.32.0-98e64ad1",
            "usage": usage,
            "kv_transfer_params": None,
            "ec_transfer_params": None,
            "metrics": None,
        }
    )


def whole_needle(echo: PromptEcho, body: bytes) -> Any:
    """Before: the key and the whole prompt searched at once."""
    marker = _ECHO_KEY + echo.json
    at = body.find(marker)
    if at < 0:
        return _loads(body)
    return _loads(b"".join((body[:at], _ECHO_KEY, b"null", body[at + len(marker) :])))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", default="500,2000,8000,32000", help="prompt lengths (default 500,2000,8000,32000)")
    parser.add_argument("--rounds", type=int, default=7, help="alternating rounds per length (default 7)")
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    print("| prompt tokens | answer | whole prompt as the needle | key, then one compare | ratio |")
    print("|---|---|---|---|---|")
    for tokens in (int(n) for n in args.tokens.split(",")):
        echo = PromptEcho(rng.integers(0, 49_152, tokens, dtype=np.int32))
        body = answer(echo.array)
        before, (after, same) = whole_needle(echo, body), echo.parse(body)
        if not same or orjson.dumps(before) != orjson.dumps(after) or value_at(body, _ECHO_KEY, echo.json) < 0:
            raise SystemExit(f"{tokens} tokens: the two ways disagree")
        ways = [("needle", functools.partial(whole_needle, echo, body)), ("key", functools.partial(echo.parse, body))]
        medians = alternate(ways, args.rounds, CALLS)
        needle, key = medians["needle"], medians["key"]
        print(f"| {tokens:,} | {len(body) / 1024:.1f} KiB | {needle:.1f} µs | {key:.1f} µs | {needle / key:.1f}× |")


if __name__ == "__main__":
    main()
