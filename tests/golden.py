"""Golden files: rulesets/ holds the canonical outputs; UPDATE_GOLDEN=1 rewrites them when
a change is intended."""
from __future__ import annotations

import os
from pathlib import Path

UPDATE_GOLDEN = os.environ.get("UPDATE_GOLDEN") == "1"


def check_golden(path: Path, actual: str) -> None:
    if UPDATE_GOLDEN:
        path.write_text(actual)
    assert path.exists(), f"golden file {path} missing: run with UPDATE_GOLDEN=1"
    assert actual == path.read_text(), f"{path.name} differs from the golden file (UPDATE_GOLDEN=1 to accept)"
