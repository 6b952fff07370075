"""A harness as the rollout: Codex CLI (``codex exec``), unmodified, in a fresh working directory per sample.

The session's sample has no messages: Codex owns its prompt (its developer instructions, the
environment context, the task), and the task reaches it on its command line (``sample.extra["task"]``),
with the files the task needs written into the working directory first (``sample.extra["files"]``).
Codex is pointed at the session by a ``config.toml`` in a temporary ``CODEX_HOME`` (``CODEX_CONFIG``:
the session's ``base_url``, its key in an environment variable, the Responses API; update checks,
analytics, telemetry, plugins and history off; commands run without approval in a sandbox that may
write only the working directory). Every request Codex sends is recorded by the proxy, token for
token; the rollout returns Codex's last message for the grader, which checks it against
``sample.extra["answer"]``.

Codex sends its own generation parameters (``reasoning``, ...): the ones that change nothing are
accepted by a session's default ``client_sampling: refuse``; a job whose harness sends more sets
``proxy.client_sampling: ignore`` (the job's values are used, Codex's recorded).

Codex is found as ``$ROLLOUT_PROXY_CODEX``, else on ``PATH`` (the demo points the first at the pinned
install the project's scripts keep in their cache: ``python -m devtools.harnesses setup``, from a clone). ``$ROLLOUT_PROXY_CODEX_ARGS`` adds arguments to
``codex exec`` (shell words), e.g. ``-c features.multi_agent=false -c web_search="disabled"`` to leave its
sub-agent tools and web search out of its requests (its first prompt is then ~6.8k tokens instead of ~9.4k,
which a model with an 8k context needs).
"""

from __future__ import annotations

import asyncio
import os
import shlex
import shutil
import tempfile
from pathlib import Path

from rollout_proxy.sdk import (
    ChatCompletionSample,
    PluginContext,
    PluginInstance,
    PluginStatus,
    RolloutInferenceProxy,
    RolloutResult,
    Runtime,
    SingleGraderResult,
    Trajectory,
    rollout,
    single_grader,
)

#: what ``codex exec`` needs to talk to a rollout session, and nothing else (``{base_url}``: the session's)
CODEX_CONFIG = """\
model = "policy"
model_provider = "rollout-proxy"
approval_policy = "never"
sandbox_mode = "workspace-write"
check_for_update_on_startup = false

[features]
plugins = false

[analytics]
enabled = false

[otel]
exporter = "none"

[history]
persistence = "none"

[model_providers.rollout-proxy]
name = "rollout-proxy"
base_url = "{base_url}"
env_key = "ROLLOUT_PROXY_API_KEY"
wire_api = "responses"
request_max_retries = 0
stream_max_retries = 0
"""
#: seconds one ``codex exec`` may take before the rollout fails
CODEX_TIMEOUT = 600.0
PINNED_CODEX = "0.171.0"


def codex_executable() -> str:
    """Codex CLI: ``$ROLLOUT_PROXY_CODEX``, else ``codex`` on ``PATH`` (the demo sets the first to the install
    the project's scripts keep in their cache)."""
    found = os.environ.get("ROLLOUT_PROXY_CODEX") or shutil.which("codex")
    if not found:
        raise FileNotFoundError(
            f"Codex CLI is not installed: `npm install -g @openai/codex@{PINNED_CODEX}`, or from a clone of this "
            "repository `python -m devtools.harnesses setup` (then ROLLOUT_PROXY_CODEX names the executable)"
        )
    return found


def codex_home(directory: Path, base_url: str) -> Path:
    """A ``CODEX_HOME`` whose ``config.toml`` points Codex at the session at ``base_url``."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.toml").write_text(CODEX_CONFIG.format(base_url=base_url))
    return directory


def codex_environment(home: Path, api_key: str) -> dict[str, str]:
    """Codex's environment: its home, the session's key, and the few variables a shell needs."""
    keep = {name: os.environ[name] for name in ("PATH", "LANG", "TERM", "TMPDIR") if name in os.environ}
    return {**keep, "HOME": str(home), "CODEX_HOME": str(home), "ROLLOUT_PROXY_API_KEY": api_key, "NO_COLOR": "1"}


async def run_codex(task: str, *, base_url: str, api_key: str, workdir: Path, home: Path) -> tuple[int, str, str]:
    """``codex exec TASK`` in ``workdir``: (exit status, its last message, what it printed on stderr)."""
    codex_home(home, base_url)
    last = home / "last-message.txt"
    process = await asyncio.create_subprocess_exec(
        codex_executable(),
        "exec",
        *shlex.split(os.environ.get("ROLLOUT_PROXY_CODEX_ARGS", "")),
        "--skip-git-repo-check",
        "--ephemeral",
        "--color",
        "never",
        "-C",
        str(workdir),
        "-o",
        str(last),
        task,
        env=codex_environment(home, api_key),
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        _, stderr = await asyncio.wait_for(process.communicate(), CODEX_TIMEOUT)
    except TimeoutError:
        process.kill()
        await process.wait()
        raise
    message = last.read_text() if last.is_file() else ""
    return process.returncode or 0, message, stderr.decode(errors="replace")


@rollout(
    name="codex_rollout",
    description="runs Codex CLI (codex exec) on the sample's task in a fresh working directory",
    runtime=Runtime(instance=PluginInstance.CPU2MEM4, timeout=900, max_concurrency=4),
)
async def codex_rollout(
    context: PluginContext, proxy: RolloutInferenceProxy, sample: ChatCompletionSample
) -> RolloutResult:
    extra = sample.extra or {}
    await proxy.aopen()
    with tempfile.TemporaryDirectory(prefix="codex-rollout-") as scratch:
        workdir, home = Path(scratch) / "work", Path(scratch) / "home"
        workdir.mkdir()
        for name, text in (extra.get("files") or {}).items():
            path = (workdir / name).resolve()
            if workdir.resolve() not in path.parents:
                return RolloutResult(status=PluginStatus.FAILURE, error=f"file {name!r} is outside the workdir")
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
        code, message, stderr = await run_codex(
            str(extra["task"]), base_url=proxy.url, api_key=proxy.jwt_token, workdir=workdir, home=home
        )
    if code != 0:
        return RolloutResult(status=PluginStatus.FAILURE, error=f"codex exec exited {code}: {stderr[-500:]}")
    return RolloutResult(status=PluginStatus.SUCCESS, extra={"final_message": message})


@single_grader(name="codex_answer_reward")
def codex_answer_reward(
    context: PluginContext, sample: ChatCompletionSample, trajectory: Trajectory
) -> SingleGraderResult:
    """1.0 when Codex's last message holds the expected answer (case-insensitive), else 0.0."""
    answer = str((sample.extra or {})["answer"]).lower()
    said = str((trajectory.extra or {}).get("final_message") or "")
    if not said:
        said = next((m.get("content") or "" for m in reversed(trajectory.messages) if m.get("role") == "assistant"), "")
    found = answer in said.lower()
    return SingleGraderResult(reward=1.0 if found else 0.0, metrics={"answered": float(found)})
