"""The server's trajectory JSON is exactly the wire ``Trajectory``: same fields, same values."""

from __future__ import annotations

import numpy as np
import orjson
import pytest

from rollout_proxy.core.trajectory import assemble
from rollout_proxy.ids import new_response_id, new_session_id
from rollout_proxy.proxy.http import json_response
from rollout_proxy.records import ImageSpan, NodeKind, PolicySpan, ResponseNode
from rollout_proxy.routing.rows import RoutingRows
from rollout_proxy.wire import Trajectory

SESSION = new_session_id()


def node(parent: ResponseNode | None, kind: NodeKind, n_prompt: int, n_output: int, **fields) -> ResponseNode:
    generated = kind is NodeKind.GENERATED
    return ResponseNode(
        id=new_response_id(SESSION),
        parent_id=parent.id if parent else None,
        kind=kind,
        api="chat",
        messages=[{"role": "user", "content": "q"}, *([{"role": "assistant", "content": "a"}] if generated else [])],
        n_input_messages=1,
        prompt_ids=np.arange(n_prompt, dtype=np.int32) + 10,
        output_ids=np.arange(n_output, dtype=np.int32) + 500,
        output_logprobs=np.linspace(-0.1, -2.7, n_output).astype(np.float32),
        finish_reason="stop" if generated else None,
        **fields,
    )


def path(*, moe: bool) -> list[ResponseNode]:
    first = node(None, NodeKind.GENERATED, 6, 4)
    injected = node(first, NodeKind.INJECTED, 3, 0)
    last = node(injected, NodeKind.GENERATED, 2, 3, fork={"diverged_from": first.id, "at_message": 1})
    if moe:
        rows = np.arange(9 * 2 * 2).reshape(9, 2, 2) % 8
        first.with_routing(RoutingRows.compact(0, rows, np.ones(9, dtype=bool)))
        last.with_routing(RoutingRows.compact(13, rows[:4], np.asarray([False, True, True, True])))
    return [first, injected, last]


def served(nodes: list[ResponseNode]) -> dict:
    """The trajectory as the server answers it (its own JSON serializer)."""
    trajectory = assemble(SESSION, nodes, extra={"reward_hint": 1})
    return orjson.loads(json_response(trajectory.to_json()).body)


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_server_json_has_exactly_the_wire_fields(moe):
    body = served(path(moe=moe))
    assert set(body) == set(Trajectory.model_fields)
    trajectory = Trajectory.model_validate(body)
    assert trajectory.model_extra == {}
    assert trajectory.model_dump().keys() == body.keys()


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_server_json_values_read_back_exactly(moe):
    nodes = path(moe=moe)
    expected = assemble(SESSION, nodes, extra={"reward_hint": 1})
    trajectory = Trajectory.model_validate(served(nodes))
    assert np.array_equal(trajectory.token_ids(), expected.total_token_ids)
    assert np.array_equal(trajectory.loss_weight(), expected.total_loss_weight)
    assert np.array_equal(trajectory.token_logprobs(), expected.total_token_logprobs)  # float32, bit for bit
    assert trajectory.response_id == nodes[-1].id and trajectory.session_id == SESSION
    assert trajectory.turns == 2 and trajectory.assistant_turns == 2
    assert trajectory.forks == [{"response_id": nodes[-1].id, "diverged_from": nodes[0].id, "at_message": 1}]
    assert trajectory.extra == {"reward_hint": 1} and trajectory.finish_reason == "stop"
    assert trajectory.usage == {"prompt_tokens": 11, "completion_tokens": 7, "total_tokens": 18}
    routed = trajectory.routed_experts_array()
    if not moe:
        assert routed is None
        return
    assert routed.shape == (18, 2, 2) and np.array_equal(routed, expected.routed_experts)
    assert (routed[9:14] == -1).all() and (routed[14:17] != -1).all() and (routed[17] == -1).all()


def test_policy_version_spans_name_a_lora_policy_and_leave_the_base_unnamed():
    """The server's spans and the wire model agree: a LoRA span carries ``policy``, a base span is
    ``{version, start, end}`` as before policies and reads back as the base's; merged within one policy only."""
    first = node(None, NodeKind.GENERATED, 4, 5, policy_versions=(PolicySpan(1, 0, 5, "pol"),))
    last = node(first, NodeKind.GENERATED, 0, 3, policy_versions=(PolicySpan(1, 0, 3, "other"),))
    base = node(None, NodeKind.GENERATED, 4, 5, policy_versions=(PolicySpan(7, 0, 5),))
    lora_json = orjson.loads(json_response(assemble(SESSION, [first, last]).to_json()).body)
    assert lora_json["policy_versions"] == [
        {"version": 1, "start": 4, "end": 9, "policy": "pol"},
        {"version": 1, "start": 9, "end": 12, "policy": "other"},  # adjacent, same version: another policy
    ]
    base_json = orjson.loads(json_response(assemble(SESSION, [base]).to_json()).body)
    assert base_json["policy_versions"] == [{"version": 7, "start": 4, "end": 9}]
    for answer in (lora_json, base_json):
        parsed = Trajectory.model_validate(answer)
        assert parsed.model_dump(mode="json")["policy_versions"] == answer["policy_versions"]  # the feed's form
    assert Trajectory.model_validate(base_json).policy_versions[0].policy == "base"


def test_image_spans_land_at_their_absolute_positions_with_weight_zero():
    """A node's image spans count in its prompt tokens; the trajectory's in ``total_token_ids``."""
    first = node(None, NodeKind.GENERATED, 30, 4, images=(ImageSpan(5, 19, "ab" * 32, 200, 120, 900),))
    injected = node(first, NodeKind.INJECTED, 25, 0, images=(ImageSpan(2, 19, "cd" * 32, 40, 300, 80),))
    last = node(injected, NodeKind.GENERATED, 22, 3, images=(ImageSpan(1, 19, "ab" * 32, 200, 120, 900),))
    trajectory = Trajectory.model_validate(served([first, injected, last]))
    assert [(image.start, image.length, image.sha256[:2]) for image in trajectory.images] == [
        (5, 19, "ab"),
        (30 + 4 + 2, 19, "cd"),
        (30 + 4 + 25 + 1, 19, "ab"),
    ]
    assert (trajectory.images[0].width, trajectory.images[0].height, trajectory.images[0].bytes) == (200, 120, 900)
    mask = trajectory.image_token_mask()
    assert mask.sum() == 3 * 19
    assert not trajectory.loss_weight()[mask].any()
    assert Trajectory.model_validate(served(path(moe=False))).images == []
