"""The shapes of the proxy's answers, for the OpenAPI document only.

Handlers build their answers as plain dicts; these ``TypedDict``s describe those dicts
so that ``proxy.openapi`` can generate their JSON Schemas with pydantic, like the request
models. Nothing validates against them at run time: the fuzz test
(tests/proxy/test_fuzz.py) holds every live answer to them, so they cannot drift quietly.
The trajectory and the feed group come from the wire package instead.
"""

from __future__ import annotations

from typing import Any, Literal, NotRequired

from pydantic import ConfigDict, with_config
from typing_extensions import TypedDict  # pydantic needs this one before Python 3.12

from rollout_proxy.wire.feed import FeedGroup, FeedImage
from rollout_proxy.wire.trajectory import PolicyVersionSpan, Trajectory


@with_config(ConfigDict(extra="forbid"))
class ErrorDetail(TypedDict):
    message: str
    type: str
    param: str | None
    code: str | None


@with_config(ConfigDict(extra="forbid"))
class ErrorBody(TypedDict):
    """Every 4xx/5xx answer of the proxy, in OpenAI's error shape."""

    error: ErrorDetail


class CompletionUsage(TypedDict):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class ToolCallFunction(TypedDict):
    name: str
    arguments: str


class ChatCompletionMessageToolCall(TypedDict):
    id: str
    type: Literal["function"]
    function: ToolCallFunction


class ChatCompletionResponseMessage(TypedDict):
    """A view parsed from the sampled tokens (content, tool calls, reasoning)."""

    role: Literal["assistant"]
    content: str | None
    tool_calls: NotRequired[list[ChatCompletionMessageToolCall]]
    reasoning_content: NotRequired[str]
    reasoning: NotRequired[str]


class ChatCompletionTokenLogprob(TypedDict):
    token: str
    logprob: float
    bytes: list[int] | None
    top_logprobs: list[Any]


class ChatCompletionChoiceLogprobs(TypedDict):
    content: list[ChatCompletionTokenLogprob]


class ChatCompletionChoice(TypedDict):
    index: int
    message: ChatCompletionResponseMessage
    finish_reason: str | None
    logprobs: ChatCompletionChoiceLogprobs | None
    #: extension: the token ids the policy sampled for this choice
    token_ids: list[int]


class ChatCompletion(TypedDict):
    """OpenAI's chat completion, plus ``prompt_token_ids`` and ``choices[].token_ids``."""

    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatCompletionChoice]
    usage: CompletionUsage
    system_fingerprint: str | None
    #: extension: the exact prompt token ids the engine was given
    prompt_token_ids: list[int]


class ResponseReasoningText(TypedDict):
    type: Literal["reasoning_text"]
    text: str


class ResponseReasoningItem(TypedDict):
    type: Literal["reasoning"]
    id: str
    summary: list[Any]
    content: list[ResponseReasoningText]
    status: str


class ResponseOutputText(TypedDict):
    type: Literal["output_text"]
    text: str
    annotations: list[Any]
    logprobs: list[Any]


class ResponseOutputMessage(TypedDict):
    type: Literal["message"]
    id: str
    role: Literal["assistant"]
    status: str
    content: list[ResponseOutputText]


class ResponseFunctionToolCall(TypedDict):
    type: Literal["function_call"]
    id: str
    call_id: str
    name: str
    arguments: str
    status: str


class ResponseInputTokensDetails(TypedDict):
    cached_tokens: int


class ResponseOutputTokensDetails(TypedDict):
    reasoning_tokens: int


class ResponseUsage(TypedDict):
    input_tokens: int
    input_tokens_details: ResponseInputTokensDetails
    output_tokens: int
    output_tokens_details: ResponseOutputTokensDetails
    total_tokens: int


class Response(TypedDict):
    """OpenAI's Responses object, plus ``finish_reason``, ``prompt_token_ids`` and ``token_ids``."""

    id: str
    object: Literal["response"]
    created_at: int
    model: str
    status: Literal["completed", "incomplete"]
    incomplete_details: dict[str, Any] | None
    error: dict[str, Any] | None
    instructions: str | None
    previous_response_id: str | None
    output: list[ResponseReasoningItem | ResponseOutputMessage | ResponseFunctionToolCall]
    parallel_tool_calls: bool
    tool_choice: Any
    tools: list[dict[str, Any]]
    temperature: float | None
    top_p: float | None
    max_output_tokens: int | None
    store: bool
    text: dict[str, Any]
    truncation: str
    metadata: dict[str, Any]
    usage: ResponseUsage
    finish_reason: str | None
    #: extension: the exact prompt token ids the engine was given
    prompt_token_ids: list[int]
    #: extension: the token ids the policy sampled
    token_ids: list[int]
    #: extension: which policy version sampled which of ``token_ids`` (half-open spans over them)
    policy_versions: list[PolicyVersionSpan]


