"""The prober (agent/health/prober.py) against real sockets on 127.0.0.1: what passes, what
fails and with which reason, which targets are checked after set_targets(), how many checks
run at once, stop() with checks in flight, and the stretch over a CPU budget. No root, no
namespace; bounds on counts, not on speed."""
from __future__ import annotations

import random
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Iterator

import pytest
import structlog

from agent.core.health import Check, Target
from agent.core.model import Backend
from agent.health import prober as prober_mod
from agent.health.prober import MAX_STRETCH, Prober, next_stretch

Result = tuple[Target, bool, str]


class Results:
    """The reports, as the prober's thread makes them."""

    def __init__(self) -> None:
        self.seen: list[Result] = []

    def __call__(self, target: Target, passed: bool, reason: str) -> None:
        self.seen.append((target, passed, reason))

    def of(self, target: Target) -> list[tuple[bool, str]]:
        return [(passed, reason) for t, passed, reason in list(self.seen) if t == target]


def run(prober: Prober, seconds: float) -> None:
    prober.run_once(time.monotonic() + seconds)


def burn(seconds: float) -> None:
    """Take `seconds` of this thread's CPU (a costly report, a costly step of the prober)."""
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


@pytest.fixture
def listener() -> Iterator[socket.socket]:
    """A listener nobody accepts from: the kernel completes the handshakes, nobody answers."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(256)
        yield sock


@pytest.fixture
def closed_port() -> Iterator[int]:
    """A port bound but not listening (held, so nobody else takes it): connects are refused."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        yield sock.getsockname()[1]


def http_server(status: int) -> ThreadingHTTPServer:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(status)
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    class Server(ThreadingHTTPServer):
        block_on_close = False

        def handle_error(self, *args: object) -> None:
            pass  # the prober resets the connection once it has the status line

    server = Server(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, args=(0.02,), daemon=True).start()
    return server


def at(sock: socket.socket | ThreadingHTTPServer, check: Check) -> Target:
    sockname = sock.getsockname() if isinstance(sock, socket.socket) else sock.server_address
    return Backend("127.0.0.1", sockname[1]), check


def test_tcp_passes_on_a_listener_and_is_refused_on_a_closed_port(listener: socket.socket, closed_port: int) -> None:
    results = Results()
    prober = Prober(results)
    up, down = at(listener, Check(interval=0.1)), (Backend("127.0.0.1", closed_port), Check(interval=0.1))
    prober.set_targets([up, down])
    run(prober, 0.35)
    prober.stop()
    # checks start at least an interval apart: at most 4 in 0.35 s (fewer on a slow machine)
    assert 1 <= len(results.of(up)) <= 4 and set(results.of(up)) == {(True, "")}
    assert 1 <= len(results.of(down)) <= 4 and set(results.of(down)) == {(False, "connection refused")}


def test_tcp_times_out_when_the_listeners_backlog_is_full() -> None:
    """A full accept queue drops the SYN (Linux, without tcp_abort_on_overflow): the connect
    neither completes nor fails within the timeout."""
    with socket.socket() as full, socket.socket() as filler:
        full.bind(("127.0.0.1", 0))
        full.listen(0)  # room for one connection
        filler.connect(full.getsockname())
        results = Results()
        prober = Prober(results)
        target = at(full, Check(interval=0.1, timeout=0.1))
        prober.set_targets([target])
        run(prober, 0.25)
        prober.stop()
    assert 1 <= len(results.of(target)) <= 2 and set(results.of(target)) == {(False, "timed out after 0.1 s")}


def test_an_address_that_cannot_be_used_fails_with_the_errnos_text() -> None:
    results = Results()
    prober = Prober(results)
    target = (Backend("224.0.0.1", 80), Check(interval=1.0))  # TCP to a multicast group: ENETUNREACH
    prober.set_targets([target])
    run(prober, 0.05)
    prober.stop()
    assert results.of(target) == [(False, "network is unreachable")]


def test_http_passes_on_the_expected_status_only() -> None:
    ok, broken = http_server(200), http_server(500)
    try:
        results = Results()
        prober = Prober(results)
        passes = at(ok, Check(kind="http", interval=0.1, path="/healthz"))
        fails = at(broken, Check(kind="http", interval=0.1))
        wrong = at(ok, Check(kind="http", interval=0.1, status=204))
        prober.set_targets([passes, fails, wrong])
        run(prober, 0.25)
        prober.stop()
    finally:
        for server in (ok, broken):
            server.shutdown()
            server.server_close()
    assert results.of(passes) and set(results.of(passes)) == {(True, "")}
    assert results.of(fails) and set(results.of(fails)) == {(False, "HTTP 500 (want 200)")}
    assert results.of(wrong) and set(results.of(wrong)) == {(False, "HTTP 200 (want 204)")}


