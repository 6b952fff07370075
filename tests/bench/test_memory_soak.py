"""The soak's slope after warm-up, with its noise: what decides that RSS is flat "within noise"."""

from __future__ import annotations

import random

import pytest

from bench.memory_soak import slope_of_minutes, t_975


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


def test_minutes_start_at_the_first_sample_and_partial_ones_are_left_out() -> None:
    # samples each 10 s from t=150 (after a warm-up): 3 minutes and 2 samples, too few for a fourth
    samples = [(150.0 + 10 * i, 100.0 + i) for i in range(20)]
    assert slope_of_minutes(samples, every=10).points == 3
    assert slope_of_minutes(samples[:12], every=10).margin == float("inf")  # 2 minutes: no interval
