"""On-policy distillation through the runner: teacher passes before grading, OPD advantages, errors.

Student and teacher are fake engines on their own loop; the teacher runs other weights
(``weight_version``), so its logprob of a token at view position p is ``fake_logprob(p, token, "teacher")``:
the advantages and top-k arrays are computed here by hand from that and checked value for value.
"""

from __future__ import annotations

import collections
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml

from devtools.fake_engine import FakeEngine, fake_logprob
from rollout_proxy.embedded import BackgroundLoop, serve_app
from rollout_proxy.runner import JobConfig, JobFailed, run_job
from rollout_proxy.runner.distill import _on_trained, opd_advantages
from rollout_proxy.runner.job import OPDSection
from rollout_proxy.state.feed import JsonlFeed
from rollout_proxy.wire.arrays import encode_array
from rollout_proxy.wire.trajectory import Trajectory
from tests.conftest import TEMPLATES, free_port

TASK, KL, TOPK = 0.5, 2.0, 3
REPLIES = ["Sunny.", "It is sunny today.", "Sunny and warm, I think, all day."]


@pytest.fixture
def engines(tokenizer_dir: Path) -> Iterator[tuple[FakeEngine, FakeEngine]]:
    loop = BackgroundLoop("fake-engines")
    student = FakeEngine(tokenizer_dir, chat_template=TEMPLATES["qwen3_style"])
    asked: collections.Counter[tuple[int, ...]] = collections.Counter()

    def policy(prompt: list[int]) -> str:  # each of a sample's generations answers differently
        asked[tuple(prompt)] += 1
        return REPLIES[(asked[tuple(prompt)] - 1) % len(REPLIES)]

    student.policy = policy
    teacher = FakeEngine(tokenizer_dir, chat_template=TEMPLATES["qwen3_style"], weight_version="teacher")
    servers = []
    for engine in (student, teacher):
        server, engine.url = loop.run(serve_app(engine.app()))  # type: ignore[attr-defined]
        servers.append(server)
    yield student, teacher
    for server in servers:
        loop.run(server.cleanup())
    loop.close()


def write_job(
    tmp_path: Path, student: FakeEngine, teacher: FakeEngine, *, teacher_name: str = "math", **opd: Any
) -> Path:
    dataset = tmp_path / "train.jsonl"
    with dataset.open("w") as out:
        for index in range(2):
            record = {
                "messages": [{"role": "user", "content": f"Weather {index}?"}],
                "extra": {"teacher": teacher_name},
            }
            out.write(json.dumps(record) + "\n")
    job = {
        "name": "opd",
        "custom_rl_pipeline": {
            "rollout": {"plugin": {"python_func": "tests.runner.opd_plugins:opd_rollout"}},
            "graders": [{"plugin": {"python_func": "tests.runner.opd_plugins:length_grader"}}],
        },
        "data": {"training_set": {"local_files": [str(dataset)]}},
        "hyperparameters": {"num_generations": 3, "max_new_tokens": 32, "batch_size": 2, "num_steps": 1},
        "proxy": {
            "engines": [student.url],  # type: ignore[attr-defined]
            "teachers": {"math": {"engines": [teacher.url]}},  # type: ignore[attr-defined]
            "output_dir": str(tmp_path / "out"),
        },
        "opd": {"task_reward_coef": TASK, "kl_reward_coef": KL, "topk": TOPK, **opd},
    }
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    return path


def is_view_of(view: list[int], ids: list[int]) -> bool:
    """Whether ``view`` is ``ids`` with one run of extra tokens inserted somewhere."""
    extra = len(view) - len(ids)
    return extra > 0 and any(view[:at] + view[at + extra :] == ids for at in range(len(ids) + 1))


def hand_grpo(rewards: list[float]) -> list[float]:
    mean = sum(rewards) / 3
    std = (sum((r - mean) ** 2 for r in rewards) / 2) ** 0.5 + 1e-6
    return [(r - mean) / std for r in rewards]


