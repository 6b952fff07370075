"""What a stored token costs: Redis memory and in-process memory per token and per open session.

    python -m bench.storage_footprint [--tokens 1000000] [--turns 8] [--out out/bench]

Writes multi-turn tool-agent sessions through the real store API (``create_session``, then
``put_node`` with nodes built as ``core/turns.py`` builds them: ``prompt_ids``/``output_ids``
int32, ``output_logprobs`` float32, the node's messages, the rolling path hashes of the chat
path as partial and full entries, "latest", policy versions), turn by turn across all sessions
(all sessions take turn 1, then turn 2, ...), until ``--tokens`` tokens are stored; once into a
private redis-server started here (or ``--redis-url``, which is flushed), once into the
in-process memory store. The workload, per session: a sample of a system prompt, two tool
schemas and a user task (rendered: ~300 tokens), then ``--turns`` turns; each turn after the
first bridges one tool result (``--bridge`` tokens, uniform) and every turn generates
``--output`` tokens (uniform): reasoning and a tool call (the last turn: reasoning and an
answer). Texts are slices of real prose (the Python docs shipped with the standard library)
and real code (standard library modules), ``--chars-per-token`` characters per token, so their
JSON escapes are real; generated token ids follow a Zipf law over a ``--vocab`` vocabulary and
logprobs a sampling-like mix. Deterministic for a ``--seed`` (except the random ids).

Definitions (printed with the numbers):
  stored tokens  every token a node stores, counted once: its ``prompt_ids`` (the bridge, or the
                 rendered sample for the first turn) and its ``output_ids``. A node stores only
                 what it adds to its parent, so this is the length of the trajectory, not more.
  raw bytes      4 per stored token (int32 id) + 4 per generated token (float32 logprob).
  Redis bytes    the rise of INFO ``used_memory`` (allocator bytes, keys and their TTLs and the
                 session index included) less the rise of ``mem_clients_normal`` (connection
                 buffers, not stored data); broken down by key kind with ``MEMORY USAGE key
                 SAMPLES 0`` (exact; it leaves out the keys' entries in the expiry table).
  memory bytes   the rise of ``tracemalloc``'s traced memory (numpy buffers included) while the
                 store holds the sessions (records, nodes, arrays, path index, summaries).

The Redis store writes node blobs zstd-compressed (``--redis-node-compression``, level 3); the
same run is repeated side by side (``--variants``) with ``plain`` blobs (level 0: as before
compression), levels 1 and 9, and a what-if, ``no-text`` (the node's messages left out of its
blob: the floor for the token arrays and the tree). How well the token ids compress depends on
the synthetic ids (Zipf); the message text is real.

Writes ``storage_footprint.json`` under ``--out`` and prints the tables. A benchmark, not a test.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import gc
import json
import random
import shutil
import tempfile
import time
import tracemalloc
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import orjson

from bench.harness import OUT, Services, start_redis, write_report
from rollout_proxy.ids import new_response_id, new_session_id, new_tool_call_id
from rollout_proxy.records import GenerationConfig, NodeKind, PolicySpan, ResponseNode, SessionRecord
from rollout_proxy.state import codec
from rollout_proxy.state.connection import RedisOptions
from rollout_proxy.state.memory import MemoryStore
from rollout_proxy.state.redis import RedisStore
from rollout_proxy.tokenization.messages import EMPTY_PATH_HASH, extend_path_hash

#: Template tokens around one rendered message (<|im_start|>role\n ... <|im_end|>\n), and the generation prompt.
MESSAGE_TOKENS = 5
GENERATION_PROMPT = 3
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "run_python",
            "description": "Run a Python snippet in the task's sandbox and return its stdout, stderr and exit code.",
            "parameters": {
                "type": "object",
                "properties": {"code": {"type": "string", "description": "the code to run"}},
                "required": ["code"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "read_file",
            "description": "Read a file of the repository under test (at most 400 lines from a line number).",
            "parameters": {
                "type": "object",
                "properties": {"path": {"type": "string"}, "start": {"type": "integer", "minimum": 1}},
                "required": ["path"],
            },
        },
    },
]


# -- the workload ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Turn:
    bridge: int  # content tokens of the bridged tool result (0 on the first turn: the sample is rendered)
    output: int  # generated tokens


def plan(args: argparse.Namespace) -> list[list[Turn]]:
    """Each session's turn sizes, sessions added until the stored tokens reach ``--tokens``."""
    rng = random.Random(args.seed)
    sessions: list[list[Turn]] = []
    total = 0
    while total < args.tokens:
        turns = [Turn(0 if k == 0 else rng.randint(*args.bridge), rng.randint(*args.output)) for k in range(args.turns)]
        sessions.append(turns)
        total += args.sample_tokens + sum(
            turn.output + (turn.bridge + MESSAGE_TOKENS + GENERATION_PROMPT if turn.bridge else 0) for turn in turns
        )
    return sessions


