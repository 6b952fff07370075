"""The soak's slope after warm-up, with its noise: what decides that RSS is flat "within noise"."""

from __future__ import annotations

import ctypes
import random
from pathlib import Path

import pytest

from bench.memory_soak import (
    FILL_WORDS,
    _libc,
    fill_word_caches,
    novel_words,
    parse_variants,
    slope_of_minutes,
    stretches,
    t_975,
)


def test_t_quantile_matches_the_tables() -> None:
    for dof, table in ((3, 3.182), (10, 2.228), (26, 2.056), (100, 1.984)):
        assert t_975(dof) == pytest.approx(table, rel=0.01)


def test_a_flat_series_with_noise_and_steps_has_zero_within_its_interval() -> None:
    noise = random.Random(7)
    samples = [(float(t), 500 + noise.gauss(0, 1.5) + (4 if t % 300 < 20 else 0)) for t in range(1500)]
    slope = slope_of_minutes(samples)
    assert slope.points == 25
    assert slope.flat, slope
    assert slope.margin < 0.2  # tight enough to tell 1.2 MiB/min apart


def test_a_slow_climb_is_told_apart_from_noise() -> None:
    noise = random.Random(8)
    samples = [(float(t), 500 + 1.2 * t / 60 + noise.gauss(0, 2)) for t in range(1500)]
    slope = slope_of_minutes(samples)
    assert not slope.flat
    assert slope.slope == pytest.approx(1.2, abs=slope.margin)


def test_stretches_tell_a_climb_that_levels_off_from_one_that_goes_on() -> None:
    """A bounded cache filling: RSS climbs 1 MiB/min for 20 minutes, then stays; a leak climbs all along."""
    noise = random.Random(3)
    levels = {"cache": lambda t: 400 + min(t, 1200) / 60, "leak": lambda t: 400 + t / 60}
    results = {
        name: {
            "samples": [(float(t), level(t) + noise.gauss(0, 0.05)) for t in range(3600)],
            "stats": [{"t": float(t), "malloc": {"in_use": level(t) / 4}} for t in range(0, 3600, 10)],
        }
        for name, level in levels.items()
    }
    rows = [line.split(" | ") for line in stretches(results, 0.0, 3).splitlines()[2:]]
    slopes = {(row[0].strip("| "), row[1]): float(row[3].split(" ± ")[0]) for row in rows}
    assert slopes[("cache", "0-20")] == pytest.approx(1024, rel=0.05)
    assert abs(slopes[("cache", "40-60")]) < 20  # KiB/min: levelled off
    assert slopes[("leak", "40-60")] == pytest.approx(1024, rel=0.05)


def test_minutes_start_at_the_first_sample_and_partial_ones_are_left_out() -> None:
    # samples each 10 s from t=150 (after a warm-up): 3 minutes and 2 samples, too few for a fourth
    samples = [(150.0 + 10 * i, 100.0 + i) for i in range(20)]
    assert slope_of_minutes(samples, every=10).points == 3
    assert slope_of_minutes(samples[:12], every=10).margin == float("inf")  # 2 minutes: no interval


def test_variants_are_read_per_store_and_unknown_ones_refused() -> None:
    variants = parse_variants(["memory:fill-word-cache", "redis:trim-every=10", "redis:arena-max=2"])
    assert variants == {"memory": {"fill-word-cache": ""}, "redis": {"trim-every": "10", "arena-max": "2"}}
    for wrong in ("disk:fill-word-cache", "memory:trim-every", "memory:fill-word-cache=1", "redis:lru=3"):
        with pytest.raises(SystemExit):
            parse_variants([wrong])


@pytest.mark.skipif(not hasattr(ctypes.CDLL(None), "mallinfo2"), reason="glibc's mallinfo2")
def test_a_filled_word_cache_takes_no_more_native_memory_for_new_words(tokenizer_dir: Path) -> None:
    """What the soak's ``fill-word-cache`` relies on: the tokenizer keeps at most 10,000 words it split, so once
    they are there new words take nothing more (and before, they do: the climb the soak saw)."""
    from tokenizers import Tokenizer

    libc = _libc()

    def grown_by_new_words(tokenizer: Tokenizer, start: int) -> float:
        before = libc.mallinfo2().uordblks
        for at in range(start, start + 6000, 500):
            tokenizer.encode(novel_words(500, at), add_special_tokens=False)
        return (libc.mallinfo2().uordblks - before) / 2**20

    fresh = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    assert grown_by_new_words(fresh, 100_000) > 1.0  # ~300 bytes a word
    filled = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    assert fill_word_caches(FILL_WORDS) >= 2  # every live tokenizer, these two among them
    assert grown_by_new_words(filled, 200_000) < 0.3
    assert grown_by_new_words(fresh, 300_000) < 0.3  # filled by its first 6,000 and the fill's 12,000
