"""Harness rollouts: a program (Codex CLI, Claude Code, mini-swe-agent, any command) as a job's rollout.

A job's ``custom_rl_pipeline.rollout.harness`` (``job.HarnessSpec``) names it; the runner then uses
``HarnessRollout.plugin()`` as the job's rollout, a single rollout like any other (sessions, retries,
finishing: ``runner.rollouts``). Per rollout, in its session:

- a fresh scratch directory ``<root>/<session id>/`` with ``work/`` (the working directory, holding the
  sample's ``extra.files``), ``home/`` (its HOME: empty, its config written there) and ``tmp/`` (TMPDIR);
- a clean environment: PATH and the locale, the session's base URL and key (as each harness reads them),
  telemetry, error reporting and update checks off, then the job's ``env`` and ``pass_env``;
- the program (``runner.processes``: its own process group, killed at the ``timeout``; bounded output);
- the rollout's ``extra["harness"]``: its exit code, whether it timed out, its seconds, the tails of its
  stdout and stderr (and their full sizes), its last message where the harness has one, and the working
  directory (``workdir_of``), which the graders read (to run the sample's tests there) and the runner
  removes once the sample is graded (``keep_workdirs``: never).

What a timeout or a non-zero exit means is the job's (``on_timeout``, ``on_error``): a status of the seed's
(the session finished with it, the error saying what happened), or ``grade`` (a success, graded as it is).
A harness that cannot run (an unknown executable) is refused when the job is loaded, before anything runs.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

import structlog

from rollout_proxy.runner.job import HarnessSpec, JobError
from rollout_proxy.runner.processes import ProcessOutcome, run_process
from rollout_proxy.sdk.decorators import Plugin, rollout
from rollout_proxy.sdk.proxy import RolloutInferenceProxy
from rollout_proxy.sdk.runtime import Runtime
from rollout_proxy.sdk.types import ChatCompletionSample, PluginContext, PluginStatus, RolloutResult, Trajectory

log = structlog.get_logger(__name__)

WHERE = "custom_rl_pipeline.rollout.harness"
#: the npm clients the project's scripts install (``python -m devtools.harnesses setup``): package, version, command
NPM_PINS = {
    "codex": ("@openai/codex", "0.171.0", "codex"),
    "claude-code": ("@anthropic-ai/claude-code", "2.1.332", "claude"),
}
#: mini-swe-agent comes with the dev extra (a Python package): its command
MINI_SWE_AGENT = ("mini-swe-agent", "2.4.6", "mini")
#: the environment variable naming each harness's program
EXECUTABLE_VARIABLES = {
    "codex": "ROLLOUT_PROXY_CODEX",
    "claude-code": "ROLLOUT_PROXY_CLAUDE_CODE",
    "mini-swe-agent": "ROLLOUT_PROXY_MINI_SWE_AGENT",
}
#: what is kept of the runner's environment (nothing else is, unless the job's ``pass_env`` names it)
KEPT = ("PATH", "LANG", "LC_ALL", "LC_CTYPE", "TZ")
#: off for every harness: telemetry, usage reports, update checks and notices, colour
QUIET = {
    "DO_NOT_TRACK": "1",
    "DISABLE_TELEMETRY": "1",
    "DISABLE_ERROR_REPORTING": "1",
    "DISABLE_AUTOUPDATER": "1",
    "NO_UPDATE_NOTIFIER": "1",
    "NPM_CONFIG_UPDATE_NOTIFIER": "false",
    "NPM_CONFIG_FUND": "false",
    "NPM_CONFIG_AUDIT": "false",
    "PIP_DISABLE_PIP_VERSION_CHECK": "1",
    "HF_HUB_DISABLE_TELEMETRY": "1",
    "OPENAI_AGENTS_DISABLE_TRACING": "1",
    "NO_COLOR": "1",
    "TERM": "dumb",
    "PYTHONUNBUFFERED": "1",
}

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

_PLACEHOLDER = re.compile(r"\{(\w+)\}")


def cache_dir() -> Path:
    """Where the project's scripts keep the pinned installs: ``$ROLLOUT_PROXY_CACHE``, else ~/.cache/rollout-proxy."""
    env = os.environ.get("ROLLOUT_PROXY_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "rollout-proxy"


def pinned_install(name: str) -> Path | None:
    """The pinned npm client's command as ``python -m devtools.harnesses setup`` installs it (None: not npm)."""
    if name not in NPM_PINS:
        return None
    package, version, command = NPM_PINS[name]
    return cache_dir() / "npm" / f"{package.strip('@').replace('/', '-')}@{version}" / "bin" / command


def codex_home(directory: Path, base_url: str) -> Path:
    """A ``CODEX_HOME`` whose ``config.toml`` points Codex at the session at ``base_url``."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.toml").write_text(CODEX_CONFIG.format(base_url=base_url))
    return directory


def codex_environment(home: Path, api_key: str) -> dict[str, str]:
    """Codex's own variables: its home and the session's key (what ``CODEX_CONFIG``'s ``env_key`` names)."""
    keep = {name: os.environ[name] for name in ("PATH", "LANG", "TERM", "TMPDIR") if name in os.environ}
    return {**keep, "HOME": str(home), "CODEX_HOME": str(home), "ROLLOUT_PROXY_API_KEY": api_key, "NO_COLOR": "1"}


def _how_to_install(name: str) -> str:
    if name in NPM_PINS:
        package, version, _ = NPM_PINS[name]
        return (
            f"`npm install -g {package}@{version}`, or from a clone of this repository `python -m devtools.harnesses "
            "setup`"
        )
    package, version, _ = MINI_SWE_AGENT
    return f"`pip install {package}=={version}` (the dev extra has it)"


def _runnable(word: str) -> str | None:
    """``word`` as an executable path: a path that is one, or a name on PATH."""
    if os.sep in word:
        path = Path(word).expanduser()
        return str(path) if path.is_file() and os.access(path, os.X_OK) else None
    return shutil.which(word)


def find_executable(spec: HarnessSpec) -> str:
    """The named harness's program (``executable``, its variable, PATH, the pinned install), or a ``JobError``."""
    if spec.executable:
        found = _runnable(spec.executable)
        if found is None:
            raise JobError(f"{WHERE}.executable: {spec.executable!r} is not an executable file or a command on PATH")
        return found
    variable = EXECUTABLE_VARIABLES[spec.name]
    if os.environ.get(variable):
        found = _runnable(os.environ[variable])
        if found is None:
            raise JobError(f"{WHERE}: ${variable} is {os.environ[variable]!r}, which is not an executable")
        return found
    command = NPM_PINS[spec.name][2] if spec.name in NPM_PINS else MINI_SWE_AGENT[2]
    candidates = [shutil.which(command), str(pinned_install(spec.name) or "")]
    if spec.name == "mini-swe-agent":  # installed with this interpreter's packages
        candidates.insert(0, _runnable(str(Path(sys.executable).with_name(command))))
    for candidate in candidates:
        if candidate and _runnable(candidate):
            return candidate
    raise JobError(
        f"{WHERE}: harness {spec.name!r} is not installed ({command!r} is not on PATH): {_how_to_install(spec.name)}; "
        f"or name its program in {WHERE}.executable or ${variable}"
    )


def task_of(sample: ChatCompletionSample) -> str | None:
    """The task a harness is given: ``extra.task``, else the text of the sample's last user message."""
    task = (sample.extra or {}).get("task")
    if isinstance(task, str) and task:
        return task
    for message in reversed(sample.message_dicts()):
        if message.get("role") == "user" and isinstance(message.get("content"), str) and message["content"]:
            return str(message["content"])
    return None


def workdir_of(trajectory: Trajectory) -> Path | None:
    """The working directory a harness rollout left for its graders (None: not a harness rollout's)."""
    harness = (trajectory.extra or {}).get("harness") or {}
    workdir = harness.get("workdir")
    return Path(workdir) if workdir else None


def substitute(words: Iterable[str], values: Mapping[str, str]) -> list[str]:
    """Each ``{name}`` of ``job.PLACEHOLDERS`` in ``words`` replaced by its value (other braces left alone)."""
    return [_PLACEHOLDER.sub(lambda m: values.get(m.group(1), m.group(0)), word) for word in words]


def _files_problem(files: Any) -> str:
    """What is wrong with a sample's ``extra.files`` ("" when nothing): a mapping of relative paths to text."""
    if not isinstance(files, dict):
        return f"must map relative paths to their text, got {type(files).__name__}"
    for name, text in files.items():
        if not isinstance(text, str):
            return f"{name!r}: its text must be a string, got {type(text).__name__}"
        parts = PurePosixPath(str(name)).parts
        if not parts or str(name).startswith("/") or ".." in parts:
            return f"{name!r} is outside the working directory"
    return ""


@dataclass(frozen=True, slots=True)
class Scratch:
    """One rollout's directories."""

    root: Path
    work: Path
    home: Path
    tmp: Path

    @classmethod
    def create(cls, root: Path, files: Mapping[str, Any]) -> Scratch:
        """The directories, with ``files`` (relative path -> text) written into ``work``; ValueError for a path
        outside it."""
        scratch = cls(root, root / "work", root / "home", root / "tmp")
        for directory in (scratch.work, scratch.home, scratch.tmp):
            directory.mkdir(parents=True)
        work = scratch.work.resolve()
        for name, text in files.items():
            path = (work / str(name)).resolve()
            if work not in path.parents:
                raise ValueError(f"extra.files: {name!r} is outside the working directory")
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(str(text))
        return scratch


@dataclass(frozen=True, slots=True)
class Launch:
    """How one harness is started: its argv, its own variables, where its last message comes from."""

    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    final_message: Callable[[ProcessOutcome], str | None] = lambda outcome: None


def _read(path: Path) -> str | None:
    return path.read_text(errors="replace") if path.is_file() else None


def _mini_submission(path: Path) -> str | None:
    try:
        return str(json.loads(path.read_text())["info"]["submission"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def placeholder_values(task: str, scratch: Scratch, *, base_url: str, job_dir: Path) -> dict[str, str]:
    return {
        "task": task,
        "workdir": str(scratch.work),
        "home": str(scratch.home),
        "python": sys.executable,
        "job_dir": str(job_dir),
        "base_url": base_url,
    }


def _launch(
    spec: HarnessSpec, executable: str, task: str, base_url: str, api_key: str, scratch: Scratch, job_dir: Path
) -> Launch:
    """The named harness's command line and variables (a ``command`` harness: its argv as given)."""
    values = placeholder_values(task, scratch, base_url=base_url, job_dir=job_dir)
    args = substitute(spec.args, values)
    if spec.name == "codex":
        home = codex_home(scratch.home / ".codex", base_url)
        last = scratch.home / "last-message.txt"
        argv = [executable, "exec", *args, "--skip-git-repo-check", "--ephemeral", "--color", "never"]
        argv += ["-C", str(scratch.work), "-o", str(last), task]
        env = {"CODEX_HOME": str(home), "ROLLOUT_PROXY_API_KEY": api_key}
        return Launch(argv, env, lambda outcome: _read(last))
    if spec.name == "claude-code":
        env = {
            "CLAUDE_CONFIG_DIR": str(scratch.home / ".claude"),
            "ANTHROPIC_BASE_URL": base_url,
            "ANTHROPIC_API_KEY": api_key,
            "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        }
        return Launch([executable, "-p", task, *args], env, lambda outcome: outcome.stdout.text().strip() or None)
    if spec.name == "mini-swe-agent":
        saved = scratch.home / "trajectory.json"
        argv = [executable, "-m", "openai/policy", "-t", task, "--yolo", "--exit-immediately", "-c", "mini.yaml"]
        argv += ["-c", f"model.model_kwargs.api_base={base_url}", "-c", f"model.model_kwargs.api_key={api_key}"]
        argv += ["-c", "model.cost_tracking=ignore_errors", "-o", str(saved), *args]
        env = {
            "MSWEA_GLOBAL_CONFIG_DIR": str(scratch.home / ".config" / "mini-swe-agent"),
            "MSWEA_SILENT_STARTUP": "1",
            "MSWEA_CONFIGURED": "true",
            "LITELLM_LOCAL_MODEL_COST_MAP": "True",
        }
        return Launch(argv, env, lambda outcome: _mini_submission(saved))
    return Launch(substitute(spec.command, values))


def base_environment(scratch: Scratch, *, base_url: str, api_key: str, task: str) -> dict[str, str]:
    """What every harness gets: PATH and the locale, its own HOME and TMPDIR, the session, quiet."""
    kept = {name: os.environ[name] for name in KEPT if name in os.environ}
    home = scratch.home
    return {
        **kept,
        **QUIET,
        "HOME": str(home),
        "TMPDIR": str(scratch.tmp),
        "XDG_CONFIG_HOME": str(home / ".config"),
        "XDG_CACHE_HOME": str(home / ".cache"),
        "XDG_DATA_HOME": str(home / ".local" / "share"),
        "XDG_STATE_HOME": str(home / ".local" / "state"),
        "ROLLOUT_PROXY_BASE_URL": base_url,
        "ROLLOUT_PROXY_API_KEY": api_key,
        "ROLLOUT_PROXY_WORKDIR": str(scratch.work),
        "ROLLOUT_PROXY_TASK": task,
        "OPENAI_BASE_URL": base_url,
        "OPENAI_API_KEY": api_key,
    }


_STATUSES = {
    "retry": PluginStatus.RETRY,
    "discard": PluginStatus.DISCARD,
    "failure": PluginStatus.FAILURE,
    "grade": PluginStatus.SUCCESS,
}


class HarnessRollout:
    """A job's harness, checked and ready: ``plugin()`` is the job's rollout; ``release`` removes what the
    graders were given; ``close`` removes the job's scratch root (one this made)."""

    def __init__(self, spec: HarnessSpec, *, base_dir: Path = Path(".")) -> None:
        self.spec = spec
        self._base_dir = base_dir.resolve()
        self.executable = find_executable(spec) if spec.name != "command" else ""
        for label, words in (("command", spec.command), ("wrapper", spec.wrapper)):
            if words:
                self._check_program(label, words[0])
        self._root: Path | None = None
        self._owns_root = spec.workdir_root is None

    def _check_program(self, label: str, word: str) -> None:
        program = substitute([word], {"python": sys.executable, "job_dir": str(self._base_dir)})[0]
        if _runnable(program) is None:
            raise JobError(f"{WHERE}.{label}[0]: {word!r} is not an executable file or a command on PATH")

    @property
    def root(self) -> Path:
        """The job's scratch root, made on first use."""
        if self._root is None:
            if self.spec.workdir_root is None:
                self._root = Path(tempfile.mkdtemp(prefix="rollout-harness-"))
            else:
                self._root = (self._base_dir / self.spec.workdir_root).resolve()
                self._root.mkdir(parents=True, exist_ok=True)
        return self._root

    def check_samples(self, records: Iterable[dict[str, Any]]) -> None:
        """Every sample has a task (``extra.task`` or a user message), or a ``JobError`` naming the first that has none."""
        for index, record in enumerate(records):
            sample = ChatCompletionSample.model_validate(record)
            if task_of(sample) is None:
                raise JobError(
                    f"{WHERE}: sample {index} of the training set has no task for the harness: give it "
                    "extra.task (or a user message)"
                )
            files = (sample.extra or {}).get("files") or {}
            problem = _files_problem(files)
            if problem:
                raise JobError(f"{WHERE}: sample {index} of the training set: extra.files {problem}")

    def plugin(self) -> Plugin:
        """The job's rollout: one harness run per call (``max_concurrency`` at once)."""
        return rollout(
            self.run,
            name=f"harness:{self.spec.name}",
            description=f"runs the {self.spec.name} harness once per rollout in a fresh working directory",
            runtime=Runtime(max_concurrency=self.spec.max_concurrency),
        )

    async def run(
        self, context: PluginContext, proxy: RolloutInferenceProxy, sample: ChatCompletionSample
    ) -> RolloutResult:
        """One rollout: the harness on the sample's task against ``proxy``'s session, in a fresh directory."""
        task = task_of(sample)
        if task is None:
            return RolloutResult(status=PluginStatus.FAILURE, error="the sample has no task (extra.task)")
        files = (sample.extra or {}).get("files") or {}
        if not isinstance(files, dict):
            return RolloutResult(status=PluginStatus.FAILURE, error="extra.files must map paths to their text")
        try:
            scratch = await asyncio.to_thread(Scratch.create, self.root / proxy.session_id, files)
        except ValueError as exc:
            return RolloutResult(status=PluginStatus.FAILURE, error=str(exc))
        spec = self.spec
        try:
            launch = await asyncio.to_thread(
                _launch, spec, self.executable, task, proxy.url, proxy.jwt_token, scratch, self._base_dir
            )
            env = {
                **base_environment(scratch, base_url=proxy.url, api_key=proxy.jwt_token, task=task),
                **launch.env,
                **spec.env,
                **{name: os.environ[name] for name in spec.pass_env if name in os.environ},
            }
            values = placeholder_values(task, scratch, base_url=proxy.url, job_dir=self._base_dir)
            argv = [*substitute(spec.wrapper, values), *launch.argv]
            try:
                outcome = await run_process(
                    argv, cwd=scratch.work, env=env, wall_time=spec.timeout, tail_bytes=spec.tail_bytes
                )
            except OSError as exc:
                await self._remove(scratch.root)
                return RolloutResult(status=PluginStatus.FAILURE, error=f"harness {spec.name} did not start: {exc}")
        except BaseException:  # cancelled (the job stopped): nothing will grade it
            await self._remove(scratch.root)
            raise
        final = await asyncio.to_thread(launch.final_message, outcome)
        report = {
            "name": spec.name,
            "exit_code": outcome.exit_code,
            "timed_out": outcome.timed_out,
            "seconds": round(outcome.seconds, 3),
            "stdout_tail": outcome.stdout.text(),
            "stderr_tail": outcome.stderr.text(),
            "stdout_bytes": outcome.stdout.total,
            "stderr_bytes": outcome.stderr.total,
            "final_message": final,
            "workdir": str(scratch.work),
        }
        status, error = self._status(outcome)
        if status is not PluginStatus.SUCCESS:
            await self._remove(scratch.root)  # nobody grades it: it is retried, dropped or fails the job
            log.info("harness_rollout_ended", harness=spec.name, status=status.value, error=error)
        return RolloutResult(status=status, error=error, extra={"harness": report})

    def _status(self, outcome: ProcessOutcome) -> tuple[PluginStatus, str]:
        """The rollout's status for how the harness ended, and the error saying so."""
        spec = self.spec
        if outcome.timed_out:
            policy = spec.on_timeout
        elif outcome.exit_code != 0:
            policy = spec.on_error
        else:
            return PluginStatus.SUCCESS, ""
        said = outcome.stderr.text().strip()[-500:] or outcome.stdout.text().strip()[-500:]
        error = f"harness {spec.name} {outcome.describe()}" + (f": {said}" if said else "")
        return _STATUSES[policy], error

    async def release(self, trajectories: Iterable[Trajectory]) -> None:
        """Remove the working directories of graded rollouts (unless ``keep_workdirs``)."""
        for trajectory in trajectories:
            workdir = workdir_of(trajectory)
            if workdir is not None and self._root is not None and self._root in workdir.parents:
                await self._remove(workdir.parent)

    async def _remove(self, path: Path) -> None:
        if not self.spec.keep_workdirs:
            await asyncio.to_thread(shutil.rmtree, path, True)

    async def close(self) -> None:
        """The end of the job: the scratch root goes too, when this made it (a temporary directory)."""
        if self._root is not None and self._owns_root and not self.spec.keep_workdirs:
            await asyncio.to_thread(shutil.rmtree, self._root, True)
