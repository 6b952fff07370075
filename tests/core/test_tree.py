"""Where a request attaches to the response tree: by content (``locate``) and by id (``after``)."""

from __future__ import annotations

import pytest

from rollout_proxy.core.tree import (
    ResponseTree,
    SamplePlacement,
    child_mark,
    choose_parent,
    echo_marks,
    place_sample,
)
from rollout_proxy.errors import InvalidRequest, NotFound
from rollout_proxy.ids import new_response_id
from rollout_proxy.metrics import Metrics
from rollout_proxy.tokenization.messages import EMPTY_PATH_HASH, path_hashes
from tests.core.builders import put_node, session_record

#: choose_parent scans every partial entry below the deepest one: a request that stops two or
#: more messages into a node is reported as having rewritten that node.

U1 = {"role": "user", "content": "What is 2+2?"}
A1 = {"role": "assistant", "content": "4."}
U2 = {"role": "user", "content": "Check it with the tool."}
A2_CALL = {
    "role": "assistant",
    "content": None,
    "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "calc", "arguments": '{"x": "2+2"}'}}],
}
T2 = {"role": "tool", "tool_call_id": "call_1", "content": "4"}
A2 = {"role": "assistant", "content": "Confirmed: 4."}
U3 = {"role": "user", "content": "Thanks."}


# -- what tells siblings of the same content apart ---------------------------------------------


def test_an_echo_carries_the_marks_its_node_wrote_whatever_its_content_looks_like():
    """The node's output and the client's echo (no content, its own spelling of the arguments) key alike."""
    output = {**A2_CALL, "content": "", "reasoning_content": "Use the tool."}
    echoed = {
        "role": "assistant",
        "content": None,
        "tool_calls": A2_CALL["tool_calls"],
        "reasoning_content": "Use the tool.",
    }
    assert echo_marks(echoed, "h") == echo_marks(output, "h")
    assert [what for what, _ in echo_marks(output, "h")] == ["tool_call_id", "reasoning"]
    assert echo_marks(output, "h")[1] != echo_marks(output, "other path")[1]  # reasoning is keyed by its path
    assert echo_marks({**A1, "reasoning_content": "x"}, "h") != echo_marks({**A1, "reasoning_content": "y"}, "h")
    assert echo_marks(A1, "h") == [] and echo_marks({**U1, "reasoning_content": "x"}, "h") == []
    assert child_mark("resp_1") not in {key for _, key in echo_marks(output, "h")}


# -- choose_parent on hand-built path-index answers ------------------------------------------


def test_no_match_starts_at_the_root():
    assert choose_parent([None, None], 2) == (None, 0, None)


def test_full_match_covers_every_message():
    assert choose_parent(["a#1", "a"], 2) == ("a", 2, None)


def test_deepest_node_wins():
    assert choose_parent(["a#1", "a", "b#1", "b", None], 5) == ("b", 4, None)


def test_partial_entry_that_diverges_is_a_fork():
    """The request agrees with node b for one message, then says something else."""
    parent, covered, fork = choose_parent(["a#1", "a", "b#1", None], 4)
    assert (parent, covered) == ("a", 2)
    assert fork == {"diverged_from": "b", "at_message": 3}


def test_request_ending_inside_a_node_is_not_a_fork():
    """A prefix of node b's messages: a sibling of b, nothing rewritten."""
    assert choose_parent(["a#1", "a", "b#1", "b#2"], 4) == ("a", 2, None)


def test_partial_entries_above_the_parent_are_ignored():
    """Only what follows the deepest full match can be a divergence."""
    assert choose_parent(["x#1", "a", None], 3) == ("a", 2, None)


SYSTEM = {"role": "system", "content": "Be brief."}
DEVELOPER = {"role": "developer", "content": "You are a coding agent."}
SAMPLE = [SYSTEM, U1]


def test_a_conversation_that_starts_with_the_sample_is_taken_as_sent():
    # compared by identity: a dropped reasoning or tool-call id does not matter
    echoed = [SYSTEM, U1, {**A1, "reasoning_content": "dropped later"}, U2]
    assert place_sample(SAMPLE, echoed) == (echoed, SamplePlacement.PREFIX)


