"""The fake's answers are the kernel's: tests/fakenft_cases.py against libnftables and the
kernel in a fresh namespace."""
from __future__ import annotations

from gwtest import report_of, script_in_fresh_namespace
from tests.fakenft_cases import CASES, OK


def test_the_kernel_answers_every_case_as_the_fake_does() -> None:
    results = report_of(script_in_fresh_namespace("ngwfake", "fakenft_cases.py"))
    for case, (_, expected) in CASES.items():
        rc, err, unchanged = results[case]
        if expected == OK:
            assert rc == 0, (case, err)
        else:
            texts = expected if isinstance(expected, tuple) else (expected,)
            assert rc != 0 and any(t in err for t in texts) and unchanged, (case, err)
