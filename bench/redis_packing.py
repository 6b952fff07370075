"""What packing a turn's Redis commands costs: redis-py's asyncio packer against hiredis's, side by side.

    python bench/redis_packing.py [--sessions 40] [--rounds 7]

redis-py's asyncio connections pack every command in Python (``pack_command``: a bytes join per
argument); its synchronous client uses ``hiredis.pack_command`` when hiredis is installed, and the
store now does too (``state.connection.HiredisPacking``). This records the commands the real store
sends for ``storage_footprint``'s tool-agent workload (``create_session``, eight ``put_node`` turns
of 100-300-token tool results and outputs, a ``get_path`` per session) into a private redis-server,
then packs the same recorded commands with both packers, alternating round by round, and checks
that they give the same bytes. A benchmark, not a test.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT))  # load_tests: the redis-server helper; bench: the workload

from redis.asyncio.connection import Connection  # noqa: E402

from bench.storage_footprint import Workload, plan  # noqa: E402
from bench.storage_footprint import parse_args as workload_args  # noqa: E402
from rollout_proxy.state.connection import packed_by_hiredis  # noqa: E402
from rollout_proxy.state.redis import RedisStore  # noqa: E402


async def record_commands(url: str, n_sessions: int) -> tuple[list[tuple[Any, ...]], str]:
    """The argument tuples the store packs for the workload (its scripts included), and the SHA of
    its ``put_node`` script."""
    args = workload_args([])
    sessions = plan(args)[:n_sessions]
    store = await RedisStore.connect(url)
    recorded: list[tuple[Any, ...]] = []
    connection_class = store._redis.connection_pool.connection_class
    packs = connection_class.pack_command

    def recording(self: Connection, *command: Any) -> list[bytes]:
        recorded.append(command)
        return packs(self, *command)

    connection_class.pack_command = recording
    try:
        await store._redis.flushdb()
        workload = Workload(args)
        conversations = [workload.session(turns) for turns in sessions]
        for conversation in conversations:
            await store.create_session(conversation.record)
        for k in range(args.turns):
            for conversation in conversations:
                node, paths, partial = workload.turn(conversation, k)
                await store.put_node(conversation.record.id, node, paths=paths, partial_paths=partial, latest="chat")
        for conversation in conversations:
            assert conversation.parent_id is not None
            await store.get_path(conversation.record.id, conversation.parent_id)
    finally:
        connection_class.pack_command = packs
        await store.close()
    return recorded, store._put_node.sha


def per_command_us(connection: Connection, commands: list[tuple[Any, ...]]) -> float:
    started = time.perf_counter()
    for command in commands:
        connection.pack_command(*command)
    return (time.perf_counter() - started) / len(commands) * 1e6


def main(argv: list[str] | None = None) -> None:
    from load_tests.run import Services, start_redis

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sessions", type=int, default=40, help="sessions of the workload (default 40)")
    parser.add_argument("--rounds", type=int, default=7, help="rounds, the packers alternating (default 7)")
    options = parser.parse_args(argv)
    if not shutil.which("redis-server"):
        raise SystemExit("redis-server is not installed (apt-get install redis-server)")
    services = Services(Path(tempfile.mkdtemp(prefix="rp-bench-packing-")))
    try:
        commands, put_node_sha = asyncio.run(record_commands(start_redis(services), options.sessions))
    finally:
        services.stop()
        shutil.rmtree(services.workdir, ignore_errors=True)
    puts = [command for command in commands if command[:2] == ("EVALSHA", put_node_sha)]
    packers = {"redis-py (Python)": Connection(), "hiredis": packed_by_hiredis(Connection)()}
    python, hiredis = packers.values()
    differing = sum(b"".join(python.pack_command(*c)) != b"".join(hiredis.pack_command(*c)) for c in commands)
    times: dict[tuple[str, str], list[float]] = {}
    for _ in range(options.rounds):
        for name, connection in packers.items():
            times.setdefault((name, "all"), []).append(per_command_us(connection, commands))
            times.setdefault((name, "put"), []).append(per_command_us(connection, puts))
    print(f"{len(commands)} commands recorded ({len(puts)} put_node script calls), {differing} packed differently\n")
    print("| packer | µs per command, median of rounds | µs per put_node call | by round (put_node) |")
    print("|---|---|---|---|")
    for name in packers:
        rounds = ", ".join(f"{value:.1f}" for value in times[(name, "put")])
        print(
            f"| {name} | {statistics.median(times[(name, 'all')]):.1f} | "
            f"{statistics.median(times[(name, 'put')]):.1f} | {rounds} |"
        )


if __name__ == "__main__":
    main()
