"""The teacher pass end to end: a proxy, a student fake engine and a teacher fake engine on real ports.

The fake's logprob of a token depends on its position and id only (same weights), so a teacher that
sees the student's exact tokens scores them exactly as they were sampled, and a teacher that sees
inserted context scores each token at its shifted position: both are checked value for value.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from aiohttp import web

from devtools.fake_engine import FakeEngine, FakeEngineServer, fake_logprob
from rollout_proxy.app import create_app
from rollout_proxy.settings import Settings
from rollout_proxy.state.memory import MemoryStore
from rollout_proxy.wire.trajectory import Trajectory
from tests.conftest import TEMPLATES, TEMPLATES_DIR, free_port
from tests.harness import ProxyHarness

USER = [{"role": "user", "content": "What is 2+2?"}]
HINT = "Reference: the answer is 4; check the arithmetic."
RUBRIC = "Grade: exact number only."


@pytest.fixture
async def teacher(tokenizer_dir: Path, template_name: str) -> AsyncIterator[FakeEngine]:
    engine = FakeEngine(tokenizer_dir, chat_template=TEMPLATES[template_name], model_name="fake-teacher")
    async with FakeEngineServer(engine) as url:
        engine.url = url  # type: ignore[attr-defined]
        yield engine


@pytest.fixture
async def opd(fake_engine: FakeEngine, teacher: FakeEngine, template_name: str) -> AsyncIterator[ProxyHarness]:
    template = TEMPLATES_DIR / f"{template_name}.jinja" if TEMPLATES[template_name] is not None else None
    async with ProxyHarness.running(
        engine_urls=[fake_engine.url],
        store=MemoryStore(),
        fake=fake_engine,
        chat_template=str(template or ""),
        teachers=f"math={teacher.url}",  # type: ignore[attr-defined]
    ) as harness:
        yield harness


async def two_turns(proxy: ProxyHarness) -> tuple[str, str]:
    """A two-turn rollout (the first answer with a <think> block); its session and last response id."""
    assert proxy.fake is not None
    proxy.fake.queue("<think>2 and 2</think>It is 4.", "Yes, 4.")
    session = await proxy.create_session(USER)
    first = await session.client.chat.completions.create(model="m", messages=USER)
    history = [*USER, first.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "Sure?"}]
    second = await session.client.chat.completions.create(model="m", messages=history)
    return session.session_id, second.id


async def teacher_pass(proxy: ProxyHarness, session_id: str, **body: Any) -> tuple[int, Any]:
    return await proxy.request("POST", f"/v1/admin/sessions/{session_id}/teacher_pass", json=body)


async def test_without_context_the_teacher_scores_the_students_exact_tokens(opd: ProxyHarness, teacher: FakeEngine):
    session_id, response_id = await two_turns(opd)
    status, body = await teacher_pass(opd, session_id, response_id=response_id, teacher="math")
    assert status == 200, body
    trajectory = Trajectory.model_validate(await opd.trajectory(response_id))
    sent = teacher.completions[-1]
    assert sent["prompt"] == trajectory.total_token_ids  # one call, the student's exact tokens
    assert sent["max_tokens"] == 1 and sent["prompt_logprobs"] == 0
    trained = trajectory.loss_weight() > 0
    values = body["total_teacher_logprobs"]
    assert len(values) == len(trajectory.total_token_ids)
    assert all((value is None) == (not flag) for value, flag in zip(values, trained, strict=True))
    # same weights: the teacher's logprob of every trained token is the one it was sampled with
    assert np.array_equal(
        np.asarray([v for v in values if v is not None], dtype=np.float32), trajectory.token_logprobs()[trained]
    )
    assert body["teacher"] == "math" and body["teacher_topk"] is None and body["n_tokens_injected"] == 0


async def test_context_is_inserted_before_its_turn_and_positions_map_back(opd: ProxyHarness, teacher: FakeEngine):
    session_id, response_id = await two_turns(opd)
    contexts = [
        {"qa_index": 0, "message": {"role": "user", "content": HINT}},
        {"qa_index": 1, "message": {"role": "user", "content": RUBRIC}},
    ]
    status, body = await teacher_pass(
        opd, session_id, response_id=response_id, teacher="math", teacher_context=contexts
    )
    assert status == 200, body
    student = (await opd.trajectory(response_id))["total_token_ids"]
    weights = np.asarray((await opd.trajectory(response_id))["total_loss_weight"])
    view = teacher.completions[-1]["prompt"]
    injected = body["n_tokens_injected"]
    assert len(view) == len(student) + injected and injected > 0
    # find the fragments: the view is the student's tokens with two runs inserted
    text = teacher.decode(view)
    for content in (HINT, RUBRIC):
        fragment = f"\n<|im_start|>user\n{content}<|im_end|>"
        assert text.count(fragment) == 1
        # right before the generation prompt of its assistant turn
        assert text[text.index(fragment) + len(fragment) :].startswith("\n<|im_start|>assistant\n")
    assert teacher.decode(student) == text.replace(f"\n<|im_start|>user\n{HINT}<|im_end|>", "").replace(
        f"\n<|im_start|>user\n{RUBRIC}<|im_end|>", ""
    )
    # every trained token's value is the teacher's at its shifted place in the view
    positions = student_positions(student, view)
    expected = [fake_logprob(int(positions[i]), token) if weights[i] > 0 else None for i, token in enumerate(student)]
    assert body["total_teacher_logprobs"] == pytest.approx(expected)
    first_turn = int(np.flatnonzero(weights > 0)[0])
    assert positions[first_turn] > first_turn  # the first turn's tokens sit after the inserted hint


def student_positions(student: list[int], view: list[int]) -> np.ndarray:
    """Greedy alignment of the student's tokens inside the view (the fragments are whole extra runs)."""
    positions, at = [], 0
    for token in student:
        while view[at] != token:
            at += 1
        positions.append(at)
        at += 1
    return np.asarray(positions)


