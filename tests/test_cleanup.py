"""The cleanup worker (agent/run/cleanup.py), run a round at a time: conntrack by state on a
fake flow table, and stale affinity entries through the reconciler on the fake nft edge,
slot reuse included. The kernel's side is in netns-tests/test_flows_kernel.py."""
from __future__ import annotations

from typing import Any, Iterable, Sequence

from agent.kernel.caps import UNPROBED, Capabilities
from agent.run.cleanup import Cleanup
from agent.core.flows import Flow, Query
from agent.core.model import Backend, Identity
from agent.run.reconcile import Reconciler
from agent.settings import Settings
from tests.builders import eip, rule
from tests.fakenft import FakeNft, edges, wired
from tests.sources import Store

TCP, UDP = 6, 17
EIP = "172.18.0.10"
DNS, WEB = Identity(EIP, 53, "udp"), Identity(EIP, 80, "tcp")
A, B = Backend("10.0.1.11", 5353), Backend("10.0.1.12", 5353)


class FlowTable:
    """Conntrack as a list of flows; `fail` makes the next calls raise as a netlink error would."""

    def __init__(self, flows: Iterable[Flow]) -> None:
        self.flows_ = list(flows)
        self.fail = 0
        self.queries: list[Query] = []

    def flows(self, query: Query) -> list[Flow]:
        if self.fail:
            self.fail -= 1
            raise OSError(105, "injected: no buffer space")
        self.queries.append(query)
        return [f for f in self.flows_ if f.dst == query.eip and f.proto == query.proto
                and query.port in (None, f.dport)]

    def delete(self, flows: Sequence[Flow]) -> int:
        gone = [f for f in flows if f in self.flows_]
        self.flows_ = [f for f in self.flows_ if f not in flows]
        return len(gone)


def flow(client: int, identity: Identity, backend: Backend | None) -> Flow:
    proto = {"tcp": TCP, "udp": UDP}[identity.proto]
    src, sport = (backend.ip, backend.port) if backend else (identity.eip, identity.port)
    return Flow(proto, f"172.18.0.{100 + client}", 40000 + client, identity.eip, identity.port, src, sport, client)


class NoPins:
    def entries(self, name: str) -> list[Any]:
        return []


def worker(table: FlowTable, serving: dict[Identity, tuple[Backend, ...]]) -> Cleanup:
    return Cleanup(serving.get, lambda: table, NoPins)  # type: ignore[arg-type]


def test_udp_flows_not_natted_to_a_backend_of_now_go_and_tcp_flows_stay() -> None:
    natted_a, natted_b, before = flow(1, DNS, A), flow(2, DNS, B), flow(3, DNS, None)
    tcp_to_b = flow(4, WEB, B)
    table = FlowTable([natted_a, natted_b, before, tcp_to_b])
    cleanup = worker(table, {DNS: (A,), WEB: (A,)})
    cleanup.note([DNS, WEB], [], {})
    cleanup.run_once()
    assert table.flows_ == [natted_a, tcp_to_b]  # B left DNS; the sender from before DNS existed goes too
    assert table.queries == [Query(EIP, UDP, 53)]  # no dump for a surviving TCP identity


def test_every_flow_of_an_identity_that_went_goes_and_no_other() -> None:
    other_port, other_eip = Identity(EIP, 81, "tcp"), Identity("172.18.0.11", 80, "tcp")
    kept = [flow(1, other_port, A), flow(2, other_eip, A)]
    table = FlowTable([flow(3, WEB, A), flow(4, WEB, None), *kept])
    cleanup = worker(table, {})
    cleanup.note([], [WEB], {})
    cleanup.run_once()
    assert table.flows_ == kept


def test_an_identity_that_came_back_before_the_pass_keeps_its_flows() -> None:
    table = FlowTable([flow(1, WEB, A)])
    cleanup = worker(table, {WEB: (A,)})  # served again by the time the worker looks
    cleanup.note([], [WEB], {})
    cleanup.run_once()
    assert len(table.flows_) == 1


def test_a_failed_pass_keeps_its_work_and_the_next_round_does_it() -> None:
    table = FlowTable([flow(1, WEB, A), flow(2, DNS, None)])
    cleanup = worker(table, {DNS: (A,)})
    cleanup.note([DNS], [WEB], {})
    table.fail = 1
    cleanup.run_once()
    assert len(table.flows_) == 2 and cleanup.pending()
    cleanup.run_once()
    assert table.flows_ == [] and not cleanup.pending()


# --- affinity entries and slots, through the reconciler on the fake ----------------------

APP = ("172.18.0.10", "tcp", 443)
PIN_A, PIN_A2, PIN_OTHER = ("192.168.0.1", *APP), ("192.168.0.2", *APP), ("192.168.0.3", "172.18.0.10", "tcp", 444)
SETTINGS = Settings(gateway="gw1", conntrack=False, retire_delay=0.0, cleanup_slice=2)


