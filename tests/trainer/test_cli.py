"""``python -m rollout_proxy.trainer``: its help, and the refusals before anything starts."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from rollout_proxy.trainer.__main__ import main

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
        main(["--proxy", "http://127.0.0.1:9", "--feed", "redis://127.0.0.1:9/0", "--out", "x"])
    assert exit_.value.code == 2 and "--admin-key" in capsys.readouterr().err


def test_a_step_count_below_one_is_refused(capsys):
    with pytest.raises(SystemExit):
        main(["--proxy", "p", "--admin-key", "k", "--feed", "redis://h:1/0", "--out", "x", "--steps", "0"])
    assert "--steps must be at least 1" in capsys.readouterr().err
