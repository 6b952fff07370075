"""The SDK's public names, pinned: adding or dropping one is a decision, not a side effect."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import rollout_proxy.sdk

EXPECTED = [
    "ChatCompletionMessage",
    "ChatCompletionMessageToolCall",
    "ChatCompletionSample",
    "CriticContext",
    "Function",
    "GenerationParameterError",
    "GroupGraderResult",
    "GroupRolloutResult",
    "InferenceProxy",
    "Mode",
    "Plugin",
    "PluginContext",
    "PluginInstance",
    "PluginKind",
    "PluginStatus",
    "PluginValidationError",
    "ProxyRequestError",
    "ProxyUnreachable",
    "RolloutApiError",
    "RolloutInferenceProxy",
    "RolloutResult",
    "Runtime",
    "SingleGraderResult",
    "SingleResponse",
    "TeacherContext",
    "Thinking",
    "Trajectory",
    "decode_routed_experts",
    "group_grader",
    "group_rollout",
    "observe",
    "rollout",
    "single_grader",
    "single_rollout",
    "test_with_dataset",
    "trace_monitor",
    "wrap_async_client_inplace",
    "wrap_client_inplace",
    "wrap_inplace_trace",
    "wrap_responses_async_client_inplace",
    "wrap_responses_client_inplace",
]

# What the SDK may import from this package; the server's layers never reach plugin code.
ALLOWED = ("rollout_proxy.sdk", "rollout_proxy.wire")


def test_exported_names():
    assert sorted(rollout_proxy.sdk.__all__) == EXPECTED
    for name in rollout_proxy.sdk.__all__:
        assert getattr(rollout_proxy.sdk, name, None) is not None, name


def test_star_import_gives_exactly_the_exported_names():
    namespace: dict[str, object] = {}
    exec("from rollout_proxy.sdk import *", namespace)
    assert sorted(name for name in namespace if name != "__builtins__") == EXPECTED


def test_sdk_modules_import_only_the_sdk_and_wire():
    package = Path(rollout_proxy.sdk.__file__).parent
    imported = set()
    for module in package.glob("*.py"):
        for node in ast.walk(ast.parse(module.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                imported.add((module.name, node.module))
            elif isinstance(node, ast.Import):
                imported.update((module.name, alias.name) for alias in node.names)
    ours = {(where, name) for where, name in imported if name.split(".")[0] == "rollout_proxy"}
    assert ours and {(where, name) for where, name in ours if not name.startswith(ALLOWED)} == set()


def test_importing_the_sdk_loads_no_server_module():
    code = "import sys, rollout_proxy.sdk\nprint(sorted(m for m in sys.modules if m.startswith('rollout_proxy.')))"
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    modules = ast.literal_eval(loaded)
    assert modules and [m for m in modules if not m.startswith(ALLOWED)] == []
