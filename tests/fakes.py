"""Several fake vLLM engines, each on its own port, that a test can kill, restart and fault."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from devtools.fake_engine import FakeEngine, FakeEngineServer, Generation
from rollout_proxy.records import PolicySpan, merge_spans


@dataclass
class FakeFleet:
    engines: list[FakeEngine]
    servers: list[FakeEngineServer]

    @property
    def urls(self) -> list[str]:
        return [server.url for server in self.servers]

    def by_url(self, url: str) -> FakeEngine:
        return self.engines[self.urls.index(url)]

    async def kill(self, index: int) -> None:
        await self.servers[index].kill()

    async def restart(self, index: int) -> None:
        await self.servers[index].restart()

    def generations(self) -> list[tuple[str, Generation]]:
        """Every completion every engine generated, with the engine's URL."""
        return [
            (server.url, gen)
            for engine, server in zip(self.engines, self.servers, strict=True)
            for gen in engine.generations
        ]

    def completed(self, prompt: list[int], output: list[int]) -> list[tuple[str, Generation]]:
        """The completions that produced exactly ``output`` from exactly ``prompt`` (not cut short)."""
        return [
            (url, gen)
            for url, gen in self.generations()
            if gen.prompt == prompt and gen.tokens == output and gen.finish_reason != "abort"
        ]

    def account(
        self, prefix: list[int], output: list[int], logprobs: np.ndarray, *, default_version: int = 0
    ) -> list[PolicySpan]:
        """How the engines produced ``output`` after exactly ``prefix``, with ``logprobs``: the generations
        whose prompts, tokens and logprobs chain into it (a cut one, then its continuation; or one whole),
        and the versions the engines reported for each token. AssertionError when nothing matches."""
        found = self._chain(prefix, output, logprobs, 0)
        assert found is not None, f"no engine produced these {len(output)} tokens after this {len(prefix)}-token prompt"
        spans: list[PolicySpan] = []
        offset = 0
        for generation in found:
            for version, start, end in generation.versions:
                number = default_version if version == "default" else int(version)
                spans.append(PolicySpan(number, offset + start, offset + end))
            offset += len(generation.tokens)
        return merge_spans(spans)

    def _chain(self, prefix: list[int], output: list[int], logprobs: np.ndarray, at: int) -> list[Generation] | None:
        whole, cut = [], []
        for _, generation in self.generations():
            n = len(generation.tokens)
            if generation.prompt != prefix + output[:at] or generation.tokens != output[at : at + n]:
                continue
            if not np.allclose(generation.logprobs, logprobs[at : at + n], atol=1e-6):
                continue  # the same tokens sampled by other weights (a call sampled again)
            if generation.finish_reason != "abort" and at + n == len(output):
                whole.append(generation)
            elif generation.finish_reason == "abort" and n and at + n < len(output):
                cut.append(generation)
        if whole:
            return [whole[0]]
        for generation in cut:
            rest = self._chain(prefix, output, logprobs, at + len(generation.tokens))
            if rest is not None:
                return [generation, *rest]
        return None

    def check_trajectory(self, trajectory: dict[str, Any], *, default_version: int = 0) -> None:
        """Every token the policy generated in ``trajectory`` is what an engine sampled after exactly the
        tokens before it, with that engine's logprobs and the versions it reported."""
        ids = trajectory["total_token_ids"]
        weights = np.asarray(trajectory["total_loss_weight"])
        logprobs = np.asarray(trajectory["total_token_logprobs"])
        expected: list[PolicySpan] = []
        edges = np.flatnonzero(np.diff(np.concatenate([[0], weights, [0]])))
        for start, end in zip(edges[::2], edges[1::2], strict=True):
            spans = self.account(ids[:start], ids[start:end], logprobs[start:end], default_version=default_version)
            expected += [PolicySpan(span.version, start + span.start, start + span.end) for span in spans]
        assert trajectory["policy_versions"] == [span.to_dict() for span in merge_spans(expected)]


@asynccontextmanager
async def fake_fleet(tokenizer_dir: Path, count: int, **fields: Any) -> AsyncIterator[FakeFleet]:
    engines = [FakeEngine(tokenizer_dir, **fields) for _ in range(count)]
    servers = [FakeEngineServer(engine) for engine in engines]
    for engine, server in zip(engines, servers, strict=True):
        engine.url = await server.start()  # type: ignore[attr-defined]
    try:
        yield FakeFleet(engines, servers)
    finally:
        for server in servers:
            await server.stop()
