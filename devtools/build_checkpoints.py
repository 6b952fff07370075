"""Build the test checkpoints from the SmolLM2-135M-Instruct GGUF (runs in the engine venv).

Standalone on purpose: it needs torch + transformers, which only the engine venv has, so it
must not import rollout_proxy. Outputs:

* dense: SmolLM2-135M-Instruct as a plain HF Llama checkpoint in float32 safetensors.
  transformers dequantizes the GGUF on load but refuses to save a GGUF-quantized model, so
  the state dict is copied into a fresh ``LlamaForCausalLM(config)`` first.
* moe: a sparse upcycle into Mixtral (4 experts, top-2, random router with a fixed seed,
  every expert = the dense MLP). Identical experts + renormalized top-k weights reproduce
  the dense output exactly, so text stays coherent while routing decisions are real.
  It is written with the classic Mixtral key names (``block_sparse_moe.experts.E.w1``),
  which vLLM loads and transformers 5 converts on load.
* perturbed (only with ``--perturbed-out``): the dense checkpoint with seeded Gaussian noise
  on every matrix (``W + NOISE * rms(W) * N(0, 1)``; norms untouched), same config and
  tokenizer: a "new policy" for weight-reload tests. Greedy text stays the dense model's
  while the logprobs of the same tokens move by ~0.2 nats on average. Its parameters and
  the measured shift are written to ``perturbation.json`` in the checkpoint.

* vlm (only with ``--vlm-out``): a tiny Idefics3 (SmolVLM's architecture) vision-language model:
  a random, seeded SigLIP-style vision tower (2 layers, width 64, 128 px images in 16 px patches)
  and pixel-shuffle connector in front of the dense checkpoint's text weights, so greedy text
  stays SmolLM2's. SmolLM2's tokenizer gains Idefics3's image tokens (new embedding rows: the
  mean row plus seeded noise). Image splitting is off and every image is resized to 128x128, so
  each image expands to the same span: ``<fake_token_around_image><global-img>`` +
  ``<image>`` x 16 + ``<fake_token_around_image>`` (19 ids). The chat template is
  ``templates/qwen3_style_vlm.jinja``: one ``<image>`` per image part. Everything but the weights
  is written by ``write_vlm_files`` (no torch: the project venv's tests call it).

* vlm_moe (only with ``--vlm-moe-out``, from the built moe and vlm checkpoints): the vlm's vision tower,
  connector, tokenizer and processor over the moe checkpoint's text weights (the image tokens' embedding
  rows the vlm's), for MoE routing with images. vLLM's Idefics3 hard-codes a Llama text model, so vLLM
  serves it as ``Idefics3MoeForConditionalGeneration`` (``engine_models/rp_idefics3_moe.py``: vLLM's
  Idefics3 over vLLM's Mixtral), registered by ``vllm_server``. Checked tensor by tensor against its
  sources here, and by the real engine in the tests.
Greedy generation of dense and MoE is compared with transformers at the end; a mismatch
fails. The perturbed copy must keep the dense greedy text and shift logprobs within bounds.
Each output is built in a temp dir next to its target and renamed into place.

    python build_checkpoints.py --gguf F.gguf --dense-out DIR --moe-out DIR [--force]
    python build_checkpoints.py --dense-out DIR --perturbed-out DIR [--force]
    python build_checkpoints.py --dense-out DIR --vlm-out DIR [--force]
    python build_checkpoints.py --dense-out DIR --moe-out DIR --vlm-out DIR --vlm-moe-out DIR [--force]
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, cast

NUM_EXPERTS = 4
TOP_K = 2
ROUTER_SEED = 0
CHECK_PROMPT = [{"role": "user", "content": "What is the capital of France?"}]
CHECK_TOKENS = 12
#: Relative noise of the perturbed copy and its seed; 0.02 measured: mean |dlogprob| 0.20,
#: max 1.0 over the check sequence, greedy text unchanged (0.05 gave 0.48, still unchanged).
PERTURB_NOISE = 0.02
PERTURB_SEED = 1234
#: Bounds the perturbed copy must meet (mean |dlogprob| over the check sequence's tokens).
PERTURB_MIN_SHIFT = 0.05
PERTURB_MAX_SHIFT = 1.0


#: The tiny vision-language checkpoint (--vlm-out). Seeded: the same build gives the same weights.
VLM_SEED = 37
VLM_TEMPLATE = Path(__file__).with_name("templates") / "qwen3_style_vlm.jinja"
#: Idefics3's tokens, added to SmolLM2's tokenizer in this order (ids from 49152 on). The processor
#: uses the first four; the row/col tags only when splitting, which this checkpoint turns off.
VLM_ADDED_TOKENS = [
    "<fake_token_around_image>",
    "<image>",
    "<end_of_utterance>",
    "<global-img>",
    *[f"<row_{r}_col_{c}>" for r in range(1, 7) for c in range(1, 7)],
]
#: A SigLIP-style tower small enough to cost nothing on a CPU: 128 px images, 16 px patches
#: (8x8 = 64 patches), pixel shuffle by 2 -> 16 image embeddings (= <image> ids) per image.
VLM_IMAGE_SIZE = 128
VLM_PATCH_SIZE = 16
VLM_VISION: dict[str, Any] = {
    "model_type": "idefics3_vision",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_channels": 3,
    "image_size": VLM_IMAGE_SIZE,
    "patch_size": VLM_PATCH_SIZE,
    "hidden_act": "gelu_pytorch_tanh",
    "layer_norm_eps": 1e-6,
}
VLM_SCALE_FACTOR = 2
VLM_CHECK_TOKENS = 8


def log(msg: str) -> None:
    print(f"[build_checkpoints] {msg}", file=sys.stderr, flush=True)


def _atomic_dir(target: Path):
    """A temp dir beside target; `_commit` renames it over target."""
    target.parent.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))


def _commit(tmp: Path, target: Path) -> None:
    tmp.chmod(0o755)  # mkdtemp makes it 0700; the files inside may be 0600 too
    for f in tmp.iterdir():
        f.chmod(0o644)
    if target.exists():
        shutil.rmtree(target)
    tmp.rename(target)


def _save_tokenizer(tok, out: Path) -> None:
    """Save the tokenizer with the chat template inside tokenizer_config.json.

    transformers 5 writes the template to chat_template.jinja by default; older readers
    and humans look in tokenizer_config.json, so keep a single copy there.
    """
    tok.save_pretrained(out)
    cfg_path = out / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    jinja = out / "chat_template.jinja"
    if jinja.exists():
        cfg["chat_template"] = jinja.read_text()
        jinja.unlink()
    if not cfg.get("chat_template"):
        raise RuntimeError("tokenizer has no chat template")
    # transformers 5 records its generic "TokenizersBackend" class, which transformers 4
    # cannot load; PreTrainedTokenizerFast (just tokenizer.json) loads in both.
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    for junk in ("is_local", "local_files_only", "backend"):
        cfg.pop(junk, None)
    cfg_path.write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n")


def _generation_config(tok) -> dict:
    # Only token ids: vLLM fills unset sampling params from this file, and we want none.
    return {
        "bos_token_id": tok.bos_token_id,
        "eos_token_id": tok.eos_token_id,
        "pad_token_id": tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id,
    }


def build_dense(gguf: Path, out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    t0 = time.monotonic()
    log(f"loading + dequantizing {gguf.name}")
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    quant = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    config = quant.config
    if config.model_type != "llama" or not isinstance(config, LlamaConfig):
        raise RuntimeError(f"expected a llama GGUF, got {config.model_type}")
    for attr in ("quantization_config", "gguf_file"):
        if hasattr(config, attr):
            delattr(config, attr)
    config.dtype = torch.float32
    model = LlamaForCausalLM(config)
    torch.nn.Module.to(model, torch.float32)  # transformers types its own .to() for one call shape only
    model.load_state_dict(quant.state_dict(), strict=True)
    model.eval()
    tmp = _atomic_dir(out)
    model.save_pretrained(tmp, safe_serialization=True)
    cfg_path = tmp / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.pop("_model_name_or_path", None)  # GGUF metadata noise
    cfg_path.write_text(json.dumps(cfg, indent=2) + "\n")
    _save_tokenizer(tok, tmp)
    (tmp / "generation_config.json").write_text(json.dumps(_generation_config(tok), indent=2))
    _commit(tmp, out)
    log(f"dense checkpoint in {time.monotonic() - t0:.0f}s: {out}")


def _mixtral_config(dense: dict) -> dict:
    """Mixtral config.json equivalent to the dense Llama config (no sliding window, no bias)."""
    keep = [
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "hidden_act",
        "max_position_embeddings",
        "initializer_range",
        "rms_norm_eps",
        "rope_theta",
        "rope_parameters",
        "rope_scaling",
        "tie_word_embeddings",
        "bos_token_id",
        "eos_token_id",
        "pad_token_id",
        "attention_dropout",
        "transformers_version",
    ]
    if dense.get("attention_bias") or dense.get("mlp_bias"):
        raise RuntimeError("dense model has biases; Mixtral has none")
    cfg = {k: dense[k] for k in keep if dense.get(k) is not None}
    cfg.update(
        {
            "architectures": ["MixtralForCausalLM"],
            "model_type": "mixtral",
            "num_local_experts": NUM_EXPERTS,
            "num_experts_per_tok": TOP_K,
            "router_aux_loss_coef": 0.0,
            "output_router_logits": False,
            "sliding_window": None,
            "dtype": "float32",
            "use_cache": True,
        }
    )
    return cfg


def build_moe(dense_dir: Path, out: Path) -> None:
    import torch
    from safetensors.torch import load_file, save_file

    t0 = time.monotonic()
    dense_cfg = json.loads((dense_dir / "config.json").read_text())
    cfg = _mixtral_config(dense_cfg)
    sd = load_file(dense_dir / "model.safetensors")
    gen = torch.Generator().manual_seed(ROUTER_SEED)
    hidden = cfg["hidden_size"]
    out_sd: dict[str, torch.Tensor] = {}
    mlp_map = {"gate_proj": "w1", "down_proj": "w2", "up_proj": "w3"}
    for name, t in sd.items():
        parts = name.split(".")
        if ".mlp." not in name:
            out_sd[name] = t.contiguous()
            continue
        # model.layers.{i}.mlp.{proj}.weight -> block_sparse_moe.experts.{e}.{w}.weight
        layer, proj = parts[2], parts[4]
        for e in range(NUM_EXPERTS):
            key = f"model.layers.{layer}.block_sparse_moe.experts.{e}.{mlp_map[proj]}.weight"
            out_sd[key] = t.clone().contiguous()
    for i in range(cfg["num_hidden_layers"]):
        # Unit-scale router logits so top-2 choices and weights are far from uniform.
        w = torch.randn(NUM_EXPERTS, hidden, generator=gen) / hidden**0.5
        out_sd[f"model.layers.{i}.block_sparse_moe.gate.weight"] = w
    tmp = _atomic_dir(out)
    save_file(out_sd, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    (tmp / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    for f in dense_dir.iterdir():
        if f.name not in ("config.json", "model.safetensors") and f.is_file():
            shutil.copy2(f, tmp / f.name)
    _commit(tmp, out)
    log(f"moe checkpoint in {time.monotonic() - t0:.0f}s: {out}")


def verify(dense_dir: Path, moe_dir: Path) -> None:
    """Greedy tokens must match between dense and upcycled MoE (and the MoE must load fully)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, BatchEncoding

    tok = AutoTokenizer.from_pretrained(dense_dir)
    encoded = tok.apply_chat_template(CHECK_PROMPT, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    if not isinstance(encoded, BatchEncoding):  # what return_dict=True returns; the annotation lists every mode
        raise TypeError(f"apply_chat_template returned {type(encoded).__name__}, not a BatchEncoding")
    ids = encoded["input_ids"]
    results = {}
    for name, d in (("dense", dense_dir), ("moe", moe_dir)):
        loaded = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32, output_loading_info=True)
        model, info = cast(tuple[Any, dict[str, Any]], loaded)  # typed as the model alone, whatever the flags
        bad = {k: v for k, v in info.items() if v}
        if bad:
            raise RuntimeError(f"{name} checkpoint did not load cleanly: {bad}")
        model.eval()
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=CHECK_TOKENS, do_sample=False, attention_mask=torch.ones_like(ids))
            logits = model(ids).logits[0, -1]
        results[name] = (out[0, ids.shape[1] :].tolist(), logits)
        log(f"{name}: {tok.decode(results[name][0])!r}")
    (dt, dl), (mt, ml) = results["dense"], results["moe"]
    diff = (dl - ml).abs().max().item()
    log(f"max logit diff dense vs moe: {diff:.2e}")
    if dt != mt or diff > 1e-2:
        raise SystemExit(f"FAIL: dense and moe differ: {dt} vs {mt} (max logit diff {diff})")


