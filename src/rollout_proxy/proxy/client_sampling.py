"""Generation parameters a client sends, against the session that pins them (``client_sampling``).

A session pins how the policy samples (``GenerationConfig``). A plugin written for the proxy never sets
those parameters; a harness run unmodified (Codex, the Agents SDK, Claude Code) always sends some. The
session says what happens then:

- ``refuse`` (the default, the seed's rule): a field that would change sampling is a 400
  (``PinnedParameter``, naming it). A field whose value changes nothing is accepted: equal to the
  session's value, or neutral (``n: 1``, a penalty of 0, ``reasoning`` without an effort, ...);
- ``ignore``: everything is accepted, the session's values are used, and what the client asked for
  (the fields that are not no-ops) is returned for the caller to record on the node (and count).

One function (``check_client_sampling``) over a per-API table of ``SamplingField``s: an API adds its
own table (a tuple of fields, most of them built from the helpers here) and calls it with the payload.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from rollout_proxy.errors import PinnedParameter
from rollout_proxy.records import GenerationConfig

ClientSampling = Literal["refuse", "ignore"]
CLIENT_SAMPLING_MODES: tuple[ClientSampling, ...] = ("refuse", "ignore")

#: whether a value the client sent changes nothing, given the session's settings
NoOp = Callable[[Any, GenerationConfig], bool]


def never(value: Any, generation: GenerationConfig) -> bool:
    return False


def equal_to(read: Callable[[GenerationConfig], Any]) -> NoOp:
    """A no-op when the value is the session's (numbers compared as numbers, never a bool for a number)."""

    def no_op(value: Any, generation: GenerationConfig) -> bool:
        if isinstance(value, bool) or not isinstance(value, int | float):
            return False
        return bool(value == read(generation))

    return no_op


def neutral(*values: float) -> NoOp:
    """A no-op when the value is one that leaves sampling as it is (``n: 1``, a penalty of 0)."""

    def no_op(value: Any, generation: GenerationConfig) -> bool:
        return not isinstance(value, bool) and isinstance(value, int | float) and value in values

    return no_op


def _top_k(value: Any, generation: GenerationConfig) -> bool:
    """vLLM reads 0 and -1 alike (no top-k); the session stores 0 for both."""
    if isinstance(value, bool) or not isinstance(value, int):
        return False
    return (0 if value == -1 else value) == generation.top_k


def _enable_thinking(generation: GenerationConfig) -> bool | None:
    kwargs = generation.chat_template_kwargs or {}
    value = kwargs.get("enable_thinking")
    return value if isinstance(value, bool) else None


#: Reasoning efforts that ask for nothing the session does not already do: none (no effort given, the
#: Agents SDK's default for its default model); whether the policy thinks is the session's
#: ``chat_template_kwargs`` (``enable_thinking``), which no effort can change.
NO_OP_EFFORTS = (None, "none")


def _effort(value: Any, generation: GenerationConfig) -> bool:
    return value in NO_OP_EFFORTS


def _reasoning(value: Any, generation: GenerationConfig) -> bool:
    """Responses' ``reasoning``: ``summary`` / ``generate_summary`` change no token; only ``effort`` could."""
    return isinstance(value, dict) and value.get("effort") in NO_OP_EFFORTS


def _thinking(value: Any, generation: GenerationConfig) -> bool:
    """``thinking: {"type": "enabled" | "disabled"}`` equal to the session's ``enable_thinking``."""
    if not isinstance(value, dict):
        return False
    kind = value.get("type")
    return kind in ("enabled", "disabled") and _enable_thinking(generation) is (kind == "enabled")


def _template_kwargs(value: Any, generation: GenerationConfig) -> bool:
    """Every key the client sets has the session's value already."""
    if not isinstance(value, dict):
        return False
    session = generation.chat_template_kwargs or {}
    return all(key in session and session[key] == item for key, item in value.items())


def _max_tokens(value: Any, generation: GenerationConfig) -> bool:
    return not isinstance(value, bool) and isinstance(value, int) and value == generation.max_new_tokens


