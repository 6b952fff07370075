"""VLLMEngine against the fake vLLM server and a scripted one: what it sends, what it reads, how it fails."""

from __future__ import annotations

import asyncio
import dataclasses

import aiohttp
import numpy as np
import pytest
from aiohttp import web

from devtools.fake_engine import fake_logprob
from rollout_proxy.engines import vllm_http
from rollout_proxy.engines.base import SamplingParams
from rollout_proxy.engines.vllm_http import LOGPROB_FLOOR, VLLMEngine
from rollout_proxy.errors import EngineError, EngineTimeout, EngineUnavailable
from tests.conftest import free_port

MESSAGES = [{"role": "user", "content": "What is 2+2?"}]
PARAMS = SamplingParams(max_tokens=16, temperature=1.0, top_p=1.0, top_k=0)


@pytest.fixture
async def client(fake):
    engine = VLLMEngine(fake.url + "/")
    yield engine
    await engine.close()


@pytest.fixture
async def scripted_client(scripted):
    engine = VLLMEngine(scripted.url)
    yield engine
    await engine.close()


def completion_body(choice: str) -> str:
    return '{"id": "cmpl-1", "object": "text_completion", "choices": [' + choice + "]}"


async def test_info_reads_the_model_card(client, fake):
    info = await client.info()
    assert (info.url, info.model, info.max_model_len) == (fake.url, fake.model_name, fake.max_model_len)
    assert await client.healthy()


async def test_tokenize_uses_the_engines_template(fake_engine):
    engine = VLLMEngine(fake_engine.url)
    try:
        for add_generation_prompt in (True, False):
            ids = await engine.tokenize_messages(
                MESSAGES, tools=None, add_generation_prompt=add_generation_prompt, chat_template_kwargs=None
            )
            expected = fake_engine.encode(fake_engine.render(MESSAGES, add_generation_prompt=add_generation_prompt))
            assert ids.dtype == np.int32 and ids.tolist() == expected
        text = "Hello <|im_end|> world"
        assert (await engine.tokenize_text(text)).tolist() == fake_engine.encode(text)
    finally:
        await engine.close()


async def test_complete_sends_every_sampling_setting(client, fake):
    prompt = np.asarray(fake.encode("Count to three:"), dtype=np.int32)
    await client.complete(prompt, SamplingParams(max_tokens=9, temperature=0.7, top_p=0.9, top_k=0))
    payload = fake.completions[-1]
    assert payload == {
        "model": fake.model_name,
        "prompt": prompt.tolist(),
        "max_tokens": 9,
        "temperature": 0.7,
        "top_p": 0.9,
        "top_k": -1,  # vLLM's "disabled"
        "n": 1,
        "logprobs": 0,
        "return_token_ids": True,
        "stream": False,
        "min_p": 0.0,
        "presence_penalty": 0.0,
        "frequency_penalty": 0.0,
        "repetition_penalty": 1.0,
    }
    params = SamplingParams(
        max_tokens=4, temperature=0.5, top_p=1.0, top_k=20, seed=3, stop=("\n",), routed_experts_prompt_start=5
    )
    await client.complete(prompt, params)
    payload = fake.completions[-1]
    assert payload["top_k"] == 20 and payload["seed"] == 3 and payload["stop"] == ["\n"]
    assert payload["routed_experts_prompt_start"] == 5


async def test_complete_returns_the_sampled_tokens_and_logprobs(client, fake):
    prompt = np.asarray(fake.encode("Say hi:"), dtype=np.int32)
    fake.queue("Hi there")
    completion = await client.complete(prompt, PARAMS)
    sampled = [*fake.encode("Hi there"), fake.eos_id]
    assert completion.output_ids.dtype == np.int32 and completion.output_ids.tolist() == sampled
    expected = [fake_logprob(len(prompt) + i, token) for i, token in enumerate(sampled)]
    assert np.array_equal(completion.output_logprobs, np.asarray(expected, dtype=np.float32))
    assert completion.prompt_ids.tolist() == prompt.tolist()
    assert completion.text == "Hi there" and completion.finish_reason == "stop"
    assert completion.nonfinite_logprobs == 0 and completion.routed_experts is None
    assert client.returns_routing is False


