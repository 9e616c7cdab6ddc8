"""Capped exponential backoff with jitter, shared by the apply retries and the watches."""
from __future__ import annotations

import random


class Backoff:
    """Delays that double from `first` up to `cap`, each jittered down by up to `jitter`
    (so many gateways retrying after one outage do not retry in step)."""

    def __init__(self, first: float, cap: float, jitter: float = 0.5, rng: random.Random | None = None) -> None:
        self.first = first
        self.cap = cap
        self.jitter = jitter
        self._rng = rng or random.Random()
        self._next = first

    def next(self) -> float:
        """The delay before the next attempt; each call doubles the one after."""
        base = self._next
        self._next = min(base * 2, self.cap)
        return base * (1 - self.jitter * self._rng.random())

    def reset(self) -> None:
        self._next = self.first
