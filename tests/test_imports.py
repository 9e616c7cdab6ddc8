"""Import contracts by package (kopf's import-linter idea, by reading the source): the wings
are layered and the wings of one layer independent; the pure core imports no I/O library,
directly or through another agent module; the reconciler reaches none of the loop's wiring;
the supervisor (the container's PID 1) reaches the standard library only, and its entry
point loads no other agent module; nothing the agent ships imports the lab. Each contract
has a twin showing it can fail."""
from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

from tests.builders import ROOT

AGENT = ROOT / "agent"
PURE = tuple(f"core.{p.stem}" for p in sorted((AGENT / "core").glob("*.py")) if p.stem != "__init__")
IO = {"nftables", "pyroute2", "subprocess", "socket", "threading", "kubernetes", "prometheus_client", "structlog",
      "ctypes", "os", "http", "urllib3", "yaml"}
# The loop's own wiring (issue 10): one sync knows nothing of health, metrics or retries.
LOOP_WIRING = {"ops.health", "ops.metrics", "backoff", "run.loop", "run.schedule"}


def imports_of(path: Path) -> set[str]:
    """Every module a file imports, at the top or inside a function (absolute names)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


def closure(module: str) -> set[str]:
    """What an agent module imports, through every agent module it imports."""
    return _walk(module)[1]


def agent_modules(module: str) -> set[str]:
    """The agent modules a module reaches (itself included), directly or through others."""
    return _walk(module)[0]


def path_of(module: str) -> Path:
    return AGENT / (module.replace(".", "/") + ".py")


def module_of(dotted: str) -> str:
    """The agent module a dotted name (module, or module.attribute) is in, "" if none."""
    parts = dotted.split(".")
    for n in range(len(parts), 0, -1):
        if path_of(".".join(parts[:n])).exists():
            return ".".join(parts[:n])
    return ""


def _walk(module: str) -> tuple[set[str], set[str]]:
    """(agent modules reached, other top-level packages imported) from one agent module."""
    seen: set[str] = set()
    todo, external = [module], set()
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        for imported in imports_of(path_of(name)):
            top, _, rest = imported.partition(".")
            if top == "agent" and rest and module_of(rest):
                todo.append(module_of(rest))
            elif top != "agent":
                external.add(top)
    return seen, external


@pytest.mark.parametrize("module", PURE)
def test_the_pure_core_imports_no_io(module: str) -> None:
    assert closure(module) & IO == set(), f"{path_of(module)} reaches I/O: {sorted(closure(module) & IO)}"


# Top to bottom; a module may import its own wing and the layers below, never a layer above
# nor another wing of its own layer. Leaves are wings of one module each.
LAYERS = (("cli",), ("run", "deploy"), ("ops",), ("kernel", "sources", "health"), ("core",),
          ("settings", "errors", "backoff", "log", "memory"))
RANK = {wing: n for n, layer in enumerate(LAYERS) for wing in layer}


def every_module() -> list[str]:
    """Every module of the agent, dotted below `agent` (packages' __init__ left out)."""
    return sorted(".".join(p.relative_to(AGENT).with_suffix("").parts) for p in AGENT.rglob("*.py")
                  if p.stem != "__init__")


def import_graph() -> dict[str, set[str]]:
    """Each agent module's direct imports of other agent modules."""
    return {m: {module_of(i.partition(".")[2]) for i in imports_of(path_of(m)) if i.startswith("agent.")} - {""}
            for m in every_module()}


def layering_violations(graph: dict[str, set[str]]) -> list[str]:
    found = []
    for module, imported in sorted(graph.items()):
        wing = module.split(".")[0]
        for other in sorted(imported):
            theirs = other.split(".")[0]
            if theirs != wing and RANK[theirs] <= RANK[wing]:
                why = "the same layer" if RANK[theirs] == RANK[wing] else "a layer above"
                found.append(f"agent.{module} imports agent.{other}: {why}")
    return found


def test_every_module_is_in_a_wing_of_the_layers() -> None:
    assert {m.split(".")[0] for m in every_module()} <= set(RANK)


def test_the_wings_are_layered_and_a_layers_wings_independent() -> None:
    assert layering_violations(import_graph()) == []


def test_the_layering_contract_can_fail() -> None:
    graph = import_graph()
    assert "core.plan" in graph["run.reconcile"] or "core.render" in graph["run.reconcile"]  # the graph is read
    assert layering_violations({"core.model": {"kernel.nft"}}) == [
        "agent.core.model imports agent.kernel.nft: a layer above"]
    assert layering_violations({"kernel.view": {"sources.kube"}, "run.loop": {"deploy.inject"}}) == [
        "agent.kernel.view imports agent.sources.kube: the same layer",
        "agent.run.loop imports agent.deploy.inject: the same layer"]


def test_the_supervisor_reaches_the_standard_library_only() -> None:
    reached, external = _walk("deploy.supervise")
    assert reached == {"deploy.supervise"}
    assert external - set(sys.stdlib_module_names) - {"__future__"} == set()


def test_the_supervisor_contract_can_fail() -> None:
    assert _walk("cli")[1] - set(sys.stdlib_module_names) >= {"structlog"}


def _agent_loaded(code: str) -> tuple[set[str], set[str]]:
    """(agent modules, modules from outside the standard library) a fresh interpreter loads
    for `code`, beyond what it loads for nothing (site's own hooks)."""
    extra = _fresh(code) - _fresh("pass")
    return ({m for m in extra if m.split(".")[0] == "agent"},
            {m for m in extra if m.split(".")[0] not in sys.stdlib_module_names and m.split(".")[0] != "agent"})


def test_the_containers_pid_1_starts_through_an_entry_point_that_loads_only_the_supervisor() -> None:
    import tomllib

    from agent.deploy.inject import Options, agent_container

    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    command = agent_container(Options(image="x"))["command"][0]
    module, _, function = scripts[command].partition(":")
    assert (module, function) == ("agent.deploy.supervise", "main")
    assert _agent_loaded(f"from {module} import {function}") == ({"agent", "agent.deploy", "agent.deploy.supervise"}, set())


def test_the_pid_1_contract_can_fail() -> None:
    agent, outside = _agent_loaded("from agent.cli import main")
    assert "agent.settings" in agent and "structlog" in outside


def test_the_contract_can_fail() -> None:
    assert {"nftables", "socket", "subprocess"} <= closure("kernel.nft") | closure("kernel.view") | closure("kernel.ctnetlink")  # the edges do


def test_the_reconciler_reaches_none_of_the_loops_wiring() -> None:
    reached = agent_modules("run.reconcile")
    assert "kernel.nftread" in reached  # through agent/kernel/view.py: the walk follows the agent, not only its own imports
    assert reached & LOOP_WIRING == set(), f"agent/run/reconcile.py reaches {sorted(reached & LOOP_WIRING)}"


def test_the_reconciler_contract_can_fail() -> None:
    assert LOOP_WIRING <= agent_modules("cli")  # the entry point does (backoff only through the loop)


def test_nothing_the_agent_ships_imports_the_lab() -> None:
    for path in sorted(AGENT.rglob("*.py")):
        assert not any(m == "lab" or m.startswith("lab.") for m in imports_of(path)), path.name


def _fresh(code: str, env: dict[str, str] | None = None) -> set[str]:
    """The modules a fresh interpreter holds after running `code`."""
    import json
    import os
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", code + "\nimport sys, json; print(json.dumps(sorted(sys.modules)))"],
                         capture_output=True, text=True, cwd=ROOT, env={**os.environ, **(env or {})}, timeout=60)
    assert out.returncode == 0, out.stderr
    return set(json.loads(out.stdout.splitlines()[-1]))


