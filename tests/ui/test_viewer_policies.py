"""The viewer's read API shows each session's policy beside its versions, and filters by policy (both stores)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from devtools.lora_adapter import build_adapter
from tests.fakes import FakeFleet, fake_fleet
from tests.harness import ProxyHarness

QUESTION = [{"role": "user", "content": "What is two plus two?"}]


@pytest.fixture(scope="module")
def adapter_dir(tokenizer_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_adapter(tokenizer_dir, tmp_path_factory.mktemp("adapters") / "v1", targets=("q_proj",), seed=1)


@pytest.fixture
async def viewer(tokenizer_dir: Path, store) -> AsyncIterator[tuple[ProxyHarness, FakeFleet]]:
    async with (
        fake_fleet(tokenizer_dir, 1, max_lora_rank=16) as fakes,
        ProxyHarness.running(engine_urls=fakes.urls, store=store) as harness,
    ):
        yield harness, fakes


async def one_turn(harness: ProxyHarness, policy: str | None) -> tuple[str, str]:
    session = await harness.create_session(QUESTION, policy=policy)
    answer = await session.client.chat.completions.create(model="m", messages=QUESTION)
    status, body = await harness.request(
        "POST", f"/v1/sessions/{session.session_id}/finish", json={"status": "success"}
    )
    assert status == 200, body
    return session.session_id, answer.id


async def listed(harness: ProxyHarness, query: str) -> list[str]:
    status, page = await harness.request("GET", f"/v1/admin/sessions?{query}")
    assert status == 200, page
    return [item["session_id"] for item in page["data"]]


async def test_the_listing_shows_and_filters_by_policy(viewer, adapter_dir):
    harness, _ = viewer
    status, body = await harness.request("POST", "/v1/admin/policies", json={"name": "pol", "path": str(adapter_dir)})
    assert status == 200, body
    base, _ = await one_turn(harness, None)
    lora, lora_leaf = await one_turn(harness, "pol")

    status, page = await harness.request("GET", "/v1/admin/sessions")
    assert status == 200
    shown = {item["session_id"]: (item["policy"], item["policy_versions"]) for item in page["data"]}
    assert shown == {lora: ("pol", ["pol@v1"]), base: ("base", ["0"])}
    assert await listed(harness, "policy=pol") == [lora]
    assert await listed(harness, "policy=base") == [base]
    assert await listed(harness, "policy=other") == []
    assert await listed(harness, "policy_version=pol%40v1") == [lora]
    assert await listed(harness, "policy_version=0") == [base]

    status, tree = await harness.request("GET", f"/v1/admin/sessions/{lora}")
    assert status == 200 and tree["summary"]["policy"] == "pol"
    assert [node["policy_versions"] for node in tree["nodes"]] == [["pol@v1"]]
    status, tokens = await harness.request("GET", f"/v1/admin/responses/{lora_leaf}/tokens")
    assert status == 200 and {span["policy"] for span in tokens["trajectory"]["policy_versions"]} == {"pol"}