class Texts:
    """Slices of real prose and real code (from the standard library), so sizes and escapes are real."""

    def __init__(self, seed: int) -> None:
        import pydoc_data.topics

        self.prose = " ".join(pydoc_data.topics.topics.values())
        stdlib = Path(json.__file__).resolve().parents[1]
        self.code = "\n".join(
            (stdlib / name).read_text() for name in ("argparse.py", "asyncio/base_events.py", "json/decoder.py")
        )
        self.rng = random.Random(seed)

    def _slice(self, source: str, chars: int) -> str:
        start = self.rng.randrange(0, len(source) - chars - 1)
        return source[start : start + chars]

    def prose_of(self, chars: int) -> str:
        return self._slice(self.prose, max(chars, 1))

    def code_of(self, chars: int) -> str:
        return self._slice(self.code, max(chars, 1))


@dataclass(slots=True)
class Conversation:
    """Where one session stands: what the next turn extends."""

    record: SessionRecord
    turns: list[Turn]
    parent_id: str | None = None
    end_hash: str = EMPTY_PATH_HASH
    call_id: str = ""
    prompt_len: int = 0  # the whole prompt so far (usage)


class Workload:
    """Sessions and nodes as the proxy builds them (``core.sessions``, ``core.turns``)."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.texts = Texts(args.seed)
        self.rng = np.random.default_rng(args.seed)
        self.ranks_to_ids = self.rng.permutation(args.vocab).astype(np.int32)
        self.cpt = args.chars_per_token
        self.generation = GenerationConfig(max_new_tokens=2048, temperature=1.0)

    def tokens(self, n: int) -> np.ndarray:
        """Token ids with a Zipf law over the vocabulary (frequent tokens first, then a fixed permutation)."""
        ranks = np.minimum(self.rng.zipf(1.1, n), self.args.vocab) - 1
        return self.ranks_to_ids[ranks]

    def logprobs(self, n: int) -> np.ndarray:
        """Sampling-like: most tokens near-certain, the rest spread out."""
        sure = self.rng.random(n) < 0.6
        values = np.where(sure, -self.rng.exponential(0.01, n), -self.rng.exponential(1.5, n))
        return values.astype(np.float32)

    def sample_messages(self) -> list[dict[str, Any]]:
        system = self.texts.prose_of(int(self.args.sample_tokens * 0.45 * self.cpt))
        task = self.texts.prose_of(int(self.args.sample_tokens * 0.25 * self.cpt))
        return [{"role": "system", "content": system}, {"role": "user", "content": task}]

    def session(self, turns: list[Turn]) -> Conversation:
        now = time.time()
        record = SessionRecord(
            id=new_session_id(),
            messages=self.sample_messages(),
            tools=TOOLS,
            extra={"answer": "42", "task_id": f"task-{self.rng.integers(1_000_000)}"},
            generation=self.generation,
            context={"model_customization_job_id": "job-bench", "phase": "train", "current_training_step": 7},
            created_at=now,
            expires_at=now + 3600,
            engine="http://10.0.0.7:8000",
        )
        return Conversation(record=record, turns=turns)

    def assistant(self, n_out: int, last: bool) -> dict[str, Any]:
        chars = max(n_out - 1, 1) * self.cpt  # the last token is the end of turn
        if last:
            return {
                "role": "assistant",
                "content": self.texts.prose_of(int(chars * 0.5)),
                "reasoning_content": self.texts.prose_of(int(chars * 0.5)),
            }
        code = self.texts.code_of(max(int(chars * 0.3) - 15 * int(self.cpt), 8))  # the call's wrapper tokens
        call = {"id": new_tool_call_id(), "type": "function"}
        call["function"] = {"name": "run_python", "arguments": json.dumps({"code": code}, ensure_ascii=False)}
        return {
            "role": "assistant",
            "content": "",
            "tool_calls": [call],
            "reasoning_content": self.texts.prose_of(int(chars * 0.7)),
        }

    def turn(self, conversation: Conversation, k: int) -> tuple[ResponseNode, dict[str, str], dict[str, str]]:
        """Turn ``k`` of the conversation: (the node, full path entries, partial path entries), as ``_save`` writes them."""
        turn = conversation.turns[k]
        record = conversation.record
        if k == 0:
            new_messages = list(record.messages)
            delta = self.args.sample_tokens
        else:
            content = self.texts.code_of(int(turn.bridge * self.cpt))
            new_messages = [{"role": "tool", "tool_call_id": conversation.call_id, "content": content}]
            delta = turn.bridge + MESSAGE_TOKENS + GENERATION_PROMPT
        last = k == len(conversation.turns) - 1
        message = self.assistant(turn.output, last)
        prompt_len = conversation.prompt_len + delta
        hashes, current = [], conversation.end_hash
        for each in [*new_messages, message]:
            current = extend_path_hash(current, each)
            hashes.append(current)
        node = ResponseNode(
            id=new_response_id(record.id),
            parent_id=conversation.parent_id,
            kind=NodeKind.GENERATED,
            api="chat",
            messages=[*new_messages, message],
            n_input_messages=len(new_messages),
            prompt_ids=self.tokens(delta),
            output_ids=self.tokens(turn.output),
            output_logprobs=self.logprobs(turn.output),
            finish_reason="stop" if last else "tool_calls",
            usage={
                "prompt_tokens": prompt_len,
                "completion_tokens": turn.output,
                "total_tokens": prompt_len + turn.output,
            },
            path_hash=hashes[-1],
            created_at=time.time(),
            model="Qwen/Qwen3-8B",
            policy_versions=(PolicySpan(7, 0, turn.output),),
        )
        partial = {path_hash: f"{node.id}#{index + 1}" for index, path_hash in enumerate(hashes[:-1])}
        conversation.parent_id, conversation.end_hash = node.id, hashes[-1]
        conversation.prompt_len = prompt_len + turn.output
        conversation.call_id = message["tool_calls"][0]["id"] if "tool_calls" in message else ""
        return node, {node.path_hash: node.id}, partial


@dataclass(slots=True)
class Tally:
    prompt_tokens: int = 0
    output_tokens: int = 0
    arrays: int = 0  # bytes of the node blobs' arrays
    messages_json: int = 0  # bytes of the messages' JSON inside the blobs' headers
    header_rest: int = 0  # the rest of the blobs (magic, length, the header's other fields)
    session_json: int = 0  # the session records' JSON
    blobs: int = 0  # bytes of the node blobs as written (a variant's encoding)

    @property
    def tokens(self) -> int:
        return self.prompt_tokens + self.output_tokens

    @property
    def raw(self) -> int:
        return 4 * self.tokens + 4 * self.output_tokens

    def add(self, node: ResponseNode) -> None:
        self.prompt_tokens += len(node.prompt_ids)
        self.output_tokens += len(node.output_ids)
        blob, _ = codec.encode_node(node)
        arrays = 4 * (len(node.prompt_ids) + 2 * len(node.output_ids))
        messages = len(orjson.dumps(node.messages))
        self.arrays += arrays
        self.messages_json += messages
        self.header_rest += len(blob) - arrays - messages


# -- the Redis variants (side by side with the default) --------------------------------------------


@dataclass(frozen=True, slots=True)
class Variant:
    level: int  # --redis-node-compression
    strip_text: bool = False  # a what-if: the node's messages left out of its blob


DEFAULT_LEVEL = RedisOptions().node_compression
VARIANTS: dict[str, Variant] = {
    "plain": Variant(0),
    "level-1": Variant(1),
    "level-9": Variant(9),
    "no-text": Variant(DEFAULT_LEVEL, strip_text=True),
}


# -- Redis -----------------------------------------------------------------------------------------


async def redis_memory(client: Any) -> int:
    """Allocator bytes less the connections' buffers, once settled: a hash table Redis is growing keeps
    its old table until an incremental rehash (done a step at a time, on commands and on its 100 ms cron)
    ends, so two reads 0.1 s apart must agree (at most 2 s)."""

    async def read() -> int:
        info = await client.info("memory")
        return int(info["used_memory"]) - int(info.get("mem_clients_normal", 0))

    now = await read()
    for _ in range(20):
        await asyncio.sleep(0.1)
        now, before = await read(), now
        if now == before:
            break
    return now


def key_kind(key: bytes) -> str:
    text = key.decode()
    if text.startswith("rp:{sessions}:"):
        return "index:" + text.rsplit(":", 1)[1]
    return text.rsplit(":", 1)[1]


async def breakdown(client: Any) -> dict[str, dict[str, int]]:
    """MEMORY USAGE (exact: SAMPLES 0) summed by key kind."""
    kinds: dict[str, dict[str, int]] = {}
    batch: list[bytes] = []

    async def flush() -> None:
        async with client.pipeline(transaction=False) as pipe:
            for key in batch:
                pipe.memory_usage(key, samples=0)
            sizes = await pipe.execute()
        for key, size in zip(batch, sizes, strict=True):
            row = kinds.setdefault(key_kind(key), {"keys": 0, "bytes": 0})
            row["keys"] += 1
            row["bytes"] += int(size or 0)
        batch.clear()

    async for key in client.scan_iter(match="rp:*", count=1000):
        batch.append(key)
        if len(batch) >= 500:
            await flush()
    if batch:
        await flush()
    return dict(sorted(kinds.items(), key=lambda item: -item[1]["bytes"]))


async def run_redis(
    url: str, sessions: list[list[Turn]], args: argparse.Namespace, variant: str | None
) -> dict[str, Any]:
    chosen = VARIANTS[variant] if variant is not None else Variant(DEFAULT_LEVEL)
    tally = Tally()
    store = await RedisStore.connect(url, options=RedisOptions(node_compression=chosen.level))
    encode = store._encode

    async def counted(node: ResponseNode) -> tuple[bytes, bytes | None]:
        blob, routing = await encode(dataclasses.replace(node, messages=[]) if chosen.strip_text else node)
        tally.blobs += len(blob)
        return blob, routing

    store._encode = counted  # type: ignore[method-assign]
    client = store._redis
    try:
        await client.flushdb()
        workload = Workload(args)
        warm = workload.session([Turn(0, 10)])  # the scripts load once: not stored data
        await store.create_session(warm.record)
        node, paths, partial = workload.turn(warm, 0)
        await store.put_node(warm.record.id, node, paths=paths, partial_paths=partial, latest="chat")
        await client.flushdb()
        workload = Workload(args)
        tally.blobs = 0
        base = await redis_memory(client)
        conversations = [workload.session(turns) for turns in sessions]
        for conversation in conversations:
            await store.create_session(conversation.record)
            tally.session_json += len(orjson.dumps(conversation.record.to_dict()))
        after = [await redis_memory(client) - base]
        for k in range(args.turns):
            for conversation in conversations:
                node, paths, partial = workload.turn(conversation, k)
                tally.add(node)
                await store.put_node(conversation.record.id, node, paths=paths, partial_paths=partial, latest="chat")
            after.append(await redis_memory(client) - base)
        kinds = await breakdown(client)
    finally:
        await store.close()
    name = f"redis (zstd level {DEFAULT_LEVEL}, the default)" if variant is None else f"redis {variant}"
    return result(name, len(sessions), after, tally, kinds)


# -- the memory store -----------------------------------------------------------------------------


def traced() -> int:
    gc.collect()
    return tracemalloc.get_traced_memory()[0]


async def run_memory(sessions: list[list[Turn]], args: argparse.Namespace) -> dict[str, Any]:
    store = MemoryStore()
    workload = Workload(args)
    tally = Tally()
    tracemalloc.start()
    try:
        base = traced()
        conversations = [workload.session(turns) for turns in sessions]
        for conversation in conversations:
            await store.create_session(conversation.record)
        after = [traced() - base]
        for k in range(args.turns):
            for conversation in conversations:
                node, paths, partial = workload.turn(conversation, k)
                tally.add(node)  # its temporaries are freed: only what the store keeps is counted
                await store.put_node(conversation.record.id, node, paths=paths, partial_paths=partial, latest="chat")
            after.append(traced() - base)
        tracemalloc.stop()
    finally:
        await store.close()
    return result("memory", len(sessions), after, tally, {})


# -- the report -------------------------------------------------------------------------------------


def result(name: str, n_sessions: int, after: list[int], tally: Tally, kinds: dict[str, Any]) -> dict[str, Any]:
    total = after[-1]
    return {
        "store": name,
        "sessions": n_sessions,
        "stored_tokens": tally.tokens,
        "prompt_tokens": tally.prompt_tokens,
        "generated_tokens": tally.output_tokens,
        "raw_bytes": tally.raw,
        "bytes": total,
        "bytes_per_token": total / tally.tokens,
        "vs_raw": total / tally.raw,
        "per_session_after_turns": [value / n_sessions for value in after],
        "blob": {
            "arrays": tally.arrays,
            "messages_json": tally.messages_json,
            "header_rest": tally.header_rest,
            "session_json": tally.session_json,
            "written": tally.blobs,
        },
        "keys": kinds,
    }


def workload(report: dict[str, Any]) -> str:
    """The run's workload in one line: sessions, turns, token counts, what raw means."""
    main, s = report["results"][0], report["settings"]
    return (
        f"{main['sessions']} sessions x {s['turns']} turns (tool agent: bridges {s['bridge'][0]}-{s['bridge'][1]}, "
        f"outputs {s['output'][0]}-{s['output'][1]} tokens, {s['chars_per_token']:g} chars/token); "
        f"{main['stored_tokens']:,} stored tokens ({main['generated_tokens']:,} generated); "
        f"raw = 4 B x stored tokens (int32 ids) + 4 B x generated tokens (float32 logprobs) = {main['raw_bytes']:,} B"
    )