async def test_non_finite_logprobs_are_clamped_and_counted(scripted, scripted_client):
    scripted.answer(
        "/v1/completions",
        200,
        completion_body(
            '{"text": "abcd", "token_ids": [5, 6, 7, 8], "finish_reason": "stop", "prompt_token_ids": [1, 2],'
            ' "logprobs": {"token_logprobs": [NaN, -Infinity, -0.5, Infinity]}}'
        ),
    )
    completion = await scripted_client.complete(np.asarray([1, 2], dtype=np.int32), PARAMS)
    assert completion.nonfinite_logprobs == 3
    assert completion.output_logprobs.tolist() == [LOGPROB_FLOOR, LOGPROB_FLOOR, -0.5, 0.0]
    assert np.isfinite(completion.output_logprobs).all()


@pytest.mark.parametrize("status", [400, 404, 500])
async def test_an_error_answer_is_an_engine_error_with_the_engines_message(client, fake, status):
    fake.failures.append((status, "the engine's own words"))
    with pytest.raises(EngineError) as raised:
        await client.complete(np.asarray([1, 2, 3], dtype=np.int32), PARAMS)
    assert raised.value.status == 502 and not isinstance(raised.value, EngineUnavailable)
    assert "the engine's own words" in raised.value.message and str(status) in raised.value.message


async def test_an_overloaded_engine_is_unavailable(client, fake):
    fake.failures.append((503, "busy"))
    with pytest.raises(EngineUnavailable) as raised:
        await client.complete(np.asarray([1, 2, 3], dtype=np.int32), PARAMS)
    assert raised.value.status == 503 and "busy" in raised.value.message


async def test_an_engine_nobody_listens_on_is_unavailable():
    engine = VLLMEngine(f"http://127.0.0.1:{free_port()}")
    try:
        with pytest.raises(EngineUnavailable):
            await engine.info()
        assert not await engine.healthy()
    finally:
        await engine.close()


async def test_an_engine_that_does_not_answer_in_time_is_a_timeout(fake):
    fake.delay = 1.0
    engine = VLLMEngine(fake.url, request_timeout=0.2)
    try:
        await engine.info()
        with pytest.raises(EngineTimeout):
            await engine.complete(np.asarray([1, 2, 3], dtype=np.int32), PARAMS)
    finally:
        await engine.close()


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/completions", "<html>not json</html>"),
        ("/v1/completions", '{"object": "text_completion", "choices": []}'),
        ("/v1/completions", completion_body('{"text": "a", "finish_reason": "stop", "logprobs": null}')),
        ("/v1/completions", completion_body('{"text": "a", "token_ids": [5], "logprobs": null}')),
        (
            "/v1/completions",
            completion_body('{"text": "a", "token_ids": [5, 6], "logprobs": {"token_logprobs": [-1]}}'),
        ),
        ("/v1/models", '{"object": "list", "data": [{"id": "m"}]}'),
        ("/v1/models", '{"object": "list", "data": []}'),
    ],
    ids=["not-json", "no-choices", "no-token-ids", "no-logprobs", "short-logprobs", "no-max-len", "no-model"],
)
async def test_an_unusable_answer_is_an_engine_error(scripted, scripted_client, path, body):
    scripted.answer(path, 200, body)
    with pytest.raises(EngineError) as raised:
        await scripted_client.complete(np.asarray([1, 2], dtype=np.int32), PARAMS)
    assert not isinstance(raised.value, EngineUnavailable)


async def test_tokenize_without_tokens_is_an_engine_error(scripted, scripted_client):
    scripted.answer("/tokenize", 200, '{"count": 0}')
    with pytest.raises(EngineError):
        await scripted_client.tokenize_text("hello")


