"""Report: a refused transaction is told once per distinct batch."""
from __future__ import annotations

from agent.errors import ApplyError
from agent.ops.report import Reporter


class _Sink:
    def __init__(self) -> None:
        self.sent: list[tuple[str, ...]] = []

    def warning(self, kind: str, name: str, uid: str, reason: str, message: str, api_version: str = "") -> None:
        self.sent.append((kind, name, reason, message))


def test_a_refused_transaction_gets_one_event_per_distinct_batch() -> None:
    sink = _Sink()
    reporter = Reporter(sink, "gw1")
    err = ApplyError(1, "Error: Could not process rule: File exists", "abc123abc123", 7)
    reporter.apply_failed(err)
    reporter.apply_failed(err)  # the retry of the same batch
    assert sink.sent == [("VpcNatGateway", "gw1", "ApplyFailed",
                          "nftables refused the transaction (digest abc123abc123, 7 commands): "
                          "Error: Could not process rule: File exists")]
    reporter.apply_succeeded()
    reporter.apply_failed(err)  # failing again after a success is news
    assert len(sink.sent) == 2
