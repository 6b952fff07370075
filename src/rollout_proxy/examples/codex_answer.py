"""The grader of the Codex demo job (``codex_job.yaml``): did Codex's last message give the answer?

The rollout is the runner's Codex harness (``custom_rl_pipeline.rollout.harness: {name: codex}``,
``runner.harness``): ``codex exec`` on ``sample.extra["task"]`` in a fresh working directory holding
``sample.extra["files"]``; its last message is ``trajectory.extra["harness"]["final_message"]``.
"""

from __future__ import annotations

from rollout_proxy.sdk import ChatCompletionSample, PluginContext, SingleGraderResult, Trajectory, single_grader


@single_grader(name="codex_answer_reward")
def codex_answer_reward(
    context: PluginContext, sample: ChatCompletionSample, trajectory: Trajectory
) -> SingleGraderResult:
    """1.0 when Codex's last message holds the expected answer (case-insensitive), else 0.0."""
    answer = str((sample.extra or {})["answer"]).lower()
    said = str(((trajectory.extra or {}).get("harness") or {}).get("final_message") or "")
    if not said:
        said = next((m.get("content") or "" for m in reversed(trajectory.messages) if m.get("role") == "assistant"), "")
    found = answer in said.lower()
    return SingleGraderResult(reward=1.0 if found else 0.0, metrics={"answered": float(found)})
