"""Images in the normal form: each API's image shapes become ``{"type": "image", "image": <sha256>}`` parts,
so the canonical key names an image by its bytes, whichever way it was sent."""

from __future__ import annotations

import base64
import hashlib
import io

import pytest
from PIL import Image

from rollout_proxy.tokenization.messages import canonical_key
from rollout_proxy.wire.anthropic import conversation
from rollout_proxy.wire.errors import WireFormatError
from rollout_proxy.wire.images import ImageSet, count_image_parts, image_hashes
from rollout_proxy.wire.messages import MessageFold, normalize_message, normalize_messages
from rollout_proxy.wire.responses import input_to_messages


def png(color: str = "red", size: tuple[int, int] = (4, 3)) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", size, color).save(out, "PNG")
    return out.getvalue()


RED, BLUE = png("red"), png("blue")


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def chat_user(*parts: dict) -> dict:
    return {"role": "user", "content": [{"type": "text", "text": "look"}, *parts]}


def image_url(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url, "detail": "high"}}


def anthropic_image(data: bytes, mime: str = "image/png") -> dict:
    return {"type": "image", "source": {"type": "base64", "media_type": mime, "data": base64.b64encode(data).decode()}}


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def test_a_chat_image_becomes_a_part_named_by_the_hash_of_its_bytes():
    images = ImageSet()
    message = normalize_message(chat_user(image_url(data_url(RED))), images=images)
    assert message == {
        "role": "user",
        "content": [{"type": "text", "text": "look"}, {"type": "image", "image": sha(RED)}],
    }
    assert images.parts == 1 and [raw.sha256 for raw in images.fresh] == [sha(RED)]
    assert images.fresh[0].data == RED and images.fresh[0].declared == "image/png" and not images.fresh[0].strict
    assert images.fresh[0].param == "messages.content[1].image_url.url"


def test_text_only_content_stays_a_string():
    images = ImageSet()
    message = normalize_message({"role": "user", "content": [{"type": "text", "text": "a"}, "b"]}, images=images)
    assert message["content"] == "a\nb" and images.parts == 0


def test_the_same_image_is_the_same_key_on_every_api_and_another_image_is_not():
    chat = normalize_messages([chat_user(image_url(data_url(RED)))])[0]
    responses = input_to_messages(
        [
            {
                "role": "user",
                "content": [
                    {"type": "input_text", "text": "look"},
                    {"type": "input_image", "image_url": data_url(RED)},
                ],
            }
        ]
    )[0]
    messages = conversation(
        None, [{"role": "user", "content": [{"type": "text", "text": "look"}, anthropic_image(RED)]}]
    )
    assert canonical_key(chat) == canonical_key(responses) == canonical_key(messages.messages[0])
    other = normalize_messages([chat_user(image_url(data_url(BLUE)))])[0]
    assert canonical_key(other) != canonical_key(chat)
    # the declared type of a data URL is not part of what identifies the image: its bytes are
    assert canonical_key(normalize_messages([chat_user(image_url(data_url(RED, "image/jpeg")))])[0]) == canonical_key(
        chat
    )


def test_an_image_sent_twice_is_two_parts_and_one_image():
    images = ImageSet()
    normalize_messages([chat_user(image_url(data_url(RED)), image_url(data_url(RED)))], images=images)
    assert images.parts == 2 and len(images.fresh) == 1 and list(images.held) == [sha(RED)]


@pytest.mark.parametrize(
    ("part", "param", "words"),
    [
        (image_url("data:image/png;base64,%%%"), "content[1].image_url.url", "does not decode"),
        (image_url("data:image/png,rawbytes"), "content[1].image_url.url", "must be base64"),
        (image_url("data:image/png;base64,"), "content[1].image_url.url", "empty"),
        (image_url("ftp://host/a.png"), "content[1].image_url.url", "data: URL or an http(s) URL"),
        ({"type": "image_url", "image_url": {}}, "content[1].image_url.url", "URL as a string"),
        ({"type": "input_image", "file_id": "file-1"}, "content[1].file_id", "Files API"),
        (image_url("https://example.com/a.png"), "content[1].image_url.url", "--image-urls"),
    ],
)
def test_a_bad_image_is_refused_naming_where(part, param, words):
    with pytest.raises(WireFormatError) as raised:
        normalize_message(chat_user(part), param="messages[2]", images=ImageSet())
    assert raised.value.param == f"messages[2].{param}"
    assert words in raised.value.message


