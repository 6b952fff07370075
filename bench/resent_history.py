"""What reading a Chat Completions body costs as its resent history grows: a whole parse against the intake's.

    python bench/resent_history.py [--turns 10,50,100,200] [--rounds 7] [--tools]

A Chat Completions turn resends the whole conversation. Before, the proxy parsed the whole body
(``orjson.loads``) and wrote its messages again as JSON to compare them with the session's last
conversation (``MessageIntake.look_up``); now ``MessageIntake.load`` finds the last conversation's
JSON in the body and parses only what is around it. For each length this builds the body the openai
SDK sends at that turn (compact JSON, ``model`` first), remembers the turn before in a
``KnownMessages`` as the proxy would, then times both ways (parse, then look up the messages),
alternating round by round, and checks that they give the same payload and the same indices to
check. The bench's sessions resend plain chat turns; ``--tools`` adds a tool call and its result to
each turn. A benchmark, not a test.
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path
from typing import Any

import orjson

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT))  # bench: the side-by-side timer

from bench.side_by_side import alternate  # noqa: E402
from rollout_proxy.proxy.known_messages import KnownMessages, MessageIntake  # noqa: E402
from rollout_proxy.proxy.limits import load_json_object  # noqa: E402

CALLS = 200  # per round and way


def conversation(turns: int, tools: bool) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Conversation 7: tell me something."}]
    for turn in range(turns):
        if tools:
            call = {"id": f"call_{turn}", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}
            messages += [
                {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": f"call_{turn}", "content": f"sunny, {turn} C"},
            ]
        messages += [
            {"role": "assistant", "content": f"Answer {turn}: the quick brown fox jumps over the lazy dog."},
            {"role": "user", "content": f"Turn {turn}: and then?"},
        ]
    return messages


def remembered(messages: list[dict[str, Any]]) -> KnownMessages:
    """A ``KnownMessages`` that saw ``messages`` as session ``s``'s last conversation."""
    known = KnownMessages()
    intake = MessageIntake(known)
    intake.look_up(messages, session_id="s")
    intake.normalize_and_hash(messages)
    return known


def whole(known: KnownMessages, body: bytes) -> tuple[dict[str, Any], Any]:
    intake = MessageIntake(known)
    payload = load_json_object(body)
    return payload, intake.look_up(payload["messages"], session_id="s")


def spliced(known: KnownMessages, body: bytes) -> tuple[dict[str, Any], Any]:
    intake = MessageIntake(known)
    payload = intake.load(body, session_id="s")
    return payload, intake.look_up(payload["messages"], session_id="s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--turns", default="10,50,100,200", help="history lengths in turns (default 10,50,100,200)")
    parser.add_argument("--rounds", type=int, default=7, help="alternating rounds per length (default 7)")
    parser.add_argument("--tools", action="store_true", help="a tool call and its result in every turn")
    args = parser.parse_args()
    print("| turn | body | whole parse + look-up | intake's parse + look-up | ratio |")
    print("|---|---|---|---|---|")
    for turns in (int(turn) for turn in args.turns.split(",")):
        history = conversation(turns, args.tools)
        known = remembered(history[:-2])  # the turn before: without this turn's answer and question
        body = orjson.dumps({"model": "policy", "messages": history, "max_tokens": 16})
        one, other = whole(known, body), spliced(known, body)
        if orjson.dumps(one[0]) != orjson.dumps(other[0]) or one[1] != other[1]:
            raise SystemExit(f"turn {turns}: the two ways disagree")
        if known.resent_bodies != 1:
            raise SystemExit(f"turn {turns}: the intake parsed the whole body")
        ways = [("whole", functools.partial(whole, known, body)), ("spliced", functools.partial(spliced, known, body))]
        medians = alternate(ways, args.rounds, CALLS)
        before, after = medians["whole"], medians["spliced"]
        print(f"| {turns} | {len(body) / 1024:.1f} KiB | {before:.1f} µs | {after:.1f} µs | {before / after:.1f}× |")


if __name__ == "__main__":
    main()
