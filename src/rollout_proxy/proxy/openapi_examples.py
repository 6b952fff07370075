"""Request bodies that succeed, by name, for the OpenAPI document's ``examples``.

Readers of the document copy them; the fuzz test sends each one first (schemathesis's
examples phase), so every success path is walked before the generated bodies arrive.
"""

from __future__ import annotations

from typing import Any

USER: dict[str, Any] = {"role": "user", "content": "What is the weather in Paris?"}
CITY: dict[str, Any] = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
WEATHER_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {"name": "get_weather", "description": "Current weather for a city", "parameters": CITY},
}
CALL: dict[str, Any] = {
    "id": "call_1",
    "type": "function",
    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
}

CHAT: dict[str, dict[str, Any]] = {
    "first_turn": {"model": "policy", "messages": [USER]},
    "tools": {"model": "policy", "messages": [USER], "tools": [WEATHER_TOOL], "tool_choice": "auto"},
    "tool_result": {
        "model": "policy",
        "messages": [
            USER,
            {"role": "assistant", "content": None, "tool_calls": [CALL]},
            {"role": "tool", "tool_call_id": "call_1", "content": '{"sky": "clear", "celsius": 21}'},
        ],
        "tools": [WEATHER_TOOL],
    },
    "content_parts_logprobs_stop": {
        "model": "policy",
        "messages": [
            {"role": "system", "content": "Answer briefly."},
            {"role": "user", "content": [{"type": "text", "text": "What is the weather in Paris?"}]},
        ],
        "logprobs": True,
        "stop": ["\n\n"],
    },
}

RESPONSES: dict[str, dict[str, Any]] = {
    "text_input": {"model": "policy", "input": "What is the weather in Paris?"},
    "items_and_instructions": {
        "model": "policy",
        "instructions": "Answer briefly.",
        "input": [{"type": "message", "role": "user", "content": "What is the weather in Paris?"}],
        "tools": [{"type": "function", "name": "get_weather", "parameters": CITY}],
    },
    "function_call_output": {
        "model": "policy",
        "previous_response_id": "resp_00000000000000000000000000000000",
        "input": [{"type": "function_call_output", "call_id": "call_1", "output": '{"sky": "clear"}'}],
    },
}

SESSION: dict[str, dict[str, Any]] = {
    "single": {
        "sample": {"messages": [USER], "extra": {"answer": "sunny"}},
        "generation": {"max_new_tokens": 64, "temperature": 1.0},
    },
    "group_with_tools": {
        "sample": {"messages": [USER], "tools": [WEATHER_TOOL], "thinking": {"type": "enabled"}},
        "generation": {"max_new_tokens": 64, "top_p": 0.95, "top_k": 20, "seed": 7},
        "n_sample": 2,
        "concurrency": {"key": "job-1", "max_requests": 8},
        "context": {"step": 3},
    },
}

APPEND: dict[str, dict[str, Any]] = {
    "user_turn": {"messages": [{"role": "user", "content": "And tomorrow?"}]},
}

FINISH: dict[str, dict[str, Any]] = {
    "success": {"status": "success", "extra": {"graded_by": "exact-match"}},
    "failure": {"status": "failure", "error": "the tool timed out"},
}

#: Anthropic Messages bodies; ``max_tokens`` is the session's ``generation.max_new_tokens`` (a no-op), or the
#: session takes ``client_sampling: ignore`` (Claude Code's 128000)
ANTHROPIC_TOOL: dict[str, Any] = {
    "name": "get_weather",
    "description": "Current weather for a city",
    "input_schema": CITY,
}
MESSAGES: dict[str, dict[str, Any]] = {
    "first_turn": {"model": "policy", "max_tokens": 32, "messages": [USER]},
    "system_blocks_and_tools": {
        "model": "policy",
        "max_tokens": 32,
        "system": [{"type": "text", "text": "Answer briefly.", "cache_control": {"type": "ephemeral"}}],
        "messages": [{"role": "user", "content": [{"type": "text", "text": "What is the weather in Paris?"}]}],
        "tools": [ANTHROPIC_TOOL, {"type": "web_search_20250305", "name": "web_search"}],
        "tool_choice": {"type": "auto"},
    },
    "tool_result": {
        "model": "policy",
        "max_tokens": 32,
        "messages": [
            USER,
            {
                "role": "assistant",
                "content": [{"type": "tool_use", "id": "call_1", "name": "get_weather", "input": {"city": "Paris"}}],
            },
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": "call_1", "content": '{"sky": "clear"}'}],
            },
        ],
        "tools": [ANTHROPIC_TOOL],
        "stop_sequences": ["\n\n"],
    },
}
COUNT_TOKENS: dict[str, dict[str, Any]] = {
    "with_tools": {"model": "policy", "system": "Answer briefly.", "messages": [USER], "tools": [ANTHROPIC_TOOL]},
}
