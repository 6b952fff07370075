"""The admin fleet routes' bodies: an engine URL the proxy can call, and policy versions every client reads exactly.

An engine added by URL is called by every worker from then on: a URL with credentials, a query or a
bad port would be stored and fail (or leak) on each call, so it is refused when it is added.
"""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from rollout_proxy.proxy.handlers.fleet_admin import (
    MAX_POLICY_VERSION,
    EngineIn,
    PauseIn,
    ResumeIn,
)
from rollout_proxy.settings import check_engine_url


@pytest.mark.parametrize(
    "url, kept",
    [
        ("http://10.0.0.5:8000", "http://10.0.0.5:8000"),
        ("https://engine.internal/", "https://engine.internal"),  # a trailing slash is dropped
        ("http://[::1]:8001/vllm/", "http://[::1]:8001/vllm"),
    ],
)
def test_an_engine_base_url_is_kept_without_its_trailing_slash(url, kept):
    assert check_engine_url(url) == kept


@pytest.mark.parametrize(
    "url",
    [
        "engine:8000",  # no scheme
        "ftp://engine:8000",
        "http://",  # no host
        "http://engine:8000/?token=1",
        "http://engine:8000/#frag",
        "http://user:secret@engine:8000",  # credentials would be stored and logged
        "http://engine :8000",
        "http://engine:99999",
        "http://engine:port",
    ],
)
def test_a_url_that_is_not_an_engines_base_url_is_refused(url):
    with pytest.raises(ValueError, match=r"base URL|port"):
        check_engine_url(url)


def test_the_add_body_checks_its_url_and_version():
    assert EngineIn.model_validate({"url": "http://e:1/", "policy_version": 3}).url == "http://e:1"
    for body in (
        {"url": "http://user@e:1"},
        {"url": "http://e:1", "policy_version": -1},
        {"url": "http://e:1", "policy_version": "3"},  # strict: no coercion
        {"url": "http://e:1", "extra": True},
    ):
        with pytest.raises(ValidationError):
            EngineIn.model_validate(body)


def test_policy_versions_stop_at_the_largest_safe_json_integer():
    assert ResumeIn.model_validate({"policy_version": MAX_POLICY_VERSION}).policy_version == 2**53 - 1
    with pytest.raises(ValidationError):
        ResumeIn.model_validate({"policy_version": MAX_POLICY_VERSION + 1})
    with pytest.raises(ValidationError):
        ResumeIn.model_validate({})


def test_a_pause_defaults_to_abort_and_knows_only_its_modes():
    assert PauseIn.model_validate({}).mode == "abort"
    with pytest.raises(ValidationError):
        PauseIn.model_validate({"mode": "drain"})
