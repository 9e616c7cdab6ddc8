"""The command line: what it refuses before doing anything."""
import pytest

from agent.cli import main


@pytest.mark.parametrize("table", ["nat-gw", "1natgw", "x" * 65, "natgw;"])
def test_a_table_name_nft_text_cannot_carry_is_refused_at_start(table, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--table", table, "show"])
    assert exit_.value.code == 2 and "--table" in capsys.readouterr().err
