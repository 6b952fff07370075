"""What rollout and grader plugins import: the names and behaviour of the Ark RL SDK.

from rollout_proxy.sdk import (
    rollout, group_rollout, single_grader, group_grader, Runtime, PluginInstance,
    RolloutInferenceProxy, InferenceProxy, Mode, ChatCompletionSample, PluginContext,
    PluginStatus, RolloutResult, GroupRolloutResult, SingleResponse, Trajectory,
    SingleGraderResult, GroupGraderResult, TeacherContext, CriticContext, test_with_dataset,
    trace_monitor, wrap_inplace_trace, observe,   # tracing (OpenTelemetry), as the seed's ark_sdk.core.trace
)

Every failure to reach the proxy or of a request it refused is a ``ProxyRequestError``
(``ProxyUnreachable`` when no answer came), with the HTTP status and the OpenAI error body.
"""

from rollout_proxy.sdk.clients import (
    GenerationParameterError,
    RolloutApiError,
    wrap_async_client_inplace,
    wrap_client_inplace,
    wrap_responses_async_client_inplace,
    wrap_responses_client_inplace,
)
from rollout_proxy.sdk.decorators import (
    Plugin,
    PluginKind,
    group_grader,
    group_rollout,
    rollout,
    single_grader,
    single_rollout,
)
from rollout_proxy.sdk.local import test_with_dataset
from rollout_proxy.sdk.proxy import InferenceProxy, Mode, RolloutInferenceProxy
from rollout_proxy.sdk.runtime import PluginInstance, Runtime
from rollout_proxy.sdk.tracing import observe, trace_monitor, wrap_inplace_trace
from rollout_proxy.sdk.transport import ProxyRequestError, ProxyUnreachable
from rollout_proxy.sdk.types import (
    ChatCompletionMessage,
    ChatCompletionMessageToolCall,
    ChatCompletionSample,
    CriticContext,
    Function,
    GroupGraderResult,
    GroupRolloutResult,
    PluginContext,
    PluginStatus,
    RolloutResult,
    SingleGraderResult,
    SingleResponse,
    TeacherContext,
    Thinking,
    Trajectory,
    decode_routed_experts,
)
from rollout_proxy.sdk.validation import PluginValidationError

__all__ = [
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
