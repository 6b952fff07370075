"""``@rollout`` / ``@single_rollout`` / ``@group_rollout`` / ``@single_grader`` / ``@group_grader``.

A decorator checks the function when it is declared (its signature, its runtime
settings) and returns a ``Plugin``: called as before, it also checks what the
function returns; ``await plugin.arun(...)`` runs a sync function in a thread pool so
it never blocks the caller's event loop.
"""

from __future__ import annotations

import asyncio
import enum
import functools
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel

from rollout_proxy.sdk.proxy import RolloutInferenceProxy
from rollout_proxy.sdk.runtime import Runtime
from rollout_proxy.sdk.types import (
    GroupGraderResult,
    GroupRolloutResult,
    RolloutResult,
    SingleGraderResult,
    Trajectory,
)
from rollout_proxy.sdk.validation import (
    PluginValidationError,
    check_group_grader,
    check_group_rollout,
    check_rollout_config,
    check_single_grader,
)


class PluginKind(str, enum.Enum):
    SINGLE_ROLLOUT = "single_rollout"
    GROUP_ROLLOUT = "group_rollout"
    SINGLE_GRADER = "single_grader"
    GROUP_GRADER = "group_grader"

    @property
    def is_rollout(self) -> bool:
        return self in (PluginKind.SINGLE_ROLLOUT, PluginKind.GROUP_ROLLOUT)


#: the parameters each kind is called with, in order
SIGNATURES = {
    PluginKind.SINGLE_ROLLOUT: ("context", "proxy", "sample"),
    PluginKind.GROUP_ROLLOUT: ("context", "proxy", "sample", "n_sample"),
    PluginKind.SINGLE_GRADER: ("context", "sample", "trajectory"),
    PluginKind.GROUP_GRADER: ("context", "sample", "trajectories"),
}


@dataclass(frozen=True, slots=True)
class PluginSpec:
    kind: PluginKind
    name: str
    description: str
    runtime: Runtime
    is_async: bool


def _check_signature(function: Callable[..., Any], kind: PluginKind) -> None:
    wanted = SIGNATURES[kind]
    parameters = [
        p
        for p in inspect.signature(function).parameters.values()
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
    ]
    required = [p for p in parameters if p.default is p.empty]
    if kind is PluginKind.GROUP_ROLLOUT and not any(p.name == "n_sample" for p in parameters):
        raise TypeError(
            f"@group_rollout {function.__name__} needs an 'n_sample' parameter: (context, proxy, sample, n_sample=1)"
        )
    if len(parameters) < len(wanted) - (kind is PluginKind.GROUP_ROLLOUT) or len(required) > len(wanted):
        raise TypeError(
            f"@{kind.value} {function.__name__} must take ({', '.join(wanted)}), got ({', '.join(p.name for p in parameters)})"
        )


class Plugin:
    """A declared plugin function. Call it as the original; ``arun`` for async callers."""

    def __init__(self, function: Callable[..., Any], spec: PluginSpec) -> None:
        functools.update_wrapper(self, function)
        self.function = function
        self.spec = spec

    def __repr__(self) -> str:
        return f"<{self.spec.kind.value} plugin {self.spec.name!r}>"

    def _prepare(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> inspect.BoundArguments:
        bound = inspect.signature(self.function).bind(*args, **kwargs)
        bound.apply_defaults()
        proxy = bound.arguments.get("proxy")
        if isinstance(proxy, RolloutInferenceProxy):
            proxy.group = self.spec.kind is PluginKind.GROUP_ROLLOUT
        return bound

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        bound = self._prepare(args, kwargs)
        result = self.function(*bound.args, **bound.kwargs)
        if inspect.isawaitable(result):
            return self._checked_async(result, bound)
        return self._check(result, bound)

    async def _checked_async(self, awaitable: Any, bound: inspect.BoundArguments) -> Any:
        return self._check(await awaitable, bound)

    async def arun(self, *args: Any, **kwargs: Any) -> Any:
        """Run from async code: sync functions go to a worker thread."""
        if self.spec.is_async:
            return await self(*args, **kwargs)
        return await asyncio.to_thread(self, *args, **kwargs)

    def _check(self, result: Any, bound: inspect.BoundArguments) -> Any:
        kind = self.spec.kind
        arguments = bound.arguments
        if kind is PluginKind.SINGLE_ROLLOUT and result is not None:
            result = _coerce(result, RolloutResult, kind)
            proxy = arguments.get("proxy")
            turns = sum(1 for m in getattr(proxy, "messages", []) if m.get("role") == "assistant")
            check_rollout_config(result.config, turns)
        elif kind is PluginKind.GROUP_ROLLOUT:
            result = _coerce(result, GroupRolloutResult, kind)
            check_group_rollout(result, int(arguments["n_sample"]))
        elif kind is PluginKind.SINGLE_GRADER:
            result = _coerce(result, SingleGraderResult, kind)
            check_single_grader(result)
        elif kind is PluginKind.GROUP_GRADER:
            result = _coerce(result, GroupGraderResult, kind)
            trajectories = [
                t if isinstance(t, Trajectory) else Trajectory.model_validate(t) for t in arguments["trajectories"]
            ]
            check_group_grader(result, trajectories)
        return result


def _coerce(result: Any, model: type[BaseModel], kind: PluginKind) -> Any:
    if isinstance(result, model):
        return result
    if isinstance(result, dict) or hasattr(result, "__dataclass_fields__") or hasattr(result, "model_dump"):
        data = result if isinstance(result, dict) else getattr(result, "model_dump", lambda: vars(result))()
        return model.model_validate(data)
    raise PluginValidationError(f"@{kind.value} must return a {model.__name__}, got {type(result).__name__}")


def _declare(
    kind: PluginKind,
    function: Callable[..., Any] | None,
    name: str | None,
    description: str | None,
    runtime: Runtime | dict | None,
):
    runtime_spec = runtime if isinstance(runtime, Runtime) else Runtime.model_validate(runtime or {})

    def decorate(target: Callable[..., Any]) -> Plugin:
        target = target.function if isinstance(target, Plugin) else target
        _check_signature(target, kind)
        spec = PluginSpec(
            kind=kind,
            name=name or target.__name__,
            description=description or (inspect.getdoc(target) or ""),
            runtime=runtime_spec,
            is_async=inspect.iscoroutinefunction(target),
        )
        return Plugin(target, spec)

    return decorate(function) if function is not None else decorate


def single_rollout(function=None, *, name=None, description=None, runtime=None):
    """A rollout producing one trajectory per call: ``(context, proxy, sample) -> RolloutResult | None``."""
    return _declare(PluginKind.SINGLE_ROLLOUT, function, name, description, runtime)


rollout = single_rollout


def group_rollout(function=None, *, name=None, description=None, runtime=None):
    """A rollout producing ``n_sample`` trajectories per call (Responses API):
    ``(context, proxy, sample, n_sample) -> GroupRolloutResult``."""
    return _declare(PluginKind.GROUP_ROLLOUT, function, name, description, runtime)


def single_grader(function=None, *, name=None, description=None, runtime=None):
    """Scores one trajectory: ``(context, sample, trajectory) -> SingleGraderResult``."""
    return _declare(PluginKind.SINGLE_GRADER, function, name, description, runtime)


def group_grader(function=None, *, name=None, description=None, runtime=None):
    """Scores a sample's trajectories together: ``(context, sample, trajectories) -> GroupGraderResult``."""
    return _declare(PluginKind.GROUP_GRADER, function, name, description, runtime)
