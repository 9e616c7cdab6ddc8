"""The command line: what it refuses before doing anything."""
import pytest

from agent.cli import main


@pytest.mark.parametrize("table", ["nat-gw", "1natgw", "x" * 65, "natgw;"])
def test_a_table_name_nft_text_cannot_carry_is_refused_at_start(table, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--table", table, "show"])
    assert exit_.value.code == 2 and "--table" in capsys.readouterr().err


def test_health_exits_0_or_1_from_the_status_socket(tmp_path, capsys):
    from agent.caps import Capabilities
    from agent.health import Health
    from agent.status import StatusServer

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
    from agent.supervise import supervise

    monkeypatch.delenv("GATEWAY_NAME", raising=False)
    assert supervise(["run", "--from-dir", str(tmp_path)]) == 2  # once, not in a loop
