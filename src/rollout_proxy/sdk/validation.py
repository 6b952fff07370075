"""Checks on what plugins return, with the error text a plugin author needs to fix it."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

from rollout_proxy.sdk.types import (
    CriticContext,
    GroupGraderResult,
    GroupRolloutResult,
    SingleGraderResult,
    TeacherContext,
    Trajectory,
)
from rollout_proxy.wire.feed import TokenAdvantageError, token_advantage_rows


class PluginValidationError(ValueError):
    """A plugin returned something the training engine cannot use."""


def _finite(values: Iterable[float], what: str) -> None:
    for index, value in enumerate(values):
        if not isinstance(value, (int, float)) or not math.isfinite(value):
            raise PluginValidationError(
                f"{what}[{index}] is {value!r}; every value must be a finite number (no NaN/Inf)"
            )


def check_group_rollout(result: GroupRolloutResult, n_sample: int) -> None:
    if result.status == "success" and len(result.responses) != n_sample:
        raise PluginValidationError(
            f"a group rollout must return exactly n_sample={n_sample} responses, got {len(result.responses)}; "
            "each SingleResponse.id names one trajectory (its last response)"
        )


def _text_only(message: Any, where: str) -> None:
    content = message.content
    if not isinstance(content, str):
        raise PluginValidationError(f"{where}.message.content must be text (a string), not {type(content).__name__}")


def _check_contexts(
    items: Sequence[Any], model: type[TeacherContext] | type[CriticContext], where: str, assistant_turns: int
) -> None:
    if not isinstance(items, list):
        raise PluginValidationError(f"{where} must be a list of {model.__name__} dicts")
    if len(items) > assistant_turns:
        raise PluginValidationError(
            f"{where} has {len(items)} entries but the trajectory has only {assistant_turns} assistant turns"
        )
    for index, item in enumerate(items):
        context: TeacherContext | CriticContext = item if isinstance(item, model) else model.model_validate(item)
        if not 0 <= context.qa_index < assistant_turns:
            raise PluginValidationError(
                f"{where}[{index}].qa_index={context.qa_index} is outside the trajectory's assistant turns "
                f"(0..{assistant_turns - 1}); qa_index counts assistant turns from 0, not messages"
            )
        _text_only(context.message, f"{where}[{index}]")


def check_rollout_config(config: dict[str, Any] | None, assistant_turns: int) -> None:
    """``teachers`` (one per trajectory, optional ``teacher_context``) and ``critic_context``."""
    if not config:
        return
    teachers = config.get("teachers")
    if teachers is not None:
        if not isinstance(teachers, dict) or len(teachers) > 1:
            raise PluginValidationError(
                "config['teachers'] must name at most one teacher per trajectory, e.g. {'teacher_math': {}}"
            )
        for name, settings in teachers.items():
            contexts = (settings or {}).get("teacher_context")
            if contexts is not None:
                _check_contexts(
                    contexts, TeacherContext, f"config['teachers'][{name!r}]['teacher_context']", assistant_turns
                )
    if config.get("critic_context") is not None:
        _check_contexts(config["critic_context"], CriticContext, "config['critic_context']", assistant_turns)


def check_single_grader(result: SingleGraderResult) -> None:
    _finite([result.reward], "reward")


def check_group_grader(result: GroupGraderResult, trajectories: Sequence[Trajectory]) -> None:
    n = len(trajectories)
    if result.status != "success":
        return
    if len(result.rewards) != n:
        raise PluginValidationError(
            f"rewards has {len(result.rewards)} values for {n} trajectories; return one per trajectory, in order"
        )
    _finite(result.rewards, "rewards")
    if result.seq_advantages is not None and result.tok_advantages is not None:
        raise PluginValidationError("return either seq_advantages or tok_advantages from one grader call, not both")
    if result.seq_advantages is not None:
        if len(result.seq_advantages) != n:
            raise PluginValidationError(
                f"seq_advantages has {len(result.seq_advantages)} values for {n} trajectories; one per trajectory"
            )
        _finite(result.seq_advantages, "seq_advantages")
    if result.tok_advantages is not None:
        if len(result.tok_advantages) != n:
            raise PluginValidationError(
                f"tok_advantages has {len(result.tok_advantages)} lists for {n} trajectories; one per trajectory"
            )
        entries: list[Any] = list(result.tok_advantages)
        for index, (values, trajectory) in enumerate(zip(entries, trajectories, strict=True)):
            _check_token_advantages(values, trajectory, index)


def _check_token_advantages(values: list[Any], trajectory: Trajectory, index: int) -> None:
    """``tok_advantages[index]``: one value per token, of the trajectory's one sequence (the seed's form), or one
    list per sequence of ``trajectory.sequences()`` (``wire.feed.token_advantage_rows``)."""
    sequences = trajectory.sequences()
    if trajectory.total_token_ids is None:  # no tokens to check against (a mocked trajectory): values only
        nested = bool(values) and all(isinstance(row, list) for row in values)
        for k, row in enumerate(values if nested else [values]):
            _finite(row, f"tok_advantages[{index}][{k}]" if nested else f"tok_advantages[{index}]")
        return
    lengths = [len(sequence.total_token_ids or []) for sequence in sequences]
    flat = not any(isinstance(row, list) for row in values)
    if flat and len(lengths) == 1 and len(values) != lengths[0]:
        raise PluginValidationError(
            f"tok_advantages[{index}] has {len(values)} values but trajectory {index} has {lengths[0]} tokens; "
            "give one per token of total_token_ids (masked positions may hold any finite value)"
        )
    try:
        rows = token_advantage_rows(values, lengths)
    except TokenAdvantageError as exc:
        where = f"tok_advantages[{index}]" + ("" if exc.sequence is None else f"[{exc.sequence}]")
        raise PluginValidationError(
            f"{where}: {exc.message}; trajectory {index} has {len(lengths)} sequence(s) "
            f"(trajectory.sequences(): the main one and its branches) of {lengths} tokens"
        ) from None
    for k, row in enumerate(rows):
        _finite(row, f"tok_advantages[{index}]" if flat else f"tok_advantages[{index}][{k}]")


def check_advantage_batch(results: Sequence[GroupGraderResult]) -> None:
    """All or none of a batch's groups carry custom advantages."""
    custom = [r.seq_advantages is not None or r.tok_advantages is not None for r in results]
    if any(custom) and not all(custom):
        raise PluginValidationError(
            f"{sum(custom)} of {len(custom)} groups in this batch return custom advantages; "
            "a batch must use custom advantages for all of its groups or for none"
        )