# Parts of the kubernetes package the agent never uses, and the heavy libraries they pull in
# (kubeapi.py: 6 MB of the agent's memory at 10,000 identities).
UNUSED_KUBERNETES = {"kubernetes.dynamic", "kubernetes.stream", "kubernetes.utils.create_from_yaml", "kubernetes.leaderelection",
                     "kubernetes.informer", "kubernetes.config.kube_config", "kubernetes.client.api.custom_objects_api",
                     "requests", "oauthlib", "websocket"}


def test_the_directory_path_loads_neither_kubernetes_nor_yaml_before_it_needs_them() -> None:
    loaded = _fresh("import agent.cli")
    assert not {m for m in loaded if m.split(".")[0] in ("kubernetes", "yaml", "pydantic")}


def test_the_pod_path_loads_only_the_parts_of_the_kubernetes_client_it_uses(tmp_path: Path) -> None:
    (tmp_path / "token").write_text("t0ken")
    (tmp_path / "ca.crt").write_text("-----BEGIN CERTIFICATE-----\n")  # read as a path, not parsed here
    loaded = _fresh(f"import agent.cli, agent.sources.kube, agent.sources.events\n"
                    f"from pathlib import Path\n"
                    f"from agent.sources.kubeapi import api_client\n"
                    f"api_client(None, Path({str(tmp_path)!r}))",
                    {"KUBERNETES_SERVICE_HOST": "10.96.0.1", "KUBERNETES_SERVICE_PORT": "443"})
    assert {"kubernetes.client.api_client", "kubernetes.watch.watch", "kubernetes.config.incluster_config"} <= loaded
    assert loaded & UNUSED_KUBERNETES == set()
