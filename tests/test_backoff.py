"""Capped exponential backoff with jitter."""
from __future__ import annotations

import random

from agent.backoff import Backoff


def test_backoff_doubles_with_jitter_up_to_its_cap() -> None:
    backoff = Backoff(0.5, 30.0, jitter=0.5, rng=random.Random(7))
    delays = [backoff.next() for _ in range(10)]
    bases = [0.5, 1, 2, 4, 8, 16, 30, 30, 30, 30]
    assert all(base * 0.5 <= d <= base for d, base in zip(delays, bases)), delays
    backoff.reset()
    assert 0.25 <= backoff.next() <= 0.5