def tables(report: dict[str, Any]) -> str:
    """The workload, the store table and where Redis's bytes go, as the bench prints them."""
    return "\n".join([workload(report), "", store_table(report), "", breakdown_table(report)])


def store_table(report: dict[str, Any]) -> str:
    """Bytes per stored token and per open session, every store and variant of the run."""
    s = report["settings"]
    lines = [
        "| store | bytes | per stored token | vs raw | per open session: empty | after 1 turn | after 3 turns "
        f"| after {s['turns']} turns |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in report["results"]:
        per = r["per_session_after_turns"]
        few = per[min(3, len(per) - 1)]
        lines.append(
            f"| {r['store']} | {r['bytes'] / 2**20:.1f} MiB | {r['bytes_per_token']:.2f} B | {r['vs_raw']:.2f}x "
            f"| {per[0] / 1024:.1f} KiB | {per[min(1, len(per) - 1)] / 1024:.1f} KiB | {few / 1024:.1f} KiB "
            f"| {per[-1] / 1024:.1f} KiB |"
        )
    return "\n".join(lines)


def breakdown_table(report: dict[str, Any]) -> str:
    """Where the default Redis run's bytes go: the blobs' parts, then each kind of key."""
    main = report["results"][0]
    blob = main["blob"]
    lines = [
        f"what is stored, before Redis's own costs (per stored token): token arrays {blob['arrays'] / main['stored_tokens']:.2f} B "
        f"(= raw), node messages JSON {blob['messages_json'] / main['stored_tokens']:.2f} B, rest of the node headers "
        f"{blob['header_rest'] / main['stored_tokens']:.2f} B, session records {blob['session_json'] / main['stored_tokens']:.2f} B",
        "",
        "| Redis key | keys | bytes (MEMORY USAGE) | per stored token | share of used_memory rise |",
        "|---|---|---|---|---|",
    ]
    counted = 0
    for kind, row in main["keys"].items():
        counted += row["bytes"]
        lines.append(
            f"| {kind} | {row['keys']} | {row['bytes']:,} | {row['bytes'] / main['stored_tokens']:.2f} B "
            f"| {row['bytes'] / main['bytes'] * 100:.1f}% |"
        )
        if kind == "nodes":
            extra = row["bytes"] - blob["written"]
            lines.append(
                f"| nodes: the blobs | | {blob['written']:,} | {blob['written'] / main['stored_tokens']:.2f} B "
                f"| {blob['written'] / main['bytes'] * 100:.1f}% |"
            )
            lines.append(
                f"| nodes: hash entries, allocator rounding | | {extra:,} | {extra / main['stored_tokens']:.2f} B "
                f"| {extra / main['bytes'] * 100:.1f}% |"
            )
    rest = main["bytes"] - counted
    lines.append(
        f"| (expiry entries, dict tables) | | {rest:,} | {rest / main['stored_tokens']:.2f} B | {rest / main['bytes'] * 100:.1f}% |"
    )
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    def pair(text: str) -> tuple[int, int]:
        low, _, high = text.partition("-")
        return int(low), int(high or low)

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=1_000_000, help="stored tokens to reach (default 1,000,000)")
    parser.add_argument("--turns", type=int, default=8, help="turns per session (default 8)")
    parser.add_argument(
        "--bridge", type=pair, default=(100, 300), help="tool-result tokens per turn, LOW-HIGH (default 100-300)"
    )
    parser.add_argument(
        "--output", type=pair, default=(100, 300), help="generated tokens per turn, LOW-HIGH (default 100-300)"
    )
    parser.add_argument(
        "--sample-tokens", type=int, default=300, help="the rendered sample: system, tools, task (default 300)"
    )
    parser.add_argument("--chars-per-token", type=float, default=4.0, help="text characters per token (default 4.0)")
    parser.add_argument("--vocab", type=int, default=151_936, help="vocabulary size of the token ids (default Qwen's)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--variants",
        default=",".join(VARIANTS),
        help=f"what-if blob encodings to also run on Redis, comma-separated ('' for none; default {','.join(VARIANTS)})",
    )
    parser.add_argument("--no-memory", action="store_true", help="skip the in-process memory store")
    parser.add_argument("--redis-url", help="an empty Redis to use, flushed (default: a private redis-server)")
    parser.add_argument("--out", type=Path, default=OUT, help="JSON (default out/bench)")
    args = parser.parse_args(argv)
    args.variants = [name for name in args.variants.split(",") if name]
    for name in args.variants:
        if name not in VARIANTS:
            parser.error(f"unknown variant {name!r} (known: {', '.join(VARIANTS)})")
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    sessions = plan(args)
    services = Services(Path(tempfile.mkdtemp(prefix="rp-bench-", dir=args.out)))
    try:
        url = args.redis_url
        if url is None:
            if not shutil.which("redis-server"):
                raise SystemExit("redis-server is not installed (apt-get install redis-server), or pass --redis-url")
            url = start_redis(services)
        results = [asyncio.run(run_redis(url, sessions, args, None))]
        results += [asyncio.run(run_redis(url, sessions, args, variant)) for variant in args.variants]
        if not args.no_memory:
            results.append(asyncio.run(run_memory(sessions, args)))
    finally:
        services.stop()
        shutil.rmtree(services.workdir, ignore_errors=True)
    settings = {key: value for key, value in vars(args).items() if key not in ("out", "redis_url")}
    report = {"settings": settings, "results": results, "goal_vs_raw": 1.2, "met": results[0]["vs_raw"] <= 1.2}
    write_report(args.out / "storage_footprint.json", report, "bench.storage_footprint", argv)
    print(tables(report))
    verdict = "met" if report["met"] else "NOT met"
    print(f"\ngoal: Redis bytes <= 1.2x raw: {verdict} ({results[0]['vs_raw']:.2f}x)")
    print(f"wrote {args.out / 'storage_footprint.json'}")
    return report


if __name__ == "__main__":
    main()
