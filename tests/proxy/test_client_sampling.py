"""What a client may send against the sampling a session pins: no-ops pass, the rest is refused or recorded.

A harness run unmodified always sends some sampling fields; ``refuse`` must let through the values that
change nothing (so Codex and the Agents SDK work on a default session) and name the first field that would
change the distribution; ``ignore`` must report every such field for the node, and nothing that is a no-op.
"""

from __future__ import annotations

import pytest

from rollout_proxy.errors import PinnedParameter
from rollout_proxy.proxy.client_sampling import (
    CHAT_FIELDS,
    MESSAGES_FIELDS,
    RESPONSES_FIELDS,
    check_client_sampling,
)
from rollout_proxy.records import GenerationConfig

SESSION = GenerationConfig(
    max_new_tokens=512, temperature=0.7, top_p=0.9, top_k=0, seed=3, chat_template_kwargs={"enable_thinking": False}
)


@pytest.mark.parametrize(
    "payload",
    [
        {},
        {"temperature": 0.7, "top_p": 0.9, "max_tokens": 512, "seed": 3},  # the session's own values
        {"temperature": None, "top_p": None},  # null is not sent
        {"n": 1, "presence_penalty": 0, "frequency_penalty": 0.0, "repetition_penalty": 1, "min_p": 0},
        {"top_k": -1},  # vLLM reads -1 as 0: no top-k, as the session
        {"logit_bias": {}},
        {"reasoning": {"summary": "auto"}, "reasoning_effort": "none"},
        {"thinking": {"type": "disabled"}},  # the session does not think
        {"chat_template_kwargs": {"enable_thinking": False}},
    ],
)
def test_values_that_change_nothing_pass_a_refuse_session(payload):
    assert check_client_sampling(payload, SESSION, CHAT_FIELDS, mode="refuse") == {}


@pytest.mark.parametrize(
    "payload, field",
    [
        ({"temperature": 1.0}, "temperature"),
        ({"temperature": True}, "temperature"),  # a bool is never a number here
        ({"max_tokens": 100}, "max_tokens"),
        ({"n": 2}, "n"),
        ({"top_k": 20}, "top_k"),
        ({"seed": 4}, "seed"),
        ({"logit_bias": {"42": 5}}, "logit_bias"),
        ({"reasoning": {"effort": "high"}}, "reasoning"),
        ({"thinking": {"type": "enabled"}}, "thinking"),
        ({"chat_template_kwargs": {"enable_thinking": True}}, "chat_template_kwargs"),
        ({"chat_template_kwargs": {"other": 1}}, "chat_template_kwargs"),
    ],
)
def test_a_field_that_would_change_sampling_is_refused_by_name(payload, field):
    with pytest.raises(PinnedParameter, match=f"'{field}'") as caught:
        check_client_sampling(payload, SESSION, CHAT_FIELDS, mode="refuse")
    assert caught.value.param == field and caught.value.status == 400


def test_ignore_returns_every_field_asked_for_and_no_no_ops():
    payload = {"temperature": 1.0, "top_p": 0.9, "max_output_tokens": 64, "n": 1, "reasoning": {"effort": "low"}}
    asked = check_client_sampling(payload, SESSION, RESPONSES_FIELDS, mode="ignore")
    assert asked == {"temperature": 1.0, "max_output_tokens": 64, "reasoning": {"effort": "low"}}


def test_claude_codes_usual_fields_are_not_no_ops_on_the_messages_api():
    payload = {"max_tokens": 32000, "thinking": {"type": "adaptive"}, "output_config": {"effort": "high"}}
    asked = check_client_sampling(payload, SESSION, MESSAGES_FIELDS, mode="ignore")
    assert asked == payload
    no_ops = {"max_tokens": 512, "thinking": {"type": "disabled"}, "output_config": {"effort": None}}
    assert check_client_sampling(no_ops, SESSION, MESSAGES_FIELDS, mode="refuse") == {}
    with pytest.raises(PinnedParameter, match="output_config"):
        check_client_sampling({"output_config": {"format": {"type": "json"}}}, SESSION, MESSAGES_FIELDS, mode="refuse")


def test_fields_outside_the_apis_table_are_not_checked():
    """The Messages API has no ``n`` or ``seed``: they are left to the request model, not pinned here."""
    assert check_client_sampling({"seed": 99, "n": 4}, SESSION, MESSAGES_FIELDS, mode="refuse") == {}