def build_perturbed(dense_dir: Path, out: Path, noise: float = PERTURB_NOISE, seed: int = PERTURB_SEED) -> None:
    """Seeded noise on every matrix of the dense checkpoint; everything else copied as is."""
    import torch
    from safetensors.torch import load_file, save_file

    t0 = time.monotonic()
    sd = load_file(dense_dir / "model.safetensors")
    gen = torch.Generator().manual_seed(seed)
    out_sd: dict[str, torch.Tensor] = {}
    for name in sorted(sd):  # fixed order: the same seed gives the same checkpoint
        t = sd[name]
        if t.ndim >= 2 and t.is_floating_point():
            rms = t.float().pow(2).mean().sqrt()
            t = (t.float() + noise * rms * torch.randn(t.shape, generator=gen)).to(t.dtype)
        out_sd[name] = t.contiguous()
    tmp = _atomic_dir(out)
    save_file(out_sd, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    for f in dense_dir.iterdir():
        if f.name != "model.safetensors" and f.is_file():
            shutil.copy2(f, tmp / f.name)
    info = {"source": dense_dir.name, "relative_noise": noise, "seed": seed}
    (tmp / "perturbation.json").write_text(json.dumps(info, indent=2) + "\n")
    _commit(tmp, out)
    log(f"perturbed checkpoint in {time.monotonic() - t0:.0f}s: {out}")


def verify_perturbed(dense_dir: Path, perturbed_dir: Path) -> dict:
    """Same greedy text as dense, logprobs of the same tokens shifted within bounds."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, BatchEncoding

    tok = AutoTokenizer.from_pretrained(dense_dir)
    encoded = tok.apply_chat_template(CHECK_PROMPT, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    if not isinstance(encoded, BatchEncoding):
        raise TypeError(f"apply_chat_template returned {type(encoded).__name__}, not a BatchEncoding")
    ids = encoded["input_ids"]
    greedy, logprobs = {}, {}
    sequence = None
    for name, d in (("dense", dense_dir), ("perturbed", perturbed_dir)):
        model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=CHECK_TOKENS, do_sample=False, attention_mask=torch.ones_like(ids))
            if sequence is None:
                sequence = out  # score the dense model's tokens under both
            logits = model(sequence).logits[0, :-1]
        greedy[name] = out[0, ids.shape[1] :].tolist()
        logprobs[name] = torch.log_softmax(logits, -1).gather(1, sequence[0, 1:, None])[:, 0]
        log(f"{name}: {tok.decode(greedy[name])!r}")
    shift = (logprobs["dense"] - logprobs["perturbed"]).abs()
    stats = {
        "mean_abs_logprob_shift": round(shift.mean().item(), 4),
        "max_abs_logprob_shift": round(shift.max().item(), 4),
    }
    log(f"logprob shift over {shift.numel()} tokens: {stats}")
    if greedy["dense"] != greedy["perturbed"]:
        raise SystemExit(f"FAIL: perturbed greedy text differs: {greedy}")
    if not PERTURB_MIN_SHIFT <= stats["mean_abs_logprob_shift"] <= PERTURB_MAX_SHIFT:
        raise SystemExit(f"FAIL: logprob shift {stats} outside [{PERTURB_MIN_SHIFT}, {PERTURB_MAX_SHIFT}]")
    return stats


def vlm_image_seq_len() -> int:
    """<image> ids per image: the vision tower's patches after pixel shuffle (the model's own formula)."""
    side = VLM_IMAGE_SIZE // VLM_PATCH_SIZE
    return side * side // VLM_SCALE_FACTOR**2


def write_vlm_files(dense_dir: Path, out: Path) -> dict:
    """Everything of the VLM checkpoint but its weights; returns config.json. Needs no torch.

    The processor files are transformers' own (``Idefics3Processor.save_pretrained``), configured
    by hand: no splitting, one 128 px square per image, ``image_seq_len`` from the tower's shape.
    """
    from tokenizers import AddedToken
    from transformers import AutoTokenizer, Idefics3Processor
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

    tok = AutoTokenizer.from_pretrained(dense_dir)
    base_len = len(tok)
    tok.add_tokens([AddedToken(t, special=True, normalized=False) for t in VLM_ADDED_TOKENS], special_tokens=True)
    ids = tok.convert_tokens_to_ids(VLM_ADDED_TOKENS)
    if ids != list(range(base_len, base_len + len(VLM_ADDED_TOKENS))):
        raise RuntimeError(f"image tokens did not get fresh consecutive ids: {ids}")
    tok.chat_template = VLM_TEMPLATE.read_text()
    edge = {"longest_edge": VLM_IMAGE_SIZE}
    image_processor = Idefics3ImageProcessorPil(do_image_splitting=False, size=edge, max_image_size=edge)
    processor = Idefics3Processor(image_processor, tok, image_seq_len=vlm_image_seq_len())
    processor.save_pretrained(out)
    for stray in ("chat_template.jinja", "chat_template.json"):  # one template: tokenizer_config.json's
        (out / stray).unlink(missing_ok=True)
    _save_tokenizer(tok, out)
    dense = json.loads((dense_dir / "config.json").read_text())
    text = {k: v for k, v in dense.items() if k not in ("architectures", "dtype", "transformers_version")}
    text.update({"vocab_size": len(tok), "tie_word_embeddings": True})
    cfg = {
        "architectures": ["Idefics3ForConditionalGeneration"],
        "model_type": "idefics3",
        "image_token_id": tok.convert_tokens_to_ids("<image>"),
        "scale_factor": VLM_SCALE_FACTOR,
        "tie_word_embeddings": True,
        "pad_token_id": dense.get("pad_token_id"),
        "use_cache": True,
        "dtype": "float32",
        "text_config": text,
        "vision_config": dict(VLM_VISION),
    }
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    (out / "generation_config.json").write_text(json.dumps(_generation_config(tok), indent=2))
    return cfg


def build_vlm(dense_dir: Path, out: Path) -> None:
    """Random seeded vision tower + connector over the dense model's text weights."""
    import torch
    from safetensors.torch import load_file
    from transformers import Idefics3Config, Idefics3ForConditionalGeneration

    t0 = time.monotonic()
    tmp = _atomic_dir(out)
    cfg = write_vlm_files(dense_dir, tmp)
    generation = (tmp / "generation_config.json").read_text()
    torch.manual_seed(VLM_SEED)
    model = Idefics3ForConditionalGeneration(Idefics3Config(**cfg))
    torch.nn.Module.to(model, torch.float32)
    dense_sd = load_file(dense_dir / "model.safetensors")
    state = model.state_dict()
    gen = torch.Generator().manual_seed(VLM_SEED)
    with torch.no_grad():
        for name, t in dense_sd.items():
            if name == "lm_head.weight":
                continue  # tied to the embeddings
            target = "model.text_model." + name.removeprefix("model.")
            if name == "model.embed_tokens.weight":
                # New rows (the image tokens): the mean embedding plus noise of a tenth of its spread.
                extra = state[target].shape[0] - t.shape[0]
                noise = torch.randn(extra, t.shape[1], generator=gen) * t.std(0) * 0.1
                t = torch.cat([t, t.mean(0) + noise])
            state[target].copy_(t)
        # The connector's output lands among token embeddings: scale it to their size (the tower
        # ends in a LayerNorm, so its features have unit scale).
        proj = state["model.connector.modality_projection.proj.weight"]
        emb_rms = dense_sd["model.embed_tokens.weight"].pow(2).mean().sqrt()
        proj.copy_(torch.randn(proj.shape, generator=gen) * emb_rms / proj.shape[1] ** 0.5)
    model.save_pretrained(tmp, safe_serialization=True)
    # Ours, not the re-serialized ones (save_pretrained rewrites both).
    (tmp / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    (tmp / "generation_config.json").write_text(generation)
    _commit(tmp, out)
    log(f"vlm checkpoint in {time.monotonic() - t0:.0f}s: {out}")


def vlm_check_image():
    """A seeded 200x120 RGB noise picture (not square: the resize to 128x128 is exercised)."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(VLM_SEED)
    return Image.fromarray(rng.integers(0, 256, (120, 200, 3), dtype=np.uint8), "RGB")


def verify_vlm(dense_dir: Path, vlm_dir: Path) -> None:
    """The VLM loads fully, speaks SmolLM2's greedy text, and expands an image as documented."""
    import torch
    from transformers import (
        AutoModelForCausalLM,
        AutoProcessor,
        AutoTokenizer,
        BatchEncoding,
        Idefics3ForConditionalGeneration,
    )

    dense_tok = AutoTokenizer.from_pretrained(dense_dir)
    encoded = dense_tok.apply_chat_template(
        CHECK_PROMPT, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    if not isinstance(encoded, BatchEncoding):
        raise TypeError(f"apply_chat_template returned {type(encoded).__name__}, not a BatchEncoding")
    ids_t = encoded["input_ids"]
    dense = AutoModelForCausalLM.from_pretrained(dense_dir, dtype=torch.float32).eval()
    loaded = Idefics3ForConditionalGeneration.from_pretrained(vlm_dir, dtype=torch.float32, output_loading_info=True)
    vlm, info = cast(tuple[Any, dict[str, Any]], loaded)
    bad = {k: v for k, v in info.items() if v}
    if bad:
        raise RuntimeError(f"vlm checkpoint did not load cleanly: {bad}")
    vlm.eval()
    greedy = {}
    with torch.no_grad():
        for name, model in (("dense", dense), ("vlm", vlm)):
            out = model.generate(
                ids_t, max_new_tokens=CHECK_TOKENS, do_sample=False, attention_mask=torch.ones_like(ids_t)
            )
            greedy[name] = out[0, ids_t.shape[1] :].tolist()
            log(f"{name} text-only: {dense_tok.decode(greedy[name])!r}")
    if greedy["dense"] != greedy["vlm"]:
        raise SystemExit(f"FAIL: the vlm's text-only greedy differs from dense: {greedy}")

    processor = AutoProcessor.from_pretrained(vlm_dir)
    tok = processor.tokenizer
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is in this picture?"}]}]
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    marked = tok(text, add_special_tokens=False)["input_ids"]
    inputs = processor(text=text, images=[vlm_check_image()], return_tensors="pt", add_special_tokens=False)
    image_id = tok.convert_tokens_to_ids("<image>")
    fake, glob = tok.convert_tokens_to_ids(["<fake_token_around_image>", "<global-img>"])
    span = [fake, glob, *[image_id] * vlm_image_seq_len(), fake]
    at = marked.index(image_id)
    if inputs["input_ids"][0].tolist() != marked[:at] + span + marked[at + 1 :]:
        raise SystemExit(f"FAIL: the processor's expansion is not {span}: {inputs['input_ids'][0].tolist()}")
    with torch.no_grad():
        out = vlm.generate(**inputs, max_new_tokens=VLM_CHECK_TOKENS, do_sample=False)
    new = out[0, inputs["input_ids"].shape[1] :].tolist()
    log(f"vlm with an image ({len(span)}-id span): {tok.decode(new)!r} {new}")


#: the architecture the vlm_moe checkpoint names (served by ``engine_models/rp_idefics3_moe.py``)
VLM_MOE_ARCHITECTURE = "Idefics3MoeForConditionalGeneration"
VLM_MOE_COPIED = ("tokenizer.json", "tokenizer_config.json", "processor_config.json", "generation_config.json")


def build_vlm_moe(moe_dir: Path, vlm_dir: Path, out: Path) -> None:
    """The vlm's vision tower and connector over the moe checkpoint's text weights; no new randomness."""
    import torch
    from safetensors.torch import load_file, save_file

    t0 = time.monotonic()
    tmp = _atomic_dir(out)
    for name in VLM_MOE_COPIED:
        shutil.copyfile(vlm_dir / name, tmp / name)
    cfg = json.loads((vlm_dir / "config.json").read_text())
    moe_cfg = json.loads((moe_dir / "config.json").read_text())
    text = {k: v for k, v in moe_cfg.items() if k not in ("architectures", "dtype", "transformers_version")}
    text.update({"vocab_size": cfg["text_config"]["vocab_size"], "tie_word_embeddings": True})
    cfg.update({"architectures": [VLM_MOE_ARCHITECTURE], "text_config": text})
    (tmp / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    vlm = load_file(vlm_dir / "model.safetensors")
    state = {k: v for k, v in vlm.items() if not k.startswith("model.text_model.") and k != "lm_head.weight"}
    for name, tensor in load_file(moe_dir / "model.safetensors").items():
        if name == "lm_head.weight":
            continue  # tied to the embeddings
        if name == "model.embed_tokens.weight":  # the image tokens' rows: the vlm's
            tensor = torch.cat([tensor, vlm["model.text_model.embed_tokens.weight"][tensor.shape[0] :]])
        state["model.text_model." + name.removeprefix("model.")] = tensor.contiguous()
    save_file(state, tmp / "model.safetensors", metadata={"format": "pt"})
    _commit(tmp, out)
    log(f"vlm_moe checkpoint in {time.monotonic() - t0:.0f}s: {out}")


def verify_vlm_moe(moe_dir: Path, vlm_dir: Path, out: Path) -> None:
    """Every text tensor is the moe's (the embeddings extended by the vlm's image rows), every other the vlm's."""
    import torch
    from safetensors.torch import load_file

    built, moe, vlm = (load_file(d / "model.safetensors") for d in (out, moe_dir, vlm_dir))
    expected = {k for k in vlm if not k.startswith("model.text_model.") and k != "lm_head.weight"}
    expected |= {"model.text_model." + k.removeprefix("model.") for k in moe if k != "lm_head.weight"}
    if set(built) != expected:
        raise RuntimeError(f"vlm_moe tensors differ from their sources: {sorted(set(built) ^ expected)[:5]}")
    for name, tensor in built.items():
        if not name.startswith("model.text_model."):
            source = vlm[name]
        else:
            source = moe["model." + name.removeprefix("model.text_model.")]
            if name.endswith("embed_tokens.weight"):  # the moe's rows, then the vlm's image-token rows
                source = torch.cat([source, vlm[name][len(source) :]])
        if not tensor.equal(source):
            raise RuntimeError(f"vlm_moe: {name} is not its source's")
    log(f"vlm_moe checkpoint verified: {len(built)} tensors from moe and vlm")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gguf", type=Path, help="needed when the dense checkpoint is (re)built")
    ap.add_argument("--dense-out", type=Path, required=True)
    ap.add_argument("--moe-out", type=Path)
    ap.add_argument("--perturbed-out", type=Path)
    ap.add_argument("--vlm-out", type=Path)
    ap.add_argument(
        "--vlm-moe-out",
        type=Path,
        help="with --moe-out and --vlm-out, both built already: the MoE VLM from them (nothing else is built)",
    )
    ap.add_argument("--force", action="store_true", help="rebuild existing outputs")
    args = ap.parse_args()
    if args.vlm_moe_out is not None:
        sources = (args.moe_out, args.vlm_out)
        if any(d is None or not (d / "config.json").exists() for d in sources):
            ap.error("--vlm-moe-out needs --moe-out and --vlm-out, both built")
        if args.force or not (args.vlm_moe_out / "config.json").exists():
            build_vlm_moe(args.moe_out, args.vlm_out, args.vlm_moe_out)
        verify_vlm_moe(args.moe_out, args.vlm_out, args.vlm_moe_out)
        return 0
    if args.moe_out is None and args.perturbed_out is None and args.vlm_out is None:
        ap.error("nothing to build: give --moe-out, --perturbed-out and/or --vlm-out")
    built = False
    if args.moe_out is not None:
        if args.force or not (args.dense_out / "config.json").exists():
            if args.gguf is None:
                ap.error("--gguf is needed to build the dense checkpoint")
            build_dense(args.gguf, args.dense_out)
            built = True
        if built or args.force or not (args.moe_out / "config.json").exists():
            build_moe(args.dense_out, args.moe_out)
        verify(args.dense_out, args.moe_out)
    if args.perturbed_out is not None:
        if not (args.dense_out / "config.json").exists():
            ap.error(f"{args.dense_out} is not built yet")
        if built or args.force or not (args.perturbed_out / "config.json").exists():
            build_perturbed(args.dense_out, args.perturbed_out)
        stats = verify_perturbed(args.dense_out, args.perturbed_out)
        info_path = args.perturbed_out / "perturbation.json"
        info_path.write_text(json.dumps({**json.loads(info_path.read_text()), **stats}, indent=2) + "\n")
    if args.vlm_out is not None:
        if not (args.dense_out / "config.json").exists():
            ap.error(f"{args.dense_out} is not built yet")
        if built or args.force or not (args.vlm_out / "config.json").exists():
            build_vlm(args.dense_out, args.vlm_out)
        verify_vlm(args.dense_out, args.vlm_out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
