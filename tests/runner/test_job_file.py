"""Job files: every problem reported with its path, before anything runs."""

from __future__ import annotations

import subprocess
import sys

import pytest
import yaml

from rollout_proxy.cli import main
from rollout_proxy.runner import JobConfig, JobError
from rollout_proxy.runner.runner import JobRunner
from rollout_proxy.state.feed import JsonlFeed
from tests.conftest import free_port
from tests.runner.conftest import write_dataset, write_job


@pytest.fixture
def job_path(tmp_path):
    dataset = write_dataset(tmp_path / "train.jsonl", ["ok"] * 2)
    return write_job(tmp_path, dataset=dataset, graders=[("quality_grader", 1.0)], engine_url="http://127.0.0.1:9")


def edit(path, change):
    data = yaml.safe_load(path.read_text())
    change(data)
    path.write_text(yaml.safe_dump(data))
    return path


def test_a_valid_job_loads(job_path):
    job = JobConfig.load(job_path)
    assert job.hyperparameters.num_generations == 3 and job.custom_rl_pipeline.graders[0].weight == 1.0


@pytest.mark.parametrize(
    "change, expected",
    [
        (
            lambda d: d["custom_rl_pipeline"]["rollout"]["plugin"].update(pyhton_func="x:y"),
            "custom_rl_pipeline.rollout.plugin.pyhton_func: unknown field",
        ),
        (lambda d: d.update(hyperparamters={}), "hyperparamters: unknown field"),
        (
            lambda d: d["hyperparameters"].update(num_generations=0),
            "hyperparameters.num_generations: Input should be greater than or equal to 1",
        ),
        (lambda d: d["hyperparameters"].update(top_p=1.5), "hyperparameters.top_p"),
        (lambda d: d["custom_rl_pipeline"]["graders"][0].update(weight=-1), "custom_rl_pipeline.graders.0.weight"),
        (lambda d: d["custom_rl_pipeline"].update(graders=[]), "custom_rl_pipeline.graders"),
        (
            lambda d: d["custom_rl_pipeline"]["rollout"]["plugin"].update(python_func="no_colon"),
            "must be 'module:function'",
        ),
        (lambda d: d["data"]["training_set"].update(local_files=["missing.jsonl"]), "no such file"),
        (lambda d: d.pop("data"), "data: Field required"),
        (lambda d: d.setdefault("proxy", {}).update(client_sampling="allow"), "proxy.client_sampling"),
        (
            lambda d: d.setdefault("proxy", {}).update(engines=["localhost:8000"]),
            "proxy.engines: 'localhost:8000' must be an engine's base URL",
        ),
        (
            lambda d: d.setdefault("proxy", {}).update(teachers={"t": {"engines": ["http://a:1", "ftp://b"]}}),
            "proxy.teachers.t.engines: 'ftp://b' must be an engine's base URL",
        ),
    ],
)
def test_problems_are_reported_with_their_path(job_path, change, expected):
    with pytest.raises(JobError) as raised:
        JobConfig.load(edit(job_path, change))
    assert expected in str(raised.value)


def test_client_sampling_is_a_job_setting(job_path):
    assert JobConfig.load(job_path).proxy.client_sampling == "refuse"  # the seed's rule by default
    job = JobConfig.load(edit(job_path, lambda d: d.setdefault("proxy", {}).update(client_sampling="ignore")))
    assert job.proxy.client_sampling == "ignore"


def test_samples_may_leave_out_messages(job_path, tmp_path):
    """A harness owns its prompt: the sample carries only what the rollout and the grader need."""
    job = JobConfig.load(job_path)
    sample = job.sample({"extra": {"task": "Read marker.txt."}})
    assert sample.messages == [] and sample.extra == {"task": "Read marker.txt."}


def test_several_problems_are_reported_together(job_path):
    def change(d):
        d["hyperparameters"]["batch_size"] = 0
        d["extra_field"] = 1

    with pytest.raises(JobError, match=r"2 problem\(s\)"):
        JobConfig.load(edit(job_path, change))


@pytest.mark.parametrize(
    "python_func, expected",
    [
        ("tests.runner.nowhere:fn", "cannot import 'tests.runner.nowhere'"),
        ("tests.runner.runner_plugins:missing", "has no 'missing'"),
        ("tests.runner.runner_plugins:first_call", "is not declared with @single_rollout or @group_rollout"),
        ("tests.runner.runner_plugins:quality_grader", "is a @single_grader, expected single_rollout or group_rollout"),
    ],
)
def test_plugins_are_checked_before_running(job_path, python_func, expected):
    job = JobConfig.load(
        edit(job_path, lambda d: d["custom_rl_pipeline"]["rollout"]["plugin"].update(python_func=python_func))
    )
    with pytest.raises(JobError, match=expected.replace("(", r"\(").replace("@", "@")):
        JobRunner(job, proxy_url="http://127.0.0.1:9", admin_key="k", feed=JsonlFeed(job_path.parent / "f.jsonl"))


def test_cli_reports_job_problems_and_exits_2(job_path):
    edit(job_path, lambda d: d.update(bogus=1))
    result = subprocess.run(
        [sys.executable, "-m", "rollout_proxy", "run", str(job_path)], capture_output=True, text=True
    )
    assert result.returncode == 2 and "bogus: unknown field" in result.stderr