class SessionCreated(TypedDict):
    """What a plugin needs as its OpenAI client settings (``base_url``, ``api_key``)."""

    session_id: str
    base_url: str
    api_key: str
    expires_at: int


class GenerationSettings(TypedDict):
    max_new_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    chat_template_kwargs: dict[str, Any] | None


class SessionInfo(TypedDict):
    id: str
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    extra: dict[str, Any]
    generation: GenerationSettings
    context: dict[str, Any]
    created_at: float
    expires_at: float
    #: the session's engine URL: for the admin key only
    engine: NotRequired[str | None]
    n_sample: int | None
    status: Literal["open", "finished"]
    result: dict[str, Any] | None
    concurrency: dict[str, Any] | None


#: How a node relates to the tree: ``kind`` (continuation, rewrite, new_conversation, retry), the client's
#: ``label`` (``X-Rollout-Branch`` or ``metadata.rollout_branch``), ``from`` (the node it extends, diverged
#: from or retries) and ``at_message`` (a rewrite's first differing message); "from" is a keyword, hence
#: the functional form
BranchInfo = TypedDict(
    "BranchInfo",
    {
        "kind": Literal["continuation", "rewrite", "new_conversation", "retry"],
        "label": str | None,
        "from": str | None,
        "at_message": int | None,
    },
)


class RolloutSequenceInfo(Trajectory):
    """A sequence of the rollout: its trajectory (loss weight 1 only on the tokens it trains)."""

    leaf: str


class RolloutExport(TypedDict):
    """Every sequence of a session's tree, the main one first; every sampled token trained in exactly one."""

    session_id: str
    retry: Literal["keep", "drop"]
    sequences: list[RolloutSequenceInfo]
    sampled_tokens: int
    trained_tokens: int
    #: retries the conversation did not go on from (``retry: drop``): sampled, not trained
    dropped_tokens: int


class MessagesAppended(TypedDict):
    response_id: str
    session_id: str


class SessionFinished(TypedDict):
    session_id: str
    status: Literal["success", "failure", "discard", "retry"]
    error: str | None
    trajectories: list[Trajectory]
    #: the bytes of every image the trajectories' spans name, by sha256 (absent when they name none)
    images: NotRequired[dict[str, FeedImage]]


class FeedItem(TypedDict):
    id: str
    data: FeedGroup


class FeedPage(TypedDict):
    """One page of graded groups; ``next`` is the cursor to pass as ``after``."""

    entries: list[FeedItem]
    next: str | None


class ModelCard(TypedDict):
    id: str
    object: Literal["model"]
    owned_by: str
    max_model_len: int | None


class ModelList(TypedDict):
    object: Literal["list"]
    data: list[ModelCard]


class EngineEntry(TypedDict):
    """One engine of the fleet, as the operator sees it."""

    url: str
    state: Literal["starting", "healthy", "draining", "paused", "unhealthy", "stale", "removed"]
    #: the policy version of its weights (null: not known yet)
    policy_version: int | None
    in_flight: int
    last_error: str | None


class FleetView(TypedDict):
    """The fleet's policy version, whether it is paused, and every engine."""

    policy_version: int
    paused: bool
    engines: list[EngineEntry]


class ControlEntry(EngineEntry):
    """An engine after a pause or resume step: whether the step worked, and if not, why."""

    ok: bool
    error: str | None


class FleetControl(TypedDict):
    """The fleet after a pause or a resume, with each engine the step was sent to."""

    policy_version: int
    paused: bool
    failed: int
    engines: list[ControlEntry]


class PolicyEngine(TypedDict):
    """A policy on one engine: the name its calls use there, or why it takes none."""

    url: str
    state: Literal["starting", "healthy", "draining", "paused", "unhealthy", "stale"]
    #: vLLM's ``model`` for its calls there (``<policy>@v<N>``; the base: its name or ``base@zero``); null: none
    served_name: str | None
    #: why this engine takes no call of the policy (it failed to load the adapter)
    drained: str | None
    #: calls holding each served name on this engine now
    in_use: dict[str, int]


class PolicyEntry(TypedDict):
    """A policy: the base model, or a LoRA adapter of it with its current version."""

    name: str
    kind: Literal["base", "lora"]
    #: the base's: the fleet's policy version; a LoRA policy's: its adapter version (null: none published)
    version: int | None
    path: str | None
    engines: list[PolicyEngine]


class PolicyList(TypedDict):
    policies: list[PolicyEntry]


class PublishEntry(TypedDict):
    url: str
    ok: bool
    error: str | None
    served_name: str | None


class PolicyPublished(TypedDict):
    """A version published: loaded and switched to on each engine that took it, the others drained for it."""

    policy: str
    version: int
    served_name: str
    path: str
    failed: int
    engines: list[PublishEntry]


