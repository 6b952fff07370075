"""Encoding a rendered conversation piece by piece, with the pieces a template repeats cached.

A Hugging Face tokenizer first cuts its input at the added tokens it finds (``<|im_start|>``,
``<|im_end|>``, ...), then normalizes, pre-tokenizes and encodes each stretch between them on
its own. So a text cut right after a special token encodes as the concatenation of its pieces'
encodings, and a piece the template renders every turn (the system prompt and tools, the bridge's
anchor, ``"\\n<|im_start|>"``) need not be encoded again: a bridge encoded whole cost ~160 µs
here, piece by piece ~50 µs (README, "Rendering").

Only where that holds exactly is it used (``exact_split_tokens``): a special token that no
other added token contains or overlaps, matched as it is written (no ``lstrip``/``rstrip``/
``single_word``, not normalized), in a tokenizer that matches special tokens at all; and
probes (a piece, then each of several kinds of text) must encode the same cut and whole. A
pre-tokenizer that treats the start of the input apart (SentencePiece's "prepend a space to the
first word") fails them, and that tokenizer is encoded whole. Rendering is still checked
against the engine's ``/tokenize`` (``core.rendering``), at start and on sampled live turns.
"""

from __future__ import annotations

import functools
import re
from array import array
from collections.abc import Callable, Iterable, Sequence
from typing import Any

#: pieces up to this long share the main cache (a template's markup, short messages)
CACHED_PIECE_CHARS = 4096
#: pieces the cache holds (least recently used out first): a few MB at most
CACHED_PIECES = 4096
#: longer pieces, up to this long, go to a small cache of their own: a tools block (Codex's 13 tools render
#: ~19k characters, 7 ms to encode) or a system prompt is rendered again on every turn's bridge, where a long
#: tool result is rarely seen twice and would only push the short pieces out of the main cache
CACHED_LONG_PIECE_CHARS = 65536
#: long pieces the second cache holds (least recently used out first): at most ~10 MB of text and ids
CACHED_LONG_PIECES = 32
#: how an added token may take more than its own text (strip the whitespace next to it, ...): never a cut
_FLAGS = ("lstrip", "rstrip", "single_word", "normalized")
#: what follows a special token in the probes: words, spaces, newlines, digits, non-ASCII, a contraction
_PROBE_TEXTS = ("x", "hello world", " x", "  x", "\n", "\nx", "\n\n x", "\t1", "12 34", "'s", "é ü", "", "<")

Encode = Callable[[str], list[int]]


def exact_split_tokens(tokenizer: Any, encode: Encode) -> frozenset[str]:
    """The special tokens a text can be cut after, its encoding unchanged (empty: encode texts whole)."""
    if getattr(tokenizer, "split_special_tokens", False):  # special tokens are encoded as text
        return frozenset()
    added = list(getattr(tokenizer, "added_tokens_decoder", {}).values())
    contents = [str(token.content) for token in added]
    chosen = {
        str(token.content)
        for token in added
        if token.content and getattr(token, "special", False) and not any(getattr(token, flag, True) for flag in _FLAGS)
    }
    chosen -= _matched_across(chosen, contents)
    probes_agree = all(
        encode(before + split + after) == encode(before + split) + encode(after)
        for split in chosen
        for before in ("", "a", "x\n")
        for after in _PROBE_TEXTS
    )
    return frozenset(chosen) if probes_agree else frozenset()


def _matched_across(candidates: set[str], contents: list[str]) -> set[str]:
    """The candidates another added token could be matched instead of or across: one that contains a
    candidate, or ends with a candidate's start. Linear in the added tokens (some models have thousands)."""
    longest = max(map(len, candidates), default=0)
    by_start: dict[str, set[str]] = {}
    for candidate in candidates:
        for cut in range(1, len(candidate)):
            by_start.setdefault(candidate[:cut], set()).add(candidate)
    found: set[str] = set()
    for other in contents:
        for start in range(len(other)):
            for end in range(start + 1, min(len(other), start + longest) + 1):
                inside = other[start:end]
                if inside in candidates and inside != other:
                    found.add(inside)  # inside a longer added token
            found |= by_start.get(other[start:], set()) - {other}  # a suffix of it starts a candidate
    return found


class PieceEncoder:
    """``encode`` of a whole text, computed as its pieces' (each ending with a split token), cached.

    Thread-safe: the cache is ``functools.lru_cache`` (its bookkeeping holds the GIL).
    """

    def __init__(self, encode: Encode, split_tokens: Iterable[str]) -> None:
        ordered = sorted(split_tokens, key=len, reverse=True)
        self._encode = encode
        self._splits = re.compile("|".join(re.escape(token) for token in ordered)) if ordered else None
        self._cached = functools.lru_cache(maxsize=CACHED_PIECES)(lambda piece: tuple(encode(piece)))
        self._cached_long = functools.lru_cache(maxsize=CACHED_LONG_PIECES)(
            lambda piece: array("i", encode(piece))  # 4 bytes a token, not a tuple of ints
        )

    @property
    def splits(self) -> bool:
        """Whether texts are encoded in pieces (False: whole, the tokenizer allows no exact cut)."""
        return self._splits is not None

    def __call__(self, text: str) -> list[int]:
        return self.ids(text).tolist()

    def ids(self, text: str) -> array[int]:
        """``encode(text)`` as 32-bit ids (numpy reads them without a copy)."""
        if self._splits is None:
            return array("i", self._encode(text))
        ids = array("i")
        start = 0
        for found in self._splits.finditer(text):
            ids.extend(self._piece(text[start : found.end()]))
            start = found.end()
        if start < len(text):
            ids.extend(self._piece(text[start:]))
        return ids

    def _piece(self, piece: str) -> Sequence[int]:
        if len(piece) <= CACHED_PIECE_CHARS:
            return self._cached(piece)
        return self._cached_long(piece) if len(piece) <= CACHED_LONG_PIECE_CHARS else self._encode(piece)