async def test_opd_job_publishes_hand_computed_advantages_and_top_k(engines, tmp_path):
    student, teacher = engines
    summary = await run_job(JobConfig.load(write_job(tmp_path, student, teacher)), progress=False)
    assert summary.groups_published == 2
    feed = JsonlFeed(summary.feed.removeprefix("jsonl:"))
    groups = [entry.group for entry in await feed.read(limit=10)]
    views = {tuple(c["prompt"]): c for c in teacher.completions}
    assert len(teacher.completions) == 6  # one teacher call per trajectory
    for group in groups:
        assert group.advantage_kind == "tok"
        assert len({round(r, 6) for r in group.rewards}) > 1  # a real task signal
        grpo = hand_grpo(group.rewards)
        for trajectory, advantages, task in zip(group.trajectories, group.advantages, grpo, strict=True):
            ids = trajectory.total_token_ids
            weights = trajectory.loss_weight()
            trained = np.flatnonzero(weights > 0)
            # the teacher saw the student's tokens with the hint inserted before the answer
            view = next(v for v in views if is_view_of(list(v), ids))
            injected = len(view) - len(ids)
            assert "Reference: it is sunny." in teacher.decode(list(view)) and views[view]["prompt_logprobs"] == TOPK
            assert trajectory.teacher == "math"
            expected = [0.0] * len(ids)
            for i in trained:
                teacher_lp = float(np.float32(fake_logprob(int(i) + injected, ids[i], "teacher")))
                student_lp = float(trajectory.token_logprobs()[i])
                assert trajectory.total_teacher_logprobs[i] == pytest.approx(teacher_lp)
                expected[i] = TASK * task - KL * (student_lp - teacher_lp)
            assert advantages == pytest.approx(expected, abs=1e-5)
            # top-k: k ids per trained token, by the teacher's rank, logprobs as the teacher gave them
            top = trajectory.teacher_topk_arrays()
            assert top is not None
            top_ids, top_logprobs = top
            assert top_ids.shape == (len(trained), TOPK) and top_ids.dtype == np.int32
            for row, i in enumerate(trained):
                assert top_logprobs[row].tolist() == pytest.approx(
                    sorted((fake_logprob(int(i) + injected, int(t), "teacher") for t in top_ids[row]), reverse=True)
                )
            # the critic's view: the same hint, rendered with the student's template
            assert trajectory.critic is not None and trajectory.critic["n_tokens_injected"] == injected
            assert trajectory.critic["token_ids"] == list(view)


async def test_topk_type_student_records_the_policys_own_top_k_at_sampling(engines, tmp_path):
    student, teacher = engines
    summary = await run_job(JobConfig.load(write_job(tmp_path, student, teacher, topk_type="student")), progress=False)
    assert summary.groups_published == 2
    assert {c["logprobs"] for c in student.completions} == {TOPK}  # every generation asked for the top k
    feed = JsonlFeed(summary.feed.removeprefix("jsonl:"))
    for entry in await feed.read(limit=10):
        for trajectory in entry.group.trajectories:
            top = trajectory.student_topk_arrays()
            assert top is not None and trajectory.teacher_topk_arrays() is not None  # both distributions
            top_ids, top_logprobs = top
            trained = np.flatnonzero(trajectory.loss_weight() > 0)
            assert top_ids.shape == (len(trained), TOPK)
            for row, i in enumerate(trained):  # the student's weights, at the student's positions
                assert top_logprobs[row].tolist() == pytest.approx([fake_logprob(int(i), int(t)) for t in top_ids[row]])


def test_topk_type_student_needs_a_top_k():
    with pytest.raises(ValueError, match="topk >= 2"):
        OPDSection(topk=1, topk_type="student")


async def test_an_unknown_teacher_fails_the_job_with_the_proxys_message(engines, tmp_path):
    student, teacher = engines
    job = JobConfig.load(write_job(tmp_path, student, teacher, teacher_name="physics"))
    with pytest.raises(JobFailed, match="unknown teacher 'physics'"):
        await run_job(job, progress=False)


async def test_an_unreachable_teacher_fails_the_rollout_then_the_job_after_retries(engines, tmp_path):
    student, teacher = engines
    path = write_job(tmp_path, student, teacher)
    raw = yaml.safe_load(path.read_text())
    raw["proxy"]["teachers"] = {"math": {"engines": [f"http://127.0.0.1:{free_port()}"]}}
    path.write_text(yaml.safe_dump(raw))
    with pytest.raises(JobFailed, match="the teacher pass with teacher 'math' failed"):
        await run_job(JobConfig.load(path), progress=False)
    assert len(student.completions) > 2 * 3  # the rollouts were tried again before the job gave up


def trajectory(**fields: Any) -> Trajectory:
    return Trajectory.model_validate(fields)