def test_a_conversation_with_none_of_the_sample_gets_it_after_its_instructions():
    """The instructions (system and developer messages) stay first; the sample follows them, once."""
    assert place_sample(SAMPLE, [A1, U2]) == ([SYSTEM, U1, A1, U2], SamplePlacement.INSERTED)
    instructions = {"role": "system", "content": "Answer in French."}
    conversation = [instructions, DEVELOPER, U2]
    placed, how = place_sample(SAMPLE, conversation)
    assert placed == [instructions, DEVELOPER, SYSTEM, U1, U2] and how is SamplePlacement.INSERTED
    assert place_sample(SAMPLE, conversation, insert=False) == (conversation, SamplePlacement.ABSENT)


def test_a_harness_prompt_around_the_task_is_taken_as_sent():
    """Codex: its developer prompt and environment context, then the task: the sample's only message."""
    context = {"role": "user", "content": "<environment_context>...</environment_context>"}
    conversation = [DEVELOPER, DEVELOPER, context, U1]
    assert place_sample([U1], conversation) == (conversation, SamplePlacement.CONTAINED)
    # a system prompt inside the input (LangChain's Responses mode): not user, system, user
    inside = [{"role": "system", "content": "Be kind."}, U1]
    assert place_sample([U1], inside) == (inside, SamplePlacement.CONTAINED)


def test_part_of_the_sample_or_the_sample_out_of_order_is_taken_as_sent_and_flagged():
    partial = [{"role": "system", "content": "Other instructions."}, U1, A1]
    assert place_sample(SAMPLE, partial) == (partial, SamplePlacement.PARTIAL)
    swapped = [U1, SYSTEM, A1]
    assert place_sample(SAMPLE, swapped) == (swapped, SamplePlacement.OUT_OF_ORDER)
    twice = [U1, U1]  # the sample holds the same message twice: both must be there
    assert place_sample(twice, [U1, A1]) == ([U1, A1], SamplePlacement.PARTIAL)
    assert all(how.flagged for how in (SamplePlacement.PARTIAL, SamplePlacement.OUT_OF_ORDER))
    assert not any(how.flagged for how in (SamplePlacement.PREFIX, SamplePlacement.CONTAINED))


def test_a_session_without_sample_messages_takes_every_conversation_as_sent():
    assert place_sample([], [DEVELOPER, U2]) == ([DEVELOPER, U2], SamplePlacement.NO_SAMPLE)


# -- ResponseTree on a real store ------------------------------------------------------------


@pytest.fixture
async def tree_setup(store):
    """A session with a two-node chain: [U1, A1] then [U2, A2_CALL, T2, A2]."""
    session = session_record()
    await store.create_session(session)
    first = await put_node(store, session.id, [], [U1, A1])
    second = await put_node(store, session.id, first, [U2, A2_CALL, T2, A2])
    metrics = Metrics()
    return ResponseTree(store=store, metrics=metrics), session, second, metrics


async def test_locate_extends_the_deepest_node(tree_setup):
    tree, session, path, metrics = tree_setup
    placement = await tree.locate(session, [U1, A1, U2, A2_CALL, T2, A2, U3], api="chat")
    assert [node.id for node in placement.parent] == [node.id for node in path]
    assert placement.parent_id == path[-1].id
    assert placement.new_messages == [U3]
    assert placement.new_hashes == path_hashes([U3], start=path[-1].path_hash)
    assert placement.new_hashes == path_hashes([U1, A1, U2, A2_CALL, T2, A2, U3])[-1:]
    assert placement.end_hash == placement.new_hashes[-1]
    assert placement.fork is None
    assert metrics.value("forks_total", api="chat") == 0


async def test_locate_a_conversation_that_is_all_in_the_tree(tree_setup):
    tree, session, path, _ = tree_setup
    placement = await tree.locate(session, [U1, A1], api="chat")
    assert [node.id for node in placement.parent] == [path[0].id]
    assert placement.new_messages == [] and placement.new_hashes == []
    assert placement.end_hash == path[0].path_hash