class Unloading(TypedDict):
    url: str
    #: unloaded there once no call of this proxy holds it
    served_name: str


class PolicyRetired(TypedDict):
    """A LoRA policy out of the registry: new sessions on it are refused, turns of open ones get a 409; each
    engine's version unloaded once its calls in flight finished."""

    policy: str
    retired: Literal[True]
    #: its last version (null: none was published); the name registered again numbers on after it
    version: int | None
    unloading: list[Unloading]


class Health(TypedDict):
    status: Literal["ok"]


class EnginesHealth(TypedDict):
    healthy: int
    total: int
    #: each engine's URL and health, for the admin key only
    urls: NotRequired[dict[str, bool]]


class Readiness(TypedDict):
    ready: bool
    store: bool
    engines: EnginesHealth


# -- the trajectory viewer's read API (admin key) ----------------------------------------------


class SessionSummary(TypedDict):
    """What a session's tree holds, in numbers."""

    session_id: str
    created_at: float
    expires_at: float
    status: Literal["open", "finished"]
    #: the runner's ``context.model_customization_job_id`` and ``current_training_step``
    job_id: str | None
    step: int | None
    n_sample: int | None
    #: the rollout's own status, once finished (success, failure, discard, retry)
    result_status: str | None
    error: str | None
    #: the response ids the finish emitted
    responses: list[str]
    nodes: int
    turns: int
    injected: int
    tokens: int
    generated_tokens: int
    #: how each branch ended (its last generated node)
    finish_reasons: list[str]
    forks: int
    routing_disagreements: int
    nonfinite_logprobs: int
    #: the versions that sampled its tokens: the base's as a number (`"3"`), a LoRA policy's as `"pol@v3"`
    policy_versions: list[str]
    #: the policy its turns sample with (`base`, or a LoRA policy's name)
    policy: str


class SessionListItem(SessionSummary):
    """A session's summary as the index has it: written at create, rewritten from its whole tree at finish."""

    #: rewards of its graded trajectories, from the trainer feed (``--feed``)
    rewards: list[float | None]


class SessionList(TypedDict):
    """Newest first; ``next`` is the cursor of the next page (a page may be short while it is set)."""

    data: list[SessionListItem]
    next: str | None
    #: whether this proxy reads a trainer feed (rewards and advantages)
    feed: bool
    grades_error: str | None


class TreeNode(TypedDict):
    id: str
    parent_id: str | None
    kind: Literal["generated", "injected"]
    api: str
    #: the messages this node adds: its inputs, then (generated) its output
    messages: list[dict[str, Any]]
    n_input_messages: int
    finish_reason: str | None
    prompt_tokens: int
    output_tokens: int
    usage: dict[str, int]
    #: where a rewritten history forked: ``{"diverged_from", "at_message"}``
    fork: dict[str, Any] | None
    created_at: float
    model: str | None
    meta: dict[str, Any]
    policy_versions: list[str]
    #: how the node relates to the tree (``docs/rollouts.md``)
    branch: BranchInfo | None


class GradeInfo(TypedDict):
    group_id: str
    job_id: str
    step: int
    index: int
    reward: float | None
    advantage: float | None
    advantage_kind: str


class SequenceInfo(TypedDict):
    """One sequence of the session's rollout: its leaf, its nodes, the nodes it trains."""

    leaf: str
    response_ids: list[str]
    branch: BranchInfo
    main: bool
    dropped: bool
    trained: list[str]


class TokenCounts(TypedDict):
    sampled: int
    trained: int
    dropped: int


class SessionTree(TypedDict):
    """A session's record, every node of its response tree, its sequences, and its graded responses."""

    session: dict[str, Any]
    #: the tree as it is now (an open session's too)
    summary: SessionSummary
    nodes: list[TreeNode]
    sequences: list[SequenceInfo]
    tokens: TokenCounts
    grades: dict[str, GradeInfo]
    feed: bool
    grades_error: str | None


class TokenSegment(TypedDict):
    """Tokens ``start``..``end`` came from ``node_id``: its prompt (bridge) part or its output."""

    node_id: str
    kind: Literal["generated", "injected"]
    part: Literal["prompt", "output"]
    start: int
    end: int


class TrajectoryTokens(TypedDict):
    """The trajectory as the trainer gets it, with what the viewer adds."""

    trajectory: Trajectory
    #: each token's text, decoded alone (None where it could not be; ``pieces_error`` says why)
    pieces: list[str | None]
    pieces_error: str | None
    segments: list[TokenSegment]
    #: the node each of ``trajectory.messages`` came from
    message_nodes: list[str]
    grade: GradeInfo | None
    #: per-token advantages (``advantage_kind`` tok), aligned with the tokens
    token_advantages: list[float] | None
    feed: bool
    grades_error: str | None
