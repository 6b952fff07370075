"""What the session listing costs: the index writes at create and finish, and a listing page.

Against a private redis-server (started here) and the memory store, side by side:
  create      median ms of ``create_session`` (Redis: the record and its index entry, pipelined)
  set only    median ms of the bare record write it replaced (one SET), for comparison
  finish      median ms of ``finish_session`` on a session with ``--nodes`` nodes (Redis: the
              compare-and-set, then the tree read and the summary write)
  bare finish the same without the summary (Redis: the compare-and-set alone), for comparison
  page        median ms of a 50-session listing page, no filter, over ``--sessions`` live sessions
  rare page   median ms of a listing whose filter matches nothing (the scan stops at SCAN_LIMIT)

    python bench/viewer_index.py --sessions 20000 --nodes 6
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


async def timed(call, repeat: int) -> float:
    samples = []
    for _ in range(repeat):
        started = time.perf_counter()
        await call()
        samples.append((time.perf_counter() - started) * 1000)
    return statistics.median(samples)


async def nothing(*args: object) -> None:
    return None


async def measure(store, name: str, sessions: int, nodes: int) -> dict[str, float | str]:
    import orjson

    from rollout_proxy.state import keys, listing
    from tests.state.test_store_contract import node, put, session_record

    records = [
        dataclasses.replace(session_record(3600), context={"model_customization_job_id": "job"})
        for _ in range(sessions)
    ]
    for record in records:
        await store.create_session(record)
    result: dict[str, float | str] = {"store": name}
    extra = iter([session_record(3600) for _ in range(200)])
    result["create"] = await timed(lambda: store.create_session(next(extra)), 200)
    if name == "redis":
        client = store._redis
        bare = iter([session_record(3600) for _ in range(200)])

        async def set_only() -> None:
            record = next(bare)
            await client.set(
                keys.session_key(record.id), orjson.dumps(record.to_dict()), pxat=int(record.expires_at * 1000)
            )

        result["set only"] = await timed(set_only, 200)
    trees = []
    for record in records[:100]:
        parent = None
        for seed in range(nodes):
            item = node(record.id, parent, n_tokens=200, seed=seed)
            await put(store, record.id, item)
            parent = item.id
        trees.append(record.id)
    pending = iter(trees)
    finish = {"status": "success", "responses": []}
    result["finish"] = await timed(lambda: store.finish_session(next(pending), finish), 50)
    if name == "redis":
        summarize, store._index_finished = store._index_finished, nothing
        result["bare finish"] = await timed(lambda: store.finish_session(next(pending), finish), 50)
        store._index_finished = summarize
    result["page"] = await timed(lambda: store.list_sessions(listing.everything, limit=50), 50)
    result["rare page"] = await timed(lambda: store.list_sessions(lambda summary: False, limit=50), 10)
    return result


async def main(sessions: int, nodes: int) -> None:
    from rollout_proxy.state.memory import MemoryStore
    from rollout_proxy.state.redis import RedisStore

    binary = shutil.which("redis-server")
    if binary is None:
        raise SystemExit("redis-server is not installed")
    port, workdir = free_port(), tempfile.mkdtemp(prefix="rp-bench-")
    server = subprocess.Popen(  # noqa: ASYNC220 (started once, before anything is measured)
        [binary, "--port", str(port), "--save", "", "--appendonly", "no", "--dir", workdir],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        redis_store = await RedisStore.connect(f"redis://127.0.0.1:{port}/0")
        memory_store = MemoryStore()
        rows = [
            await measure(memory_store, "memory", sessions, nodes),
            await measure(redis_store, "redis", sessions, nodes),
        ]
        await redis_store.close()
        await memory_store.close()
    finally:
        server.terminate()
        server.wait(timeout=10)
        shutil.rmtree(workdir, ignore_errors=True)
    columns = ["store", "create", "set only", "finish", "bare finish", "page", "rare page"]
    print(f"{sessions} live sessions, {nodes} nodes per finished tree; median ms")
    print("| " + " | ".join(columns) + " |")
    print("|" + "---|" * len(columns))
    for row in rows:
        cells = [row.get(column, "") for column in columns]
        print("| " + " | ".join(f"{cell:.3f}" if isinstance(cell, float) else str(cell) for cell in cells) + " |")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sessions", type=int, default=20_000)
    parser.add_argument("--nodes", type=int, default=6)
    args = parser.parse_args()
    asyncio.run(main(args.sessions, args.nodes))