def test_opd_formula_by_hand():
    """Two trajectories: a seq task advantage spread over trained tokens; one without a teacher (task only)."""
    first = trajectory(
        total_token_ids=[1, 2, 3, 4],
        total_loss_weight=[0, 1, 1, 0],
        total_token_logprobs=[0, -1.0, -0.5, 0],
        teacher="t",
        total_teacher_logprobs=[None, -0.25, -2.0, None],
    )
    second = trajectory(total_token_ids=[1, 5, 6], total_loss_weight=[0, 1, 1], total_token_logprobs=[0, -1, -1])
    kind, advantages = opd_advantages(
        [first, second], ("seq", [1.0, -1.0]), OPDSection(task_reward_coef=2, kl_reward_coef=0.5)
    )
    assert kind == "tok"
    assert advantages[0] == pytest.approx([0.0, 2 - 0.5 * (-1.0 + 0.25), 2 - 0.5 * (-0.5 + 2.0), 0.0])
    assert advantages[1] == pytest.approx([0.0, -2.0, -2.0])


def test_opd_advantages_of_a_rollout_with_branches_are_one_row_per_sequence():
    """The teacher pass scores the main sequence; a branch (a subagent) gets the task term alone."""
    branch = trajectory(total_token_ids=[7, 8, 9], total_loss_weight=[0, 1, 1], total_token_logprobs=[0, -3.0, -3.0])
    main = trajectory(
        total_token_ids=[1, 2],
        total_loss_weight=[0, 1],
        total_token_logprobs=[0, -1.0],
        teacher="t",
        total_teacher_logprobs=[None, -0.5],
        branches=[branch.model_dump()],
    )
    section = OPDSection(task_reward_coef=2, kl_reward_coef=0.5)
    kind, advantages = opd_advantages([main], ("seq", [1.0]), section)
    assert kind == "tok" and advantages == [[pytest.approx([0.0, 2 - 0.5 * (-1.0 + 0.5)]), [0.0, 2.0, 2.0]]]
    _, per_token = opd_advantages([main], ("tok", [[[9.0, 1.0], [9.0, 0.5, -1.0]]]), section)
    assert per_token == [[pytest.approx([0.0, 2 - 0.5 * (-1.0 + 0.5)]), [0.0, 1.0, -2.0]]]
    with pytest.raises(JobFailed, match="trajectory 0: task advantages: a flat list of 2"):
        opd_advantages([main], ("tok", [[0.0, 1.0]]), section)


def test_the_teacher_pass_is_kept_to_the_tokens_a_trajectory_trains():
    """A group sample whose first turn an earlier sample trains: the pass's values and top-k rows of it go."""
    shared_later = trajectory(total_token_ids=[1, 2, 3, 4, 5], total_loss_weight=[0, 0, 0, 0, 1])
    ids = np.arange(9, dtype=np.int32).reshape(3, 3)
    logprobs = -np.arange(9, dtype=np.float32).reshape(3, 3)
    answer = {
        "teacher": "t",
        "total_teacher_logprobs": [None, -1.0, -2.0, None, -3.0],  # the pass scored the path's every generated token
        "teacher_topk": {"ids": encode_array(ids), "logprobs": encode_array(logprobs)},
    }
    kept = _on_trained(shared_later, answer)
    assert kept["total_teacher_logprobs"] == [None, None, None, None, -3.0]
    read = trajectory(teacher_topk=kept["teacher_topk"]).teacher_topk_arrays()
    assert read is not None and read[0].tolist() == [[6, 7, 8]] and read[1].tolist() == [[-6.0, -7.0, -8.0]]
    whole = trajectory(total_token_ids=[1, 2, 3, 4, 5], total_loss_weight=[0, 1, 1, 0, 1])
    assert _on_trained(whole, answer) == answer


def test_opd_refuses_a_teacher_missing_on_a_trained_token():
    broken = trajectory(
        total_token_ids=[1, 2],
        total_loss_weight=[0, 1],
        total_token_logprobs=[0, -1],
        teacher="t",
        total_teacher_logprobs=[None, None],
    )
    with pytest.raises(JobFailed, match="do not cover"):
        opd_advantages([broken], ("grpo", [0.0]), OPDSection())


def test_top_k_arrays_read_back_exactly():
    ids = np.arange(6, dtype=np.int32).reshape(2, 3)
    logprobs = -np.linspace(0.1, 3.0, 6, dtype=np.float32).reshape(2, 3)
    read = trajectory(teacher_topk={"ids": encode_array(ids), "logprobs": encode_array(logprobs)}).teacher_topk_arrays()
    assert read is not None
    assert np.array_equal(read[0], ids) and read[0].dtype == np.int32
    assert np.array_equal(read[1], logprobs) and read[1].dtype == np.float32
