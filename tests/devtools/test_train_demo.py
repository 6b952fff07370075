"""``./scripts/demo.sh --train``'s own parts (the real run is `make train-demo`, a benchmark): the job it
runs, the summary it prints, its redis-server (installed with apt on a machine without one), and what it
refuses."""

from __future__ import annotations

import shutil
import socket
from pathlib import Path

import pytest

from devtools import apt, demo, train_demo


def test_the_training_job_ties_each_step_to_the_weights_trained_on_the_one_before():
    job = train_demo.train_job(
        demo.load_job("short-answer", samples=None, generations=None, steps=None),
        steps=None,
        samples=None,
        generations=None,
    )
    hyper = job.hyperparameters
    assert (hyper.num_steps, hyper.batch_size, hyper.num_generations) == (8, 8, 4)
    assert job.training_loop.max_staleness == 0
    small = train_demo.train_job(
        demo.load_job("short-answer", samples=2, generations=2, steps=3), steps=3, samples=2, generations=2
    )
    assert (small.hyperparameters.num_steps, small.hyperparameters.batch_size) == (3, 2)


def test_the_trainer_is_started_on_the_demo_checkpoint_with_the_jobs_settings(tmp_path):
    job = train_demo.train_job(
        demo.load_job("short-answer", samples=None, generations=None, steps=None),
        steps=5,
        samples=None,
        generations=None,
    )
    command = train_demo.TrainDemo(job, tmp_path, learning_rate=3e-5, seed=7).trainer_command(
        "http://127.0.0.1:1", "key", "redis://127.0.0.1:2/0", tmp_path
    )
    options = dict(zip(command[3::2], command[4::2], strict=False))
    assert command[1:3] == ["-m", "rollout_proxy.trainer"]
    assert options["--steps"] == "5" and options["--lr"] == "3e-05" and options["--seed"] == "7"
    assert options["--temperature"] == "1.0" and options["--out"] == str(tmp_path / "trainer")
    assert options["--model"].endswith("smollm2-135m-instruct")


