"""Routing capture at scale: a 100-turn, 64k-token trajectory of a 48-layer, top-8 MoE.

Goals (issue #5): the trajectory's routing is assembled in under 100 ms; stored
routing bytes are within 5% of T x 48 x 8; the per-turn cost of turn 100 is within
1.5x that of turn 2. Per-turn cost is what the proxy does with a turn's routing:
decode the engine's base64 .npy, check and place the rows, pack them for the store
(the parent path is read without routing rows, so this does not grow with depth).

    python bench/routing_bench.py [--turns 100] [--tokens 65536] [--repeat 5]
"""

from __future__ import annotations

import argparse
import base64
import io
import statistics
import sys
import time
from dataclasses import dataclass

import numpy as np

from rollout_proxy.records import NodeKind, ResponseNode
from rollout_proxy.routing import (
    RoutingRows,
    align_turn,
    assemble_routing,
    decode_engine_routing,
    first_row_position,
    prompt_start,
    routing_json,
)
from rollout_proxy.state.codec import decode_node, encode_node

LAYERS, TOP_K, EXPERTS = 48, 8, 128


@dataclass
class Turn:
    node: ResponseNode
    seconds: float


def engine_payload(rng: np.random.Generator, rows: int) -> str:
    """What vLLM sends: base64 of a uint8 .npy (128 experts fit a byte)."""
    array = rng.integers(0, EXPERTS, size=(rows, LAYERS, TOP_K), dtype=np.uint8)
    buffer = io.BytesIO()
    np.save(buffer, array, allow_pickle=False)
    return base64.b64encode(buffer.getvalue()).decode()


def run(turns: int, tokens: int, seed: int = 0) -> tuple[list[Turn], int]:
    rng = np.random.default_rng(seed)
    per_turn = tokens // turns
    output_len = per_turn // 2
    path: list[ResponseNode] = []
    results = []
    total = 0
    for index in range(turns):
        delta = per_turn - output_len
        prompt_len = total + delta
        start = prompt_start(path)
        payload = engine_payload(rng, prompt_len - start + output_len - 1)
        began = time.perf_counter()
        rows, valid = decode_engine_routing(payload)
        first = first_row_position(
            prompt_len=prompt_len, output_len=output_len, requested_start=start, n_rows=len(rows)
        )
        routing, _ = align_turn(path, first=first, rows=rows, valid=valid)
        node = ResponseNode(
            id=f"resp_{index:032x}",
            parent_id=path[-1].id if path else None,
            kind=NodeKind.GENERATED,
            api="chat",
            messages=[],
            n_input_messages=0,
            prompt_ids=np.zeros(delta, dtype=np.int32),
            output_ids=np.zeros(output_len, dtype=np.int32),
            output_logprobs=np.zeros(output_len, dtype=np.float32),
        ).with_routing(routing)
        blob, routing_blob = encode_node(node)
        seconds = time.perf_counter() - began
        # what the next turn reads back: the node without its rows
        path.append(decode_node(blob))
        path[-1].routing = RoutingRows.from_bytes(path[-1].routing_span, routing_blob)
        results.append(Turn(node=path[-1], seconds=seconds))
        total = prompt_len + output_len
    return results, total


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--turns", type=int, default=100)
    parser.add_argument("--tokens", type=int, default=65536)
    parser.add_argument("--repeat", type=int, default=5, help="runs to take medians over")
    args = parser.parse_args(argv)

    per_turn_costs: list[list[float]] = []
    assembly_ms = []
    for repeat in range(args.repeat):
        results, total = run(args.turns, args.tokens, seed=repeat)
        per_turn_costs.append([turn.seconds for turn in results])
        path = [turn.node for turn in results]
        began = time.perf_counter()
        routing = assemble_routing(path, total)
        assembly_ms.append((time.perf_counter() - began) * 1000)
    assert routing is not None and routing.shape == (total, LAYERS, TOP_K)
    assert (routing[-1] == -1).all() and (routing[:-1] >= 0).all()
    stored = sum(turn.node.routing.nbytes for turn in results)
    ideal = total * LAYERS * TOP_K
    turn2 = statistics.median(costs[1] for costs in per_turn_costs)
    turn_last = statistics.median(costs[-1] for costs in per_turn_costs)
    assembly = statistics.median(assembly_ms)

    checks = [
        (f"assembly of {total} x {LAYERS} x {TOP_K}", f"{assembly:.1f} ms", assembly < 100),
        ("stored routing bytes / (T x 48 x 8)", f"{stored / ideal:.4f}", abs(stored / ideal - 1) <= 0.05),
        (
            f"per-turn cost turn {args.turns} / turn 2",
            f"{turn_last * 1000:.2f} / {turn2 * 1000:.2f} ms = {turn_last / turn2:.2f}x",
            turn_last <= 1.5 * turn2,
        ),
    ]
    width = max(len(name) for name, _, _ in checks)
    for name, value, ok in checks:
        print(f"{name:<{width}}  {value:<32} {'ok' if ok else 'MISSED'}")
    began = time.perf_counter()
    field = routing_json(routing)
    encoded_ms = (time.perf_counter() - began) * 1000
    print(f"{'(info) base64 trajectory field':<{width}}  {encoded_ms:.1f} ms for {len(field['data']) / 2**20:.0f} MiB")
    return 0 if all(ok for _, _, ok in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