async def test_top_k_per_trained_token_in_the_compact_array_form(opd: ProxyHarness, teacher: FakeEngine):
    session_id, response_id = await two_turns(opd)
    status, body = await teacher_pass(opd, session_id, response_id=response_id, teacher="math", topk=4)
    assert status == 200, body
    assert teacher.completions[-1]["prompt_logprobs"] == 4
    trajectory = Trajectory.model_validate({**(await opd.trajectory(response_id)), **body})
    top = trajectory.teacher_topk_arrays()
    assert top is not None
    ids, logprobs = top
    n_trained = int((trajectory.loss_weight() > 0).sum())
    assert ids.shape == logprobs.shape == (n_trained, 4) and ids.dtype == np.int32 and logprobs.dtype == np.float32
    assert np.all(np.diff(logprobs, axis=1) <= 0)  # by rank
    chosen = trajectory.teacher_logprobs()
    assert chosen is not None
    trained_values = chosen[trajectory.loss_weight() > 0]
    assert np.all(trained_values <= logprobs[:, 0])  # no token beats the teacher's top-1
    first_pos = int(np.flatnonzero(trajectory.loss_weight() > 0)[0])
    assert logprobs[0].tolist() == pytest.approx(
        sorted((fake_logprob(first_pos, int(t)) for t in ids[0]), reverse=True)
    )


async def test_refusals(opd: ProxyHarness):
    session_id, response_id = await two_turns(opd)
    status, body = await teacher_pass(opd, session_id, response_id=response_id, teacher="physics")
    assert status == 400 and body["error"]["param"] == "teacher" and "math" in body["error"]["message"]
    status, body = await teacher_pass(opd, session_id, response_id=response_id, teacher="math", topk=129)
    assert status == 400 and body["error"]["param"] == "topk"
    past = [{"qa_index": 2, "message": {"role": "user", "content": "x"}}]
    status, body = await teacher_pass(opd, session_id, response_id=response_id, teacher="math", teacher_context=past)
    assert status == 400 and body["error"]["param"] == "teacher_context[0].qa_index"
    status, body = await teacher_pass(opd, "sess_nope", response_id=response_id, teacher="math")
    assert status == 404
    status, body = await opd.request(
        "POST",
        f"/v1/admin/sessions/{session_id}/teacher_pass",
        json={"response_id": response_id, "teacher": "math"},
        token=None,
    )
    assert status == 401


async def test_a_teacher_that_is_down_is_a_503_not_a_missing_field(opd: ProxyHarness, teacher: FakeEngine):
    session_id, response_id = await two_turns(opd)
    teacher.failures.extend([(503, "teacher overloaded")] * 8)
    status, body = await teacher_pass(opd, session_id, response_id=response_id, teacher="math")
    assert status == 503, body
    assert "127.0.0.1" not in body["error"]["message"]  # engine URLs are never shown


class OtherVocabulary(FakeEngine):
    """A teacher whose tokenizer encodes text differently (ids shifted by one)."""

    async def _tokenize(self, request: web.Request) -> web.Response:
        response = await super()._tokenize(request)
        payload = await request.json()
        if "prompt" not in payload:
            return response
        import json

        answer = json.loads(response.body)  # type: ignore[arg-type]
        answer["tokens"] = [token + 1 for token in answer["tokens"]]
        return web.json_response(answer)


async def test_a_teacher_with_another_tokenizer_is_refused(
    fake_engine: FakeEngine, tokenizer_dir: Path, template_name: str
):
    other = OtherVocabulary(tokenizer_dir, chat_template=TEMPLATES[template_name])
    async with (
        FakeEngineServer(other) as url,
        ProxyHarness.running(
            engine_urls=[fake_engine.url],
            store=MemoryStore(),
            fake=fake_engine,
            teachers=f"odd={url}",  # type: ignore[attr-defined]
        ) as proxy,
    ):
        session_id, response_id = await two_turns(proxy)
        status, body = await teacher_pass(proxy, session_id, response_id=response_id, teacher="odd")
        assert status == 400 and body["error"]["code"] == "teacher_tokenizer_mismatch"
        assert not other.completions  # nothing was scored