def test_lora_makes_the_job_a_grpolora_job_whose_sessions_sample_the_policy_its_trainer_publishes(tmp_path):
    """``--train --lora``: the job file the demo writes is the GRPOLoRA job the runner runs (its sessions on
    the LoRA policy, each step waiting for the version trained on the one before), the trainer is started on
    it (``--job``) and reads from it the adapter to train and the policy to publish, and vLLM serves
    adapters of that rank, loaded at run time."""
    from rollout_proxy.runner.job import JobConfig
    from rollout_proxy.trainer.__main__ import parser
    from rollout_proxy.trainer.settings import TrainerSettings

    sizes = {"steps": None, "samples": None, "generations": None}
    job = train_demo.lora_job(train_demo.train_job(demo.load_job("short-answer", **sizes), **sizes))
    assert job.customization_type == "GRPOLoRA" and job.proxy.policy == train_demo.LORA_POLICY
    assert job.lora is not None and (job.lora.policy, job.lora.rank) == (train_demo.LORA_POLICY, 16)
    assert job.training_loop.max_staleness == 0 and job.hyperparameters.num_steps == 8

    written = JobConfig.load(train_demo.write_job_file(job, tmp_path / train_demo.JOB_FILE))
    assert written.dataset_files() == job.dataset_files()  # by absolute path: read from anywhere
    assert written.model_dump(exclude={"data"}) == job.model_dump(exclude={"data"})

    run = train_demo.TrainDemo(job, tmp_path, learning_rate=train_demo.LORA_LEARNING_RATE)
    command = run.trainer_command("http://127.0.0.1:1", "key", "redis://127.0.0.1:2/0", tmp_path)
    settings = TrainerSettings.from_env(**vars(parser().parse_args(command[3:])))
    assert settings.job == str(tmp_path / train_demo.JOB_FILE)
    assert (settings.policy, settings.lora_rank, settings.alpha) == (train_demo.LORA_POLICY, 16, 32)
    assert settings.target_modules == tuple(job.lora.target_modules) and settings.lr == 5e-4

    engine = run.engine()
    vllm = engine.command(Path("python"), Path("model"))
    assert vllm[vllm.index("--enable-lora") :][:5] == ["--enable-lora", "--max-lora-rank", "16", "--max-loras", "4"]
    assert engine.environment()["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "true"
    assert engine.environment()["VLLM_SERVER_DEV_MODE"] == "1"


def test_without_lora_the_trainer_trains_the_full_weights_on_an_engine_without_adapters(tmp_path):
    sizes = {"steps": None, "samples": None, "generations": None}
    run = train_demo.TrainDemo(train_demo.train_job(demo.load_job("short-answer", **sizes), **sizes), tmp_path)
    command = run.trainer_command("http://127.0.0.1:1", "key", "redis://127.0.0.1:2/0", tmp_path)
    assert "--job" not in command and "--lora-rank" not in command and "--policy" not in command
    assert "--enable-lora" not in run.engine().command(Path("python"), Path("model"))
    assert run.job.proxy.policy == "base"


@pytest.mark.parametrize(
    "argv, lora, lr",
    [
        (["--train", "--lora"], True, train_demo.LORA_LEARNING_RATE),
        (["--train", "--lora", "--lr", "1e-3"], True, 1e-3),
        (["--train"], False, train_demo.LEARNING_RATE),
    ],
)
def test_the_command_line_runs_the_lora_job_at_the_lora_learning_rate(monkeypatch, argv, lora, lr):
    """What ``./scripts/demo.sh --train --lora`` hands the training demo (its run replaced: no vLLM here)."""
    started: list[train_demo.TrainDemo] = []
    monkeypatch.setattr(demo.engine_env, "setup", lambda: None)
    monkeypatch.setattr(apt, "ensure_command", lambda *args, **kwargs: Path("redis-server"))
    monkeypatch.setattr(train_demo.TrainDemo, "run", lambda self: started.append(self) or Path())
    assert demo.main([*argv, "--steps", "3"]) == 0
    [run] = started
    assert run.learning_rate == lr and run.job.hyperparameters.num_steps == 3
    assert (run.job.customization_type, run.job.proxy.policy) == (
        ("GRPOLoRA", train_demo.LORA_POLICY) if lora else ("GRPO", "base")
    )


def test_lora_is_refused_in_words_without_train_or_on_the_fake_engine(capsys):
    with pytest.raises(SystemExit):
        demo.main(["--lora"])
    assert "--lora says what --train trains (a LoRA adapter): give --train too" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        demo.main(["--lora", "--engine", "fake"])
    assert "give --train too" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        demo.main(["--train", "--lora", "--engine", "fake"])
    assert "it runs on --engine vllm only" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        demo.main(["--help"])
    assert "--lora" in capsys.readouterr().out


def record(step: int, reward: float, max_abs: float, other: int = 0) -> dict:
    stats = {"tokens": 10, "max_abs": max_abs, "mean_abs": max_abs / 4, "k3": 0.0, "over": 0, "over_share": 0.0}
    return {
        "step": step,
        "trained_version": step,
        "reward": {"mean": reward, "std": 0.1, "min": 0.0, "max": 1.0},
        "mismatch": {
            "threshold": 1e-3,
            "tokens": 10 + other,
            "current": stats,
            "other_version": {**stats, "tokens": other},
        },
        "timing": {"train_s": 60.0, "pause_s": 0.1, "reload_s": 2.0, "resume_s": 0.1},
    }


def test_the_summary_gives_the_first_and_last_rewards_the_worst_mismatch_and_the_time_per_step():
    text = train_demo.render_training([record(0, 0.25, 1e-5), record(1, 0.5, 3e-5), record(2, 0.75, 2e-5)], 540.0)
    assert "3 step(s): reward 0.250 at the first step, 0.750 at the last" in text
    assert "3.0 min per step" in text
    assert "max |trainer - vLLM logprob| 3e-05 over 30 trained tokens; 0 token(s) of another version" in text
    assert text.count("\n  step ") == 3
    assert train_demo.render_training([], 1.0) == "training      no step trained"


def test_the_lora_summary_says_each_adapter_was_published_without_a_pause():
    lora = record(0, 0.25, 1e-5)
    lora["timing"] = {"train_s": 60.0, "pause_s": 0.0, "publish_s": 0.4, "resume_s": 0.0}
    text = train_demo.render_training([lora], 60.0)
    assert "adapter published in 0.4s, fleet not paused" in text and "fleet paused" not in text


def test_its_redis_server_starts_and_stops(tmp_path):
    redis = train_demo.RedisProcess(tmp_path / "redis")
    url = redis.start()
    port = int(url.rsplit(":", 1)[1].split("/")[0])
    with socket.create_connection(("127.0.0.1", port), timeout=1):
        pass
    redis.stop()
    with pytest.raises(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
        pass


def test_train_and_keep_running_do_not_go_together(capsys):
    with pytest.raises(SystemExit):
        demo.main(["--train", "--keep-running"])
    assert "--train and --keep-running" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        demo.main(["--help"])
    assert "--train" in capsys.readouterr().out


def fake_apt(bin_dir: Path, *, provides: dict[str, str]) -> Path:
    """A PATH of one directory holding an ``apt-get`` (and a ``sudo``) that log their calls and "install" a
    package by linking its command from ``provides`` (command -> the real program) into the directory."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    calls = bin_dir.parent / "apt-calls.log"
    links = "\n".join(
        f"    {command}) /bin/ln -sf {target} {bin_dir / command} ;;" for command, target in provides.items()
    )
    (bin_dir / "apt-get").write_text(
        "#!/bin/sh\n"
        f'echo "$@" >> {calls}\n'
        '[ "$1" = install ] || exit 0\n'
        'for package in "$@"; do\n  case "$package" in\n'
        f"{links}\n"
        "  esac\ndone\n"
    )
    (bin_dir / "sudo").write_text('#!/bin/sh\nexec "$@"\n')
    for script in ("apt-get", "sudo"):
        (bin_dir / script).chmod(0o755)
    return calls


def test_a_machine_without_redis_server_gets_it_from_apt_once(tmp_path, monkeypatch):
    """`make train-demo` on a fresh machine: redis-server is installed with apt, started, stopped; the next
    run finds it and installs nothing."""
    real = shutil.which("redis-server")
    assert real is not None  # the tests' own Redis servers need it
    calls = fake_apt(tmp_path / "bin", provides={"redis-server": real})
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))
    for run in range(2):
        redis = train_demo.RedisProcess(tmp_path / f"redis-{run}")
        url = redis.start()
        port = int(url.rsplit(":", 1)[1].split("/")[0])
        with socket.create_connection(("127.0.0.1", port), timeout=1):
            pass
        redis.stop()
    assert calls.read_text().splitlines() == ["install -y -q --no-install-recommends redis-server"]
    assert (tmp_path / "bin" / "redis-server").is_symlink()


def test_without_apt_it_says_what_to_install(tmp_path, monkeypatch):
    (tmp_path / "empty").mkdir()
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    with pytest.raises(apt.SetupError) as raised:
        train_demo.RedisProcess(tmp_path / "redis").start()
    assert "needs redis-server, and this machine has no apt-get" in str(raised.value)


def test_an_install_that_fails_is_retried_after_an_update_then_refused_in_words(tmp_path, monkeypatch):
    calls = fake_apt(tmp_path / "bin", provides={})  # installs nothing
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))
    with pytest.raises(apt.SetupError, match="redis-server is installed but 'redis-server' is not on PATH"):
        apt.ensure_command("redis-server", why="a test")
    (tmp_path / "bin" / "apt-get").write_text(f'#!/bin/sh\necho "$@" >> {calls}\n[ "$1" = update ]\n')
    with pytest.raises(apt.SetupError, match="failed: install npm yourself"):
        apt.ensure_command("npm", why="a test")
    assert calls.read_text().splitlines()[-3:] == [
        "install -y -q --no-install-recommends npm",
        "update -q",
        "install -y -q --no-install-recommends npm",
    ]
