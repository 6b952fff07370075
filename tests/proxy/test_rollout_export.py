"""One rollout, many conversations: the export of a session's whole tree (``GET /v1/sessions/{id}/rollout``).

One harness-owned session (no sample messages) holds, as a harness run does: the main agent's turn,
a subagent of its own (Responses API, ``previous_response_id``, labelled by header), the main agent's
second turn, a compaction (the task then a summary: a rewrite, labelled in ``metadata``) retried and
continued, a side call on the Anthropic Messages API (a title), and an edited second turn (a sibling
sharing the main agent's first turn). On both stores
and both templates, checked against what the fake engine received and sampled: every generated node's
tokens are the engine's, every sampled token is trained (weight 1) in exactly one sequence but the
retry the conversation did not go on from, and a finish that names no responses emits them all.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from rollout_proxy.proxy import keys
from rollout_proxy.records import NodeKind
from rollout_proxy.wire.trajectory import Trajectory
from tests.harness import ProxyHarness, Session

SYSTEM = {"role": "system", "content": "You are the main agent."}
TASK = {"role": "user", "content": "Fix the failing test."}
SUB = [
    {"role": "system", "content": "You are a search subagent."},
    {"role": "user", "content": "Find where the test lives."},
]
SUMMARY = {"role": "user", "content": "Summary so far: the test is in tests/test_x.py."}


async def harness_session(proxy: ProxyHarness, **fields: Any) -> Session:
    status, body = await proxy.request(
        "POST", "/v1/sessions", json={"sample": {}, "generation": {"max_new_tokens": 64}, **fields}
    )
    assert status == 201, body
    return Session(client=proxy.client(body["base_url"], body["api_key"]), **body)


def assistant(completion: Any) -> dict[str, Any]:
    return {"role": "assistant", "content": completion.choices[0].message.content}


async def run_harness(proxy: ProxyHarness, session: Session) -> dict[str, str]:
    """The rollout, as a harness runs it; the response id of each turn by name."""
    fake = proxy.fake
    assert fake is not None
    chat = session.client.chat.completions
    fake.queue("Let me look.", "tests/test_x.py", "Found it: tests/test_x.py.", "I will edit it.")
    main1 = await chat.create(model="m", messages=[SYSTEM, TASK])
    sub1 = await session.client.responses.create(model="m", input=SUB, extra_headers={"X-Rollout-Branch": "subagent-1"})
    sub2 = await session.client.responses.create(
        model="m",
        input="Say it in one line.",
        previous_response_id=sub1.id,
        extra_headers={"X-Rollout-Branch": "subagent-1"},
    )
    history = [SYSTEM, TASK, assistant(main1), {"role": "user", "content": "The subagent says tests/test_x.py."}]
    main2 = await chat.create(model="m", messages=history)
    fake.queue("Compacted once.", "Compacted again.", "Continuing after the summary.", "A title.", "Edited turn.")
    compacted = [SYSTEM, TASK, SUMMARY]
    compact = await chat.create(model="m", messages=compacted, metadata={"rollout_branch": "compaction"})
    again = await chat.create(model="m", messages=compacted, metadata={"rollout_branch": "compaction"})  # retried
    compact2 = await chat.create(
        model="m", messages=[*compacted, assistant(again), {"role": "user", "content": "Go on."}]
    )
    # a side call on the Anthropic Messages API (a title), labelled by header: a conversation of its own
    status, title = await proxy.request(
        "POST",
        "/v1/messages",
        json={"model": "m", "max_tokens": 64, "messages": [{"role": "user", "content": "Write a title."}]},
        token=None,
        headers={"x-api-key": session.api_key, "anthropic-version": "2023-06-01", "X-Rollout-Branch": "title"},
    )
    assert status == 200, title
    edited = await chat.create(
        model="m", messages=[SYSTEM, TASK, assistant(main1), {"role": "user", "content": "Edited: go on."}]
    )
    ids = [r.id for r in (main1, sub1, sub2, main2, compact, again, compact2)] + [title["id"], edited.id]
    names = ("main1", "sub1", "sub2", "main2", "compact", "again", "compact2", "title", "edited")
    return dict(zip(names, ids, strict=True))


def node_spans(sequence: dict[str, Any], nodes: dict[str, Any]) -> dict[str, tuple[int, int]]:
    """Where each generated node's output is in a sequence's ``total_token_ids``."""
    spans, position = {}, 0
    for response_id in sequence["response_ids"]:
        node = nodes[response_id]
        position += len(node.prompt_ids)
        if node.kind is NodeKind.GENERATED:
            spans[response_id] = (position, position + len(node.output_ids))
        position += len(node.output_ids)
    return spans


@pytest.mark.parametrize("retry", ["drop", "keep"])
async def test_the_export_trains_every_sampled_token_once(proxy: ProxyHarness, retry: str):
    session = await harness_session(proxy, retry=retry)
    turns = await run_harness(proxy, session)
    status, export = await proxy.request("GET", f"/v1/sessions/{session.session_id}/rollout", token=session.api_key)
    assert status == 200, export
    stored = await proxy.app[keys.STORE].get_nodes(session.session_id)
    nodes = {node.id: node for node in stored}
    fake = proxy.fake
    assert fake is not None
    # every generated node's path is exactly what the engine was given and sampled, turn by turn
    generated = [node for node in stored if node.kind is NodeKind.GENERATED]
    assert len(generated) == len(fake.generations) == 9 and not fake.routing_probes
    leaves_by_id = {sequence["leaf"]: sequence for sequence in export["sequences"]}
    engine_tokens = 0
    for node, generation in zip(generated, fake.generations, strict=True):
        engine_tokens += len(generation.tokens)
        assert node.output_ids.tolist() == generation.tokens
        if node.id in leaves_by_id:
            assert leaves_by_id[node.id]["total_token_ids"] == generation.prompt + generation.tokens
    # one sequence per generated leaf, the main one (the latest leaf) first
    leaves = [sequence["leaf"] for sequence in export["sequences"]]
    assert leaves[0] == turns["edited"] and export["sequences"][0]["main"]
    expected = {turns[name] for name in ("sub2", "main2", "compact", "compact2", "title", "edited")}
    assert set(leaves) == expected and len(leaves) == len(expected)
    # every sampled token has weight 1 in exactly one sequence (the dropped retry's in none)
    trained_in: dict[str, int] = {node.id: 0 for node in generated}
    for sequence in export["sequences"]:
        weights = np.asarray(sequence["total_loss_weight"])
        for node_id, (start, end) in node_spans(sequence, nodes).items():
            assert set(weights[start:end].tolist()) <= {0.0, 1.0} and len(set(weights[start:end].tolist())) <= 1
            trained_in[node_id] += int(weights[start:end].all()) if end > start else 0
        assert weights.sum() == sum(
            end - start for node_id, (start, end) in node_spans(sequence, nodes).items() if weights[start:end].all()
        )
    dropped_id = turns["compact"]
    assert trained_in == {node_id: 0 if retry == "drop" and node_id == dropped_id else 1 for node_id in trained_in}
    sampled = sum(len(node.output_ids) for node in generated)
    assert export["sampled_tokens"] == sampled == engine_tokens
    assert export["trained_tokens"] + export["dropped_tokens"] == sampled
    assert export["dropped_tokens"] == (len(nodes[dropped_id].output_ids) if retry == "drop" else 0)
    assert sum(sum(sequence["total_loss_weight"]) for sequence in export["sequences"]) == export["trained_tokens"]
    # the branches, named: where each sequence leaves the tree, and the clients' labels
    branch = {sequence["leaf"]: sequence["branch"] for sequence in export["sequences"]}
    assert branch[turns["sub2"]] == {
        "kind": "new_conversation",
        "label": "subagent-1",
        "from": None,
        "at_message": None,
    }
    assert branch[turns["compact2"]]["kind"] == "retry" and branch[turns["compact2"]]["from"] == turns["compact"]
    assert branch[turns["compact"]] == {
        "kind": "rewrite",
        "label": "compaction",
        "from": turns["main1"],
        "at_message": 2,
    }
    assert branch[turns["edited"]]["kind"] == "new_conversation"  # the main agent's own root
    assert branch[turns["title"]] == {"kind": "new_conversation", "label": "title", "from": None, "at_message": None}
    assert {node.api for node in generated} == {"chat", "responses", "messages"}  # all three APIs
    assert [s["dropped"] for s in export["sequences"]].count(True) == (1 if retry == "drop" else 0)


async def test_a_finish_naming_no_responses_emits_the_whole_rollout(proxy: ProxyHarness):
    session = await harness_session(proxy)
    turns = await run_harness(proxy, session)
    _, export = await proxy.request("GET", f"/v1/sessions/{session.session_id}/rollout")
    status, finished = await proxy.request(
        "POST", f"/v1/sessions/{session.session_id}/finish", json={"status": "success", "extra": {"score": 1}}
    )
    assert status == 200, finished
    (main,) = [Trajectory.model_validate(t) for t in finished["trajectories"]]
    assert main.response_id == turns["edited"] and main.main
    kept = [s for s in export["sequences"] if not s["dropped"]]
    assert [s.response_id for s in main.sequences()] == [s["leaf"] for s in kept]
    for got, want in zip(main.sequences(), kept, strict=True):
        assert got.total_token_ids == want["total_token_ids"] and got.total_loss_weight == want["total_loss_weight"]
        assert got.extra == {"score": 1}
    assert sum(sum(s.total_loss_weight or []) for s in main.sequences()) == export["trained_tokens"]
    # the dropped retry is in no sequence: its counts travel on the main trajectory
    assert main.rollout_counts is not None and main.rollout_counts.model_dump() == {
        "sequences": len(kept),
        "sampled_tokens": export["sampled_tokens"],
        "trained_tokens": export["trained_tokens"],
        "dropped_tokens": export["dropped_tokens"],
        "dropped_sequences": 1,
    }
    assert export["dropped_tokens"] > 0 and all(branch.rollout_counts is None for branch in main.branches)


async def test_a_finish_naming_responses_trains_a_shared_turn_in_the_first_named_only(proxy: ProxyHarness):
    """The main agent's second turn and the edited one share its first turn; the dropped retry is named too."""
    session = await harness_session(proxy)
    turns = await run_harness(proxy, session)
    named = [turns["main2"], turns["edited"], turns["compact"]]
    status, finished = await proxy.request(
        "POST",
        f"/v1/sessions/{session.session_id}/finish",
        json={"status": "success", "responses": [{"id": response_id} for response_id in named]},
    )
    assert status == 200, finished
    nodes = {node.id: node for node in await proxy.app[keys.STORE].get_nodes(session.session_id)}
    trajectories = finished["trajectories"]
    assert [t["response_id"] for t in trajectories] == named
    trained: dict[str, list[int]] = {}
    for index, trajectory in enumerate(trajectories):
        path = [nodes[turns["main1"]], nodes[trajectory["response_id"]]]
        if trajectory["response_id"] == turns["compact"]:
            path = [nodes[turns["compact"]]]
        weights = np.asarray(trajectory["total_loss_weight"])
        logprobs = np.asarray(trajectory["total_token_logprobs"])
        for node_id, (start, end) in node_spans({"response_ids": [n.id for n in path]}, nodes).items():
            if weights[start:end].all():
                trained.setdefault(node_id, []).append(index)
                assert logprobs[start:end].tolist() == nodes[node_id].output_logprobs.tolist()
            else:
                assert not weights[start:end].any() and not logprobs[start:end].any()
    # each named turn once: the shared first turn by the first named response that holds it
    assert trained == {turns["main1"]: [0], turns["main2"]: [0], turns["edited"]: [1], turns["compact"]: [2]}
    assert sum(sum(t["total_loss_weight"]) for t in trajectories) == sum(
        len(nodes[turns[name]].output_ids) for name in ("main1", "main2", "edited", "compact")
    )


async def test_the_export_is_the_admins_or_the_sessions_own(proxy: ProxyHarness):
    session = await harness_session(proxy)
    other = await harness_session(proxy)
    path = f"/v1/sessions/{session.session_id}/rollout"
    assert (await proxy.request("GET", path, token=other.api_key))[0] == 404  # as for any id not its own
    assert (await proxy.request("GET", path, token=None))[0] == 401
    status, empty = await proxy.request("GET", path)
    assert status == 200 and empty["sequences"] == [] and empty["sampled_tokens"] == 0
    status, body = await proxy.request("GET", "/v1/sessions/sess_0000000000000000/rollout")
    assert status == 404 and body["error"]["code"] == "session_not_found"


async def test_a_bad_branch_label_is_a_400_and_stores_nothing(proxy: ProxyHarness):
    session = await harness_session(proxy)
    status, body = await proxy.request(
        "POST",
        "/v1/chat/completions",
        json={"model": "m", "messages": [TASK], "metadata": {"rollout_branch": "x" * 300}},
        token=session.api_key,
    )
    assert status == 400 and body["error"]["param"] == "metadata.rollout_branch"
    assert await proxy.app[keys.STORE].get_nodes(session.session_id) == []
