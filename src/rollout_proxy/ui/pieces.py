"""Token ids as the text pieces the viewer shows: each id decoded alone, remembered per model.

A piece is what one id decodes to by itself (the engine's ``/detokenize`` of ``[id]``, or a
local tokenizer's decode): a byte-level token that is only part of a multi-byte character
decodes to U+FFFD, and the viewer shows its id beside it. Pieces depend only on the model's
tokenizer, so each id is asked once per model and kept (bounded); the ids a trajectory
needs are asked a few at a time within a deadline: a slow or dead engine costs the viewer
its pieces, never its answer.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from rollout_proxy.errors import ProxyError

#: Decode calls in flight at once, over all viewers: the engine's real work comes first.
CONCURRENCY = 8
#: Seconds the pieces of one trajectory may take before the answer goes out without them.
DEADLINE = 10.0
#: Pieces remembered (a model's vocabulary, a few times over).
MAX_ENTRIES = 500_000


@runtime_checkable
class TokenDecoder(Protocol):
    """What turns token ids into text: an engine (``/detokenize``) or a local tokenizer."""

    async def detokenize(self, token_ids: Sequence[int]) -> str: ...


@dataclass(frozen=True, slots=True)
class Pieces:
    texts: list[str | None]  # one per token; None where it could not be decoded
    error: str | None = None  # why some are missing


class PieceCache:
    def __init__(
        self, *, concurrency: int = CONCURRENCY, deadline: float = DEADLINE, max_entries: int = MAX_ENTRIES
    ) -> None:
        self._limit = asyncio.Semaphore(concurrency)
        self._deadline = deadline
        self._max_entries = max_entries
        self._known: dict[tuple[str, int], str] = {}

    def _remember(self, model: str, token: int, text: str) -> None:
        if len(self._known) >= self._max_entries:
            self._known.pop(next(iter(self._known)))  # the oldest
        self._known[(model, token)] = text

    async def pieces(self, decoder: TokenDecoder, model: str, token_ids: Sequence[int]) -> Pieces:
        """Every token's piece; the ones not known yet are decoded now, within the deadline."""
        missing = sorted({token for token in token_ids if (model, token) not in self._known})

        async def decode(token: int) -> None:
            async with self._limit:
                if (model, token) not in self._known:
                    self._remember(model, token, await decoder.detokenize([token]))

        error = None
        try:
            async with asyncio.timeout(self._deadline):
                outcomes = await asyncio.gather(*(decode(token) for token in missing), return_exceptions=True)
        except TimeoutError:
            error = f"the engine did not decode the token pieces within {self._deadline:g}s"
        else:
            failures = [outcome for outcome in outcomes if isinstance(outcome, BaseException)]
            for failure in failures:
                if not isinstance(failure, ProxyError):
                    raise failure
            if failures:
                error = f"the engine could not decode the token pieces: {failures[0]}"
        return Pieces([self._known.get((model, token)) for token in token_ids], error)
