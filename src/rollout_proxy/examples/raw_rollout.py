"""Lower-level control (the template's ``raw_rollout.py``): a plain client, state kept by hand.

The policy answers; a second model (here: a canned reviewer, standing in for any
model outside the policy) adds a critique that is *not* trained on; the policy then
revises. ``process_completion`` records each policy answer, and
``update_state_from_messages`` inserts the reviewer's turn with loss weight 0.
"""

from __future__ import annotations

from typing import cast

import openai
from openai.types.chat import ChatCompletionMessageParam

from rollout_proxy.sdk import (
    ChatCompletionSample,
    PluginContext,
    PluginStatus,
    RolloutInferenceProxy,
    RolloutResult,
    rollout,
)


def reviewer(answer: str) -> str:
    return f"Reviewer: the answer has {len(answer.split())} words; make it shorter and more precise."


@rollout(name="raw_rollout")
def raw_rollout(
    context: PluginContext, proxy: RolloutInferenceProxy, sample: ChatCompletionSample
) -> RolloutResult | None:
    client = openai.OpenAI(base_url=proxy.url, api_key=proxy.jwt_token)  # not wrapped: state is ours to keep
    messages = cast(list[ChatCompletionMessageParam], [m.model_dump(exclude_none=True) for m in sample.messages])
    first = client.chat.completions.create(model="policy", messages=messages)
    proxy.process_completion(first, messages=messages)
    critique = [
        {"role": "user", "content": "Please ask the reviewer."},
        {"role": "assistant", "content": reviewer(first.choices[0].message.content or "")},
        {"role": "user", "content": "Revise your answer."},
    ]
    reviewed_id = proxy.update_state_from_messages(critique, previous_response_id=first.id)
    revised = client.chat.completions.create(
        model="policy", messages=cast(list[ChatCompletionMessageParam], proxy.messages)
    )
    proxy.process_completion(revised, messages=proxy.messages)
    return RolloutResult(status=PluginStatus.SUCCESS, extra={"reviewed_id": reviewed_id, "final_id": revised.id})
