"""Golden files: rulesets/ holds the canonical outputs; UPDATE_GOLDEN=1 rewrites them when
a change is intended."""
from __future__ import annotations

import os
import re
from pathlib import Path

UPDATE_GOLDEN = os.environ.get("UPDATE_GOLDEN") == "1"


def check_golden(path: Path, actual: str) -> None:
    if UPDATE_GOLDEN:
        path.write_text(actual)
    assert path.exists(), f"golden file {path} missing: run with UPDATE_GOLDEN=1"
    assert actual == path.read_text(), f"{path.name} differs from the golden file (UPDATE_GOLDEN=1 to accept)"


_ELEMENTS = re.compile(r"elements = \{(.*?)\s*\}", re.S)


def _top_level(text: str, sep: str = ",") -> list[str]:
    """`text` split at `sep` outside double quotes (comments hold commas)."""
    parts, start, quoted = [], 0, False
    for i, c in enumerate(text):
        if c == '"':
            quoted = not quoted
        elif c == sep and not quoted:
            parts.append(text[start:i])
            start = i + 1
    return [*parts, text[start:]]


def nft_text_by_meaning(listing: str) -> str:
    """An `nft list` text with each set's or map's elements sorted and one per line: nft
    1.1.7 prints a map's elements in another order than 1.0.6 and 1.1.3, meaning the same."""
    return _ELEMENTS.sub(lambda m: "elements = {\n" + ",\n".join(sorted(
        " ".join(e.split()) for e in _top_level(m.group(1)))) + " }", listing)
