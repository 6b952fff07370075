"""The tiny vision-language checkpoint's files (build_checkpoints.write_vlm_files): its tokenizer, config,
processor and chat template, built from the dense SmolLM2 checkpoint without torch (seconds).

What the proxy relies on: the image tokens are new ids beside SmolLM2's unchanged ones, every image
(whatever its size) expands to the same documented span, and the template puts one ``<image>`` per image
part where the part is."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from PIL import Image

from devtools.build_checkpoints import VLM_ADDED_TOKENS, VLM_TEMPLATE, vlm_image_seq_len, write_vlm_files

transformers = pytest.importorskip("transformers")

QWEN3_STYLE = VLM_TEMPLATE.with_name("qwen3_style.jinja")


@pytest.fixture(scope="module")
def vlm_dir(tokenizer_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    if not (tokenizer_dir / "config.json").exists():
        pytest.skip(f"no SmolLM2 checkpoint in {tokenizer_dir} (python -m devtools.engine_env setup builds it)")
    out = tmp_path_factory.mktemp("vlm")
    write_vlm_files(tokenizer_dir, out)
    return out


@pytest.fixture(scope="module")
def processor(vlm_dir: Path):
    return transformers.AutoProcessor.from_pretrained(vlm_dir)


def ids(processor, *names: str) -> list[int]:
    return processor.tokenizer.convert_tokens_to_ids(list(names))


def test_image_tokens_are_new_ids_and_text_tokenizes_as_smollm2(vlm_dir: Path, tokenizer_dir: Path, processor):
    dense = transformers.AutoTokenizer.from_pretrained(tokenizer_dir)
    tok = processor.tokenizer
    assert tok.convert_tokens_to_ids(VLM_ADDED_TOKENS) == list(range(len(dense), len(dense) + len(VLM_ADDED_TOKENS)))
    text = "<|im_start|>user\nDescribe the image, then say <b>hi</b>.<|im_end|>\n"
    assert tok(text, add_special_tokens=False)["input_ids"] == dense(text, add_special_tokens=False)["input_ids"]
    # Every image token is one atomic id, also inside text (the processor's expansion relies on it).
    assert tok("a<image>b<global-img>", add_special_tokens=False)["input_ids"] == [
        *dense("a", add_special_tokens=False)["input_ids"],
        *ids(processor, "<image>"),
        *dense("b", add_special_tokens=False)["input_ids"],
        *ids(processor, "<global-img>"),
    ]
    cfg = json.loads((vlm_dir / "config.json").read_text())
    assert cfg["model_type"] == "idefics3"
    assert cfg["text_config"]["vocab_size"] == len(tok)
    assert cfg["image_token_id"] == tok.convert_tokens_to_ids("<image>")


def test_image_seq_len_matches_the_vision_tower(vlm_dir: Path, processor):
    """The processor's <image> count per image must equal the embeddings the model makes per image."""
    cfg = json.loads((vlm_dir / "config.json").read_text())
    vision = cfg["vision_config"]
    embeddings = (vision["image_size"] // vision["patch_size"]) ** 2 // cfg["scale_factor"] ** 2
    assert processor.image_seq_len == vlm_image_seq_len() == embeddings == 16
    assert processor.image_processor.do_image_splitting is False
    assert processor.image_processor.max_image_size == {"longest_edge": vision["image_size"]}


@pytest.mark.parametrize("size", [(200, 120), (40, 300), (128, 128), (1000, 1000)])
def test_every_image_expands_to_the_same_span(processor, size: tuple[int, int]):
    fake, image, glob = ids(processor, "<fake_token_around_image>", "<image>", "<global-img>")
    text = "<|im_start|>user\n<image>\nWhat is this?<|im_end|>\n"
    marked = processor.tokenizer(text, add_special_tokens=False)["input_ids"]
    out = processor(text=text, images=[Image.new("RGB", size, (200, 30, 30))], add_special_tokens=False)
    at = marked.index(image)
    span = [fake, glob, *[image] * 16, fake]
    assert out["input_ids"][0] == marked[:at] + span + marked[at + 1 :]
    assert out["pixel_values"].shape == (1, 1, 3, 128, 128)


def render(processor, messages: list[dict], **kwargs) -> str:
    return processor.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kwargs)


def test_template_puts_one_marker_per_image_part_in_place(processor):
    messages = [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "Compare"},
                {"type": "image", "image": "ab12"},
                {"type": "text", "text": "and"},
                {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
            ],
        }
    ]
    assert (
        render(processor, messages)
        == "<|im_start|>user\nCompare\n<image>\nand\n<image><|im_end|>\n<|im_start|>assistant\n"
    )
    tool_turn = [
        {"role": "user", "content": "Take a screenshot."},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"type": "function", "function": {"name": "screenshot", "arguments": "{}"}}],
        },
        {"role": "tool", "tool_call_id": "c1", "content": [{"type": "image", "image": "cd34"}]},
    ]
    assert render(processor, tool_turn).endswith(
        "<|im_start|>user\n<tool_response>\n<image>\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )


def test_text_only_renders_as_qwen3_style(processor):
    """Without images the VLM's template is the text template the other tests use, token for token."""
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": "there"}]},
        {"role": "assistant", "content": "<think>greet</think>Hello!"},
        {"role": "user", "content": "Bye"},
    ]
    tok = processor.tokenizer
    expected = tok.apply_chat_template(
        messages, chat_template=QWEN3_STYLE.read_text(), tokenize=False, add_generation_prompt=True
    )
    assert render(processor, messages) == expected