def sticky_world(version: str = "1.0.6", caps: Any = UNPROBED) -> tuple[FakeNft, Reconciler, Store]:
    """:443 ClientIP over .11 (slot 0) and .12 (slot 1); :444 ClientIP over .11 (slot 0)."""
    fake, store = FakeNft(version), Store()
    store.put(eip("eip-web", "172.18.0.10"))
    for name, port, ip in (("app-a", 443, "10.0.1.11"), ("app-b", 443, "10.0.1.12"), ("other", 444, "10.0.1.11")):
        store.put(rule(name, port, ip, 9090, affinity="ClientIP", timeout=600))
    reconciler = wired(SETTINGS, *edges(fake), caps=caps)
    reconciler.sync(store, None)
    store.take()
    for key in (PIN_A, PIN_A2, PIN_OTHER):
        fake.pin("natgw", "aff_0", key)  # clients the data path pinned to .11
    return fake, reconciler, store


def slots(reconciler: Reconciler, port: int) -> dict[str, int]:
    from agent.core.layout import slots_of

    assert reconciler.mirror is not None
    return {b.ip: s for b, s in slots_of(reconciler.mirror)[Identity("172.18.0.10", port, "tcp")].items()}


def test_a_replaced_backend_leaves_its_slot_blocked_until_its_clients_pins_are_gone() -> None:
    fake, reconciler, store = sticky_world()
    store.put(rule("app-a", 443, "10.0.1.13", 9090, affinity="ClientIP", timeout=600))  # .11 -> .13 in one change
    reconciler.sync(store, store.take())
    assert slots(reconciler, 443) == {"10.0.1.12": 1, "10.0.1.13": 2}  # not slot 0: .11's clients are pinned there
    assert reconciler.cleanup.blocked == {Identity("172.18.0.10", 443, "tcp"): {0}}
    fresh = ("192.168.0.9", *APP)
    fake.pin("natgw", "aff_2", fresh)  # the newcomer's first client
    reconciler.cleanup.run_once()
    batches = len(fake.batches)
    assert reconciler.clean_affinity() == 2  # PIN_A, PIN_A2: one slice of cleanup_slice=2 entries
    assert len(fake.batches) == batches + 1
    assert fake.entries("natgw", "aff_0") == {PIN_OTHER}  # the other identity's client stays pinned
    assert fresh in fake.entries("natgw", "aff_2")  # the newcomer's pins are never touched
    assert reconciler.cleanup.blocked == {}
    store.put(rule("app-d", 443, "10.0.1.14", 9090, affinity="ClientIP", timeout=600))
    reconciler.sync(store, store.take())
    assert slots(reconciler, 443)["10.0.1.14"] == 0  # free again once its old pins are gone


def test_stale_pins_go_a_slice_per_turn_and_the_slot_unblocks_after_the_last() -> None:
    fake, reconciler, store = sticky_world()
    for n in range(3):
        fake.pin("natgw", "aff_0", (f"192.168.1.{n}", *APP))  # five of :443's clients on .11 now
    store.drop("IptablesDnatRule", "app-a")
    reconciler.sync(store, store.take())
    reconciler.cleanup.run_once()
    deleted = []
    while (n := reconciler.clean_affinity()) or reconciler.cleanup.has_slice():
        deleted.append(n)
        if reconciler.cleanup.has_slice():
            assert reconciler.cleanup.blocked  # not before the last slice
    assert deleted == [2, 2, 1] and reconciler.cleanup.blocked == {}
    assert fake.entries("natgw", "aff_0") == {PIN_OTHER}


def test_a_refused_delete_reads_what_remains_and_deletes_it() -> None:
    fake, reconciler, store = sticky_world()
    store.drop("IptablesDnatRule", "app-a")
    reconciler.sync(store, store.take())
    reconciler.cleanup.run_once()
    del fake.tables[("ip", "natgw")].sets["aff_0"].elems[PIN_A2]  # expired after it was read
    batches = len(fake.batches)
    assert reconciler.clean_affinity() == 0  # refused: one entry in it no longer exists (1.0.6: no destroy)
    assert reconciler.cleanup.blocked  # still blocked
    reconciler.cleanup.run_once()  # what remains, read again
    assert reconciler.clean_affinity() == 1
    assert len(fake.batches) == batches + 1  # the refused one committed nothing, the retry one transaction
    assert fake.entries("natgw", "aff_0") == {PIN_OTHER} and reconciler.cleanup.blocked == {}


def test_with_destroy_an_expired_entry_fails_nothing() -> None:
    fake, reconciler, store = sticky_world("1.1.3", Capabilities(destroy=True, json_concat_maps=True))
    store.drop("IptablesDnatRule", "app-a")
    reconciler.sync(store, store.take())
    reconciler.cleanup.run_once()
    del fake.tables[("ip", "natgw")].sets["aff_0"].elems[PIN_A2]
    assert reconciler.clean_affinity() == 2 and fake.entries("natgw", "aff_0") == {PIN_OTHER}
    assert reconciler.cleanup.blocked == {}


def test_a_bug_in_a_pass_keeps_its_work_pending_and_never_raises() -> None:
    class Broken(FlowTable):
        def flows(self, query: Query) -> list[Flow]:
            raise KeyError("a bug")

    table = Broken([flow(1, WEB, A)])
    cleanup = worker(table, {})
    cleanup.note([], [WEB], {0: {("172.18.0.10", "tcp", 443)}})
    cleanup.run_once()  # logged, not raised; the affinity part still ran
    assert cleanup.pending() and cleanup.has_slice()
    assert cleanup._retry_at > 0  # retried later, not at once
