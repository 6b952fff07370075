"""Where and how a plugin runs: instance size, timeout, concurrency (checked when declared)."""

from __future__ import annotations

import enum
import re

from pydantic import BaseModel, ConfigDict, Field, field_validator

CPU_CHOICES = (1, 2, 4, 8, 16)
MEMORY_RATIOS = (2, 4, 8)  # GB of memory per CPU core
MAX_TIMEOUT = 900


class PluginInstance(str, enum.Enum):
    """``CPU{cores}MEM{GB}``: 1 to 16 cores with 2, 4 or 8 GB per core (CPU1MEM2 … CPU16MEM128)."""

    CPU1MEM2 = "CPU1MEM2"
    CPU1MEM4 = "CPU1MEM4"
    CPU1MEM8 = "CPU1MEM8"
    CPU2MEM4 = "CPU2MEM4"
    CPU2MEM8 = "CPU2MEM8"
    CPU2MEM16 = "CPU2MEM16"
    CPU4MEM8 = "CPU4MEM8"
    CPU4MEM16 = "CPU4MEM16"
    CPU4MEM32 = "CPU4MEM32"
    CPU8MEM16 = "CPU8MEM16"
    CPU8MEM32 = "CPU8MEM32"
    CPU8MEM64 = "CPU8MEM64"
    CPU16MEM32 = "CPU16MEM32"
    CPU16MEM64 = "CPU16MEM64"
    CPU16MEM128 = "CPU16MEM128"


def parse_instance(value: str | PluginInstance) -> PluginInstance:
    text = value.value if isinstance(value, PluginInstance) else str(value).strip().upper()
    match = re.fullmatch(r"CPU(\d+)MEM(\d+)", text)
    if match is None:
        raise ValueError(f"instance {value!r} is not of the form CPU<cores>MEM<GB>, e.g. CPU4MEM8")
    cores, memory = int(match.group(1)), int(match.group(2))
    if cores not in CPU_CHOICES:
        raise ValueError(f"instance {text}: cores must be one of {CPU_CHOICES} (at most CPU16MEM128)")
    if memory % cores or memory // cores not in MEMORY_RATIOS:
        raise ValueError(f"instance {text}: cores:memory must be 1:2, 1:4 or 1:8 (e.g. CPU{cores}MEM{cores * 2})")
    return PluginInstance(text)


class Runtime(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_default=True)

    instance: PluginInstance = PluginInstance.CPU1MEM2
    timeout: int | None = Field(None, gt=0, le=MAX_TIMEOUT, description="seconds per call; at most 900")
    max_concurrency: int = Field(10, ge=1, le=100, description="concurrent calls per plugin instance")
    request_concurrency: int = Field(512, ge=1, description="model requests in flight at once")
    min_replicas: int | None = Field(None, ge=0)
    max_replicas: int | None = Field(None, ge=1)

    @field_validator("instance", mode="before")
    @classmethod
    def _instance(cls, value: object) -> PluginInstance:
        return parse_instance(value)  # type: ignore[arg-type]

    @field_validator("max_replicas")
    @classmethod
    def _replicas(cls, value: int | None, info) -> int | None:
        low = info.data.get("min_replicas")
        if value is not None and low is not None and value < low:
            raise ValueError(f"max_replicas ({value}) is below min_replicas ({low})")
        return value
