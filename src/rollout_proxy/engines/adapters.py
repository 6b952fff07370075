"""A LoRA adapter's directory, checked before any engine is asked to load it, and the zero adapter.

An adapter is what peft's ``save_pretrained`` writes and vLLM loads: ``adapter_config.json`` and
``adapter_model.safetensors`` (or ``.bin``). ``read_adapter`` refuses, in words, what vLLM 0.32 would
refuse or cannot find (a missing directory or file, a config that is not LoRA, DoRA, biases,
``modules_to_save`` other than a classifier head), so a bad publish changes nothing on any engine.

The zero adapter (``write_zero_adapter``) serves the base policy on an engine that serves adapters too.
On the CPU, vLLM 0.32 applies the adapter in the last LoRA slot to a request naming the base model when
the two are batched together (its torch LoRA ops read index -1 as the last slot; vllm PRs #48421 and
#49656): wrong logprobs, and no error. A request naming an adapter whose weights are all zero is exactly
the base model (measured: 1.3e-5 from the base run alone), so once an engine serves adapters, base calls
name this one. It is one LoRA pair of a published adapter (same shapes, any dtype) with every byte of its
data zero: +0.0 in every float format.

The files are read and written in a worker thread (``asyncio.to_thread``): never on the event loop.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rollout_proxy.errors import AdapterRefused

CONFIG_FILE = "adapter_config.json"
SAFETENSORS_FILE = "adapter_model.safetensors"
WEIGHT_FILES = (SAFETENSORS_FILE, "adapter_model.bin")
#: ``modules_to_save`` vLLM 0.32 accepts (a classification head); anything else is refused at load
ALLOWED_MODULES_TO_SAVE = frozenset({"classifier", "score"})
#: ``init_lora_weights`` strings vLLM 0.32 serves (the others change the base weights at load)
SUPPORTED_STRING_INITS = frozenset({"gaussian", "eva", "orthogonal", "mica", "lora_ga"})
#: a safetensors header larger than this is not an adapter's (its tensor index is a few hundred KB at most)
MAX_HEADER_BYTES = 64 * 1024 * 1024
#: the zero adapter's directory, beside the adapter it was made from (the engines must see it too)
ZERO_PREFIX = ".rollout-proxy-zero-"


@dataclass(frozen=True, slots=True)
class AdapterFiles:
    """An adapter directory that passed the checks: where it is and what vLLM will check against it."""

    path: str
    rank: int
    target_modules: tuple[str, ...]
    weights: str  # the weights file's name
    config: dict[str, Any]


def _refused(path: str, why: str) -> AdapterRefused:
    return AdapterRefused(f"{path} is not a LoRA adapter vLLM can serve: {why}", param="path")


def read_adapter(path: str) -> AdapterFiles:
    """The adapter at ``path`` (an absolute directory, as the engines will read it), or ``AdapterRefused``."""
    if not os.path.isabs(path):
        raise AdapterRefused(
            f"the adapter's path must be absolute (the engines resolve it on their own hosts): {path!r}", param="path"
        )
    directory = Path(path)
    if not directory.is_dir():
        raise _refused(path, "no such directory")
    try:
        raw = (directory / CONFIG_FILE).read_text()
    except FileNotFoundError:
        raise _refused(path, f"it has no {CONFIG_FILE} (write it with peft's save_pretrained)") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise _refused(path, f"its {CONFIG_FILE} cannot be read ({exc})") from None
    try:
        config = json.loads(raw)
    except ValueError:
        raise _refused(path, f"its {CONFIG_FILE} is not JSON") from None
    if not isinstance(config, dict):
        raise _refused(path, f"its {CONFIG_FILE} is not a JSON object")
    weights = next((name for name in WEIGHT_FILES if (directory / name).is_file()), None)
    if weights is None:
        raise _refused(path, f"it has no weights ({' or '.join(WEIGHT_FILES)})")
    _check_config(path, config)
    targets = config.get("target_modules") or ()
    ranks = [config["r"], *(config.get("rank_pattern") or {}).values()]
    return AdapterFiles(
        path=path,
        rank=max(int(rank) for rank in ranks),
        target_modules=(targets,) if isinstance(targets, str) else tuple(str(t) for t in targets),
        weights=weights,
        config=config,
    )


def _check_config(path: str, config: dict[str, Any]) -> None:
    """What vLLM 0.32's ``PEFTHelper`` refuses, said before an engine is asked."""
    peft_type = config.get("peft_type", "LORA")
    if str(peft_type).upper() != "LORA":
        raise _refused(path, f"its peft_type is {peft_type!r}, not LORA")
    pattern = config.get("rank_pattern") or {}
    if not isinstance(pattern, dict):
        raise _refused(path, "its rank_pattern is not a mapping")
    for rank in (config.get("r"), *pattern.values()):
        if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
            raise _refused(path, f"its rank r is {rank!r}, not a positive integer")
    if config.get("use_dora"):
        raise _refused(path, "DoRA (use_dora) is not supported by vLLM")
    if config.get("lora_bias") or config.get("bias", "none") not in ("none", None):
        raise _refused(path, "LoRA biases (bias, lora_bias) are not supported by vLLM")
    init = config.get("init_lora_weights", True)
    if isinstance(init, str) and init.lower() not in SUPPORTED_STRING_INITS:
        raise _refused(
            path,
            f"init_lora_weights={init!r} changes the base weights when peft loads it: convert it to a plain LoRA "
            "adapter (peft's path_initial_model_for_weight_conversion)",
        )
    for key, what in (
        ("alora_invocation_tokens", "Activated LoRA (aLoRA)"),
        ("layer_replication", "layer_replication"),
        ("use_bdlora", "block-diagonal LoRA (BD-LoRA)"),
    ):
        if config.get(key):
            raise _refused(path, f"{what} is not supported by vLLM")
    to_save = config.get("modules_to_save")
    if to_save and not set(to_save) <= ALLOWED_MODULES_TO_SAVE:
        raise _refused(
            path,
            f"vLLM only supports modules_to_save being None or {sorted(ALLOWED_MODULES_TO_SAVE)}, not {to_save}: "
            "train the adapter without a full copy of those modules",
        )


