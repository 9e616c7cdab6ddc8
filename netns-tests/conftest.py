"""Network-namespace tests: real kernel nftables, real conntrack, real traffic.

They need root and the kernel's nf_tables; when that is missing the run fails loudly
(never a skip counted as a pass)."""
from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Iterator

import pytest

from lab.topology import Lab, cleanup_stale
from gwtest import Agent, run_agent


def pytest_sessionstart(session: pytest.Session) -> None:
    problems = []
    if os.geteuid() != 0:
        problems.append("not root")
    for tool in ("ip", "nft", "conntrack"):
        if shutil.which(tool) is None:
            problems.append(f"{tool} not installed")
    if problems:
        pytest.exit("netns tests cannot run: " + ", ".join(problems), returncode=3)
    cleanup_stale()


@pytest.fixture
def lab() -> Iterator[Lab]:
    with Lab() as built:
        yield built


@pytest.fixture
def agent(lab: Lab, tmp_path: Path) -> Iterator[Agent]:
    rules = tmp_path / "rules"
    rules.mkdir()
    yield from run_agent(Agent(lab, rules, tmp_path / "agent.log"))
