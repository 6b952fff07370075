"""``python -m rollout_proxy.trainer``: its help, and the refusals before anything starts."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rollout_proxy.trainer.__main__ import main, parser
from rollout_proxy.trainer.settings import TrainerSettings
from tests.harness import ADMIN_KEY

ROOT = Path(__file__).resolve().parents[2]


def test_help_explains_the_trainer_and_its_options():
    done = subprocess.run(
        [sys.executable, "-m", "rollout_proxy.trainer", "--help"],
        capture_output=True,
        text=True,
        check=True,
        env={"PYTHONPATH": f"{ROOT / 'src'}:{ROOT}", "PATH": "/usr/bin:/bin"},
    )
    for words in ("reference GRPO trainer", "--proxy", "--feed", "--lr", "--mismatch-threshold", "--ratio-cap"):
        assert words in done.stdout


def test_no_admin_key_is_refused_before_anything_starts(capsys, monkeypatch):
    monkeypatch.delenv("ROLLOUT_PROXY_ADMIN_KEY", raising=False)
    with pytest.raises(SystemExit) as exit_:
        main(["--proxy", "http://127.0.0.1:9", "--feed", "redis://127.0.0.1:9/0", "--model", "m", "--out", "x"])
    assert exit_.value.code == 2 and "--admin-key" in capsys.readouterr().err


def test_a_step_count_below_one_is_refused(capsys):
    with pytest.raises(SystemExit):
        main(
            [
                "--proxy",
                "p",
                "--admin-key",
                "k",
                "--feed",
                "redis://h:1/0",
                "--model",
                "m",
                "--out",
                "x",
                "--steps",
                "0",
            ]
        )
    assert "--steps: Input should be greater than or equal to 1" in capsys.readouterr().err


async def run_cli(*args: str) -> tuple[int, str]:
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "rollout_proxy.trainer",
        *args,
        env={**os.environ, "PYTHONPATH": f"{ROOT / 'src'}:{ROOT}"},
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
    )
    async with asyncio.timeout(120):
        _, stderr = await process.communicate()
    assert process.returncode is not None
    return process.returncode, stderr.decode()


async def test_a_proxy_that_refuses_or_is_not_there_stops_it_in_words(tiny_fleet, redis_url, tiny_checkpoint, tmp_path):
    common = ["--feed", redis_url, "--model", str(tiny_checkpoint), "--out", str(tmp_path)]
    code, said = await run_cli("--proxy", tiny_fleet.proxy.url, "--admin-key", "not-the-key", *common)
    assert code == 1 and "stopped: reading the fleet's policy version failed (401)" in said
    assert "Traceback" not in said
    code, said = await run_cli("--proxy", "http://127.0.0.1:9", "--admin-key", "key", *common)
    assert code == 1 and "stopped: reading the fleet's policy version failed (no answer)" in said
    code, said = await run_cli(
        "--proxy",
        tiny_fleet.proxy.url,
        "--admin-key",
        ADMIN_KEY,
        *common[:2],
        "--model",
        str(tmp_path / "none"),
        "--out",
        str(tmp_path),
    )
    assert code == 2 and "no checkpoint in" in said and "engine_env setup" in said


def test_a_feed_that_is_not_redis_is_refused(capsys):
    with pytest.raises(SystemExit):
        main(["--proxy", "p", "--admin-key", "k", "--feed", "jsonl:out/feed.jsonl", "--model", "m", "--out", "x"])
    assert "the trainer reads a Redis feed" in capsys.readouterr().err


def test_the_package_and_the_loop_never_import_torch():
    """Only the learner needs torch (rollout-proxy[train]): a trainer of its own uses the rest without it."""
    code = (
        "import sys; import rollout_proxy.trainer, rollout_proxy.trainer.loop, rollout_proxy.trainer.batch, "
        "rollout_proxy.trainer.mismatch, rollout_proxy.trainer.fleet, rollout_proxy.trainer.plot; "
        "print('torch' in sys.modules)"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, env={"PYTHONPATH": f"{ROOT / 'src'}"}
    )
    assert done.stdout.strip() == "False"


WHERE = ["--proxy", "p", "--admin-key", "k", "--feed", "redis://h:1/0", "--model", "m", "--out", "x"]


@pytest.mark.parametrize(
    "flags, expected",
    [
        (["--lora-rank", "4", "--policy", "p"], "LoRA rank 4 is not one vLLM serves: use one of 1, 8, 16, 32"),
        (["--lora-rank", "16", "--policy", "p", "--lora-alpha", "0"], "LoRA alpha must be above 0"),
        (["--lora-rank", "16", "--policy", "p", "--target-modules", "q_proj,mlp"], "not mlp"),
        (["--lora-rank", "16"], "--lora-rank trains a LoRA policy of the proxy: name it with --policy"),
        (["--policy", "p"], "--policy names the LoRA policy the trainer publishes: give --lora-rank too"),
        (["--lora-rank", "16", "--policy", "base"], "not 'base'"),
    ],
)
def test_lora_settings_vllm_cannot_serve_are_refused_at_start(capsys, flags, expected):
    with pytest.raises(SystemExit) as exit_:
        main([*WHERE, *flags])
    assert exit_.value.code == 2 and expected in capsys.readouterr().err


def job_file(tmp_path: Path, **fields) -> str:
    path = tmp_path / "job.yaml"
    path.write_text(json.dumps({"name": "j", **fields}))  # JSON is YAML
    return str(path)


def test_a_job_file_gives_the_adapter_and_refuses_what_the_trainer_does_not_train(tmp_path, capsys):
    lora = job_file(
        tmp_path,
        customization_type="GRPOLoRA",
        lora={"policy": "pol", "rank": 8, "target_modules": ["q_proj", "v_proj"]},
    )
    settings = TrainerSettings.from_env(**vars(parser().parse_args([*WHERE, "--job", lora])))
    assert (settings.policy, settings.lora_rank, settings.alpha, settings.target_modules) == (
        "pol",
        8,
        16,
        ("q_proj", "v_proj"),
    )
    agreeing = [*WHERE, "--job", lora, "--lora-rank", "8", "--target-modules", "q_proj", "--target-modules", "v_proj"]
    assert TrainerSettings.from_env(**vars(parser().parse_args(agreeing))).lora_rank == 8
    for flags, expected in [
        (["--lora-rank", "16"], "trains another adapter than the flags: lora_rank 16 (the job's: 8)"),
        (["--policy", "other"], "policy other (the job's: pol)"),
    ]:
        with pytest.raises(SystemExit):
            main([*WHERE, "--job", lora, *flags])
        assert expected in capsys.readouterr().err
    full = job_file(tmp_path, customization_type="GRPO")
    assert TrainerSettings.from_env(**vars(parser().parse_args([*WHERE, "--job", full]))).lora_rank is None
    with pytest.raises(SystemExit):
        main([*WHERE, "--job", full, "--lora-rank", "8", "--policy", "p"])
    assert "is a GRPO job (the full weights): it takes no lora_rank, policy" in capsys.readouterr().err
    for fields, expected in [
        ({"lora": {"policy": "pol", "rank": 4}}, "lora: LoRA rank 4 is not one vLLM serves"),
        ({"lora": {"policy": "pol", "dropout": 0.1}}, "lora.dropout: Extra inputs are not permitted"),
        ({}, "GRPOLoRA trains a LoRA adapter: add a 'lora' section"),
    ]:
        with pytest.raises(SystemExit):
            main([*WHERE, "--job", job_file(tmp_path, customization_type="GRPOLoRA", **fields)])
        assert expected in capsys.readouterr().err
    for kind in ("DPOLoRA", "FinetuneLoRA", "Other"):
        with pytest.raises(SystemExit):
            main([*WHERE, "--job", job_file(tmp_path, customization_type=kind)])
        assert f"customization_type: {kind!r} is not trained here; the supported types are GRPO" in (
            capsys.readouterr().err
        )
