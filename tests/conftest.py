"""Unit tests (no root, no kernel): test-run settings and fixtures. Builders live in
tests/builders.py, fakes in tests/fakenft.py and tests/sources.py."""
from __future__ import annotations

import os
from typing import Any

import pytest
from hypothesis import settings as hypothesis_settings

from agent import log as logsetup
from tests.builders import web_objects as _web_objects

# CI replays the same examples on every run (they found their bugs here, with thousands
# of random runs); a developer's run keeps exploring.
hypothesis_settings.register_profile("ci", derandomize=True)
if os.environ.get("CI"):
    hypothesis_settings.load_profile("ci")

logsetup.configure("console", "info")  # the agent's level: no per-transaction debug dumps


@pytest.fixture
def web_objects() -> list[dict[str, Any]]:
    return _web_objects()
