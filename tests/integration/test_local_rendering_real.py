"""Local rendering against a real vLLM: the self-check passes for both templates, the shapes where
vLLM's preparation differs from a plain ``apply_chat_template`` render the same, and a tool chat
rendered by the proxy alone has zero drift against what vLLM itself reports it consumed.
"""

from __future__ import annotations

from pathlib import Path

from rollout_proxy.engines.vllm_http import VLLMEngine
from rollout_proxy.proxy import keys
from rollout_proxy.tokenization.local import LocalTemplate, tokenizer_dir
from rollout_proxy.tokenization.selfcheck import Case, canonical_cases, self_check
from tests.harness import WEATHER_TOOL, ProxyHarness
from tests.integration.conftest import SERVER_CONFIGS, RecordingRelay, TokenAudit
from tests.integration.test_chat_real import SYSTEM, check_trajectory, check_turns

#: What vLLM's /tokenize does beyond the template (tokenization/vllm_chat.py), each shape once.
VLLM_SHAPES = [
    Case(
        "reasoning_content_is_dropped",
        [
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello.", "reasoning_content": "vLLM's /tokenize drops this"},
            {"role": "user", "content": "Again?"},
        ],
    ),
    Case(
        "developer_becomes_system",
        [{"role": "system", "content": "A"}, {"role": "user", "content": "q"}, {"role": "developer", "content": "B"}],
    ),
    Case(
        "null_content_and_odd_arguments",
        [
            {"role": "user", "content": "Weather?"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "not json"}},
                    {"id": "c2", "type": "function", "function": {"name": "get_weather", "arguments": "[1]"}},
                    {"id": "c3", "type": "function", "function": {"name": "get_weather", "arguments": ""}},
                ],
            },
            {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        ],
        tools=[{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}],
    ),
    Case("named_user", [{"role": "user", "content": "Hi", "name": "ann"}], tools=[WEATHER_TOOL]),
    Case("ignored_kwargs", [{"role": "user", "content": "Hi"}], chat_template_kwargs={"not_in_template": 1}),
]


def chat_template_of(name: str) -> str:
    template = SERVER_CONFIGS[name].get("chat_template")
    return str(template) if template else ""


async def test_the_self_check_passes_against_real_vllm(real_template: str, relay: RecordingRelay):
    engine = VLLMEngine(relay.url)
    try:
        root = (await engine.info()).root
        directory = tokenizer_dir(root)
        assert directory is not None, f"vLLM's model root {root!r} is not readable here"
        local = LocalTemplate.load(Path(directory), chat_template_of(real_template) or None)
        report = await self_check(local, engine)
        assert report.passed, [diff.log_fields() for diff in report.diffs]
        assert report.rendered == 2 * len(canonical_cases())
        shapes = await self_check(local, engine, cases=VLLM_SHAPES)
        assert shapes.passed, [diff.log_fields() for diff in shapes.diffs]
    finally:
        await engine.close()


async def test_a_tool_chat_rendered_locally_has_zero_drift(
    real_template: str, relay: RecordingRelay, audit: TokenAudit
):
    settings = {"chat_template": chat_template_of(real_template), "render_check_rate": 0.0}
    async with ProxyHarness.running(engine_urls=[relay.url], **settings) as proxy:
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What's the weather in Paris?"}]
        session = await proxy.create_session(
            messages, tools=[WEATHER_TOOL], max_new_tokens=24, temperature=1.0, top_p=0.95, seed=5
        )
        tokenizes_at_start = sum(path == "/tokenize" for path, _ in relay.requests)
        follow_ups = [("tool", "Paris: 21C, sunny"), ("user", "And Berlin?"), None]
        last = None
        for index, follow_up in enumerate(follow_ups):
            last = await session.client.chat.completions.create(model="m", messages=messages, tools=[WEATHER_TOOL])
            message = last.choices[0].message
            messages.append(message.model_dump())
            if follow_up is None:
                break
            role, content = follow_up
            if role == "tool":
                call_id = message.tool_calls[0].id if message.tool_calls else f"call_external_{index}"
                messages.append({"role": "tool", "tool_call_id": call_id, "content": content})
            else:
                messages.append({"role": "user", "content": content})
        assert sum(path == "/tokenize" for path, _ in relay.requests) == tokenizes_at_start  # rendered here
        assert proxy.app[keys.METRICS].value("renders_total", source="local") == 3
        turns = check_turns(relay, audit)
        assert len(turns) == 3
        check_trajectory(await proxy.trajectory(last.id), turns, audit)
