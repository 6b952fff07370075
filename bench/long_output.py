"""A streamed turn's CPU per output token as the output grows: does a 32k-token answer cost each token what a
1k-token one does?

    python -m bench.long_output                                    # 1k, 8k and 32k tokens, this tree
    python -m bench.long_output --baseline /tmp/rp-base-f1e8f08     # and another checkout, rounds alternating
    python -m bench.long_output --sizes 1000,4000 --rounds 1        # quicker

What runs is the proxy's own per-delta work on a streamed turn, in process, without sockets: the incremental
parser (``IncrementalParser.feed``, hermes tools and ``<think>`` reasoning, as Qwen3 is served) and each API's
SSE framing of the delta (``ChatChunks``, ``ResponseEvents``, ``MessageEvents``, then ``sse.encode``), one
token of text a delta (`` word``). Three outputs: a long reasoning (``<think>`` never closed), a long answer,
and one long tool call (its arguments, until ``</tool_call>``). Each size runs in a fresh process per tree
(``--baseline``: that checkout's ``src`` first), the trees in turn, rotated each round; a cell is the best of
``--repeats`` runs in that process, the table the median over rounds. Linear work shows as the same µs per
token at every size; work that copies what came before grows with the size.

A benchmark, not a test (tests/bench/test_long_output.py runs it tiny). The published run is on
docs/benchmarks/streaming_ttft.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.harness import OUT, ROOT, baseline_env, child_env, markdown_table, revision, rotated, write_report

PIECE = " word"
#: output name -> the text before the repeated piece
OUTPUTS = {
    "reasoning": "<think>\n",
    "answer": "Sure",
    "tool call": '<tool_call>\n{"name": "write_file", "arguments": {"text": "',
}
APIS = ("chat", "responses", "messages")


def measure(output: str, api: str, tokens: int) -> float:
    """Seconds for ``tokens`` deltas of ``output`` through the parser and ``api``'s framing (this process's
    ``rollout_proxy``)."""
    import numpy as np

    from rollout_proxy.core.streaming import TurnDelta, TurnStarted
    from rollout_proxy.proxy.chat_stream import ChatChunks
    from rollout_proxy.proxy.messages_stream import MessageEvents
    from rollout_proxy.proxy.responses_stream import ResponseEvents
    from rollout_proxy.proxy.sse import encode
    from rollout_proxy.records import GenerationConfig, SessionRecord
    from rollout_proxy.tokenization.parsers import OutputParser
    from rollout_proxy.tokenization.parsers.incremental import IncrementalParser

    started = TurnStarted("resp_bench", "bench-model", np.arange(8, dtype=np.int32), time.time(), {})
    session = SessionRecord("sess_bench", [], None, {}, GenerationConfig(), {}, time.time(), time.time() + 60)
    framing: Any = {
        "chat": lambda: ChatChunks(started, model=None, usage=False, logprobs=False),
        "responses": lambda: ResponseEvents(started, session=session, tools=None, model=None),
        "messages": lambda: MessageEvents(started, model=None, key=b"bench"),
    }[api]()
    parser = IncrementalParser(OutputParser.named("hermes", "think"))
    ids, logprobs = np.ones(1, dtype=np.int32), np.zeros(1, dtype=np.float32)
    encode(framing.start(started))
    begin = time.perf_counter()
    for text in [OUTPUTS[output], *[PIECE] * (tokens - 1)]:
        encode(framing.frames(TurnDelta(ids, logprobs, parser.feed(text))))
    return time.perf_counter() - begin


def _worker(sizes: Sequence[int], repeats: int) -> dict[str, float]:
    """µs per token, the best of ``repeats``, for each output × API × size: ``"output|api|size"``."""
    cells: dict[str, float] = {}
    for output in OUTPUTS:
        for api in APIS:
            for size in sizes:
                best = min(measure(output, api, size) for _ in range(repeats))
                cells[f"{output}|{api}|{size}"] = best / size * 1e6
    return cells


def _run_tree(env: dict[str, str], sizes: Sequence[int], repeats: int) -> dict[str, float]:
    command = [sys.executable, "-m", "bench.long_output", "--worker", "--sizes", ",".join(map(str, sizes))]
    command += ["--repeats", str(repeats)]
    done = subprocess.run(command, env=env, cwd=ROOT, capture_output=True, text=True, timeout=3600)
    if done.returncode != 0:
        raise SystemExit(f"bench.long_output: a worker failed:\n{done.stderr[-3000:]}")
    cells: dict[str, float] = json.loads(done.stdout.splitlines()[-1])
    return cells


def run(sizes: Sequence[int], rounds: int, repeats: int, baseline: Path | None) -> dict[str, Any]:
    trees: dict[str, tuple[str, dict[str, str]]] = {"this tree": (revision(ROOT), child_env())}
    if baseline is not None:
        trees["baseline"] = (revision(baseline), baseline_env(baseline))
    measured: dict[str, list[dict[str, float]]] = {name: [] for name in trees}
    for round_index in range(rounds):
        for name in rotated(list(trees), round_index):
            measured[name].append(_run_tree(trees[name][1], sizes, repeats))
    rows = []
    for output in OUTPUTS:
        for api in APIS:
            for name, (rev, _env) in trees.items():
                per_size = {  # keyed by the size as text, as the JSON keeps it
                    str(size): statistics.median(cells[f"{output}|{api}|{size}"] for cells in measured[name])
                    for size in sizes
                }
                rows.append({"output": output, "api": api, "tree": name, "revision": rev, "us_per_token": per_size})
    return {"sizes": list(sizes), "rounds": rounds, "repeats": repeats, "piece": PIECE, "rows": rows}


def table(report: dict[str, Any]) -> str:
    sizes = report["sizes"]
    header = ["output", "API", "tree", *[f"µs / token at {size:,}" for size in sizes], f"{sizes[-1]:,} / {sizes[0]:,}"]
    body = []
    for row in report["rows"]:
        cells = [row["us_per_token"][str(size)] for size in sizes]
        body.append(
            [
                row["output"],
                row["api"],
                f"{row['tree']} ({row['revision']})",
                *[f"{cell:.2f}" for cell in cells],
                f"{cells[-1] / cells[0]:.2f}×",
            ]
        )
    return markdown_table(header, body)


def _sizes(value: str) -> list[int]:
    try:
        sizes = [int(part) for part in value.split(",") if part]
    except ValueError:
        raise argparse.ArgumentTypeError("comma-separated token counts, e.g. 1000,8000,32000") from None
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError("comma-separated token counts of at least 1")
    return sizes


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.long_output", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--sizes", type=_sizes, default=[1000, 8000, 32000], help="output tokens (default 1000,8000,32000)"
    )
    parser.add_argument("--rounds", type=int, default=3, help="rounds, each tree once a round (default 3)")
    parser.add_argument("--repeats", type=int, default=3, help="runs per cell in a process, the best kept (default 3)")
    parser.add_argument("--baseline", type=Path, help="another checkout, measured the same way in the same rounds")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(_worker(args.sizes, args.repeats)))
        return 0
    report = run(args.sizes, args.rounds, args.repeats, args.baseline)
    path = write_report(args.out / "long_output.json", report, "bench.long_output", argv)
    print(table(json.loads(path.read_text())))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