@dataclass(frozen=True, slots=True)
class SamplingField:
    """A request field that asks for a way of sampling; ``no_op`` says when its value changes nothing."""

    name: str
    no_op: NoOp = never


#: Fields every OpenAI-style API shares (the seed's GenerationConfig and what else changes the distribution).
SHARED_FIELDS: tuple[SamplingField, ...] = (
    SamplingField("n", neutral(1)),
    SamplingField("max_new_tokens", _max_tokens),
    SamplingField("temperature", equal_to(lambda generation: generation.temperature)),
    SamplingField("top_p", equal_to(lambda generation: generation.top_p)),
    SamplingField("top_k", _top_k),
    SamplingField("seed", lambda value, generation: value is not None and value == generation.seed),
    SamplingField("min_p", neutral(0)),
    SamplingField("presence_penalty", neutral(0)),
    SamplingField("frequency_penalty", neutral(0)),
    SamplingField("repetition_penalty", neutral(1)),
    SamplingField("logit_bias", lambda value, generation: value == {}),
    SamplingField("thinking", _thinking),
    SamplingField("reasoning_effort", _effort),
    SamplingField("chat_template_kwargs", _template_kwargs),
)

CHAT_FIELDS: tuple[SamplingField, ...] = (
    *SHARED_FIELDS,
    SamplingField("max_tokens", _max_tokens),
    SamplingField("max_completion_tokens", _max_tokens),
    SamplingField("max_output_tokens", _max_tokens),
    SamplingField("reasoning", _reasoning),
)

RESPONSES_FIELDS: tuple[SamplingField, ...] = (
    *SHARED_FIELDS,
    SamplingField("max_output_tokens", _max_tokens),
    SamplingField("max_tokens", _max_tokens),
    SamplingField("max_completion_tokens", _max_tokens),
    SamplingField("reasoning", _reasoning),
)


def _output_config(value: Any, generation: GenerationConfig) -> bool:
    """Messages' ``output_config``: no effort (or ``none``) and no ``format`` (a structured output would
    constrain sampling); any other key is taken as asking for something."""
    return (
        isinstance(value, dict)
        and value.get("effort") in NO_OP_EFFORTS
        and value.get("format") is None
        and set(value) <= {"effort", "format"}
    )


#: The Anthropic Messages API's (``POST /v1/messages``): every client sends ``max_tokens``; Claude Code also
#: ``thinking: {"type": "adaptive"}`` and ``output_config.effort``, none of them no-ops (README: set
#: ``client_sampling: ignore`` for it). ``thinking`` ``enabled``/``disabled`` is one when it is the session's.
MESSAGES_FIELDS: tuple[SamplingField, ...] = (
    SamplingField("max_tokens", _max_tokens),
    SamplingField("temperature", equal_to(lambda generation: generation.temperature)),
    SamplingField("top_p", equal_to(lambda generation: generation.top_p)),
    SamplingField("top_k", _top_k),
    SamplingField("thinking", _thinking),
    SamplingField("output_config", _output_config),
)


def check_client_sampling(
    payload: Mapping[str, Any],
    generation: GenerationConfig,
    fields: tuple[SamplingField, ...],
    *,
    mode: str,
) -> dict[str, Any]:
    """What the client asked for that the session does not do: ``{field: value}`` (empty when nothing).

    ``refuse``: the first such field is a ``PinnedParameter`` (400) naming it, and nothing is returned.
    ``ignore``: all of them are returned, to be recorded; the session's values are what the turn uses.
    A field sent as null is not sent."""
    asked: dict[str, Any] = {}
    for field in fields:
        value = payload.get(field.name)
        if value is None or field.no_op(value, generation):
            continue
        if mode != "ignore":
            raise PinnedParameter(
                f"'{field.name}' is pinned by the session's generation settings; set it in the sample or the "
                "job's hyperparameters, not in the request (a harness that always sends it: create the session "
                "with client_sampling: ignore, and the session's values are used)",
                param=field.name,
            )
        asked[field.name] = value
    return asked
