"""The proxy's CPU and latency per turn with images, side by side with the same turns as text only.

    python -m bench.images [--turns 12] [--sessions 8] [--rounds 5] [--every 4]
                           [--apis chat,responses,messages] [--stores memory,redis] [--out out/bench]

One engine double (``load_tests.engine``, fixed 16-token reply) serving the tiny Idefics3 model's files
(``devtools.build_checkpoints.write_vlm_files``: its tokenizer, template and processor config, no weights),
and in front of it one ``rollout-proxy serve`` per store (memory, and Redis where ``redis-server`` is
installed). Each session is a short conversation resent whole every turn, as the SDKs send it: in the
``image`` variant its first user message carries a ~50 KB PNG (128x128 noise, so PNG cannot shrink it; a
new one per session and turn) and every ``--every`` turns the next user message carries a new one; the
``text`` variant sends the same turns with the same text and no image. Chat Completions (``image_url``), the
Responses API (``input_image``, the output items echoed back) and the Messages API (``image`` blocks with a
base64 source), none streamed.

Text turns go to the engine's ``/v1/completions`` with token ids; image turns to ``/inference/v1/generate``
with the expanded prompt collapsed and every image of the prompt as a data URL (vLLM's
``--enable-scale-out``), so each image turn sends the engine all its images again. ``--sessions`` sessions
take turn k together (lock step); each turn's CPU is the proxy process's (``bench.harness.cpu_seconds``)
per session, the median over ``--rounds`` rounds; each round runs every (store, API, variant) once, in an
order rotated round by round (``bench.harness.rotated``). Reported per store and API, text against image:
the mean CPU per turn over every turn, over the turns that add an image (turn 1 and every ``--every``-th)
and over those that only resend; the p50 turn latency (p99 in the JSON); and the engine double's CPU per turn
(it decodes every image of an image turn again, as vLLM does: its share of the latency, not the proxy's). Writes ``images.json`` under ``--out``.
A benchmark, not a test.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import orjson
from PIL import Image

from bench.harness import (
    OUT,
    ROOT,
    Services,
    comma_choices,
    cpu_seconds,
    free_port,
    markdown_table,
    percentile,
    revision,
    rotated,
    start_engine,
    start_redis,
    write_report,
)

ADMIN_KEY = "bench-admin-key"
APIS = ("chat", "responses", "messages")
STORES = ("memory", "redis")
VARIANTS = ("text", "image")
MAX_TOKENS = 16
SIDE = 128  # pixels: 128x128 RGB noise is a ~49 KB PNG, the tiny model's one 128 px tile


def noise_png(seed: int) -> bytes:
    """A PNG of ~50 KB that is different for every seed (noise: PNG's filters cannot shrink it)."""
    pixels = np.random.default_rng(seed).integers(0, 256, size=(SIDE, SIDE, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels, "RGB").save(out, "PNG")
    return out.getvalue()


def adds_image(k: int, every: int) -> bool:
    """Whether turn ``k`` (from 0) adds an image in the image variant: the first, then every ``every``-th."""
    return k % every == 0


def user_text(index: int, k: int) -> str:
    return f"[session {index}] Turn {k}: what changed in the picture?" if k else f"[session {index}] Describe it."


class Conversation:
    """One session's conversation in one API's shape; ``image``: its user turns carry a new PNG every
    ``every`` turns (the same turns as text alone otherwise)."""

    def __init__(self, api: str, index: int, token: str, base: str, image: bool, every: int, seed: int) -> None:
        self.api, self.index, self.token, self.base = api, index, token, base
        self.image, self.every, self.seed = image, every, seed
        self.history: list[dict[str, Any]] = []
        self.images = 0  # images the conversation holds
        self.sent = 0  # bytes of the last request

    def user(self, k: int) -> dict[str, Any]:
        text = user_text(self.index, k)
        if not (self.image and adds_image(k, self.every)):
            if self.api == "responses":
                return {"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}
            return {"role": "user", "content": text}
        self.images += 1
        data = base64.b64encode(noise_png(self.seed * 1000 + k)).decode()
        if self.api == "responses":
            picture: dict[str, Any] = {"type": "input_image", "image_url": f"data:image/png;base64,{data}"}
            return {"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}, picture]}
        if self.api == "messages":
            source = {"type": "base64", "media_type": "image/png", "data": data}
            return {"role": "user", "content": [{"type": "text", "text": text}, {"type": "image", "source": source}]}
        picture = {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{data}"}}
        return {"role": "user", "content": [{"type": "text", "text": text}, picture]}

    def request(self, k: int) -> tuple[str, bytes]:
        """Turn ``k``'s URL and body: the history so far and the next user message (built here, once)."""
        self.history.append(self.user(k))
        if self.api == "responses":
            url, body = "/v1/responses", {"model": "policy", "input": self.history, "store": False}
        elif self.api == "messages":
            url, body = "/v1/messages", {"model": "policy", "max_tokens": MAX_TOKENS, "messages": self.history}
        else:
            url, body = "/v1/chat/completions", {"model": "policy", "messages": self.history}
        raw = orjson.dumps(body)
        self.sent = len(raw)
        return self.base + url, raw

    def answered(self, answer: dict[str, Any]) -> None:
        """The answer echoed back as its client would."""
        if self.api == "responses":
            self.history += answer["output"]
        elif self.api == "messages":
            self.history.append({"role": "assistant", "content": answer["content"]})
        else:
            self.history.append({"role": "assistant", "content": answer["choices"][0]["message"]["content"]})


async def turn(http: aiohttp.ClientSession, conversation: Conversation, url: str, body: bytes) -> float:
    headers = {"Authorization": f"Bearer {conversation.token}", "Content-Type": "application/json"}
    started = time.perf_counter()
    async with http.post(url, data=body, headers=headers) as response:
        raw = await response.read()
    elapsed = time.perf_counter() - started
    if response.status != 200:
        raise SystemExit(f"{conversation.api} turn (image={conversation.image}): {response.status} {raw[:300]!r}")
    conversation.answered(orjson.loads(raw))
    return elapsed


async def lockstep(
    http: aiohttp.ClientSession,
    base: str,
    pids: tuple[int, int],
    api: str,
    image: bool,
    args: argparse.Namespace,
    seed: int,
) -> dict[str, Any]:
    """Every session takes turn k together: the CPU seconds per session for each turn of the proxy and of the
    engine double (``pids``), every turn's latencies, the images the conversations end with and the last
    request's bytes."""
    conversations = []
    for index in range(args.sessions):
        body = {"generation": {"max_new_tokens": MAX_TOKENS}}
        async with http.post(f"{base}/v1/sessions", json=body, headers={"Authorization": f"Bearer {ADMIN_KEY}"}) as r:
            created = await r.json()
        conversations.append(
            Conversation(api, index, created["api_key"], base, image, args.every, seed * 100_000 + index)
        )
    pid, engine_pid = pids
    cpu: list[float] = []
    engine_cpu = 0.0
    latencies: list[float] = []
    for k in range(args.turns):
        bodies = [conversation.request(k) for conversation in conversations]  # the client's work, not timed
        before, engine_before = cpu_seconds(pid), cpu_seconds(engine_pid)
        latencies += await asyncio.gather(
            *(turn(http, conversation, *body) for conversation, body in zip(conversations, bodies, strict=True))
        )
        cpu.append((cpu_seconds(pid) - before) / args.sessions)
        engine_cpu += cpu_seconds(engine_pid) - engine_before
    return {
        "cpu": cpu,
        "engine_cpu": engine_cpu / (args.sessions * args.turns),
        "latencies": latencies,
        "images": conversations[0].images,
        "last_request_bytes": conversations[0].sent,
    }


def vlm_files(workdir: Path) -> Path:
    """The tiny Idefics3 model's files (no weights: the engine double needs none)."""
    from devtools.build_checkpoints import write_vlm_files
    from devtools.engine_env import ensure_checkpoints

    out = workdir / "vlm"
    out.mkdir()
    write_vlm_files(ensure_checkpoints()["dense"], out)
    return out


def start_proxy(services: Services, store: str, engine_url: str, model: Path) -> tuple[int, str]:
    port = free_port()
    argv = [sys.executable, "-m", "rollout_proxy", "serve", "--port", str(port), "--engine", engine_url]
    argv += ["--store", store, "--tokenizer", str(model), "--admin-key", ADMIN_KEY, "--log-level", "warning"]
    argv += ["--log-format", "json", "--session-ttl", "3600"]
    name = f"proxy-{'redis' if store.startswith('redis') else store}"
    proxy = services.start(name, argv)
    base = f"http://127.0.0.1:{port}"
    services.wait_http(name, f"{base}/readyz")
    return proxy.pid, base


def summary(rounds: list[dict[str, Any]], every: int) -> dict[str, Any]:
    """Each turn's CPU the median over the rounds; its means over every turn, the turns that add an image
    and those that do not (ms); the latency percentiles over every turn of every round."""
    cpu = [statistics.median(values) for values in zip(*(run["cpu"] for run in rounds), strict=True)]
    adding = [value for k, value in enumerate(cpu) if adds_image(k, every)]
    resending = [value for k, value in enumerate(cpu) if not adds_image(k, every)]
    latencies = [latency for run in rounds for latency in run["latencies"]]
    return {
        "cpu_per_turn": cpu,
        "cpu_ms": statistics.fmean(cpu) * 1e3,
        "cpu_adding_ms": statistics.fmean(adding) * 1e3,
        "cpu_resending_ms": statistics.fmean(resending) * 1e3 if resending else None,
        "engine_cpu_ms": statistics.fmean(run["engine_cpu"] for run in rounds) * 1e3,
        "p50_ms": percentile(latencies, 50) * 1e3,
        "p99_ms": percentile(latencies, 99) * 1e3,
        "images": rounds[0]["images"],
        "last_request_kb": rounds[0]["last_request_bytes"] / 1024,
    }


async def run(args: argparse.Namespace) -> dict[str, Any]:
    services = Services(Path(tempfile.mkdtemp(prefix="rp-bench-images-", dir=args.out)))
    targets = [(store, api, variant) for store in args.stores for api in args.apis for variant in VARIANTS]
    measured: dict[tuple[str, str, str], list[dict[str, Any]]] = {target: [] for target in targets}
    try:
        model = vlm_files(services.workdir)
        engine, engine_url = start_engine(
            services, policy="fixed", extra=["--tokenizer", str(model), "--model", "fake-idefics3"]
        )
        urls = {"memory": "memory"} | ({"redis": start_redis(services)} if "redis" in args.stores else {})
        started = {store: start_proxy(services, urls[store], engine_url, model) for store in args.stores}
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as http:
            warm = argparse.Namespace(**{**vars(args), "sessions": 2, "turns": 3})
            for pid, base in started.values():  # tokenizer, template and rule loaded, connections open
                for api in args.apis:
                    for image in (False, True):
                        await lockstep(http, base, (pid, engine.pid), api, image, warm, seed=999)
            seed = 0
            for round_index in range(args.rounds):
                for store, api, variant in rotated(targets, round_index):
                    pid, base = started[store]
                    seed += 1
                    result = await lockstep(http, base, (pid, engine.pid), api, variant == "image", args, seed)
                    measured[(store, api, variant)].append(result)
                    print(f"  round {round_index + 1}/{args.rounds}: {store} {api} {variant} done", flush=True)
    finally:
        services.stop()
        shutil.rmtree(services.workdir, ignore_errors=True)
    settings = {key: value for key, value in vars(args).items() if key != "out"}
    runs = [
        {"store": store, "api": api, "variant": variant, **summary(rounds, args.every)}
        for (store, api, variant), rounds in measured.items()
    ]
    return {"settings": settings, "revision": revision(ROOT), "png_bytes": len(noise_png(0)), "runs": runs}


def table(report: dict[str, Any]) -> str:
    settings = report["settings"]
    runs = {(run["store"], run["api"], run["variant"]): run for run in report["runs"]}
    header = ["store", "API", "CPU / turn: text", "image", "image − text", "turns with a new image: text", "image"]
    header += ["resending only: text", "image", "p50: text", "image", "engine double CPU / turn: text", "image"]
    header += ["last request: image"]
    rows = []
    for store in settings["stores"]:
        for api in settings["apis"]:
            text, image = runs[(store, api, "text")], runs[(store, api, "image")]
            resend = (
                [f"{text['cpu_resending_ms']:.2f} ms", f"{image['cpu_resending_ms']:.2f} ms"]
                if text["cpu_resending_ms"] is not None
                else ["-", "-"]
            )
            rows.append(
                [
                    store,
                    api,
                    f"{text['cpu_ms']:.2f} ms",
                    f"{image['cpu_ms']:.2f} ms",
                    f"{image['cpu_ms'] - text['cpu_ms']:+.2f} ms",
                    f"{text['cpu_adding_ms']:.2f} ms",
                    f"{image['cpu_adding_ms']:.2f} ms",
                    *resend,
                    f"{text['p50_ms']:.1f} ms",
                    f"{image['p50_ms']:.1f} ms",
                    f"{text['engine_cpu_ms']:.2f} ms",
                    f"{image['engine_cpu_ms']:.2f} ms",
                    f"{image['images']} images, {image['last_request_kb']:.0f} KB",
                ]
            )
    what = (
        f"{settings['sessions']} sessions in lock step × {settings['turns']} turns, {settings['rounds']} rounds; "
        f"image variant: a new {report['png_bytes'] / 1024:.0f} KB PNG at turn 1 and every {settings['every']} "
        f"turns after (revision {report['revision']})"
    )
    return what + "\n\n" + markdown_table(header, rows)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--turns", type=int, default=12, help="turns per conversation (default 12)")
    parser.add_argument("--sessions", type=int, default=8, help="sessions in lock step (default 8)")
    parser.add_argument("--rounds", type=int, default=5, help="rounds, each target once, rotated (default 5)")
    parser.add_argument("--every", type=int, default=4, help="a new image every N turns (default 4)")
    parser.add_argument("--apis", type=comma_choices(APIS), default=list(APIS), help="default chat,responses,messages")
    parser.add_argument(
        "--stores", type=comma_choices(STORES), default=None, help="default memory,redis (redis if installed)"
    )
    parser.add_argument("--out", type=Path, default=OUT, help="where the JSON goes (default out/bench)")
    args = parser.parse_args(argv)
    if args.turns < 1 or args.sessions < 1 or args.rounds < 1 or args.every < 1:
        parser.error("--turns, --sessions, --rounds and --every: at least 1")
    if args.stores is None:
        args.stores = ["memory", *(["redis"] if shutil.which("redis-server") else [])]
    elif "redis" in args.stores and not shutil.which("redis-server"):
        parser.error("--stores redis needs redis-server")
    args.out.mkdir(parents=True, exist_ok=True)
    report = asyncio.run(run(args))
    write_report(args.out / "images.json", report, "bench.images", argv)
    print(table(report))
    print(f"wrote {args.out / 'images.json'}")


if __name__ == "__main__":
    main()
