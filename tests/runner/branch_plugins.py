"""A rollout plugin that runs as a harness does: a main agent, a subagent, a compaction retried once."""

from __future__ import annotations

from typing import Any

from rollout_proxy.sdk import PluginStatus, RolloutResult, SingleGraderResult, rollout, single_grader

SUBAGENT = [
    {"role": "system", "content": "You are a weather subagent."},
    {"role": "user", "content": "Which city is it about?"},
]


def _assistant(completion: Any) -> dict[str, Any]:
    return completion.choices[0].message.model_dump(exclude_none=True)


@rollout(name="branching_rollout")
def branching_rollout(context, proxy, sample):
    """Names no responses: the whole rollout (every branch) is the result."""
    client = proxy.rollout_client()
    question = [message.model_dump(exclude_none=True) for message in sample.messages]
    first = client.chat.completions.create(model="m", messages=question)
    client.chat.completions.create(model="m", messages=SUBAGENT, extra_headers={"X-Rollout-Branch": "subagent"})
    client.chat.completions.create(
        model="m", messages=[*question, _assistant(first), {"role": "user", "content": "And tomorrow in Paris?"}]
    )
    compacted = [*question, {"role": "user", "content": "Summary: asked about the weather in Paris."}]
    client.chat.completions.create(model="m", messages=compacted)
    client.chat.completions.create(model="m", messages=compacted)  # retried
    return RolloutResult(status=PluginStatus.SUCCESS, error="", extra={})


@single_grader(name="sequences")
def sequences_grader(context, sample, trajectory):
    """Sees the whole rollout: the main sequence, its branches."""
    assert trajectory.main and all(not branch.main for branch in trajectory.branches)
    return SingleGraderResult(reward=float(len(trajectory.sequences())))
