"""An image task: a picture of one coloured shape, a question about it, a one-word answer.

Each record of ``data/image_answer.jsonl`` holds the system line as its ``messages`` and, in ``extra``, the
question, the picture (a PNG as a data URL) and the answer: a session's sample takes no image (the proxy
stores an image with the turn that sends it, by its hash), so the rollout sends the question and the picture
together as the user's message, the sample's system line first. The grader is the short-answer one
(``short_answer.grade_reply``): 1.0 for the word alone, 0.5 for it in a short reply. Served by a
vision-language model the proxy has a placeholder rule for (the tiny Idefics3 checkpoint of
``devtools/build_checkpoints.py --vlm-out``; vLLM with ``--enable-scale-out``). ``python -m
rollout_proxy.examples.image_answer OUT.jsonl`` writes the dataset again (``records``).
"""

from __future__ import annotations

import base64
import io
import json
import sys
from typing import Any, cast

from openai.types.chat import ChatCompletionMessageParam

from rollout_proxy.examples.short_answer import grade_reply
from rollout_proxy.sdk import (
    ChatCompletionSample,
    PluginContext,
    PluginInstance,
    PluginStatus,
    RolloutInferenceProxy,
    RolloutResult,
    Runtime,
    SingleGraderResult,
    Trajectory,
    rollout,
    single_grader,
)

MODEL = "vlm"
SYSTEM = "Look at the picture and answer with one word, nothing else."
COLOURS = {"red": (220, 30, 30), "green": (30, 160, 60), "blue": (40, 70, 220), "yellow": (235, 200, 20)}
SHAPES = ("circle", "square", "triangle")
SIDE = 64  # pixels


def draw(shape: str, colour: str) -> bytes:
    """A ``SIDE`` px PNG: one ``shape`` in ``colour`` on white."""
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (SIDE, SIDE), "white")
    pen = ImageDraw.Draw(image)
    box = (12, 12, SIDE - 12, SIDE - 12)
    fill = COLOURS[colour]
    if shape == "circle":
        pen.ellipse(box, fill=fill)
    elif shape == "square":
        pen.rectangle(box, fill=fill)
    else:
        pen.polygon([(SIDE // 2, 10), (SIDE - 10, SIDE - 12), (10, SIDE - 12)], fill=fill)
    out = io.BytesIO()
    image.save(out, "PNG", optimize=True)
    return out.getvalue()


def records() -> list[dict[str, Any]]:
    """The dataset: each shape in each colour, asked its colour or its shape in turn."""
    out = []
    for index, (shape, colour) in enumerate((shape, colour) for colour in COLOURS for shape in SHAPES):
        asks_colour = index % 2 == 0
        question = "What colour is the shape?" if asks_colour else "What shape is this?"
        image = "data:image/png;base64," + base64.b64encode(draw(shape, colour)).decode()
        extra = {"question": question, "image": image, "answer": colour if asks_colour else shape}
        out.append({"messages": [{"role": "system", "content": SYSTEM}], "extra": extra})
    return out


def user_message(sample: ChatCompletionSample) -> dict[str, Any]:
    """The question and the picture, as one Chat Completions user message."""
    extra = sample.extra or {}
    return {
        "role": "user",
        "content": [
            {"type": "text", "text": str(extra["question"])},
            {"type": "image_url", "image_url": {"url": str(extra["image"])}},
        ],
    }


@rollout(
    name="image_answer_rollout",
    description="asks one question about a picture and keeps the reply",
    runtime=Runtime(instance=PluginInstance.CPU2MEM4, timeout=300, max_concurrency=16),
)
async def image_answer_rollout(
    context: PluginContext, proxy: RolloutInferenceProxy, sample: ChatCompletionSample
) -> RolloutResult:
    client = proxy.async_rollout_client()
    messages = cast(list[ChatCompletionMessageParam], [*sample.message_dicts(), user_message(sample)])
    await client.chat.completions.create(model=MODEL, messages=messages)
    return RolloutResult(status=PluginStatus.SUCCESS)


@single_grader(name="image_answer_reward")
def image_answer_reward(
    context: PluginContext, sample: ChatCompletionSample, trajectory: Trajectory
) -> SingleGraderResult:
    answer = str((sample.extra or {})["answer"])
    reply = next((m.get("content") or "" for m in reversed(trajectory.messages) if m.get("role") == "assistant"), "")
    reward, metrics = grade_reply(reply if isinstance(reply, str) else "", [answer])
    return SingleGraderResult(reward=reward, metrics=metrics, status=PluginStatus.SUCCESS)


if __name__ == "__main__":
    with open(sys.argv[1], "w") as out:
        out.writelines(json.dumps(record) + "\n" for record in records())
