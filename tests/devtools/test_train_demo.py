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
