"""The runner's admin client against a real proxy (and the fake engine): sessions, finish, counters, errors."""

from __future__ import annotations

import pytest

from rollout_proxy.runner.admin import AdminClient
from rollout_proxy.sdk.transport import ProxyClient, ProxyRequestError, ProxyUnreachable
from rollout_proxy.sdk.types import ChatCompletionSample
from tests.conftest import free_port
from tests.harness import ADMIN_KEY, ProxyHarness

USER = [{"role": "user", "content": "Tell me a fact."}]


@pytest.fixture
def template_name() -> str:
    """One chat template is enough here: the client does not depend on it."""
    return "qwen3_style"


@pytest.fixture
async def proxy(fake_engine):
    async with ProxyHarness.running(engine_urls=[fake_engine.url], fake=fake_engine) as harness:
        yield harness


@pytest.fixture
async def admin(proxy):
    async with AdminClient(proxy.url, ADMIN_KEY) as client:
        yield client


def sample(**generation) -> ChatCompletionSample:
    return ChatCompletionSample.model_validate({"messages": USER, "extra": {"id": "s1"}, **generation})


async def test_a_session_is_created_with_the_samples_settings_and_finished_into_trajectories(proxy, admin):
    proxy.fake.queue("Water boils at 100C.")
    session = await admin.create_session(sample(max_new_tokens=32), context={"phase": "train"})
    status, record = await proxy.request("GET", f"/v1/sessions/{session.session_id}")
    assert status == 200 and record["generation"]["max_new_tokens"] == 32
    client = proxy.client(session.url, session.jwt_token)
    answer = await client.chat.completions.create(model="m", messages=USER)
    finished = await admin.finish(session.session_id, {"status": "success", "extra": {"id": "s1"}})
    trajectories = finished.trajectories
    assert finished.images == {}  # a text rollout names no image
    assert [t.response_id for t in trajectories] == [answer.id]
    trajectory = trajectories[0]
    assert trajectory.extra["id"] == "s1" and trajectory.turns == 1
    assert len(trajectory.total_token_ids) == len(trajectory.total_loss_weight) > 0


async def test_a_harness_session_has_no_sample_messages_and_its_client_sampling(proxy, admin):
    """What the runner opens for a job whose samples leave out messages and whose sessions ignore the
    generation fields a harness sends (``proxy.client_sampling: ignore`` in the job file)."""
    harness_sample = ChatCompletionSample.model_validate({"extra": {"task": "Read marker.txt."}})
    session = await admin.create_session(harness_sample, client_sampling="ignore")
    status, record = await proxy.request("GET", f"/v1/sessions/{session.session_id}")
    assert status == 200 and record["messages"] == [] and record["client_sampling"] == "ignore"
    proxy.fake.queue("Done.")
    client = proxy.client(session.url, session.jwt_token)
    answer = await client.responses.create(model="m", input="Read marker.txt.", temperature=0.1)
    assert answer.output_text == "Done."  # temperature 0.1 ignored: the session's is used


async def test_counters_are_summed_by_name_and_absent_until_counted(proxy, admin):
    assert "forks_total" not in await admin.counters()
    proxy.fake.queue("Water boils at 100C.", "Another one?", "Ice melts at 0C.")
    session = await admin.create_session(sample())
    client = proxy.client(session.url, session.jwt_token)
    first = await client.chat.completions.create(model="m", messages=USER)
    more = {"role": "user", "content": "More."}
    await client.chat.completions.create(model="m", messages=[*USER, first.choices[0].message.model_dump(), more])
    rewritten = {"role": "assistant", "content": "Water boils at 90C."}
    await client.chat.completions.create(model="m", messages=[*USER, rewritten, more])  # a fork
    counters = await admin.counters()
    assert counters["forks_total"] == 1.0 and "prompt_drift_total" not in counters


async def test_an_error_answer_surfaces_with_its_status(proxy, admin):
    session = await admin.create_session(sample())
    await admin.finish(session.session_id, {"status": "failure", "error": "tool down"})
    with pytest.raises(ProxyRequestError) as finished_twice:
        await admin.finish(session.session_id, {"status": "success"})
    assert finished_twice.value.status == 409 and finished_twice.value.message
    with pytest.raises(ProxyRequestError) as unknown:
        await admin.finish("sess_0000000000000000", {"status": "success"})
    assert unknown.value.status == 404


async def test_a_wrong_admin_key_is_refused(proxy):
    async with AdminClient(proxy.url, "not-the-key") as client:
        with pytest.raises(ProxyRequestError) as refused:
            await client.counters()
    assert refused.value.status == 401 and "admin key" in refused.value.message


async def test_no_proxy_is_unreachable_not_a_transport_error():
    async with AdminClient(f"http://127.0.0.1:{free_port()}", ADMIN_KEY, timeout=5) as client:
        with pytest.raises(ProxyUnreachable) as unreachable:
            await client.counters()
    assert unreachable.value.status is None


async def test_a_shared_transport_is_left_open(proxy):
    transport = ProxyClient(proxy.url, ADMIN_KEY)
    async with AdminClient(proxy.url, ADMIN_KEY, transport=transport) as client:
        await client.counters()
    assert await transport.aget("/v1/admin/counters") is not None  # still usable
    await transport.aclose()


async def test_a_jobs_policy_reaches_its_sessions_and_an_unknown_one_is_the_proxys_400(proxy, admin):
    """``proxy.policy`` in the job file is sent at session creation (the runner's ``Rollouts``); the base's body
    names none, and a policy the proxy does not know is refused there in words."""
    session = await admin.create_session(sample(), policy="base")
    status, record = await proxy.request("GET", f"/v1/sessions/{session.session_id}")
    assert status == 200 and "policy" not in record
    with pytest.raises(ProxyRequestError) as raised:
        await admin.create_session(sample(), policy="grpo-lora")
    assert raised.value.status == 400 and "its policies: base" in str(raised.value)
    assert await admin.policy_version() == await admin.policy_version("base")