def test_http_times_out_when_the_answer_does_not_come(listener: socket.socket) -> None:
    """Connected (the kernel accepts), asked, never answered: the timeout covers the answer too."""
    results = Results()
    prober = Prober(results)
    target = at(listener, Check(kind="http", interval=0.1, timeout=0.1))
    prober.set_targets([target])
    run(prober, 0.25)
    prober.stop()
    assert 1 <= len(results.of(target)) <= 2
    assert set(results.of(target)) == {(False, "timed out after 0.1 s awaiting the HTTP status line")}
    conn, _ = listener.accept()
    with conn:
        assert conn.recv(4096).startswith(b"GET / HTTP/1.0\r\nHost: 127.0.0.1:")


def test_a_removed_target_is_not_reported_even_if_its_check_was_in_flight(listener: socket.socket) -> None:
    results = Results()
    prober = Prober(results)
    kept = at(listener, Check(interval=0.05))
    removed = at(listener, Check(kind="http", interval=0.5, timeout=0.3))  # in flight for 0.3 s
    prober.set_targets([kept, removed])
    run(prober, 0.1)
    assert results.of(kept) and not results.of(removed)
    before = len(results.of(kept))
    prober.set_targets([kept])
    run(prober, 0.5)  # past the removed check's timeout
    prober.stop()
    assert not results.of(removed)
    assert len(results.of(kept)) > before


