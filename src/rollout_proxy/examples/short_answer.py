"""The demo's task: short English questions a 135M model gets right some of the time.

Each sample is a few-shot chat (a system line and three solved examples, all prompt)
ending in a question; the rollout asks it once, the grader checks the reply against
``extra["answer"]`` (and ``extra["aliases"]``). Sampled at temperature 1, SmolLM2-135M
answers some questions often, some rarely, so rollouts of one sample disagree and GRPO's
advantages are not zero: a learning signal, where the weather demo had none. The bundled
questions were picked from 24 candidates by their measured success over 8 samples each
(real vLLM, this model): from 0.06 (a dog's legs) through 0.12-0.50 (Rome, green, 7 + 2,
snow) and 0.75 (Tokyo, Berlin, "cold") to 1.0 (Paris, "down"); mean about 0.5.

The rollout is traced with the SDK's helpers (``@trace_monitor``, ``wrap_inplace_trace``):
a process with ``OTEL_EXPORTER_OTLP_ENDPOINT`` set sends a span per rollout and LLM call.
"""

from __future__ import annotations

import re
from typing import cast

from openai.types.chat import ChatCompletionMessageParam

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
    trace_monitor,
    wrap_inplace_trace,
)

MODEL = "smollm2"
_NUMBERS = "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen sixteen"
NUMBER_WORDS = {word: str(value) for value, word in enumerate(_NUMBERS.split(" "))}
#: a reply longer than this many words is not a short answer, even when it holds the right one
MAX_WORDS = 3


@rollout(
    name="short_answer_rollout",
    description="asks one short question and keeps the reply",
    runtime=Runtime(instance=PluginInstance.CPU2MEM4, timeout=300, max_concurrency=16),
)
@trace_monitor
async def short_answer_rollout(
    context: PluginContext, proxy: RolloutInferenceProxy, sample: ChatCompletionSample
) -> RolloutResult:
    client = wrap_inplace_trace(proxy.async_rollout_client())
    messages = cast(list[ChatCompletionMessageParam], sample.message_dicts())
    await client.chat.completions.create(model=MODEL, messages=messages)
    return RolloutResult(status=PluginStatus.SUCCESS)


def words(text: str) -> list[str]:
    """Lower-case words and numbers, number words as digits ("Five." -> ["5"])."""
    tokens = re.findall(r"[a-z]+|\d+", text.lower())
    return [NUMBER_WORDS.get(token, token) for token in tokens]


def grade_reply(reply: str, answers: list[str]) -> tuple[float, dict[str, float]]:
    """1.0 for the answer alone; 0.5 for the answer among at most ``MAX_WORDS`` words; else 0.0."""
    said = words(reply)
    wanted = [words(answer) for answer in answers]
    exact = any(said == answer for answer in wanted)
    contains = any(answer and _contains(said, answer) for answer in wanted)
    short = 0 < len(said) <= MAX_WORDS
    reward = 1.0 if exact else 0.5 if contains and short else 0.0
    return reward, {"exact": float(exact), "correct": float(contains), "short": float(short), "words": float(len(said))}


def _contains(said: list[str], answer: list[str]) -> bool:
    size = len(answer)
    return any(said[start : start + size] == answer for start in range(len(said) - size + 1))


@single_grader(name="short_answer_reward")
@trace_monitor
def short_answer_reward(
    context: PluginContext, sample: ChatCompletionSample, trajectory: Trajectory
) -> SingleGraderResult:
    extra = sample.extra or {}
    answers = [str(extra["answer"]), *(str(alias) for alias in extra.get("aliases", []))]
    reply = next((m.get("content") or "" for m in reversed(trajectory.messages) if m.get("role") == "assistant"), "")
    reward, metrics = grade_reply(reply, answers)
    return SingleGraderResult(reward=reward, metrics=metrics, status=PluginStatus.SUCCESS)