async def test_a_503_with_a_plain_text_body_is_unavailable(scripted, scripted_client):
    scripted.answer("/v1/completions", 503, "Service Unavailable")
    with pytest.raises(EngineUnavailable):
        await scripted_client.complete(np.asarray([1, 2], dtype=np.int32), PARAMS)


async def test_a_plain_text_error_keeps_the_engines_message(scripted, scripted_client):
    scripted.answer("/v1/completions", 500, "Internal Server Error: CUDA out of memory")
    with pytest.raises(EngineError) as raised:
        await scripted_client.complete(np.asarray([1, 2], dtype=np.int32), PARAMS)
    assert "CUDA out of memory" in raised.value.message


async def test_close_closes_only_the_client_it_created(fake):
    owned = VLLMEngine(fake.url)
    await owned.info()
    created = owned._session  # the client it opened itself
    await owned.close()
    assert created is not None and created.closed

    async with aiohttp.ClientSession() as http:
        borrowing = VLLMEngine(fake.url, session=http)
        await borrowing.info()
        await borrowing.close()
        assert not http.closed
        assert (await borrowing.info()).model == fake.model_name


TOPK = SamplingParams(max_tokens=4, temperature=1.0, top_p=1.0, top_k=0, top_logprobs=2)


async def test_top_logprobs_are_read_as_the_top_k_best_first(scripted, scripted_client):
    """vLLM lists the sampled token first: outside the top k it is one key more, inside it is in its place."""
    scripted.answer(
        "/v1/completions",
        200,
        completion_body(
            '{"text": "ab", "token_ids": [5, 6], "finish_reason": "stop", "prompt_token_ids": [1, 2],'
            ' "logprobs": {"token_logprobs": [-3.0, -0.5], "tokens": ["token_id:5", "token_id:6"], "top_logprobs": ['
            '{"token_id:5": -3.0, "token_id:9": -0.2, "token_id:8": -1.5},'
            '{"token_id:6": -0.5, "token_id:4": -Infinity}]}}'
        ),
    )
    completion = await scripted_client.complete(np.asarray([1, 2], dtype=np.int32), TOPK)
    assert completion.output_topk is not None
    assert completion.output_topk.ids.tolist() == [[9, 8], [6, 4]]
    assert completion.output_topk.logprobs.tolist() == [[pytest.approx(-0.2), -1.5], [-0.5, LOGPROB_FLOOR]]


@pytest.mark.parametrize(
    "top",
    [
        "[]",  # none
        '[{"token_id:5": -1.0}]',  # fewer than k
        '[{"five": -1.0, "token_id:3": -2.0}]',  # not keyed by id (return_tokens_as_token_ids ignored)
    ],
)
async def test_top_logprobs_that_cannot_be_read_are_an_engine_error(scripted, scripted_client, top):
    scripted.answer(
        "/v1/completions",
        200,
        completion_body(
            '{"text": "a", "token_ids": [5], "finish_reason": "stop", "prompt_token_ids": [1, 2],'
            ' "logprobs": {"token_logprobs": [-1.0], "top_logprobs": ' + top + "}}"
        ),
    )
    with pytest.raises(EngineError):
        await scripted_client.complete(np.asarray([1, 2], dtype=np.int32), TOPK)


async def test_top_logprobs_from_the_fake_match_its_distribution(client, fake):
    prompt = np.asarray(fake.encode("Hello there"), dtype=np.int32)
    completion = await client.complete(
        prompt, SamplingParams(max_tokens=5, temperature=1.0, top_p=1.0, top_k=0, top_logprobs=3)
    )
    sent = fake.completions[-1]
    assert sent["logprobs"] == 3 and sent["return_tokens_as_token_ids"] is True
    top = completion.output_topk
    assert top is not None and top.ids.shape == (len(completion.output_ids), 3)
    for index, (token, logprob) in enumerate(zip(completion.output_ids, completion.output_logprobs, strict=True)):
        position = len(prompt) + index
        assert top.logprobs[index].tolist() == pytest.approx([fake_logprob(position, int(t)) for t in top.ids[index]])
        assert np.all(np.diff(top.logprobs[index]) <= 0)
        if int(token) in top.ids[index]:  # the sampled token, when among them, with the logprob it was sampled with
            assert top.logprobs[index][top.ids[index].tolist().index(int(token))] == pytest.approx(logprob)
    plain = await client.complete(prompt, SamplingParams(max_tokens=5, temperature=1.0, top_p=1.0, top_k=0))
    assert plain.output_topk is None and fake.completions[-1]["logprobs"] == 0