def _header(path: Path) -> dict[str, Any]:
    with path.open("rb") as file:
        size_bytes = file.read(8)
        if len(size_bytes) != 8:
            raise ValueError("shorter than a safetensors header")
        (size,) = struct.unpack("<Q", size_bytes)
        if size > MAX_HEADER_BYTES:
            raise ValueError("its header is too large")
        header = json.loads(file.read(size))
    if not isinstance(header, dict):
        raise ValueError("its header is not a JSON object")
    return header


def _zero_pair(header: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """The smallest A/B pair of the adapter's tensors (a linear layer's, else an embedding's)."""
    pairs: list[tuple[int, list[tuple[str, dict[str, Any]]]]] = []
    for name, entry in header.items():
        for a_key, b_key in ((".lora_A.weight", ".lora_B.weight"), (".lora_embedding_A", ".lora_embedding_B")):
            if name.endswith(a_key):
                partner = name[: -len(a_key)] + b_key
                if partner in header:
                    tensors = [(name, entry), (partner, header[partner])]
                    size = sum(int(e["data_offsets"][1]) - int(e["data_offsets"][0]) for _, e in tensors)
                    pairs.append((size, tensors))
    if not pairs:
        raise ValueError("it holds no lora_A/lora_B pair")
    return min(pairs, key=lambda pair: (pair[0], pair[1][0][0]))[1]


def _module_name(tensor: str) -> str:
    """``...layers.0.self_attn.q_proj.lora_A.weight`` -> ``q_proj``."""
    stem = tensor.split(".lora_")[0]
    return stem.rsplit(".", 1)[-1]


def write_zero_adapter(source: AdapterFiles, root: Path | None = None) -> str:
    """A zero adapter with the shapes of one of ``source``'s LoRA pairs, written once (atomically) under
    ``root`` (default: beside ``source``); its directory. Raises ``AdapterRefused`` when ``source`` has no
    safetensors weights to take the shapes from."""
    if source.weights != SAFETENSORS_FILE:
        raise AdapterRefused(
            f"{source.path}: the zero adapter that keeps base-model calls exact is made from a safetensors "
            f"adapter, and this one has {source.weights}",
            param="path",
        )
    try:
        header = _header(Path(source.path) / SAFETENSORS_FILE)
        tensors = _zero_pair(header)
    except (OSError, ValueError, KeyError, TypeError, IndexError) as exc:
        raise AdapterRefused(f"{source.path}: its {SAFETENSORS_FILE} cannot be read ({exc})", param="path") from None
    rank = int(tensors[0][1]["shape"][0])
    new_header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, entry in tensors:
        size = int(entry["data_offsets"][1]) - int(entry["data_offsets"][0])
        new_header[name] = {"dtype": entry["dtype"], "shape": entry["shape"], "data_offsets": [offset, offset + size]}
        offset += size
    module = _module_name(tensors[0][0])
    config = {
        **{k: v for k, v in source.config.items() if k not in ("rank_pattern", "alpha_pattern")},
        "r": rank,
        "lora_alpha": rank,
        "target_modules": [module],
        "modules_to_save": None,
        "layers_to_transform": None,
        "use_rslora": False,
        "use_dora": False,
    }
    header_bytes = json.dumps(new_header, separators=(",", ":"), sort_keys=True).encode()
    header_bytes += b" " * (-len(header_bytes) % 8)  # safetensors aligns the data to 8 bytes
    config_bytes = json.dumps(config, indent=2, sort_keys=True).encode()
    digest = hashlib.blake2b(header_bytes + config_bytes, digest_size=6).hexdigest()
    parent = Path(root) if root is not None else Path(source.path).parent
    target = parent / f"{ZERO_PREFIX}{digest}"
    if (target / SAFETENSORS_FILE).is_file() and (target / CONFIG_FILE).is_file():
        return str(target)
    parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f"{ZERO_PREFIX}staging-", dir=parent))
    try:
        (staging / CONFIG_FILE).write_bytes(config_bytes)
        with (staging / SAFETENSORS_FILE).open("wb") as file:
            file.write(struct.pack("<Q", len(header_bytes)))
            file.write(header_bytes)
            file.write(bytes(offset))
        staging.chmod(0o755)
        try:
            staging.rename(target)
        except OSError:  # another worker wrote it meanwhile: theirs is the same bytes
            if not (target / SAFETENSORS_FILE).is_file():
                raise
    finally:
        if staging.exists():
            for leftover in staging.iterdir():
                leftover.unlink()
            staging.rmdir()
    return str(target)


