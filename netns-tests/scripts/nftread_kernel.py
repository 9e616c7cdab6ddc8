"""Run inside a network namespace (child of netns-tests/test_nftread_kernel.py): the
agent's own netlink read-back against the real kernel. Prints one JSON line.

    examples          program examples/ through the agent; read_table vs libnftables' listing vs render
    program N         program N identities x 4 backends (bench/identities.py) through the agent
    quiet N           read_table of that table vs Nft.read() vs render
    churn N           read_table while a neighbour table commits every 100 ms, vs a quiet
                      read; a subscriber's view of the neighbour's and of our own commits
    interrupt N       read_table with a commit forced into the middle of a dump: of another
                      table during the chain dump (which spans every chain of the family, so
                      the kernel flags it NLM_F_DUMP_INTR; the pass is kept), and of this
                      table during an element dump (the kernel flags no element dump; the
                      generation and the notifications tell, and it reads again)
    measure N         timings only (read_table quiet and under churn, draining the
                      neighbour's notifications for 10 s, decoding one notification)"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from agent import log  # noqa: E402
from agent.kernel import nfnetlink as nl  # noqa: E402
from agent.kernel import nftread  # noqa: E402
from agent.kernel import nftuapi as uapi  # noqa: E402
from agent.sources.directory import DirectorySource  # noqa: E402
from agent.run.daemon import connected  # noqa: E402
from agent.core.ruleset import EMPTY, Ruleset  # noqa: E402
from agent.settings import Settings  # noqa: E402
from tests.nftnotify import Decoder  # noqa: E402
from bench import identities as ids  # noqa: E402
from tests.oracles import build_inventory, desired_services, from_listing, render  # noqa: E402

SETTINGS = Settings(gateway="gw1", conntrack=False)
# The neighbour: another table in the namespace, one commit every ~100 ms.
NEIGHBOUR = ("nft add table ip other; nft add set ip other s '{ type inet_service; }'; "
             "while :; do nft add element ip other s '{ 1 }'; sleep 0.1; "
             "nft delete element ip other s '{ 1 }'; sleep 0.1; done")


def objects_for(directory: Path) -> list[Any]:
    source = DirectorySource(directory)
    source.poll()
    return source.objects()


def rendered(objects: list[Any]) -> Ruleset:
    services = desired_services(build_inventory(objects, SETTINGS.gateway).rules, SETTINGS.max_backends).services
    return render(services, EMPTY, SETTINGS.affinity_set_size, SETTINGS.priority)


def scale_objects(n: int) -> list[Any]:
    with tempfile.TemporaryDirectory() as d:
        ids.write_manifests(Path(d), ids.identities(n, affinity=False))
        return objects_for(Path(d))


def diff(a: Ruleset, b: Ruleset) -> dict[str, Any]:
    """Where two rulesets differ (names only; for the failure message)."""
    out: dict[str, Any] = {}
    for part in ("sets", "chains", "rules", "elements"):
        x, y = getattr(a, part), getattr(b, part)
        names = sorted(n for n in set(x) | set(y) if x.get(n) != y.get(n))
        if names:
            out[part] = names[:10]
    return out


def timed(call: Any) -> tuple[Any, float]:
    t0 = time.perf_counter()
    value = call()
    return value, time.perf_counter() - t0


def libnftables_read() -> Ruleset | None:
    """The table through libnftables' JSON listing (what the agent read before its own
    netlink view), parsed in nft 1.0.6's form: the oracle on 1.0.6."""
    import nftables

    ctx = nftables.Nftables()
    ctx.set_json_output(True)
    rc, out, err = ctx.cmd("list table ip natgw")
    return from_listing(json.loads(out)) if rc == 0 else None


def nft_version() -> str:
    return subprocess.run(["nft", "--version"], capture_output=True, text=True, check=True).stdout.split()[1].lstrip("v")


def compare(state: nftread.TableState, objects: list[Any]) -> dict[str, Any]:
    listing, listing_s = timed(lambda: libnftables_read())
    want = rendered(objects)
    got = state.ruleset()
    return {"nft_version": nft_version(), "equals_nft_read": got == listing, "equals_rendered": got == want,
            "listing_s": listing_s,
            "diff_nft_read": diff(got, listing) if listing is not None else "no table",
            "diff_rendered": diff(got, want), "elements": sum(len(e) for e in got.elements.values())}