@pytest.mark.parametrize(
    ("echo", "reported"),
    [
        ("[1,2,3]", [1, 2, 3]),  # vLLM's compact JSON, the prompt sent: found as bytes, not parsed
        ("[1, 2, 3]", [1, 2, 3]),  # other spacing: parsed
        ("[1,2,4]", [1, 2, 4]),  # another prompt: reported as the engine says (the turn refuses it)
        ("[1,2,3,4]", [1, 2, 3, 4]),  # ours with more after it
        ("[0,1,2,3]", [0, 1, 2, 3]),
    ],
    ids=["compact", "spaced", "drifted", "longer", "prefixed"],
)
async def test_the_prompt_echo_is_what_the_engine_said_however_it_is_written(scripted, scripted_client, echo, reported):
    scripted.answer(
        "/v1/completions",
        200,
        '{"choices":[{"text":"said \\"prompt_token_ids\\":[1,2,3]","token_ids":[5],"finish_reason":"stop",'
        f'"prompt_token_ids":{echo},"logprobs":{{"token_logprobs":[-0.5]}}}}]}}',
    )
    completion = await scripted_client.complete(np.asarray([1, 2, 3], dtype=np.int32), PARAMS)
    assert completion.prompt_ids.dtype == np.int32 and completion.prompt_ids.tolist() == reported
    assert completion.text == 'said "prompt_token_ids":[1,2,3]'  # the same words inside a string are text
    assert completion.output_ids.tolist() == [5] and completion.output_logprobs.tolist() == [-0.5]


async def test_a_long_prompt_echoed_by_the_engine_is_checked_without_parsing_it(client, fake, monkeypatch):
    """The fake answers as vLLM does (compact JSON): the echo of the prompt sent is matched as bytes."""
    from rollout_proxy.engines import vllm_http

    parsed: list[bytes] = []
    real_loads = vllm_http._loads

    def recording(body: bytes):
        parsed.append(body)
        return real_loads(body)

    monkeypatch.setattr(vllm_http, "_loads", recording)
    prompt = np.asarray(fake.encode("Say hi: " + "and again " * 400), dtype=np.int32)
    fake.queue("Hi there")
    completion = await client.complete(prompt, PARAMS)
    assert np.array_equal(completion.prompt_ids, prompt) and completion.text == "Hi there"
    answers = [body for body in parsed if b'"token_ids"' in body]
    assert len(answers) == 1 and b'"prompt_token_ids":null' in answers[0] and len(answers[0]) < len(prompt)


async def test_a_connection_idle_longer_than_vllm_keeps_it_is_not_reused(monkeypatch):
    """vLLM's server closes a connection idle for 5 s; a client that reuses one it kept longer races that
    close and its call is reset. After ENGINE_KEEPALIVE_S of quiet the client dials a new connection."""
    monkeypatch.setattr(vllm_http, "ENGINE_KEEPALIVE_S", 0.3)
    transports: list[int] = []

    async def weight_info(request: web.Request) -> web.Response:
        transports.append(id(request.transport))
        return web.json_response({"weight_version": "3"})

    app = web.Application()
    app.router.add_get("/weight_info", weight_info)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    engine = VLLMEngine(f"http://127.0.0.1:{port}")
    try:
        await engine.weight_version()
        await engine.weight_version()  # at once: the same connection
        await asyncio.sleep(0.8)  # longer than the client keeps an idle one
        await engine.weight_version()
    finally:
        await engine.close()
        await runner.cleanup()
    assert transports[0] == transports[1] and transports[2] != transports[1]