@pytest.mark.parametrize("role", ["system", "assistant", "tool", "developer"])
def test_chat_takes_images_in_user_messages_only(role):
    message = {"role": role, "content": [image_url(data_url(RED))], "tool_call_id": "c1"}
    with pytest.raises(WireFormatError) as raised:
        normalize_message(message, param="messages[1]", images=ImageSet())
    assert raised.value.param == "messages[1].content[0]"
    assert ("text parts only" if role == "tool" else "user messages only") in raised.value.message


def test_a_url_image_is_the_fetched_bytes_named_as_if_sent_inline():
    url = "https://example.com/red.png"
    fetched = ImageSet(urls={url: RED})
    by_url = normalize_message(chat_user(image_url(url)), images=fetched)
    assert by_url == normalize_message(chat_user(image_url(data_url(RED))), images=ImageSet())
    assert fetched.fresh[0].param == "messages.content[1].image_url.url"
    with pytest.raises(WireFormatError, match="not fetched"):
        normalize_message(chat_user(image_url("https://example.com/other.png")), images=fetched)


def test_without_an_image_set_an_image_is_only_named():
    """The SDK's bookkeeping: no fetching, no checks; a URL image is a view of its URL."""
    url = "https://example.com/red.png"
    message = normalize_message(chat_user(image_url(data_url(RED)), image_url(url)))
    assert message["content"][1:] == [{"type": "image", "image": sha(RED)}, {"type": "image", "url": url}]


def test_a_responses_tool_output_takes_images():
    images = ImageSet()
    items = [
        {"role": "user", "content": "go"},
        {"type": "function_call", "call_id": "c1", "name": "shot", "arguments": "{}"},
        {
            "type": "function_call_output",
            "call_id": "c1",
            "output": [{"type": "input_text", "text": "here"}, {"type": "input_image", "image_url": data_url(BLUE)}],
        },
    ]
    messages = input_to_messages(items, images=images)
    assert messages[2] == {
        "role": "tool",
        "tool_call_id": "c1",
        "content": [{"type": "text", "text": "here"}, {"type": "image", "image": sha(BLUE)}],
    }
    assert images.fresh[0].param == "input[2].output[1].image_url"


def test_an_anthropic_user_turn_and_tool_result_take_images():
    images = ImageSet()
    found = conversation(
        "sys",
        [
            {"role": "user", "content": "go"},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "shot", "input": {}}]},
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": "t1", "content": [anthropic_image(RED)]},
                    {"type": "text", "text": "and this"},
                    anthropic_image(BLUE, "image/png"),
                ],
            },
        ],
        images=images,
    )
    assert found.messages[3:] == [
        {"role": "tool", "tool_call_id": "t1", "content": [{"type": "image", "image": sha(RED)}]},
        {"role": "user", "content": [{"type": "text", "text": "and this"}, {"type": "image", "image": sha(BLUE)}]},
    ]
    assert [raw.param for raw in images.fresh] == [
        "messages[2].content[0].content[0].source.data",
        "messages[2].content[2].source.data",
    ]
    assert all(raw.strict and raw.declared == "image/png" for raw in images.fresh)
    assert image_hashes(found.messages) == [sha(RED), sha(BLUE)] and count_image_parts(found.messages) == 2


@pytest.mark.parametrize(
    ("block", "param"),
    [
        ({"type": "image", "source": {"type": "file", "file_id": "f"}}, "messages[0].content[0].source.type"),
        ({"type": "image", "source": {"type": "base64", "data": "AAAA"}}, "messages[0].content[0].source.media_type"),
        ({"type": "image", "source": {"type": "url", "url": "https://x/a.png"}}, "messages[0].content[0].source.url"),
        ({"type": "image"}, "messages[0].content[0].source"),
    ],
)
def test_a_bad_anthropic_image_names_where(block, param):
    with pytest.raises(WireFormatError) as raised:
        conversation(None, [{"role": "user", "content": [block]}], images=ImageSet())
    assert raised.value.param == param


def test_a_folds_images_go_on_with_it_and_a_new_request_adds_its_own():
    fold = MessageFold()
    fold.add(chat_user(image_url(data_url(RED))), "messages[0]")
    later = fold.extended()
    assert later.images.fresh == [] and sha(RED) in later.images.held and later.images.parts == 1
    later.add({"role": "assistant", "content": "ok"}, "messages[1]")
    later.add(chat_user(image_url(data_url(RED)), image_url(data_url(BLUE))), "messages[2]")
    assert [raw.sha256 for raw in later.images.fresh] == [sha(BLUE)] and later.images.parts == 3
    assert fold.images.parts == 1 and sha(BLUE) not in fold.images.held  # the kept fold is not changed
    assert later.upto(1).images.parts == 1
