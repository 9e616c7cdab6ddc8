"""Run inside a fresh network namespace: every case of tests/fakenft_cases.py against the
kernel through libnftables, each on a fresh table. Prints one JSON line: case -> [rc,
error, table unchanged after a refusal]."""
from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import nftables  # noqa: E402

from tests.fakenft_cases import CASES, SETUP  # noqa: E402


def main() -> None:
    nft = nftables.Nftables()
    nft.set_json_output(True)
    nft.set_handle_output(False)

    def listing() -> str:
        return nft.cmd("list table ip t")[1]

    results = {}
    for case, (commands, _) in CASES.items():
        rc, _, err = nft.json_cmd({"nftables": SETUP})
        assert rc == 0, err
        before = listing()
        rc, _, err = nft.json_cmd({"nftables": commands})
        results[case] = [rc, err.strip(), listing() == before]
        nft.cmd("delete table ip t")
    print(json.dumps(results))


if __name__ == "__main__":
    main()