# -- LoRA adapters ------------------------------------------------------------------------------------------


@pytest.fixture
async def lora_client(tokenizer_dir):
    from devtools.fake_engine import FakeEngine, FakeEngineServer

    fake = FakeEngine(tokenizer_dir, max_lora_rank=16)
    async with FakeEngineServer(fake) as url:
        engine = VLLMEngine(url)
        yield engine, fake
        await engine.close()


@pytest.fixture(scope="module")
def lora_dirs(tokenizer_dir, tmp_path_factory):
    from devtools.lora_adapter import build_adapter

    root = tmp_path_factory.mktemp("lora")
    return {
        "v1": build_adapter(tokenizer_dir, root / "v1", targets=("q_proj",), seed=1),
        "r32": build_adapter(tokenizer_dir, root / "r32", rank=32, targets=("q_proj",), seed=2),
    }


async def test_adapters_load_list_serve_and_unload(lora_client, lora_dirs):
    from devtools.fake_lora import adapter_key

    engine, fake = lora_client
    await engine.load_adapter("pol@v1", str(lora_dirs["v1"]), within=5.0)
    assert [(c.name, c.path, c.parent) for c in await engine.adapters()] == [
        ("pol@v1", str(lora_dirs["v1"]), fake.model_name)
    ]
    fake.queue([1000, 1001])
    prompt = np.asarray([1, 2, 3], dtype=np.int32)
    completion = await engine.complete(prompt, dataclasses.replace(PARAMS, served_model="pol@v1"))
    assert fake.completions[-1]["model"] == "pol@v1"
    key = adapter_key(str(lora_dirs["v1"]))
    assert completion.output_logprobs[0] == pytest.approx(fake_logprob(3, 1000, "default", key), abs=1e-6)
    assert (await engine.tokenize_text("hi", model="pol@v1")).tolist() == fake.encode("hi")
    assert await engine.unload_adapter("pol@v1", within=5.0) is True
    assert await engine.unload_adapter("pol@v1", within=5.0) is False  # already gone: not an error
    with pytest.raises(vllm_http.ServedModelMissing) as missing:
        await engine.complete(prompt, dataclasses.replace(PARAMS, served_model="pol@v1"))
    assert missing.value.engine_status == 404 and "does not exist" in missing.value.message


async def test_refused_loads_are_adapter_refusals_in_vllms_words(lora_client, lora_dirs, tmp_path):
    from rollout_proxy.errors import AdapterRefused

    engine, fake = lora_client
    with pytest.raises(AdapterRefused, match="LoRA rank 32 is greater than max_lora_rank 16") as rank:
        await engine.load_adapter("big", str(lora_dirs["r32"]), within=5.0)
    assert "stack trace" not in rank.value.message and rank.value.status == 400
    with pytest.raises(AdapterRefused, match="No adapter found"):
        await engine.load_adapter("gone", str(tmp_path / "gone"), within=5.0)
    await engine.load_adapter("pol@v1", str(lora_dirs["v1"]), within=5.0)
    with pytest.raises(vllm_http.AdapterAlreadyLoaded):
        await engine.load_adapter("pol@v1", str(lora_dirs["v1"]), within=5.0)
    with pytest.raises(AdapterRefused, match="conflicts with a served base model"):
        await engine.load_adapter(fake.model_name, str(lora_dirs["v1"]), within=5.0)
    assert await engine.healthy()


async def test_an_engine_without_runtime_lora_says_how_to_start_it(client, lora_dirs):
    with pytest.raises(vllm_http.AdapterLoadingNotServed, match="VLLM_ALLOW_RUNTIME_LORA_UPDATING=true"):
        await client.load_adapter("pol@v1", str(lora_dirs["v1"]), within=5.0)