async def test_an_unreachable_teacher_is_a_503(fake_engine: FakeEngine):
    async with ProxyHarness.running(
        engine_urls=[fake_engine.url],  # type: ignore[attr-defined]
        store=MemoryStore(),
        fake=fake_engine,
        teachers=f"math=http://127.0.0.1:{free_port()}",
        engine_connect_timeout=0.5,
    ) as proxy:
        session_id, response_id = await two_turns(proxy)
        status, body = await teacher_pass(proxy, session_id, response_id=response_id, teacher="math")
        assert status == 503, body


async def test_critic_view_inserts_critic_context_with_the_students_template(opd: ProxyHarness, teacher: FakeEngine):
    session_id, response_id = await two_turns(opd)
    student = (await opd.trajectory(response_id))["total_token_ids"]
    critic_context = [{"qa_index": 1, "message": {"role": "user", "content": RUBRIC}}]
    status, body = await opd.request(
        "POST",
        f"/v1/admin/sessions/{session_id}/critic_view",
        json={"response_id": response_id, "critic_context": critic_context},
    )
    assert status == 200, body
    view = body["critic_token_ids"]
    assert len(view) == len(student) + body["n_tokens_injected"]
    fragment = f"\n<|im_start|>user\n{RUBRIC}<|im_end|>"
    text = teacher.decode(view)
    assert text.count(fragment) == 1 and teacher.decode(student) == text.replace(fragment, "")
    # before the second assistant turn: after the first answer and the follow-up question
    assert text.index(fragment) > text.index("Sure?")
    assert not teacher.completions  # a view, not a scoring call


async def test_a_hung_teacher_is_a_504_within_the_engine_timeout(fake_engine: FakeEngine, teacher: FakeEngine):
    async with ProxyHarness.running(
        engine_urls=[fake_engine.url],  # type: ignore[attr-defined]
        store=MemoryStore(),
        fake=fake_engine,
        teachers=f"math={teacher.url}",  # type: ignore[attr-defined]
        engine_timeout=1.0,
    ) as proxy:
        session_id, response_id = await two_turns(proxy)
        teacher.set_fault("hang")
        status, body = await teacher_pass(proxy, session_id, response_id=response_id, teacher="math")
        teacher.set_fault(None)
        assert status == 504, body
        assert "127.0.0.1" not in body["error"]["message"]


async def test_a_teacher_pass_is_kept_with_the_session_for_get_trajectory(opd: ProxyHarness):
    session_id, response_id = await two_turns(opd)
    before = await opd.trajectory(response_id)
    assert before["teacher"] is None and before["total_teacher_logprobs"] is None
    status, body = await teacher_pass(opd, session_id, response_id=response_id, teacher="math", topk=3)
    assert status == 200, body
    after = await opd.trajectory(response_id)
    for name in ("teacher", "total_teacher_logprobs", "teacher_topk"):
        assert after[name] == body[name], name
    # other responses of the session are not scored by it
    status, page = await opd.request("GET", f"/v1/sessions/{session_id}/trajectory")
    assert status == 200 and page["response_id"] == response_id and page["teacher"] == "math"


TEACHER_TEMPLATE = (
    "{%- for message in messages %}<|im_start|>{{ message.role }}\n"
    "{% if message.role == 'user' %}[for the teacher] {% endif %}{{ message.content }}<|im_end|>\n"
    "{% endfor %}{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


async def test_a_teacher_template_renders_its_contexts(
    fake_engine: FakeEngine, teacher: FakeEngine, template_name: str, tokenizer_dir: Path, tmp_path: Path
):
    """The teacher's own chat template (rendered here, with the shared tokenizer), not its engine's."""
    template = tmp_path / "teacher.jinja"
    template.write_text(TEACHER_TEMPLATE)
    async with ProxyHarness.running(
        engine_urls=[fake_engine.url],
        store=MemoryStore(),
        fake=fake_engine,
        teachers=f"math={teacher.url}",  # type: ignore[attr-defined]
        teacher_templates=f"math={template}",
        tokenizer=str(tokenizer_dir),
    ) as proxy:
        session_id, response_id = await two_turns(proxy)
        contexts = [{"qa_index": 1, "message": {"role": "user", "content": HINT}}]
        status, body = await teacher_pass(
            proxy, session_id, response_id=response_id, teacher="math", teacher_context=contexts
        )
        assert status == 200, body
        student = (await proxy.trajectory(response_id))["total_token_ids"]
        text = teacher.decode(teacher.completions[-1]["prompt"])
        fragment = f"\n<|im_start|>user\n[for the teacher] {HINT}<|im_end|>"
        assert text.count(fragment) == 1 and teacher.decode(student) == text.replace(fragment, "")
        assert text[text.index(fragment) + len(fragment) :].startswith("\n<|im_start|>assistant\n")


@pytest.mark.parametrize(
    ("spec", "words"),
    [("physics=/nowhere.jinja", "not a teacher"), ("math=/nowhere/teacher.jinja", "not found"), ("math", "name=FILE")],
)
def test_a_bad_teacher_template_is_refused_at_start(spec: str, words: str):
    with pytest.raises(ValueError, match=words):
        create_app(Settings(admin_key="k", teachers="math=http://127.0.0.1:9", teacher_templates=spec))
