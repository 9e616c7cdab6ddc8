"""Hostile files in the rules directory: poll() never raises, and a valid file beside a
hostile one still loads and signals its change."""
from __future__ import annotations

import os
import random
from pathlib import Path

import pytest
import yaml

from agent.sources.directory import DirectorySource
from agent.core.model import RULE_KIND, manifest
from tests.builders import eip, rule
from tests.hostile import GW
from tests.oracles import build_inventory

def _sorted_scandir(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make the directory's listing order deterministic (name order)."""
    real = os.scandir
    monkeypatch.setattr(os, "scandir", lambda path: sorted(real(path), key=lambda e: e.name))


HOSTILE_FILES: dict[str, bytes] = {
    "nested.yaml": b"[" * 50_000 + b"]" * 50_000,
    "nested.json": b"[" * 50_000 + b"]" * 50_000,
    "nested-map.yaml": "".join(" " * i + "a:\n" for i in range(3000)).encode(),
    "invalid-utf8.yaml": b"kind: IptablesDnatRule\nmetadata: {name: caf\xe9}\n",
    "binary.yaml": bytes(random.Random(7).randrange(256) for _ in range(65536)),
    "nan.json": b'{"kind": "IptablesDnatRule", "metadata": {"name": "nan-port"}, "spec": {"eip": "eip-web", '
                b'"type": "share", "protocol": "tcp", "externalPort": NaN, "internalIp": "10.0.1.11", '
                b'"internalPort": Infinity}}',
    "junk-list.yaml": yaml.safe_dump({"kind": "List", "items": [1, "x", None, [1, 2], {"kind": 5}, {"metadata": "x"},
                                                                {"kind": RULE_KIND}, {"kind": RULE_KIND, "metadata": {"name": 7}}]}).encode(),
    "python-tag.yaml": b"!!python/object/apply:os.system ['echo pwned']\n",
    "huge-int.yaml": b"kind: IptablesDnatRule\nmetadata: {name: huge}\nspec: {externalPort: " + b"9" * 5000 + b"}\n",
}


@pytest.mark.parametrize("name", list(HOSTILE_FILES))
def test_directory_source_poll_never_raises_on_a_hostile_file(tmp_path: Path, name: str,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """A valid file loaded in the same poll as a hostile one must not lose its change: the
    loop syncs only when poll() returns True."""
    _sorted_scandir(monkeypatch)
    valid = [eip("eip-web", "172.18.0.10"), rule("web-a", 80, "10.0.1.11")]
    (tmp_path / "a-valid.yaml").write_text("---\n".join(yaml.safe_dump(d) for d in valid))
    (tmp_path / f"z-{name}").write_bytes(HOSTILE_FILES[name])
    source = DirectorySource(tmp_path)
    changed, raised = False, []
    for _ in range(3):  # as run_loop does: `pending |= source.poll()`, an exception logged and skipped
        try:
            changed |= source.poll()
        except Exception as exc:
            raised.append(f"{type(exc).__name__}: {str(exc)[:80]}")
    assert source.objects()[: len(valid)] == [manifest(v) for v in valid]
    assert changed, f"the valid file was loaded but its change never signalled (poll raised {raised})"
    assert raised == [], "an unparseable file must be logged as such, not raise out of poll()"
    assert {(r.name, r.backend.ip) for r in build_inventory(source.objects(), GW).rules} == {("web-a", "10.0.1.11")}
