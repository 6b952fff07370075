"""The job file, in the shape of the seed's ``job.yaml``.

Only what the runner uses is interpreted (``customization_type``, ``custom_rl_pipeline``, ``data``,
``hyperparameters``, and our ``proxy``, ``ray``, ``training_loop`` and ``lora`` sections); the rest of
the seed's fields are accepted and recorded. Of the seed's customization types the project trains ``GRPO``
(the full weights) and ``GRPOLoRA`` (a LoRA adapter: the ``lora`` section, its sessions on that LoRA policy);
any other is refused. Anything unknown or invalid is reported with its path before
anything runs. A rollout is a plugin (``custom_rl_pipeline.rollout.plugin``) or a harness the runner starts
per rollout (``custom_rl_pipeline.rollout.harness``, ours: ``runner.harness``).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from rollout_proxy.engines.adapters import DEFAULT_LORA_MODULES, lora_problems
from rollout_proxy.engines.policies import POLICY_NAME
from rollout_proxy.sdk.types import ChatCompletionSample, PluginContext
from rollout_proxy.settings import check_engine_urls
from rollout_proxy.wire.generation import BASE_POLICY


class JobError(ValueError):
    """The job file is unusable; the message lists every problem with its path."""


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class PluginRef(Strict):
    name: str | None = None
    python_func: str
    envs: dict[str, str] = Field(default_factory=dict)

    @field_validator("python_func")
    @classmethod
    def _module_function(cls, value: str) -> str:
        module, _, function = value.partition(":")
        if not module or not function:
            raise ValueError(f"python_func must be 'module:function', got {value!r}")
        return value


#: the harnesses a job can name (``runner.harness``): three pinned clients, or any command
HARNESS_NAMES = ("codex", "claude-code", "mini-swe-agent", "command")
#: what the words ``{name}`` in a harness's command, args and wrapper become, per rollout
PLACEHOLDERS = ("task", "workdir", "home", "python", "job_dir", "base_url")
_PLACEHOLDER = re.compile(r"\{(\w+)\}")
#: a message that starts with the path it is about (``section.field: ...``)
_NAMES_ITS_PATH = re.compile(r"^[a-z_]+(\.[a-z_]+)*: ")
#: what a harness's end means for the rollout: "grade" it as it is (a success: the graders see the exit code,
#: ``timed_out`` and the output tails in ``extra.harness``), or the seed's statuses
HarnessOutcome = Literal["grade", "retry", "discard", "failure"]


class HarnessSpec(Strict):
    """A program as the rollout, started by the runner once per rollout in a fresh working directory.

    ``name``: ``codex`` (Codex CLI, ``codex exec``), ``claude-code`` (``claude -p``), ``mini-swe-agent``
    (``mini``), each configured for the session here, or ``command`` (``command``: any argv, the session in
    its environment). Each gets the sample's ``extra.files`` in its working directory, the task
    (``extra.task``, else the sample's last user message), an empty HOME of its own, a clean environment
    with telemetry and update checks off, and ``timeout`` seconds of wall time.
    """

    name: Literal["codex", "claude-code", "mini-swe-agent", "command"]
    #: the argv of a ``command`` harness (placeholders: ``{task}``, ``{workdir}``, ``{home}``, ``{python}``: this
    #: interpreter, ``{job_dir}``: the job file's directory, ``{base_url}``); the named harnesses build their own
    command: list[str] = Field(default_factory=list)
    #: a named harness's program (a path, or a name on PATH); default: ``$ROLLOUT_PROXY_CODEX`` (``_CLAUDE_CODE``,
    #: ``_MINI_SWE_AGENT``), else on PATH, else the pinned install ``python -m devtools.harnesses setup`` makes
    executable: str | None = None
    #: more arguments for a named harness (e.g. Codex's ``-c key=value``)
    args: list[str] = Field(default_factory=list)
    #: what the harness runs under (an argv prefix: ``nice``, a sandbox, ``strace -f -o {home}/trace``)
    wrapper: list[str] = Field(default_factory=list)
    #: variables added to its environment, and names copied from the runner's (nothing else is)
    env: dict[str, str] = Field(default_factory=dict)
    pass_env: list[str] = Field(default_factory=list)
    timeout: float = Field(600.0, gt=0.0, description="seconds of wall time; then its process group is killed")
    max_concurrency: int = Field(4, ge=1, le=100, description="harness processes running at once")
    tail_bytes: int = Field(8192, ge=0, le=1 << 20, description="bytes of stdout and of stderr kept in extra")
    on_timeout: HarnessOutcome = "retry"
    on_error: HarnessOutcome = Field("failure", description="a non-zero exit")
    #: where the working directories go (default: a temporary directory per job); removed once graded
    workdir_root: str | None = None
    keep_workdirs: bool = False

    @model_validator(mode="after")
    def _command_or_name(self) -> HarnessSpec:
        if self.name == "command" and not self.command:
            raise ValueError("a 'command' harness needs its argv in 'command', e.g. ['{python}', 'agent.py', '{task}']")
        if self.name != "command" and self.command:
            raise ValueError(f"'command' is for name: command; harness {self.name!r} builds its own (use 'args')")
        if self.name == "command" and (self.args or self.executable):
            raise ValueError("a 'command' harness takes its whole argv in 'command' (no 'args', no 'executable')")
        for field in ("command", "args", "wrapper"):
            for word in getattr(self, field):
                unknown = [name for name in _PLACEHOLDER.findall(word) if name not in PLACEHOLDERS]
                if unknown:
                    known = ", ".join(f"{{{name}}}" for name in PLACEHOLDERS)
                    raise ValueError(f"{field}: unknown placeholder {{{unknown[0]}}} in {word!r} (known: {known})")
        return self


class RolloutSpec(Strict):
    """The rollout: a plugin (``module:function``) or a harness the runner starts (``harness``)."""

    plugin: PluginRef | None = None
    harness: HarnessSpec | None = None

    @model_validator(mode="after")
    def _one_of(self) -> RolloutSpec:
        if (self.plugin is None) == (self.harness is None):
            raise ValueError("a rollout is a 'plugin' or a 'harness': give exactly one of them")
        return self


class GraderSpec(Strict):
    plugin: PluginRef
    weight: float = Field(1.0, ge=0.0)


class Pipeline(Strict):
    rollout: RolloutSpec
    graders: list[GraderSpec] = Field(min_length=1)


class TrainingSet(Strict):
    local_files: list[str] = Field(min_length=1, max_length=20)


class Data(Strict):
    training_set: TrainingSet
    validation_set: dict[str, Any] | None = None
    validation_percentage: float | None = None


class Hyperparameters(BaseModel):
    """Sampling and batching; other hyperparameters (the trainer's) are kept as given."""

    model_config = ConfigDict(extra="allow")

    num_generations: int = Field(4, ge=1)
    max_new_tokens: int = Field(1024, ge=1)
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0)
    batch_size: int = Field(8, ge=1)
    num_steps: int | None = Field(None, ge=1)


def _engine_urls(urls: list[str]) -> list[str]:
    return list(check_engine_urls(urls))


#: engine base URLs, each checked as the proxy checks them (``settings.check_engine_url``)
EngineUrls = Annotated[list[str], AfterValidator(_engine_urls)]


class TeacherSpec(Strict):
    """An on-policy distillation teacher: a vLLM engine group of its own, sharing the student's tokenizer."""

    engines: EngineUrls = Field(min_length=1)
    #: the chat template file the teacher's contexts are rendered with (default: its engine's own)
    chat_template: str | None = None


class ProxySection(Strict):
    """Where the rollouts run (ours, not the seed's): engines, store, feed, output."""

    engines: EngineUrls = Field(default_factory=list)
    #: the teachers ``config["teachers"]`` may name, for a proxy the runner starts (an external proxy: --teacher)
    teachers: dict[str, TeacherSpec] = Field(default_factory=dict)
    store: str = "memory"
    feed: str | None = None  # jsonl:PATH or redis://...; default: a JSONL file in the output dir
    feed_stream: str = "trajectories"
    output_dir: str = "out"
    tool_parser: str = "hermes"
    reasoning_parser: str = "think"
    #: what the sessions do with the generation parameters a request sends (a harness run unmodified sends
    #: some): "refuse" them (a 400 unless the value changes nothing) or "ignore" them (the job's values are
    #: used, the client's recorded on each node)
    client_sampling: Literal["refuse", "ignore"] = "refuse"
    #: of the requests a harness retried (the same input again), train only the answer the conversation went
    #: on from ("drop") or every one ("keep")
    retry: Literal["keep", "drop"] = "drop"
    #: the policy every session of the job samples with: "base" (the engines' model) or a LoRA policy registered
    #: on the proxy (docs/policies.md); its versions are what ``training_loop.max_staleness`` counts
    policy: str = Field(BASE_POLICY, min_length=1, max_length=64)


class RaySection(Strict):
    """Run each sample's rollout and grading calls as Ray tasks (ours, not the seed's).

    The plugins must import on the workers: the job's directory and the directories the
    runner imported the plugins from go on the workers' ``PYTHONPATH`` (a shared
    filesystem), or ship them with ``runtime_env`` (e.g. ``working_dir``). The workers
    must reach the proxy's URL.
    """

    address: str = Field(min_length=1, description="HOST:PORT of the head, ray://HOST:PORT, or 'auto'")
    num_cpus: float = Field(1.0, ge=0.0, description="CPUs each plugin call reserves on its node")
    scheduling_strategy: Literal["DEFAULT", "SPREAD"] = "DEFAULT"
    runtime_env: dict[str, Any] = Field(default_factory=dict, description="passed to Ray with the paths and envs added")
    connect_timeout: float = Field(10.0, gt=0.0, description="seconds to reach the head before the job fails")


class TrainingLoop(Strict):
    """How a job's steps follow the trainer's weights (ours, not the seed's).

    Policy versions are the trainer's integer steps: after it trained on n of the job's
    steps the version is ``initial_policy_version + n`` (a step that published no group is
    not trained on, so not counted). With ``max_staleness`` S, step k's rollouts start once
    the fleet's version is at least ``initial_policy_version + k - S``, and a group whose
    oldest generated token is more than S versions behind the fleet when it is published is
    stale (see ``runner.staleness`` and README, "Training loop and max_staleness").
    """

    max_staleness: int | None = Field(None, ge=0, description="in policy versions; None: steps never wait")
    stale_groups: Literal["drop", "keep"] = Field("drop", description="keep: published with stale=true")
    initial_policy_version: int | None = Field(
        None, ge=0, description="the version before step 0; default: the fleet's when the job starts"
    )
    version_wait: float = Field(
        3600.0, gt=0.0, description="seconds a step may wait for its version; then the job fails"
    )
    poll_interval: float = Field(0.5, gt=0.0, description="seconds between reads of the fleet's version while waiting")


class OPDSection(Strict):
    """On-policy distillation (the seed's OPD): token advantages
    ``task_reward_coef * task_advantage - kl_reward_coef * (student_logprob - teacher_logprob)``."""

    task_reward_coef: float = Field(1.0, ge=0.0)
    kl_reward_coef: float = Field(1.0, ge=0.0)
    topk: int = Field(0, ge=0, le=128, description=">= 2: the teacher's top-k per trained token is recorded too")
    #: where the top-k token set comes from (the seed's): "student" also records the policy's own top-k at
    #: sampling time (``student_topk`` on each trajectory; the engines' ``--max-logprobs`` must allow ``topk``)
    topk_type: Literal["default", "student", "teacher"] = "default"

    @model_validator(mode="after")
    def _student_needs_topk(self) -> OPDSection:
        if self.topk_type == "student" and self.topk < 2:
            raise ValueError("topk_type 'student' records the student's top-k: it needs topk >= 2")
        return self

    @property
    def student_topk(self) -> int:
        """k when the policy's top-k is recorded at sampling, else 0."""
        return self.topk if self.topk_type == "student" else 0


#: the seed's customization types this project trains: the full weights, or a LoRA adapter
TRAINED_TYPES = ("GRPO", "GRPOLoRA")


def untrained_type(kind: object) -> str:
    return (
        f"customization_type: {kind!r} is not trained here; the supported types are GRPO (the full weights, "
        "python -m rollout_proxy.trainer) and GRPOLoRA (a LoRA adapter, with a 'lora' section: docs/policies.md)"
    )


class LoRASection(Strict):
    """The adapter a ``GRPOLoRA`` job trains (ours, not the seed's): the proxy's LoRA policy its sessions sample
    with and the trainer publishes (``python -m rollout_proxy.trainer --job``), and the adapter's shape."""

    policy: str = Field(min_length=1, max_length=64, description="the LoRA policy's name on the proxy")
    rank: int = Field(16, description="1, 8, 16, 32, 64, 128, 256, 320 or 512; at most the engines' --max-lora-rank")
    alpha: int | None = Field(None, description="the update is alpha / rank times B A; default: twice the rank")
    target_modules: list[str] = Field(default_factory=lambda: list(DEFAULT_LORA_MODULES))

    @model_validator(mode="after")
    def _servable(self) -> LoRASection:
        if not POLICY_NAME.match(self.policy) or self.policy == "base":
            raise ValueError(
                f"policy: a LoRA policy's name is 1-64 letters, digits, '.', '_' or '-', not 'base': {self.policy!r}"
            )
        problems = lora_problems(self.rank, self.lora_alpha, tuple(self.target_modules))
        if problems:
            raise ValueError("; ".join(problems))
        return self

    @property
    def lora_alpha(self) -> int:
        return self.alpha if self.alpha is not None else 2 * self.rank


class JobConfig(Strict):
    name: str = "rollout-job"
    #: the seed's training type: GRPO (the full weights) or GRPOLoRA (the ``lora`` section's adapter)
    customization_type: str = "GRPO"
    model_reference: dict[str, Any] | None = None
    custom_rl_pipeline: Pipeline
    data: Data
    hyperparameters: Hyperparameters = Field(default_factory=Hyperparameters)
    proxy: ProxySection = Field(default_factory=ProxySection)
    ray: RaySection | None = None  # plugin calls as Ray tasks; None: in the runner's process
    training_loop: TrainingLoop = Field(default_factory=TrainingLoop)  # max_staleness, stale groups
    opd: OPDSection | None = None  # on-policy distillation: teacher passes and OPD advantages
    lora: LoRASection | None = None  # the adapter of a GRPOLoRA job
    # accepted as in the seed, not used by the local runner
    project: str | None = None
    save_model_limit: int | None = None
    enable_trajectory: bool | None = None
    debug_config: dict[str, Any] | None = None

    base_dir: Path = Field(default=Path("."), exclude=True)

    @model_validator(mode="after")
    def _a_type_it_trains(self) -> JobConfig:
        """GRPO or GRPOLoRA (with its ``lora`` section, its sessions on that policy); anything else refused."""
        kind = self.customization_type
        if kind not in TRAINED_TYPES:
            raise ValueError(untrained_type(kind))
        if kind == "GRPOLoRA":
            if self.lora is None:
                raise ValueError(
                    "customization_type: GRPOLoRA trains a LoRA adapter: add a 'lora' section naming its policy "
                    "(lora: {policy: NAME, rank: 16})"
                )
            if self.proxy.policy not in ("base", self.lora.policy):
                raise ValueError(
                    f"proxy.policy: a GRPOLoRA job's sessions sample with its adapter, lora.policy "
                    f"{self.lora.policy!r}, not {self.proxy.policy!r}"
                )
            self.proxy.policy = self.lora.policy
        elif self.lora is not None:
            raise ValueError("lora: a 'lora' section is for customization_type: GRPOLoRA; GRPO trains the full weights")
        return self

    @model_validator(mode="after")
    def _harness_fits(self) -> JobConfig:
        harness = self.custom_rl_pipeline.rollout.harness
        if harness is None:
            return self
        if self.ray is not None:
            raise ValueError(
                "ray: a harness rollout runs in the runner's process (its working directory is where the graders "
                "read it): leave out the ray section, or run the harness from a rollout plugin"
            )
        if harness.name == "claude-code" and self.proxy.client_sampling != "ignore":
            raise ValueError(
                "custom_rl_pipeline.rollout.harness: claude-code sends max_tokens: 128000 and its own thinking "
                "settings with every request, which a session refuses: set proxy.client_sampling: ignore (the "
                "job's values are used, Claude Code's recorded)"
            )
        return self

    def dataset_files(self) -> list[Path]:
        return [(self.base_dir / path).resolve() for path in self.data.training_set.local_files]

    def sample(self, record: dict[str, Any]) -> ChatCompletionSample:
        """A dataset record with the job's generation settings (one trajectory per session request)."""
        hyper = self.hyperparameters
        settings = {
            "max_new_tokens": hyper.max_new_tokens,
            "temperature": hyper.temperature,
            "top_p": hyper.top_p,
            "top_k": hyper.top_k,
        }
        return ChatCompletionSample.model_validate({**record, **settings, "n": 1})

    def plugin_context(self, job_id: str, step: int) -> PluginContext:
        """What the plugins of training step ``step`` are told about the job."""
        model = (self.model_reference or {}).get("foundation_model") or {}
        return PluginContext(
            model_customization_job_id=job_id,
            foundation_model_name=model.get("name", ""),
            foundation_model_version=str(model.get("model_version", "")),
            customization_type=self.customization_type,
            phase="train",
            current_training_step=step,
        )

    @classmethod
    def load(cls, path: str | Path) -> JobConfig:
        path = Path(path)
        return cls.parse(read_job_file(path), base_dir=path.resolve().parent, source=str(path))

    @classmethod
    def parse(cls, raw: dict[str, Any], *, base_dir: Path = Path("."), source: str = "job") -> JobConfig:
        try:
            job = cls.model_validate({**raw, "base_dir": base_dir})
        except ValidationError as exc:
            problems = []
            for error in exc.errors():
                where = ".".join(str(part) for part in error["loc"])
                message = "unknown field" if error["type"] == "extra_forbidden" else error["msg"]
                if error["type"] == "value_error":  # our own checks' words, without pydantic's prefix
                    message = message.removeprefix("Value error, ")
                if not where and _NAMES_ITS_PATH.match(message):  # a check across sections names where
                    problems.append(f"  {message}")
                else:
                    problems.append(f"  {where or '(top level)'}: {message}")
            raise JobError(f"{source} has {len(problems)} problem(s):\n" + "\n".join(problems)) from None
        missing = [str(file) for file in job.dataset_files() if not file.is_file()]
        if missing:
            raise JobError(f"{source}: data.training_set.local_files: no such file: {', '.join(missing)}")
        return job


def read_job_file(path: str | Path) -> dict[str, Any]:
    """A job file's fields, unchecked; JobError when it cannot be read or is no YAML mapping."""
    try:
        raw = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    except OSError as exc:
        raise JobError(f"cannot read job file {path}: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        raise JobError(f"{path}: not valid YAML: {exc}") from None
    if not isinstance(raw, dict):
        raise JobError(f"{path}: a job file is a mapping of fields, got {type(raw).__name__}")
    return raw


def job_adapter(path: str | Path) -> LoRASection | None:
    """What a job file says its trainer trains: a GRPOLoRA job's adapter, None for GRPO (the full weights);
    JobError for any other type or a lora section that cannot be served. Only these fields are read (the
    trainer need not see the job's datasets or plugins)."""
    raw = read_job_file(path)
    kind = raw.get("customization_type", "GRPO")
    if kind not in TRAINED_TYPES:
        raise JobError(f"{path}: {untrained_type(kind)}")
    section = raw.get("lora")
    if kind == "GRPO":
        if section is not None:
            raise JobError(f"{path}: lora: a 'lora' section is for customization_type: GRPOLoRA")
        return None
    if not isinstance(section, dict):
        raise JobError(f"{path}: customization_type: GRPOLoRA trains a LoRA adapter: add a 'lora' section")
    try:
        return LoRASection.model_validate(section)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(['lora', *map(str, error['loc'])])}: {error['msg'].removeprefix('Value error, ')}"
            for error in exc.errors()
        )
        raise JobError(f"{path}: {problems}") from None