def test_cli_run_says_in_one_line_that_the_proxy_did_not_answer(job_path):
    url = f"http://127.0.0.1:{free_port()}"
    result = subprocess.run(
        [sys.executable, "-m", "rollout_proxy", "run", str(job_path), "--proxy-url", url, "--admin-key", "k"],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 1, result.stderr
    assert f"rollout-proxy run: no answer from the proxy at {url}: " in result.stderr
    assert "Traceback" not in result.stderr


def test_cli_run_says_in_one_line_that_its_store_cannot_be_reached(job_path, redis_gives_up_fast, capsys):
    """The in-process proxy's Redis store down: one line and exit 1, after the start-up's retries (cut short)."""
    url = f"redis://:hunter2@127.0.0.1:{free_port()}/0"
    out = job_path.parent / "out"
    assert main(["run", str(job_path), "--store", url, "--out", str(out), "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert f"rollout-proxy run: cannot reach Redis at redis://:***@127.0.0.1:{url.rsplit(':', 1)[1]} (3 tries" in err
    assert "hunter2" not in err and "Traceback" not in err


def test_cli_run_help_explains():
    result = subprocess.run(
        [sys.executable, "-m", "rollout_proxy", "run", "--help"], capture_output=True, text=True, check=True
    )
    for option in ("--engine", "--store", "--feed", "--proxy-url", "--job-id"):
        assert option in result.stdout


def test_the_policy_is_a_job_setting(job_path):
    assert JobConfig.load(job_path).proxy.policy == "base"
    job = JobConfig.load(edit(job_path, lambda d: d.setdefault("proxy", {}).update(policy="grpo-lora")))
    assert job.proxy.policy == "grpo-lora"


def test_grpo_lora_takes_its_adapter_and_its_sessions_sample_that_policy(job_path):
    edit(
        job_path,
        lambda d: d.update(
            customization_type="GRPOLoRA", lora={"policy": "grpo-lora", "rank": 8, "target_modules": ["q_proj"]}
        ),
    )
    job = JobConfig.load(job_path)
    assert job.lora is not None and (job.lora.policy, job.lora.rank, job.lora.lora_alpha) == ("grpo-lora", 8, 16)
    assert job.lora.target_modules == ["q_proj"] and job.proxy.policy == "grpo-lora"
    full = JobConfig.load(edit(job_path, lambda d: (d.update(customization_type="GRPO"), d.pop("lora"))))
    assert full.lora is None and full.proxy.policy == "base"  # the full-weight path, as before
    lora = JobConfig.load(edit(job_path, lambda d: d.update(customization_type="GRPOLoRA", lora={"policy": "p"})))
    assert lora.lora is not None and lora.lora.rank == 16 and len(lora.lora.target_modules) == 7  # the defaults


@pytest.mark.parametrize("kind", ["FinetuneLoRA", "DPOLoRA", "FinetuneSft", "DPO", "PPO", "grpo", "GRPO-LoRA", ""])
def test_a_type_the_project_does_not_train_is_refused_naming_the_supported_ones(job_path, kind):
    edit(job_path, lambda d: d.update(customization_type=kind))
    with pytest.raises(JobError) as raised:
        JobConfig.load(job_path)
    message = str(raised.value)
    assert f"customization_type: {kind!r} is not trained here" in message
    assert "the supported types are GRPO" in message and "GRPOLoRA" in message


@pytest.mark.parametrize(
    "fields, expected",
    [
        ({"customization_type": "GRPOLoRA"}, "customization_type: GRPOLoRA trains a LoRA adapter: add a 'lora'"),
        ({"lora": {"policy": "p"}}, "lora: a 'lora' section is for customization_type: GRPOLoRA"),
        ({"customization_type": "GRPOLoRA", "lora": {"policy": "p", "rank": 4}}, "LoRA rank 4 is not one vLLM"),
        ({"customization_type": "GRPOLoRA", "lora": {"policy": "p", "rank": 1024}}, "use one of 1, 8, 16"),
        ({"customization_type": "GRPOLoRA", "lora": {"policy": "p", "alpha": 0}}, "LoRA alpha must be above 0"),
        (
            {"customization_type": "GRPOLoRA", "lora": {"policy": "p", "target_modules": ["mlp"]}},
            "target modules must be some of q_proj",
        ),
        ({"customization_type": "GRPOLoRA", "lora": {"policy": "p", "target_modules": []}}, "not none"),
        ({"customization_type": "GRPOLoRA", "lora": {"policy": "base"}}, "not 'base'"),
        ({"customization_type": "GRPOLoRA", "lora": {"policy": "a b"}}, "a LoRA policy's name is"),
        ({"customization_type": "GRPOLoRA", "lora": {"policy": "p", "dropout": 0.1}}, "lora.dropout: unknown field"),
        (
            {"customization_type": "GRPOLoRA", "lora": {"policy": "p"}, "proxy": {"policy": "other"}},
            "proxy.policy: a GRPOLoRA job's sessions sample with its adapter, lora.policy 'p', not 'other'",
        ),
    ],
)
def test_a_lora_job_that_cannot_train_is_refused_with_its_path(job_path, fields, expected):
    edit(job_path, lambda d: d.update(fields))
    with pytest.raises(JobError, match="problem") as raised:
        JobConfig.load(job_path)
    assert expected in str(raised.value)


def test_cli_refuses_an_untrained_type_before_anything_starts(job_path):
    edit(job_path, lambda d: d.update(customization_type="DPOLoRA"))
    result = subprocess.run(
        [sys.executable, "-m", "rollout_proxy", "run", str(job_path)], capture_output=True, text=True
    )
    assert result.returncode == 2 and "customization_type: 'DPOLoRA' is not trained here" in result.stderr
