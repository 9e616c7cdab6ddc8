"""The command line: what it refuses before doing anything."""
import pytest

from agent.cli import main


@pytest.mark.parametrize("table", ["nat-gw", "1natgw", "x" * 65, "natgw;"])
def test_a_table_name_nft_text_cannot_carry_is_refused_at_start(table, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--table", table, "show"])
    assert exit_.value.code == 2 and "--table" in capsys.readouterr().err


def test_health_exits_0_or_1_from_the_status_socket(tmp_path, capsys):
    from agent.kernel.caps import Capabilities
    from agent.ops.health import Health
    from agent.ops.status import StatusServer

    health = Health(60, 30)
    server = StatusServer(tmp_path / "agent.sock", health.answer(Capabilities()))
    try:
        assert main(["health", "--ready", "--state-dir", str(tmp_path)]) == 1  # no full sync yet
        assert main(["health", "--live", "--state-dir", str(tmp_path)]) == 0
        health.synced()
        assert main(["health", "--ready", "--state-dir", str(tmp_path)]) == 0
        health.problems.append("the CRD lacks spec.type")
        assert main(["health", "--ready", "--state-dir", str(tmp_path)]) == 1
    finally:
        server.close()
    assert main(["health", "--live", "--state-dir", str(tmp_path)]) == 1  # nobody answers
    assert "no answer" in capsys.readouterr().err


def test_a_missing_gateway_name_names_the_annotation_and_the_variable(monkeypatch, capsys, tmp_path):
    monkeypatch.delenv("GATEWAY_NAME", raising=False)
    assert main(["run", "--from-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "GATEWAY_NAME" in err and "ovn.kubernetes.io/vpc_nat_gw" in err


def test_the_supervisor_does_not_restart_a_worker_that_refuses_its_arguments(monkeypatch, tmp_path):
    from agent.deploy.supervise import supervise

    monkeypatch.delenv("GATEWAY_NAME", raising=False)
    assert supervise(["run", "--from-dir", str(tmp_path)]) == 2  # once, not in a loop


@pytest.mark.parametrize("version", ["1.0.6", "1.1.3"])
def test_diff_plans_with_the_running_agents_capabilities_as_its_syncs_do(version, monkeypatch, capsys, tmp_path,
                                                                         web_objects):
    import json

    from agent.kernel.caps import probe
    from agent.core.desired import ListCatalog
    from agent.ops.health import Health
    from agent.settings import Settings
    from agent.ops.status import StatusServer
    from tests.fakenft import FakeNft, edges, wired
    from tests.oracles import kept

    fake = FakeNft(version)
    caps = probe(*edges(fake), "ip", "natgw")  # as the running agent found them at its start
    monkeypatch.setattr("agent.run.oneshot.KernelView", lambda family, table, **_: fake.view(family, table))
    rules = tmp_path / "rules"
    rules.mkdir()
    (rules / "rules.json").write_text(json.dumps({"kind": "List", "items": web_objects}))
    server = StatusServer(tmp_path / "agent.sock", Health(60, 30).answer(caps))
    try:
        assert main(["diff", "--gateway", "gw1", "--from-dir", str(rules), "--state-dir", str(tmp_path)]) == 1
    finally:
        server.close()
    shown = json.loads(capsys.readouterr().out)["nftables"]
    wired(Settings(gateway="gw1", conntrack=False), *edges(fake), caps=caps).sync(ListCatalog(kept(web_objects)))
    maps = [c["add"]["map"]["map"] for c in shown if c.get("add", {}).get("map", {}).get("name", "").startswith("backend_")]
    if caps.json_concat_maps:  # nft 1.1: one JSON transaction, exactly the one the sync sent
        assert fake.batches[-1] == shown and fake.texts == []
        assert maps and all(m == ["ipv4_addr", "inet_service"] for m in maps)
    else:  # nft 1.0.6: the maps went as text first, the rest as the JSON transaction
        assert maps and all(m == "ipv4_addr . inet_service" for m in maps) and fake.texts
        assert fake.batches[-1] == [c for c in shown if c["add"].get("map", {}).get("map") not in maps]


def test_diff_plans_with_the_backends_the_running_agents_checks_have_down(monkeypatch, capsys, tmp_path, web_objects):
    """A backend the agent's checks took out is not a difference: the kernel holds what a
    sync with it down sends, checked as the agent's settings say, whatever flags diff got
    (a sid CI run's diff saw every backend taken out as a difference)."""
    import json

    from agent.core.desired import ListCatalog
    from agent.core.health import DEFAULT, dump
    from agent.core.model import Backend
    from agent.kernel.caps import probe
    from agent.ops.health import Health
    from agent.ops.status import StatusServer
    from agent.run.planner import CHECK_SETTINGS, reported
    from agent.settings import Settings
    from tests.fakenft import FakeNft, edges, wired
    from tests.oracles import kept

    fake = FakeNft("1.1.3")
    caps = probe(*edges(fake), "ip", "natgw")
    monkeypatch.setattr("agent.run.oneshot.KernelView", lambda family, table, **_: fake.view(family, table))
    rules = tmp_path / "rules"
    rules.mkdir()
    (rules / "rules.json").write_text(json.dumps({"kind": "List", "items": web_objects}))
    # The agent checks every 2 s (diff is given no such flag); web-b's backend is down.
    running = Settings(gateway="gw1", conntrack=False, health_interval=2.0)
    down = frozenset({(Backend("10.0.1.12", 8080), DEFAULT._replace(interval=2.0))})
    reconciler = wired(running, *edges(fake), caps=caps)
    assert reconciler.planner.set_down(down) == 0  # nothing rendered yet, nothing to re-render
    reconciler.sync(ListCatalog(kept(web_objects)))

    def diff(health: dict) -> int:
        server = StatusServer(tmp_path / "agent.sock", Health(60, 30).answer(caps, lambda: health))
        try:
            return main(["diff", "--gateway", "gw1", "--from-dir", str(rules), "--state-dir", str(tmp_path)])
        finally:
            server.close()

    status = {"targets": [], "down": dump(down), "settings": reported(running, CHECK_SETTINGS)}
    assert diff(status) == 0 and capsys.readouterr().out == ""
    assert diff({**status, "down": []}) == 1  # with b up, the sync would put it back
    assert "10.0.1.12" in capsys.readouterr().out
    assert diff({**status, "settings": {}}) == 1  # checked every second, b's check is not the one down
    capsys.readouterr()
    assert diff({**status, "down": [["10.0.1.12", "eighty"]]}) == 1
    assert "not a list of down targets" in capsys.readouterr().err
    assert diff({**status, "settings": {"health_rise": "two"}}) == 1
    assert "not the agent's settings" in capsys.readouterr().err


def test_diff_without_an_agent_or_a_private_namespace_says_so(monkeypatch, capsys, tmp_path):
    def no_unshare(table):
        raise RuntimeError("unshare: unshare failed: Operation not permitted")

    monkeypatch.setattr("agent.run.oneshot.probe_private", no_unshare)
    assert main(["diff", "--gateway", "gw1", "--from-dir", str(tmp_path), "--state-dir", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert "no agent answered" in err and "Operation not permitted" in err


def test_routable_once_this_pods_data_plane_was_programmed_whatever_comes_after(tmp_path, capsys):
    """An HA replica's readiness: not before its first full sync; then through API outages,
    CRD problems and worker restarts (a new Health over the same state directory), and with
    no agent answering at all (the worker restarting); a new pod (state directory) starts over."""
    from agent.ops.health import Health
    from agent.ops.status import PROGRAMMED

    def worker() -> Health:
        return Health(60, 30, programmed=tmp_path / PROGRAMMED)

    first = worker()
    assert main(["health", "--routable", "--state-dir", str(tmp_path)]) == 1  # a fresh replica: no traffic yet
    first.pending()
    first.synced()
    assert main(["health", "--routable", "--state-dir", str(tmp_path)]) == 0
    first.problems.append("cannot read the CRD")  # the API blinked: ready says no ...
    assert first.readyz()[0] is False
    assert main(["health", "--routable", "--state-dir", str(tmp_path)]) == 0  # ... routable stays
    second = worker()  # the worker restarted: no sync of its own yet
    assert second.readyz()[0] is False and main(["health", "--routable", "--state-dir", str(tmp_path)]) == 0
    assert main(["health", "--routable", "--state-dir", str(tmp_path / "new-pod")]) == 1
    assert "no full sync in this pod yet" in capsys.readouterr().out


def _subcommands():
    import argparse

    from agent.cli import _parser

    (sub,) = [a for a in _parser()._actions if isinstance(a, argparse._SubParsersAction)]
    return sub.choices  # name -> its parser


@pytest.mark.parametrize("argv", [["--help"], *([name, "--help"] for name in _subcommands()),
                                  ["supervise", "-h"], ["supervise", "cleanup", "--help"]],
                         ids=lambda argv: " ".join(argv))
def test_every_help_prints_what_the_command_does_and_returns(argv):
    """`--help` prints and exits 0, no worker started and restarted (`supervise --help` once ran
    the agent's help in a loop); the usage line names the command, the description follows it."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "agent.cli", *argv], capture_output=True, text=True, timeout=10)
    assert done.returncode == 0, done.stderr
    command = [a for a in argv if not a.startswith("-")][-1:]  # `supervise cleanup --help` is cleanup's
    assert done.stdout.startswith(" ".join(["usage: natgw-agent", *command]))
    parser = _subcommands()[command[0]] if command else __import__("agent.cli").cli._parser()
    assert parser.description and " ".join(parser.description.split()) in " ".join(done.stdout.split())
    assert "worker started" not in done.stderr


@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_natgw_supervise_help_says_what_it_does_and_starts_no_worker(flag):
    import subprocess
    import sys

    from agent.deploy.supervise import DESCRIPTION

    done = subprocess.run([sys.executable, "-m", "agent.deploy.supervise", flag], capture_output=True, text=True,
                          timeout=10)
    assert done.returncode == 0 and done.stdout.startswith("usage: natgw-supervise")
    assert DESCRIPTION in done.stdout and "worker's" in done.stdout and done.stderr == ""