def test_set_targets_from_many_threads_ends_with_the_last_set(listener: socket.socket) -> None:
    results = Results()
    prober = Prober(results)
    every = [at(listener, Check(interval=0.05, path=f"/{n}")) for n in range(40)]  # tcp: the path only tells them apart
    final = every[:5]

    def churn(seed: int) -> None:
        rng = random.Random(seed)
        for _ in range(200):
            prober.set_targets(rng.sample(every, rng.randrange(len(every))))

    with structlog.testing.capture_logs() as logs:
        prober.start()
        threads = [threading.Thread(target=churn, args=(seed,)) for seed in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        prober.set_targets(final)
        time.sleep(0.2)  # the loop takes the set at its next turn, well within this
        results.seen.clear()
        time.sleep(0.3)
        prober.stop()
    assert {t for t, _, _ in results.seen} == set(final)
    assert [entry for entry in logs if entry["log_level"] in ("error", "warning")] == []


def test_stop_returns_within_a_second_and_closes_the_checks_in_flight(listener: socket.socket) -> None:
    results = Results()
    prober = Prober(results)
    prober.set_targets([at(listener, Check(kind="http", interval=10, timeout=10, path=f"/{n}")) for n in range(20)])
    prober.start()
    time.sleep(0.2)  # every check connected (spread over 10 s: the first one at once) and waiting
    started = time.monotonic()
    prober.stop()
    assert time.monotonic() - started < 1.0
    assert not any(t.name == "health" for t in threading.enumerate())
    assert results.seen == []
    conn, _ = listener.accept()
    with conn:
        conn.settimeout(1.0)
        with pytest.raises(ConnectionResetError):  # reset, not left open
            while conn.recv(4096):
                pass


@pytest.mark.parametrize("max_inflight", [3, 256])
def test_at_most_max_inflight_checks_run_at_once(listener: socket.socket, max_inflight: int) -> None:
    """Checks that each hold their connection until their timeout: in 0.5 s, 3 slots finish
    at most 3 x 0.5 / 0.1 = 15 of them; without the bound, 12 targets finish 60 (the twin)."""
    results = Results()
    prober = Prober(results, max_inflight=max_inflight)
    prober.set_targets([at(listener, Check(kind="http", interval=0.01, timeout=0.1, path=f"/{n}")) for n in range(12)])
    run(prober, 0.5)
    prober.stop()
    assert {reason for _, _, reason in results.seen} == {"timed out after 0.1 s awaiting the HTTP status line"}
    if max_inflight == 3:
        assert 3 <= len(results.seen) <= 15
    else:
        assert len(results.seen) > 15


def test_the_stretch_follows_the_cpu_a_check_takes(closed_port: int) -> None:
    """50 targets at 0.05 s ask for 1,000 checks a second. Whose report burns 1 ms of the
    prober's CPU, they take a whole core: a budget of 5% stretches them 20 times after the
    first window (2 s). Whose report costs nothing, a budget of a whole core keeps them."""
    def report(target: Target, passed: bool, reason: str) -> None:
        burn(0.001)

    targets = [(Backend("127.0.0.1", closed_port), Check(interval=0.05, path=f"/{n}")) for n in range(50)]
    costly, cheap = Prober(report), Prober(Results(), budget=1.0)
    with structlog.testing.capture_logs() as logs:
        for prober in (costly, cheap):
            prober.set_targets(targets)
            prober.start()
        time.sleep(2.5)
        for prober in (costly, cheap):
            prober.stop()
    assert costly.stretch > 10 and cheap.stretch == 1.0  # 20, less the checks in flight as the window ends
    said = [e for e in logs if e["event"] == "health checks stretched to keep their CPU budget"]
    assert len(said) == 1 and said[0]["budget"] == 0.05 and said[0]["targets"] == 50
    assert said[0]["checks_per_second"] == 1000 and said[0]["cpu_per_check_us"] > 500


def test_what_taking_new_targets_costs_is_not_charged_to_the_checks(closed_port: int,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Taking targets burns 0.5 s of the prober's CPU in a 1 s window whose other half runs
    ~500 checks (50 targets at 0.05 s). Charged to them, a check would look ~1 ms and half
    a core would stretch them twice; set aside, a check costs its tens of us and the
    intervals stay."""
    monkeypatch.setattr(prober_mod, "WINDOW", 1.0)
    prober = Prober(Results(), budget=0.5)
    retarget = prober._retarget

    def costly(now: float, wanted: frozenset[Target]) -> None:
        burn(0.5)
        retarget(now, wanted)

    monkeypatch.setattr(prober, "_retarget", costly)
    prober.set_targets([(Backend("127.0.0.1", closed_port), Check(interval=0.05, path=f"/{n}")) for n in range(50)])
    run(prober, 1.3)
    prober.stop()
    assert prober.stretch == 1.0 and prober._cost < 250e-6, prober._cost


def test_checks_start_no_faster_than_the_budget_pays_for(closed_port: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """50 targets at 0.05 s whose report burns 1 ms: 1,000 checks a second, a whole core.
    After the first window (1 s here) the budget of 5% pays for 50 checks a second; the
    checks already scheduled at the old pace start no faster than that (their due times do
    not move when the stretch rises: without the rate, all 50 ran at once)."""
    monkeypatch.setattr(prober_mod, "WINDOW", 1.0)
    started: list[float] = []

    def report(target: Target, passed: bool, reason: str) -> None:
        started.append(time.monotonic())
        burn(0.001)

    prober = Prober(report)
    prober.set_targets([(Backend("127.0.0.1", closed_port), Check(interval=0.05, path=f"/{n}")) for n in range(50)])
    t0 = time.monotonic()
    run(prober, 2.2)
    prober.stop()
    assert prober.stretch > 10
    late = [t for t in started if t > t0 + 1.05]  # after the first window
    assert 30 <= len(late) <= 80, len(late)  # 50 a second for ~1.1 s
    most = max(sum(1 for u in late if t <= u < t + 0.2) for t in late)
    assert most <= 15, most  # 10 in 0.2 s: without the rate, the 50 due together run together


def test_a_target_between_states_is_checked_again_at_its_own_interval(closed_port: int,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Stretched x20 (50 targets at 0.05 s whose report burns 1 ms, a budget of 5%), a
    target whose report says it is between states is checked at its own 0.05 s, within the
    rate the budget pays for (50 a second); the others every 1 s."""
    monkeypatch.setattr(prober_mod, "WINDOW", 1.0)
    targets = [(Backend("127.0.0.1", closed_port), Check(interval=0.05, path=f"/{n}")) for n in range(50)]
    hurried = targets[7]
    seen: list[tuple[float, Target]] = []

    def report(target: Target, passed: bool, reason: str) -> bool:
        seen.append((time.monotonic(), target))
        burn(0.001)
        return target == hurried

    prober = Prober(report)
    prober.set_targets(targets)
    t0 = time.monotonic()
    run(prober, 2.5)
    prober.stop()
    assert prober.stretch > 10
    late = [t for at, t in seen if at > t0 + 1.5]  # a second, stretched
    assert late.count(hurried) >= 8, late.count(hurried)  # ~20 (0.05 s, less the pace's share)
    assert max(late.count(t) for t in targets if t != hurried) <= 2


def test_new_targets_are_spread_over_the_stretched_interval(closed_port: int) -> None:
    """A millionth of a core fits no check (at the first guess of 30 us each): stretched to
    the cap at once, 50 new targets spread over 0.05 s x 3,600, so only the first runs now.
    Gone, they take the stretch with them."""
    results = Results()
    prober = Prober(results, budget=1e-6)
    with structlog.testing.capture_logs() as logs:
        prober.set_targets([(Backend("127.0.0.1", closed_port), Check(interval=0.05, path=f"/{n}")) for n in range(50)])
        run(prober, 0.2)
        assert prober.stretch == MAX_STRETCH and len(results.seen) == 1
        prober.set_targets([])
        run(prober, 0.01)
        prober.stop()
    assert prober.stretch == 1.0
    assert [e["event"] for e in logs] == ["health checks stretched to keep their CPU budget",
                                          "health checks back to their intervals"]


def test_next_stretch_fits_the_checks_in_the_budget() -> None:
    assert next_stretch(1.0, 30e-6, 40_000, 0.05) == pytest.approx(24.0)  # 1.2 cores asked, 0.05 given
    assert next_stretch(24.0, 30e-6, 1_000, 0.05) == 1.0  # 3% of a core: back to the intervals
    assert next_stretch(1.0, 30e-6, 1_800, 0.05) == 1.0  # 8% over: within the margin to leave 1.0
    assert next_stretch(1.2, 30e-6, 1_800, 0.05) == pytest.approx(1.08)  # ... but once stretched, kept fitting
    assert next_stretch(1.0, 30e-6, 10**9, 0.05) == MAX_STRETCH
    assert next_stretch(2.0, 30e-6, 0.0, 0.05) == 1.0  # no targets
