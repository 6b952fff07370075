"""On-policy distillation in the runner: the teacher pass of each trajectory, and OPD advantages.

A rollout whose result names a teacher (``config["teachers"]``) has each of its trajectories scored by
the proxy (``POST /v1/admin/sessions/{id}/teacher_pass``) right after its session is finished, before
the group is graded, and the answer is put on the trajectory the graders see and the feed carries.
``config["critic_context"]`` gives each trajectory its critic view the same way. A refused pass
(unknown teacher, another tokenizer, a bad ``qa_index``) fails the job with the proxy's message; a
teacher that cannot answer fails the attempt (retried as a failed rollout).

OPD advantages (the seed's formula), per trained token:
``task_reward_coef * task_advantage - kl_reward_coef * (student_logprob - teacher_logprob)``; the task
advantage is the group's (GRPO, or the graders' custom ones, sequence-level ones spread over tokens);
untrained tokens get 0. A trajectory that named no teacher gets the task term alone.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from rollout_proxy.runner.admin import AdminClient
from rollout_proxy.runner.job import OPDSection
from rollout_proxy.runner.retries import JobFailed, gather_first_error
from rollout_proxy.sdk.transport import ProxyRequestError
from rollout_proxy.sdk.types import Trajectory


class TeacherUnavailable(RuntimeError):
    """The teacher (or the proxy) could not answer now: the attempt fails and is retried."""


async def distill(
    admin: AdminClient, session_id: str, trajectories: list[Trajectory], config: dict[str, Any] | None, *, topk: int
) -> list[Trajectory]:
    """``trajectories`` with the teacher's fields and the critic's view, as ``config`` asks (else unchanged)."""
    teachers = (config or {}).get("teachers") or {}
    critic_context = (config or {}).get("critic_context") or []
    if not teachers and not critic_context:
        return trajectories
    if len(teachers) > 1:
        raise JobFailed(f"session {session_id}: config['teachers'] names {len(teachers)} teachers; one per trajectory")

    async def one(trajectory: Trajectory) -> Trajectory:
        update: dict[str, Any] = {}
        for name, settings in teachers.items():
            body = {
                "response_id": trajectory.response_id,
                "teacher": name,
                "teacher_context": (settings or {}).get("teacher_context") or [],
                "topk": topk,
            }
            answer = await _ask(admin.teacher_pass(session_id, body), f"the teacher pass with teacher {name!r}")
            update.update({key: answer[key] for key in ("teacher", "total_teacher_logprobs", "teacher_topk")})
        if critic_context:
            body = {"response_id": trajectory.response_id, "critic_context": critic_context}
            view = await _ask(admin.critic_view(session_id, body), "the critic view")
            update["critic"] = {"token_ids": view["critic_token_ids"], "n_tokens_injected": view["n_tokens_injected"]}
        return trajectory.model_copy(update=update)

    return await gather_first_error([one(trajectory) for trajectory in trajectories])  # a group's passes together


async def _ask(call: Any, what: str) -> dict[str, Any]:
    try:
        answer: dict[str, Any] = await call
    except ProxyRequestError as exc:
        if exc.status is not None and 400 <= exc.status < 500:
            raise JobFailed(f"{what} was refused: {exc.message}") from None
        raise TeacherUnavailable(f"{what} failed: {exc.message}") from None
    return answer


def opd_advantages(
    trajectories: Sequence[Trajectory], task: tuple[str, list[Any]], opd: OPDSection
) -> tuple[str, list[list[float]]]:
    """("tok", one advantage per token of each trajectory) by the seed's OPD formula."""
    kind, values = task
    advantages = []
    for index, trajectory in enumerate(trajectories):
        count = len(trajectory.total_token_ids or [])
        if kind == "tok":
            task_row = np.asarray(values[index], dtype=np.float64)
        else:  # grpo / seq: one value per trajectory
            task_row = np.full(count, float(values[index]), dtype=np.float64)
        if len(task_row) != count:
            raise JobFailed(f"trajectory {index}: {len(task_row)} task advantages for {count} tokens")
        trained = trajectory.loss_weight() > 0
        row = np.where(trained, opd.task_reward_coef * task_row, 0.0)
        teacher = trajectory.teacher_logprobs()
        if teacher is not None:
            if len(teacher) != count or np.isnan(teacher[trained]).any():
                raise JobFailed(f"trajectory {index}: the teacher's logprobs do not cover its trained tokens")
            student = trajectory.token_logprobs().astype(np.float64)
            kl = student[trained] - teacher[trained].astype(np.float64)
            row[trained] -= opd.kl_reward_coef * kl
        if not np.isfinite(row).all():
            raise JobFailed(f"trajectory {index}: an OPD advantage is not finite")
        advantages.append(row.tolist())
    return "tok", advantages
