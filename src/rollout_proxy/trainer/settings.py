"""The reference trainer's settings, declared once (``rollout_proxy.settings``): ``python -m
rollout_proxy.trainer``'s flags, its ``--help``, the ``ROLLOUT_PROXY_TRAINER_<NAME>`` variables and the
table of docs/training.md come from ``TrainerSettings``. The admin key is ``ROLLOUT_PROXY_ADMIN_KEY``, as
for ``serve`` and ``run``.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import field_validator, model_validator
from pydantic_settings import SettingsConfigDict

from rollout_proxy.engines.adapters import DEFAULT_LORA_MODULES, lora_problems
from rollout_proxy.engines.policies import POLICY_NAME
from rollout_proxy.runner.job import job_adapter
from rollout_proxy.settings import ENV_PREFIX, DeclaredSettings, setting
from rollout_proxy.state.connection import is_redis_url
from rollout_proxy.trainer.mismatch import DEFAULT_THRESHOLD


class TrainerSettings(DeclaredSettings):
    """Every setting of the reference GRPO trainer."""

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX + "TRAINER_")
    sections: ClassVar[dict[str, str]] = {
        "where": "Where",
        "learn": "The step",
        "lora": "LoRA (docs/policies.md)",
        "check": "The mismatch report and the fleet",
    }

    # -- where ------------------------------------------------------------------------------------------
    proxy: str = setting(..., "the proxy's URL (its admin API pauses and resumes the fleet)", section="where")
    admin_key: str = setting(
        ..., "the proxy's admin key (pause and resume are admin calls)", section="where", env_prefix=ENV_PREFIX
    )
    feed: str = setting(..., "the job's Redis feed: redis://HOST:PORT/DB", section="where")
    stream: str = setting("trajectories", "the feed's stream (the job's proxy.feed_stream)", section="where")
    consumer: str = setting("trainer-0", "this trainer's name in the feed's consumer group", section="where")
    claim_idle_ms: int = setting(
        60_000,
        "take over groups another consumer left unacknowledged this long (a trainer that died)",
        section="where",
        ge=0,
    )
    model: str = setting(
        ...,
        "the HF checkpoint the fleet serves now (the scripts' dense SmolLM2-135M: model_dense in `python -m "
        "devtools.engine_env paths`); a restarted trainer starts from its own checkpoint in OUT/weights "
        "instead (the fleet's version, or the one of a step it was putting on the fleet) when it wrote that one",
        section="where",
    )
    out: str = setting(..., "output directory: step log, metrics, weights, state", section="where")
    job: str | None = setting(
        None,
        "the job file the trainer trains for: customization_type GRPO trains the full weights, GRPOLoRA the "
        "adapter its lora section names (--policy, --lora-rank, --lora-alpha, --target-modules from it; a flag "
        "given too must agree); any other type is refused",
        section="where",
    )
    steps: int | None = setting(
        None,
        "stop after this many steps recorded (a step a restart finishes counts; default: run until stopped)",
        section="where",
        ge=1,
    )

    # -- the step ---------------------------------------------------------------------------------------
    lr: float = setting(2e-5, "AdamW learning rate", section="learn")
    clip_low: float = setting(0.2, "PPO clip below 1", section="learn", ge=0)
    clip_high: float = setting(0.2, "PPO clip above 1", section="learn", ge=0)
    ratio_cap: float = setting(
        3.0, "a token's importance weight counts for at most this much (negative advantages)", section="learn", gt=0
    )
    kl_coef: float = setting(0.0, "k3 KL to the starting weights (0: off)", section="learn", ge=0)
    max_grad_norm: float = setting(1.0, "gradient clipping", section="learn", gt=0)
    temperature: float = setting(
        1.0,
        "the job's sampling temperature (the engine's processed logprobs are of logits / temperature)",
        section="learn",
        gt=0,
    )
    micro_batch_tokens: int = setting(4096, "rows x longest row per forward/backward (memory)", section="learn", ge=1)
    train_tied_embeddings: bool = setting(
        False,
        "train a tied input/output embedding too (off by default: vLLM 0.32's in-place reload keeps the tied "
        "lm_head's old copy, which the mismatch report shows on every token; docs/training.md)",
        section="learn",
    )
    seed: int = setting(0, "torch's random seed", section="learn")
    threads: int | None = setting(None, "torch's CPU threads (default: torch's choice)", section="learn", ge=0)

    # -- LoRA -------------------------------------------------------------------------------------------
    lora_rank: int | None = setting(
        None,
        "train a LoRA adapter of this rank instead of the full weights (1, 8, 16, 32, 64, 128, 256, 320 or 512: "
        "the ranks vLLM serves; at most the engines' --max-lora-rank), published as --policy's next version",
        section="lora",
    )
    lora_alpha: int | None = setting(
        None,
        "the adapter's scale numerator (its update is alpha / rank times B A; default: twice the rank)",
        section="lora",
    )
    target_modules: tuple[str, ...] = setting(
        DEFAULT_LORA_MODULES,
        "the modules the adapter trains (some of q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj, "
        "embed_tokens, lm_head); repeat or join with commas",
        section="lora",
        separator=",",
        metavar="MODULE",
    )
    policy: str | None = setting(
        None,
        "the proxy's LoRA policy the adapter is (registered with its untrained adapter as version 1 when it has "
        "none); needed with --lora-rank",
        section="lora",
    )

    # -- the mismatch report and the fleet ----------------------------------------------------------------
    mismatch_threshold: float = setting(
        DEFAULT_THRESHOLD,
        "|trainer - sampling logprob| over this (nats) counts a token as mismatched",
        section="check",
        ge=0,
    )
    pause_mode: Literal["keep", "wait", "abort"] = setting(
        "keep", "how the fleet is paused for a weight update (the proxy's pause modes)", section="check"
    )
    reload_timeout: float = setting(600.0, "seconds each engine may take to reload", section="check", gt=0)
    keep_weights: int = setting(
        2,
        "checkpoints kept in OUT/weights, each with its optimizer state (the fleet's is always kept; with LoRA, "
        "so is every version an engine still has loaded or a call still uses)",
        section="check",
        ge=0,
    )

    @field_validator("feed")
    @classmethod
    def _a_redis_feed(cls, value: str) -> str:
        if not is_redis_url(value):
            raise ValueError("the trainer reads a Redis feed (redis://HOST:PORT/DB), as the job publishes")
        return value

    @field_validator("target_modules", mode="before")
    @classmethod
    def _modules_joined_by_commas(cls, value: object) -> object:
        if isinstance(value, list | tuple):
            return tuple(module.strip() for item in value for module in str(item).split(",") if module.strip())
        return value

    @model_validator(mode="before")
    @classmethod
    def _the_jobs_adapter(cls, values: Any) -> Any:
        """``job``'s adapter settings filled in (a GRPOLoRA job), those given too checked against them."""
        if not isinstance(values, dict) or not values.get("job"):
            return values
        adapter = job_adapter(values["job"])
        given = {name: values[name] for name in ("policy", "lora_rank", "lora_alpha") if values.get(name) is not None}
        if values.get("target_modules"):
            given["target_modules"] = cls._modules_joined_by_commas(values["target_modules"])
        if adapter is None:
            if given:
                raise ValueError(
                    f"{values['job']} is a GRPO job (the full weights): it takes no {', '.join(sorted(given))}"
                )
            return values
        wanted: dict[str, Any] = {
            "policy": adapter.policy,
            "lora_rank": adapter.rank,
            "lora_alpha": adapter.lora_alpha,
            "target_modules": tuple(adapter.target_modules),
        }
        differ = [  # a flag's value is still its text here
            f"{name} {given[name]} (the job's: {wanted[name]})"
            for name in given
            if (given[name] if name == "target_modules" else str(given[name]))
            != (wanted[name] if name == "target_modules" else str(wanted[name]))
        ]
        if differ:
            raise ValueError(
                f"{values['job']}'s lora section trains another adapter than the flags: {'; '.join(differ)}"
            )
        return {**values, **wanted}

    @model_validator(mode="after")
    def _lora_servable(self) -> TrainerSettings:
        if self.lora_rank is None:
            if self.policy is not None:
                raise ValueError("--policy names the LoRA policy the trainer publishes: give --lora-rank too")
            return self
        if self.policy is None:
            raise ValueError("--lora-rank trains a LoRA policy of the proxy: name it with --policy")
        if not POLICY_NAME.match(self.policy) or self.policy == "base":
            raise ValueError(
                f"--policy: a LoRA policy's name is 1-64 letters, digits, '.', '_' or '-', not 'base': {self.policy!r}"
            )
        problems = lora_problems(self.lora_rank, self.alpha, self.target_modules)
        if problems:
            raise ValueError("; ".join(problems))
        return self

    @property
    def alpha(self) -> int:
        """``lora_alpha``, or twice the rank."""
        if self.lora_alpha is not None:
            return self.lora_alpha
        return 2 * (self.lora_rank or 0)
