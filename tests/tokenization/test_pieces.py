"""Encoding piece by piece is encoding whole, token for token, or it is not used.

The real SmolLM2 tokenizer allows the cut (its chat tokens are plain special tokens); small
tokenizers built here show the refusals: a pre-tokenizer that treats the input's start apart,
a special token that strips the whitespace next to it, one a longer added token contains.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from rollout_proxy.tokenization import pieces
from rollout_proxy.tokenization.local import _encoder
from rollout_proxy.tokenization.pieces import PieceEncoder, exact_split_tokens

#: what texts here are made of: words, spaces, newlines, non-ASCII, and the chat tokens written as text
PARTS = [*"ab Z9.,'\n\t", "é", "日本", "  ", "\n\n", "<|im_start|>", "<|im_end|>", "<|endoftext|>", "<", "|>"]
PARTS += ["system\n", "user\n", "assistant\n", "<think>", "<tool_call>"]
TEXT = st.lists(st.sampled_from(PARTS), max_size=30).map("".join)


@pytest.fixture(scope="module")
def smollm(tokenizer_dir: Path):
    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir), local_files_only=True)
    whole = _encoder(tokenizer)
    return whole, PieceEncoder(whole, exact_split_tokens(tokenizer, whole))


def test_the_chat_tokens_of_smollm_allow_the_cut(smollm):
    whole, encoder = smollm
    assert encoder.splits
    conversation = "<|im_start|>system\nYou are kind.<|im_end|>\n<|im_start|>user\nHi  there\n<|im_end|>\n"
    assert encoder(conversation) == whole(conversation)
    assert encoder(conversation) == whole(conversation)  # the second time from the cache


@settings(max_examples=300, deadline=None, derandomize=True, database=None)
@given(texts=st.lists(TEXT, min_size=1, max_size=4))
def test_piece_by_piece_is_whole_for_any_text(smollm, texts):
    """Several texts in a row, so that later ones meet pieces the cache holds from earlier ones."""
    whole, encoder = smollm
    for text in texts:
        assert encoder(text) == whole(text)


def test_a_piece_longer_than_the_cache_takes_is_encoded_uncached(smollm, monkeypatch):
    whole, encoder = smollm
    monkeypatch.setattr(pieces, "CACHED_PIECE_CHARS", 8)
    text = "<|im_start|>user\n" + "a long tool result " * 20 + "<|im_end|>\nend"
    assert encoder(text) == whole(text)


def test_a_long_piece_a_template_renders_every_turn_is_encoded_once(smollm, monkeypatch):
    """A tools block longer than the main cache takes (Codex's renders ~19k characters) is kept in the small
    cache of long pieces: the second render of it encodes only what is new, and the ids are the same."""
    whole, _ = smollm
    calls: list[str] = []

    def counted(text: str) -> list[int]:
        calls.append(text)
        return whole(text)

    counting = PieceEncoder(counted, ["<|im_start|>", "<|im_end|>"])  # two of SmolLM2's exact cuts
    tools = "<|im_start|>system\n# Tools\n" + "".join(
        f'{{"name": "tool_{i}", "description": "does {i}"}}\n' for i in range(200)
    )
    tools += "<|im_end|>"
    assert pieces.CACHED_PIECE_CHARS < len(tools) <= pieces.CACHED_LONG_PIECE_CHARS
    for turn in range(3):
        text = tools + f"\n<|im_start|>user\nturn {turn}<|im_end|>\n"
        assert counting(text) == whole(text)
    assert sum(len(text) > pieces.CACHED_PIECE_CHARS for text in calls) == 1
    monkeypatch.setattr(pieces, "CACHED_LONG_PIECE_CHARS", 100)  # longer than that: encoded each time, still exact
    calls.clear()
    assert counting(tools + "x") == whole(tools + "x")
    assert counting(tools + "y") == whole(tools + "y")
    assert sum(len(text) > pieces.CACHED_PIECE_CHARS for text in calls) == 2


def small_tokenizer(pre_tokenizer, *specials: AddedToken) -> PreTrainedTokenizerFast:
    """A word-level tokenizer over a few words, with ``specials`` as its special tokens."""
    words = ["x", "hello", "world", "a", "1", "12", "34", "'s", "é", "ü", "<"]
    vocab = {"[UNK]": 0} | {word: i + 1 for i, word in enumerate(words)}
    vocab |= {"▁" + word: len(vocab) + i for i, word in enumerate(words)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizer
    backend.add_special_tokens(list(specials))
    return PreTrainedTokenizerFast(tokenizer_object=backend)


def plain(content: str, **flags: bool) -> AddedToken:
    return AddedToken(content, special=True, normalized=False, **flags)


def splits_of(tokenizer: PreTrainedTokenizerFast) -> frozenset[str]:
    return exact_split_tokens(tokenizer, _encoder(tokenizer))


def test_a_plain_special_token_of_a_plain_pre_tokenizer_is_a_cut():
    tokenizer = small_tokenizer(pre_tokenizers.WhitespaceSplit(), plain("<end>"), plain("<start>"))
    assert splits_of(tokenizer) == {"<end>", "<start>"}


def test_a_pre_tokenizer_that_treats_the_start_apart_is_encoded_whole():
    """SentencePiece's Metaspace marks the first word only: "x" after a special token is "x", alone "▁x"."""
    tokenizer = small_tokenizer(pre_tokenizers.Metaspace(prepend_scheme="first"), plain("<end>"))
    whole = _encoder(tokenizer)
    assert whole("a<end>x") != whole("a<end>") + whole("x")  # the reason
    assert splits_of(tokenizer) == frozenset()
    assert not PieceEncoder(whole, splits_of(tokenizer)).splits


@pytest.mark.parametrize("flag", ["lstrip", "rstrip", "single_word"])
def test_a_special_token_that_takes_what_is_next_to_it_is_no_cut(flag):
    tokenizer = small_tokenizer(pre_tokenizers.WhitespaceSplit(), plain("<end>", **{flag: True}), plain("<start>"))
    assert splits_of(tokenizer) == {"<start>"}


def test_a_special_token_inside_or_overlapping_another_is_no_cut():
    """ "<end>" is inside "<end>!", and "a<se" ends with the start of "<sep>" (in "a<sep>" it is matched
    first); where "a<se" itself is found it is matched, so it stays a cut. "<end>!" is left out too: an
    added token ("<end>") ends with its start (the check is on the safe side)."""
    tokenizer = small_tokenizer(
        pre_tokenizers.WhitespaceSplit(), plain("<end>"), plain("<end>!"), plain("<sep>"), plain("a<se")
    )
    assert splits_of(tokenizer) == {"a<se"}
    whole = _encoder(tokenizer)
    encoder = PieceEncoder(whole, splits_of(tokenizer))
    for text in ("a<sep> x", "x <end>! <end> a<se", "<sep><end>!a<sep>"):
        assert encoder(text) == whole(text)


def test_a_tokenizer_that_encodes_special_tokens_as_text_is_encoded_whole():
    tokenizer = small_tokenizer(pre_tokenizers.WhitespaceSplit(), plain("<end>"))
    tokenizer.split_special_tokens = True
    assert splits_of(tokenizer) == frozenset()
