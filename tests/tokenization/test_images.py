"""A model's image placeholders (``tokenization.images``): the proxy's expansion of the template's image markers is
the model's own processor's, token for token, and what it sends the engine collapses back exactly."""

from __future__ import annotations

import hashlib
import io
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from rollout_proxy.errors import TemplateRenderError
from rollout_proxy.tokenization import vllm_chat
from rollout_proxy.tokenization.images import ImagesUnavailable, load_placeholders
from rollout_proxy.tokenization.local import LocalTemplate
from rollout_proxy.wire.images import ImageBlob

transformers = pytest.importorskip("transformers")


def blob(width: int, height: int, color: tuple[int, int, int] = (200, 30, 30)) -> ImageBlob:
    buffer = io.BytesIO()
    Image.new("RGB", (width, height), color).save(buffer, format="PNG")
    data = buffer.getvalue()
    return ImageBlob(data, "image/png", width, height, hashlib.sha256(data).hexdigest())


def pil(image: ImageBlob) -> Image.Image:
    return Image.open(io.BytesIO(image.data))


@pytest.fixture(scope="module")
def local(vlm_dir: Path) -> LocalTemplate:
    template = LocalTemplate.load(vlm_dir)
    template.image_placeholders()
    return template


def two_images() -> tuple[list[dict], list[ImageBlob]]:
    first, second = blob(200, 120), blob(40, 300, (10, 200, 10))
    messages = [
        {"role": "system", "content": "Look carefully."},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "Compare"},
                {"type": "image", "image": first.sha256},
                {"type": "text", "text": "with"},
                {"type": "image", "image": second.sha256},
            ],
        },
    ]
    return messages, [first, second]


def test_the_expansion_is_the_models_processor_token_for_token(local: LocalTemplate, vlm_dir: Path):
    messages, images = two_images()
    rule = local.image_placeholders()
    text = local.render_text(messages, tools=None, add_generation_prompt=True, chat_template_kwargs=None)
    rendered = local.encode(text)
    assert len(rule.markers(rendered)) == 2  # one <image> per image part, where the part is
    expanded, spans = rule.expand(rendered, images)

    processor = transformers.AutoProcessor.from_pretrained(vlm_dir)
    reference = processor(text=text, images=[pil(image) for image in images], add_special_tokens=False)
    assert expanded.tolist() == reference["input_ids"][0]

    fake, tag, marker = (int(local.encode(t)[0]) for t in ("<fake_token_around_image>", "<global-img>", "<image>"))
    span = [fake, tag, *[marker] * 16, fake]
    assert [(s.length, s.sha256, s.width, s.height, s.nbytes) for s in spans] == [
        (19, image.sha256, image.width, image.height, len(image.data)) for image in images
    ]
    for s in spans:
        assert expanded[s.start : s.end].tolist() == span
    assert spans[1].start == int(rule.markers(rendered)[1]) + 18  # after the first span's 18 more ids


def test_collapse_gives_back_the_render_and_refuses_a_marker_without_an_image(local: LocalTemplate):
    messages, images = two_images()
    rule = local.image_placeholders()
    rendered = local.render_ids(messages, tools=None, add_generation_prompt=True, chat_template_kwargs=None)
    expanded, spans = rule.expand(rendered, images)
    assert np.array_equal(rule.collapse(expanded, spans), rendered)

    # the policy (or a user's text) wrote the marker: the engine would expand it as the first image
    stray = np.concatenate([local.encode("see <image> here"), expanded])
    shifted = [s.shifted(len(stray) - len(expanded)) for s in spans]
    with pytest.raises(ValueError, match="where no image is"):
        rule.collapse(stray, shifted)
    # a span that is not the model's span where the node says it is
    broken = expanded.copy()
    broken[spans[0].start + 3] = 42
    with pytest.raises(ValueError, match="not an image's placeholder span"):
        rule.collapse(broken, spans)
    with pytest.raises(ValueError, match="1 image marker"):
        rule.expand(rendered[: spans[0].start + 1], images)


