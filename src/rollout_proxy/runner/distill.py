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
untrained tokens get 0. A trajectory that named no teacher gets the task term alone, and so do a
rollout's branches (subagents, compactions: the teacher pass scores the main sequence); the advantages
are per sequence (``wire.feed.token_advantage_rows``).
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
from rollout_proxy.wire.arrays import decode_array, encode_array
from rollout_proxy.wire.feed import TokenAdvantageError, token_advantage_rows, token_advantage_value


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
            update.update(_on_trained(trajectory, answer))
        if critic_context:
            body = {"response_id": trajectory.response_id, "critic_context": critic_context}
            view = await _ask(admin.critic_view(session_id, body), "the critic view")
            update["critic"] = {"token_ids": view["critic_token_ids"], "n_tokens_injected": view["n_tokens_injected"]}
        return trajectory.model_copy(update=update)

    return await gather_first_error([one(trajectory) for trajectory in trajectories])  # a group's passes together


def _on_trained(trajectory: Trajectory, answer: dict[str, Any]) -> dict[str, Any]:
    """The teacher pass's fields for the tokens this trajectory trains. The pass scores every generated token
    of the response's path; a group sample whose first turns an earlier sample trains (a finish trains each
    turn once: the first named response that holds it) trains fewer, so the values and top-k rows of the
    others are left out, as if the pass had been given its loss weights."""
    fields = {key: answer[key] for key in ("teacher", "total_teacher_logprobs", "teacher_topk")}
    values = fields["total_teacher_logprobs"]
    trained = trajectory.loss_weight() > 0
    if values is None or len(values) != len(trained):
        return fields
    scored = np.asarray([value is not None for value in values], dtype=bool)
    if not (scored & ~trained).any():
        return fields
    fields["total_teacher_logprobs"] = [value if keep else None for value, keep in zip(values, trained, strict=True)]
    topk = fields["teacher_topk"]
    if topk is not None:
        rows = trained[scored]  # per scored token, in order (the top-k's rows): trained here or not
        ids = decode_array(topk["ids"], param="teacher_topk.ids")
        logprobs = decode_array(topk["logprobs"], param="teacher_topk.logprobs")
        if len(ids) == len(rows) == len(logprobs):
            fields["teacher_topk"] = {"ids": encode_array(ids[rows]), "logprobs": encode_array(logprobs[rows])}
    return fields


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
) -> tuple[str, list[Any]]:
    """("tok", per-token advantages of each rollout, one row per sequence as ``wire.feed`` has them) by the seed's
    OPD formula. The teacher pass scores the main sequence: a rollout's branches get the task term alone."""
    kind, values = task
    advantages: list[Any] = []
    for index, trajectory in enumerate(trajectories):
        sequences = trajectory.sequences()
        counts = [len(sequence.total_token_ids or []) for sequence in sequences]
        if kind == "tok":
            try:
                task_rows = [np.asarray(row, dtype=np.float64) for row in token_advantage_rows(values[index], counts)]
            except TokenAdvantageError as exc:
                place = "" if exc.sequence is None else f", sequence {exc.sequence}"
                raise JobFailed(f"trajectory {index}{place}: task advantages: {exc.message}") from None
        else:  # grpo / seq: one value per rollout
            task_rows = [np.full(count, float(values[index]), dtype=np.float64) for count in counts]
        rows = []
        for number, (sequence, task_row) in enumerate(zip(sequences, task_rows, strict=True)):
            where = f"trajectory {index}" if len(sequences) == 1 else f"trajectory {index}, sequence {number}"
            trained = sequence.loss_weight() > 0
            row = np.where(trained, opd.task_reward_coef * task_row, 0.0)
            teacher = sequence.teacher_logprobs()
            if teacher is not None:
                if len(teacher) != len(trained) or np.isnan(teacher[trained]).any():
                    raise JobFailed(f"{where}: the teacher's logprobs do not cover its trained tokens")
                student = sequence.token_logprobs().astype(np.float64)
                kl = student[trained] - teacher[trained].astype(np.float64)
                row[trained] -= opd.kl_reward_coef * kl
            if not np.isfinite(row).all():
                raise JobFailed(f"{where}: an OPD advantage is not finite")
            rows.append(row.tolist())
        advantages.append(token_advantage_value(rows))
    return "tok", advantages