class Neighbour:
    """The 100 ms neighbour, in a process group of its own (ended by its id)."""

    def __enter__(self) -> Neighbour:
        self.proc = subprocess.Popen(["bash", "-c", NEIGHBOUR], start_new_session=True,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        return self

    def __exit__(self, *_exc: object) -> None:
        os.killpg(self.proc.pid, signal.SIGTERM)
        self.proc.wait(timeout=5)


def wait_commits(sub: nl.Subscriber, count: int, timeout: float = 10.0) -> list[nl.Message]:
    """The notifications until `count` NEWGENs came."""
    got: list[nl.Message] = []
    deadline = time.monotonic() + timeout
    while sum(m.msg == uapi.NFT_MSG_NEWGEN for m in got) < count and time.monotonic() < deadline:
        sub.wait(0.2)
        got += sub.drain().messages
    return got


def examples() -> dict[str, Any]:
    objects = objects_for(ROOT / "examples")
    connected(SETTINGS).sync(objects)
    state, seconds = timed(lambda: nftread.read_table("ip", "natgw"))
    assert state is not None
    report = compare(state, objects)
    report["read_s"] = seconds
    report["absent_is_none"] = nftread.read_table("ip", "nosuchtable") is None
    report["read_set_aff_0"] = nftread.read_set("ip", "natgw", "aff_0") == []
    report["read_set_missing"] = nftread.read_set("ip", "natgw", "nosuchset") is None
    return report


def program(n: int) -> dict[str, Any]:
    objects = scale_objects(n)
    _, seconds = timed(lambda: connected(SETTINGS).sync(objects))
    return {"sync_s": seconds}


def quiet(n: int) -> dict[str, Any]:
    objects = scale_objects(n)
    state, seconds = timed(lambda: nftread.read_table("ip", "natgw"))
    assert state is not None
    report = compare(state, objects)
    report.update({"read_s": seconds, "attempts": state.attempts})
    return report


def churn(n: int) -> dict[str, Any]:
    objects = scale_objects(n)
    before = nftread.read_table("ip", "natgw")
    assert before is not None
    report: dict[str, Any] = {}
    with nl.Subscriber() as watcher, Neighbour():
        seen = wait_commits(watcher, 3)
        with nl.NfSocket() as sock:
            gen0 = nftread.generation(sock)
            state, seconds = timed(lambda: nftread.read_table("ip", "natgw", sock=sock))
            gen1 = nftread.generation(sock)
        assert state is not None
        report.update({"read_s": seconds, "attempts": state.attempts, "interrupted": state.interrupted,
                       "generations_during_read": (gen1 - gen0) & 0xFFFFFFFF,
                       "equals_quiet": state == before, "equals_rendered": state.ruleset() == rendered(objects),
                       "diff_quiet": diff(state.ruleset(), before.ruleset())})
        seen += watcher.drain().messages
        dec = Decoder()
        neighbour = [c for c in map(dec.decode, seen) if c.table == "other"]
        own = nl.own_portids()
        report["neighbour_messages"] = len(neighbour)
        report["neighbour_portids_foreign"] = bool(neighbour) and all(c.portid not in own for c in neighbour)
        # a commit through the Python binding, in this process
        import nftables

        ctx = nftables.Nftables()
        rc, _out, err = ctx.cmd("add table ip x")
        assert rc == 0, err
        own = nl.own_portids()  # libnftables opened its socket with its first command
        mine = [c for c in map(dec.decode, wait_commits(watcher, 1) + watcher.drain().messages) if c.table == "x"]
        ctx.cmd("delete table ip x")
        report["own_messages"] = len(mine)
        report["own_portid_is_ours"] = bool(mine) and all(c.portid in own for c in mine)
    return report


class _CommitMidDump(nl.NfSocket):
    """A socket that runs `commit` once, after the first message of the first dump of
    type `during`."""

    def __init__(self, during: int, commit: Any) -> None:
        super().__init__()
        self.during = during
        self.commit = commit

    def dump(self, msg: int, family: int, attrs: Any = (), flags: int = 0, timeout: float | None = None) -> Any:
        inner = super().dump(msg, family, attrs, flags, timeout)
        if msg != self.during or self.commit is None:
            return inner
        commit, self.commit = self.commit, None

        class Wrapped:
            interrupted = False

            def __iter__(self) -> Any:
                for i, m in enumerate(inner):
                    yield m
                    if i == 0:
                        commit()
                self.interrupted = inner.interrupted

        return Wrapped()


def interrupt(n: int) -> dict[str, Any]:
    import nftables

    ctx = nftables.Nftables()

    def run(text: str) -> None:
        rc, _out, err = ctx.cmd(text)
        assert rc == 0, err

    # another table with enough chains that the family's chain dump takes several datagrams
    run("add table ip other; add set ip other s { type inet_service; }\n"
        + "\n".join(f"add chain ip other c{i}" for i in range(2000)))
    before = nftread.read_table("ip", "natgw")
    assert before is not None
    report: dict[str, Any] = {}
    with _CommitMidDump(uapi.NFT_MSG_GETCHAIN, lambda: run("add element ip other s { 7 }")) as sock:
        state = nftread.read_table("ip", "natgw", sock=sock)
    assert state is not None
    report["other_table"] = {"attempts": state.attempts, "interrupted": state.interrupted, "equals": state == before}
    key = ("172.18.9.9", "tcp", 9)
    with _CommitMidDump(uapi.NFT_MSG_GETSETELEM,
                        lambda: run("add element ip natgw services { 172.18.9.9 . tcp . 9 : goto lb_n4 }")) as sock:
        state = nftread.read_table("ip", "natgw", sock=sock)
    assert state is not None
    report["own_table"] = {"attempts": state.attempts, "has_new_element": key in state.elements["services"],
                           "equals_a_fresh_read": state == nftread.read_table("ip", "natgw")}
    run("delete element ip natgw services { 172.18.9.9 . tcp . 9 }; delete table ip other")
    # A set deleted after the set dump listed it, before its element dump (a sync during
    # `show`): that dump's ENOENT is a change, read again.
    run("add set ip natgw gone { type inet_service; }")
    with _CommitMidDump(uapi.NFT_MSG_GETSETELEM, lambda: run("delete set ip natgw gone")) as sock:
        state = nftread.read_table("ip", "natgw", sock=sock)
    assert state is not None
    report["set_gone"] = {"attempts": state.attempts, "has_set": "gone" in state.sets,
                          "equals_a_fresh_read": state == nftread.read_table("ip", "natgw")}
    return report


def measure(n: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    quiet_s = []
    for _ in range(5):
        _, s = timed(lambda: nftread.read_table("ip", "natgw"))
        quiet_s.append(s)
    out["quiet_read_s"] = quiet_s
    _, out["quiet_read_no_elements_s"] = timed(lambda: nftread.read_table("ip", "natgw", elements=False))
    _, out["read_set_services_s"] = timed(lambda: nftread.read_set("ip", "natgw", "services"))
    _, out["nft_read_s"] = timed(lambda: libnftables_read())
    with Neighbour(), nl.Subscriber() as sub:
        wait_commits(sub, 2)
        churn_s, attempts = [], []
        for _ in range(5):
            st, s = timed(lambda: nftread.read_table("ip", "natgw"))
            churn_s.append(s)
            attempts.append((st.attempts, st.interrupted))  # type: ignore[union-attr]
        out["churn_read_s"] = churn_s
        out["churn_attempts_interrupted"] = attempts
        # CPU of draining (and decoding) the neighbour's notifications for 10 s
        dec = Decoder()
        sub.drain()
        cpu0, wall0, count = time.process_time(), time.monotonic(), 0
        while time.monotonic() - wall0 < 10.0:
            if sub.wait(0.5):
                for m in sub.drain().messages:
                    dec.decode(m)
                    count += 1
        out["drain_10s_cpu_s"] = time.process_time() - cpu0
        out["drain_10s_messages"] = count
        sample = wait_commits(sub, 1)
    neighbour_elem = next(m for m in sample if m.msg in (uapi.NFT_MSG_NEWSETELEM, uapi.NFT_MSG_DELSETELEM))
    gen = next(m for m in sample if m.msg == uapi.NFT_MSG_NEWGEN)
    # one element notification of our own table (decoded: key, verdict, comment)
    import nftables

    ctx = nftables.Nftables()
    with nl.Subscriber() as sub:
        rc, _out, err = ctx.cmd('add element ip natgw services { 172.18.200.1 . tcp . 1 comment "r1" : goto lb_n4 }')
        assert rc == 0, err
        ours = next(m for m in wait_commits(sub, 1) if m.msg == uapi.NFT_MSG_NEWSETELEM)
    ctx.cmd("delete element ip natgw services { 172.18.200.1 . tcp . 1 }")
    dec = Decoder(nftread.read_table("ip", "natgw", elements=False))  # type: ignore[arg-type]
    out["decoded_own_element"] = repr(dec.decode(ours).obj)
    for label, m in (("neighbour_element", neighbour_elem), ("newgen", gen), ("own_element", ours)):
        t0 = time.perf_counter()
        for _ in range(10000):
            dec.decode(m)
        out[f"decode_{label}_us"] = (time.perf_counter() - t0) / 10000 * 1e6
    return out


def main() -> None:
    log.configure("json", "warning")  # the agent's logs on stderr, warnings only
    mode = sys.argv[1]
    n = int(sys.argv[2]) if len(sys.argv) > 2 else 0
    report = {"examples": examples, "program": program, "quiet": quiet, "churn": churn, "interrupt": interrupt,
              "measure": measure}[mode](
        *([n] if mode != "examples" else []))
    print(json.dumps(report))


if __name__ == "__main__":
    main()