def test_the_string_content_format_puts_the_markers_before_the_text_as_vllm_does():
    message = {
        "role": "user",
        "content": [
            {"type": "text", "text": "Compare"},
            {"type": "image", "image": "ab"},
            {"type": "text", "text": "and"},
            {"type": "image", "image": "cd"},
        ],
    }
    (prepared,) = vllm_chat.vllm_conversation(
        [message], content_format="string", names_developer=False, image_marker="<image>"
    )
    assert prepared["content"] == "<image>\n<image>\nCompare\nand"
    (openai,) = vllm_chat.vllm_conversation([message], content_format="openai", names_developer=False)
    assert openai["content"] == [
        {"type": "text", "text": "Compare"},
        {"type": "image"},
        {"type": "text", "text": "and"},
        {"type": "image"},
    ]
    tool = {"role": "tool", "tool_call_id": "c1", "content": [{"type": "image", "image": "ab"}]}
    (kept,) = vllm_chat.vllm_conversation([tool], content_format="openai", names_developer=False)
    assert kept["content"] == [{"type": "image"}]  # vLLM keeps a tool message's parts when one is no text
    # text that already holds the marker takes that image's place (vLLM counts it), one more is refused
    written = {"role": "user", "content": [{"type": "text", "text": "<image> is"}, {"type": "image", "image": "x"}]}
    (as_is,) = vllm_chat.vllm_conversation(
        [written], content_format="string", names_developer=False, image_marker="<image>"
    )
    assert as_is["content"] == "<image> is"
    with pytest.raises(ValueError, match="more '<image>' placeholders"):
        vllm_chat.vllm_conversation(
            [
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "<image><image>"}, {"type": "image", "image": "x"}],
                }
            ],
            content_format="string",
            names_developer=False,
            image_marker="<image>",
        )


def test_a_local_render_of_too_many_written_markers_is_a_template_error(vlm_dir: Path, tmp_path: Path):
    directory = tmp_path / "vlm"
    shutil.copytree(vlm_dir, directory)
    plain = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"  # a "string" content format template
    local = LocalTemplate(transformers.AutoTokenizer.from_pretrained(directory), plain, directory=directory)
    local.image_placeholders()
    message = {"role": "user", "content": [{"type": "text", "text": "<image><image>"}, {"type": "image", "image": "x"}]}
    with pytest.raises(TemplateRenderError, match="images cannot be rendered"):
        local.render_ids([message], tools=None, add_generation_prompt=False, chat_template_kwargs=None)


def test_models_the_proxy_cannot_follow_take_no_images_and_say_why(vlm_dir: Path, tokenizer_dir: Path, tmp_path: Path):
    encode = LocalTemplate.load(vlm_dir).encode
    with pytest.raises(ImagesUnavailable, match="no image placeholder rule for this model"):
        load_placeholders(tokenizer_dir, encode)  # SmolLM2: model_type llama
    splitting = tmp_path / "splitting"
    shutil.copytree(vlm_dir, splitting)
    config = json.loads((splitting / "processor_config.json").read_text())
    config["image_processor"]["do_image_splitting"] = True
    (splitting / "processor_config.json").write_text(json.dumps(config))
    with pytest.raises(ImagesUnavailable, match="splits images into tiles"):
        load_placeholders(splitting, encode)
    # the older layout: the image processor's fields in preprocessor_config.json
    older = tmp_path / "older"
    shutil.copytree(vlm_dir, older)
    (older / "preprocessor_config.json").write_text(
        json.dumps(config.pop("image_processor") | {"do_image_splitting": False})
    )
    (older / "processor_config.json").write_text(json.dumps(config))
    assert load_placeholders(older, encode).span_ids.tolist() == load_placeholders(vlm_dir, encode).span_ids.tolist()
    (older / "processor_config.json").unlink()
    (older / "preprocessor_config.json").unlink()
    with pytest.raises(ImagesUnavailable, match="processor config"):
        load_placeholders(older, encode)