#: the ranks vLLM 0.32's ``--max-lora-rank`` takes; an adapter the trainer makes has one of them, and an engine
#: serves it when its ``--max-lora-rank`` is at least that
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
#: the modules vLLM 0.32 takes LoRA weights for in a Llama-style model (its own refusal lists this set)
VLLM_LORA_MODULES = (
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
    "embed_tokens",
    "lm_head",
)
#: what a trained adapter targets by default: every linear layer of the blocks (not the embeddings)
DEFAULT_LORA_MODULES = VLLM_LORA_MODULES[:7]
#: the largest ``lora_alpha`` taken (alpha / rank scales the adapter's update)
MAX_LORA_ALPHA = 4096


def lora_problems(rank: int, alpha: int, modules: tuple[str, ...]) -> list[str]:
    """What vLLM 0.32 could not serve in an adapter of these settings, in words (none: it can)."""
    problems = []
    if rank not in VLLM_LORA_RANKS:
        ranks = ", ".join(map(str, VLLM_LORA_RANKS))
        problems.append(
            f"LoRA rank {rank} is not one vLLM serves: use one of {ranks} (at most the engines' --max-lora-rank)"
        )
    if not 0 < alpha <= MAX_LORA_ALPHA:
        problems.append(f"LoRA alpha must be above 0 and at most {MAX_LORA_ALPHA}, not {alpha}")
    unknown = [module for module in modules if module not in VLLM_LORA_MODULES]
    if unknown or not modules:
        problems.append(
            f"target modules must be some of {', '.join(VLLM_LORA_MODULES)} (vLLM serves LoRA on these), not "
            f"{', '.join(unknown) if unknown else 'none'}"
        )
    elif len(set(modules)) != len(modules):
        problems.append(f"target modules are named twice: {', '.join(modules)}")
    return problems