async def test_locate_without_a_match_starts_at_the_root(tree_setup):
    tree, session, _, _ = tree_setup
    other = [{"role": "user", "content": "Something else entirely."}]
    placement = await tree.locate(session, other, api="chat")
    assert placement.parent == [] and placement.parent_id is None
    assert placement.new_messages == other
    assert placement.new_hashes == path_hashes(other)
    assert placement.end_hash == placement.new_hashes[-1]


async def test_locate_a_rewritten_history_forks_with_provenance(tree_setup):
    tree, session, path, metrics = tree_setup
    rewritten_tool = {**T2, "content": "5"}
    placement = await tree.locate(session, [U1, A1, U2, A2_CALL, rewritten_tool], api="chat")
    assert [node.id for node in placement.parent] == [path[0].id]
    assert placement.new_messages == [U2, A2_CALL, rewritten_tool]
    assert placement.new_hashes == path_hashes([U2, A2_CALL, rewritten_tool], start=path[0].path_hash)
    assert placement.fork == {"diverged_from": path[1].id, "at_message": 4}
    assert metrics.value("forks_total", api="chat") == 1


async def test_locate_a_prefix_of_a_node_is_no_fork(tree_setup):
    tree, session, path, metrics = tree_setup
    placement = await tree.locate(session, [U1, A1, U2, A2_CALL, T2], api="chat")
    assert [node.id for node in placement.parent] == [path[0].id]
    assert placement.new_messages == [U2, A2_CALL, T2]
    assert placement.fork is None
    assert metrics.value("forks_total", api="chat") == 0


async def test_the_same_prompt_again_is_a_sibling_not_a_fork(store):
    """A group session: every sample sends the same [system, user] prompt."""
    session = session_record(messages=[{"role": "system", "content": "Be brief."}, U1])
    await store.create_session(session)
    await put_node(store, session.id, [], [*session.messages, A1])
    tree = ResponseTree(store=store, metrics=Metrics())
    placement = await tree.locate(session, list(session.messages), api="chat")
    assert placement.parent == [] and placement.new_messages == session.messages
    assert placement.fork is None


async def test_locate_refuses_an_empty_conversation(tree_setup):
    tree, session, _, _ = tree_setup
    with pytest.raises(InvalidRequest) as raised:
        await tree.locate(session, [], api="chat")
    assert raised.value.param == "messages"


async def test_after_drops_the_echo_of_the_nodes_own_output(tree_setup):
    tree, session, path, _ = tree_setup
    # the client echoes the answer with a reasoning field the node's message lacks
    echo = {**A1, "reasoning_content": "dropped by some clients"}
    placement = await tree.after(session, path[0].id, [echo, U2])
    assert [node.id for node in placement.parent] == [path[0].id]
    assert placement.new_messages == [U2]
    assert placement.new_hashes == path_hashes([U2], start=path[0].path_hash)
    assert placement.end_hash == placement.new_hashes[-1]


async def test_after_keeps_a_first_message_that_is_not_an_echo(tree_setup):
    tree, session, path, _ = tree_setup
    different = {"role": "assistant", "content": "5."}
    placement = await tree.after(session, path[0].id, [different, U2])
    assert placement.new_messages == [different, U2]
    assert placement.new_hashes == path_hashes([different, U2], start=path[0].path_hash)


async def test_after_with_nothing_new_ends_at_the_parent(tree_setup):
    tree, session, path, _ = tree_setup
    placement = await tree.after(session, path[-1].id, [])
    assert placement.new_messages == [] and placement.end_hash == path[-1].path_hash
    assert placement.end_hash != EMPTY_PATH_HASH


async def test_unknown_ids_are_not_found(tree_setup, store):
    tree, session, path, _ = tree_setup
    with pytest.raises(NotFound) as raised:
        await tree.after(session, new_response_id(session.id), [U3])
    assert raised.value.param == "previous_response_id"
    # an id of another session is not found in this one
    other = session_record()
    await store.create_session(other)
    with pytest.raises(NotFound):
        await tree.after(other, path[-1].id, [U3])
    with pytest.raises(NotFound) as raised:
        await tree.path(session.id, "resp_not-an-id", param="response_id")
    assert raised.value.param == "response_id"
