"""Import the job's plugins by ``module:function``, as declared with the SDK decorators."""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Iterable
from pathlib import Path

from rollout_proxy.runner.job import JobConfig, JobError
from rollout_proxy.sdk.decorators import Plugin, PluginKind


def load_plugin(
    python_func: str, *, base_dir: Path, kinds: Iterable[PluginKind], envs: dict[str, str], where: str
) -> Plugin:
    """The decorated function named by ``python_func`` (the job's directory is importable)."""
    os.environ.update(envs)
    if str(base_dir) not in sys.path:
        sys.path.insert(0, str(base_dir))
    module_name, _, function_name = python_func.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise JobError(f"{where}.python_func: cannot import {module_name!r}: {exc}") from None
    plugin = getattr(module, function_name, None)
    if plugin is None:
        raise JobError(f"{where}.python_func: {module_name!r} has no {function_name!r}")
    kinds = tuple(kinds)
    if not isinstance(plugin, Plugin):
        wanted = " or ".join(f"@{kind.value}" for kind in kinds)
        raise JobError(f"{where}.python_func: {python_func} is not declared with {wanted}")
    if plugin.spec.kind not in kinds:
        raise JobError(
            f"{where}.python_func: {python_func} is a @{plugin.spec.kind.value}, expected {' or '.join(k.value for k in kinds)}"
        )
    return plugin


def load_rollout(job: JobConfig) -> Plugin:
    """The job's rollout plugin (single or group); a harness rollout is ``runner.harness.HarnessRollout``'s."""
    declared = job.custom_rl_pipeline.rollout.plugin
    if declared is None:
        raise JobError("custom_rl_pipeline.rollout: a harness, not a plugin (runner.harness.HarnessRollout runs it)")
    return load_plugin(
        declared.python_func,
        base_dir=job.base_dir,
        kinds=(PluginKind.SINGLE_ROLLOUT, PluginKind.GROUP_ROLLOUT),
        envs=declared.envs,
        where="custom_rl_pipeline.rollout.plugin",
    )


def load_graders(job: JobConfig) -> list[tuple[Plugin, float]]:
    """The job's grader plugins (single or group), each with its weight, in the job file's order."""
    return [
        (
            load_plugin(
                grader.plugin.python_func,
                base_dir=job.base_dir,
                kinds=(PluginKind.SINGLE_GRADER, PluginKind.GROUP_GRADER),
                envs=grader.plugin.envs,
                where=f"custom_rl_pipeline.graders[{index}].plugin",
            ),
            grader.weight,
        )
        for index, grader in enumerate(job.custom_rl_pipeline.graders)
    ]
