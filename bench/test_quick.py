"""The benchmark's quick mode, run for real (root, network namespaces): asserts that what
it measured is what it claims to measure. Never asserts a time."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from bench import busy as busy_mod
from bench import cleanup as cleanup_mod
from bench import identities as ids_mod
from bench import choice_report, kubeproxy, legacy, report
from bench.common import REPO, child_env
from bench.run import QUICK
from bench.sync import FULL_COUNT_MAX_SETS, max_change_commands


@pytest.fixture(scope="module")
def quick(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], Path, int]:
    assert os.geteuid() == 0, "the benchmark needs root (network namespaces, nftables)"
    out = tmp_path_factory.mktemp("bench")
    raw = out / "results.json"
    proc, stdout, stderr = _run_module("bench.run", "--quick", "--out", str(out), "--json", str(raw))
    assert proc.returncode == 0, stdout[-3000:] + stderr[-3000:]
    return json.loads(raw.read_text()), out, proc.pid


def _run_module(*argv: str) -> tuple[subprocess.Popen[str], str, str]:
    """`python -m argv...` from the repository, at most 5 minutes: (process, stdout, stderr)."""
    proc = subprocess.Popen([sys.executable, "-m", *argv], cwd=REPO, env=child_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        stdout, stderr = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.terminate()  # it deletes its namespaces on SIGTERM
            proc.wait(30)
    return proc, stdout, stderr


def _one(rows: list[dict[str, Any]], n: int, affinity: bool) -> dict[str, Any]:
    found = [r for r in rows if r["n"] == n and r["affinity"] == affinity]
    assert len(found) == 1, (n, affinity, rows)
    return found[0]


@pytest.mark.parametrize("affinity", [False, True])
def test_legacy_and_kubeproxy_tables_hold_what_they_must(quick: tuple[dict[str, Any], Path, int], affinity: bool) -> None:
    res, _, _ = quick
    for n in QUICK.sizes:
        for rows, module in ((res["legacy"], legacy), (res["kubeproxy"], kubeproxy)):
            r = _one(rows, n, affinity)
            expected = module.expected_objects(n, affinity, ids_mod.BACKENDS)
            assert expected["sets"] <= FULL_COUNT_MAX_SETS  # quick sizes are counted in full
            assert r["check"]["got"] == expected, (module.__name__, n, affinity)
        assert _one(res["legacy"], n, affinity)["processes"] == n  # one nft process per identity
        assert _one(res["kubeproxy"], n, affinity)["processes"] == 1
    assert not res["legacy_extrapolated"]  # quick mode measures every legacy size


@pytest.mark.parametrize("affinity", [False, True])
def test_changes_lead_to_the_new_backend_only(quick: tuple[dict[str, Any], Path, int], affinity: bool) -> None:
    res, _, _ = quick
    for n in QUICK.change_sizes:
        for rows in (res["legacy"], res["kubeproxy"]):
            change = _one(rows, n, affinity)["change"]
            assert change["present"] == n and change["processes"] == 1
            check = change["check"]
            assert (check["ok"], check["new_backend_in_chain"], check["old_backend_in_chain"]) == (True, True, False), check


@pytest.mark.parametrize("affinity", [False, True])
def test_agent_synced_everything_then_nothing_then_one_identity(quick: tuple[dict[str, Any], Path, int], affinity: bool) -> None:
    res, _, _ = quick
    for n in QUICK.sizes:
        a = _one(res["agent"], n, affinity)
        assert "error" not in a, a.get("error")
        assert a["objects"] == n * ids_mod.BACKENDS + len({x.eip for x in ids_mod.identities(n, affinity)})
        assert a["sync"] == {"commands": a["sync"]["commands"], "identities": n, "backends": n * ids_mod.BACKENDS, "invalid": 0}
        assert a["sync"]["commands"] > 0
        assert a["kernel"] == {"identities": n, "backends": n * ids_mod.BACKENDS}
        assert a["noop_commands"] == 0
        assert 0 < a["change"]["commands"] <= max_change_commands(affinity)
        assert a["change"]["identities"] == n and a["change"]["backends"] == n * ids_mod.BACKENDS
        ck = a["change_kernel"]
        assert ck["changed_backends"] == ck["expected_backends"]
        assert ids_mod.CHANGED_IP in ck["changed_backends"]
        assert ck["identities"] == n and ck["backends"] == n * ids_mod.BACKENDS
        assert True in a["change_polls"]  # the rewritten file was read
        if a["incremental_api"]:  # the run loop's path: sync(source, source.take_changes())
            assert a["noop_loop_commands"] == 0
            loop = a["change_loop"]
            assert 0 < loop["result"]["commands"] <= max_change_commands(affinity)
            assert loop["kernel"]["changed_backends"] == loop["kernel"]["expected_backends"]
            assert ids_mod.CHANGED_IP_2 in loop["kernel"]["changed_backends"]
            assert loop["kernel"]["identities"] == n and loop["kernel"]["backends"] == n * ids_mod.BACKENDS
        assert a["show_rc"] == 0 and a["show_identities"] == n and a["show_backends"] == n * ids_mod.BACKENDS
        assert a["rss_peak_kib"] > 0
        assert a["check"]["ok"]


def test_every_data_plane_connection_was_answered_by_a_backend_of_the_identity(quick: tuple[dict[str, Any], Path, int]) -> None:
    res, _, _ = quick
    cases = {(d["kind"], d["n"]): d for d in res["dataplane"]}
    assert set(cases) == {(k, n) for k in QUICK.dp_kinds for n in QUICK.dp_sizes}
    for (kind, n), d in cases.items():
        assert d["errors"] == 0, d["error_samples"]
        assert d["runs"] == QUICK.dp_runs
        assert d["connections"] == QUICK.dp_runs * QUICK.dp_connections
        assert sum(d["answers"].values()) == d["connections"]
        assert d["unexpected"] == []
        target = ids_mod.identities(n, False)[n - 1]
        backends = {ip for ip, _ in target.backends}
        if kind.startswith("iptables"):
            assert set(d["answers"]) == {target.backends[0][0]}  # 1:1 DNAT, the exclusive path
            assert d["setup"]["identities"] == n and d["setup"]["target_is_last"]
        elif kind == "agent-clientip":
            assert len(d["answers"]) == 1 and set(d["answers"]) <= backends  # one client: pinned
            assert d["setup"]["identities"] == n and d["setup"]["rules_or_backends"] == n * ids_mod.BACKENDS
        else:
            assert set(d["answers"]) == backends  # spread over all four
            assert d["setup"]["identities"] == n and d["setup"]["rules_or_backends"] == n * ids_mod.BACKENDS


def test_report_files_hold_every_table(quick: tuple[dict[str, Any], Path, int]) -> None:
    res, out, _ = quick
    md = (out / "BENCHMARKS.md").read_text()
    png = (out / "benchmarks-sync.png").read_bytes()
    assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 10_000
    for heading in ("**Machine:**", "## Method", "## Full sync", "### Stateless", "### ClientIP",
                    "## One identity's backend change", "## Agent details", "## Data plane", "Side by side",
                    "## Correctness checks", "![full sync times](benchmarks-sync.png)", choice_report.HEADING):
        assert heading in md, heading
    for n in QUICK.sizes:
        assert f"\n| {n:,} | " in md
    for n in QUICK.dp_sizes:
        assert f"{n:,} identities: median" in md
    assert " 0 failed." in md and "FAILED" not in md
    assert "iptables-legacy" in md and "n/a" not in md.split("## Data plane")[1]


def test_no_namespace_left_behind(quick: tuple[dict[str, Any], Path, int]) -> None:
    _, _, pid = quick
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    assert [line for line in listed.splitlines() if line.startswith(f"nb{pid}-")] == []


# --- the busy neighbour benchmark (bench/busy.py), small -----------------------------------

BUSY_N = 500
BUSY_REPS = 2


@pytest.fixture(scope="module")
def busy(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], int]:
    assert os.geteuid() == 0, "the benchmark needs root (network namespaces, nftables)"
    raw = tmp_path_factory.mktemp("busy") / "busy.json"
    proc, stdout, stderr = _run_module("bench.busy", "--n", str(BUSY_N), "--reps", str(BUSY_REPS), "--cpu-seconds", "2",
                                       "--scrapes", "2", "--readbacks", "1", "--json", str(raw))
    assert raw.exists(), stderr[-3000:]
    res = json.loads(raw.read_text())
    assert json.loads(stdout) == res
    return res, proc.returncode


def test_busy_every_check_passed(busy: tuple[dict[str, Any], int]) -> None:
    res, rc = busy
    assert [k for k, ok in res["checks"].items() if not ok] == []
    assert rc == 0 and res["ok"]
    assert res["programmed_identities"] == BUSY_N + 1 and res["table"]["identities"] == BUSY_N + 1
    assert res["agent_pid_measured"]  # the CPU read is the agent's own process
    assert res["pins"] == busy_mod.CLIENTS
    assert res["neighbour"]["commits"] > 0 and res["neighbour"]["failures"] == 0  # it was busy all along
    assert set(res["targets"]) == set(busy_mod.TARGETS)
    assert res["machine"]["nft"].startswith("nftables v") and res["machine"]["python"]


def test_busy_every_damage_was_real_and_repaired(busy: tuple[dict[str, Any], int]) -> None:
    res, _ = busy
    assert set(res["repairs"]) == {"flushed chain", "deleted map element", "deleted set"}
    for name, r in res["repairs"].items():
        assert len(r["runs"]) == BUSY_REPS and len(r["seconds"]) == BUSY_REPS, name
        for run in r["runs"]:
            assert run["nft_rc"] == 0, run["nft_stderr"]
            assert run["drift_logged"], name  # the agent saw the damage and said so
            assert run["repaired"] and run["full_reads"] >= 1, name  # a full read equalled the table before
            assert run["repair_s"] is not None


def test_busy_restart_sent_nothing_and_kept_every_pin(busy: tuple[dict[str, Any], int]) -> None:
    r = busy[0]["restart"]
    assert r["killed_rc"] == -9
    assert r["sent_nothing"] and r["sent"] == []
    assert r["table_unchanged"]
    assert r["pins"] == busy_mod.CLIENTS and r["pins_lost"] == {} and r["pins_kept"]


def test_busy_show_diff_scrapes_and_readback_answered(busy: tuple[dict[str, Any], int]) -> None:
    res, _ = busy
    c = res["commands"]
    assert c["show"]["rc"] == 0 and c["show"]["identities"] == BUSY_N + 1
    assert c["show"]["backends"] == (BUSY_N + 1) * ids_mod.BACKENDS
    assert c["show_json"]["rc"] == 0 and c["show_json"]["identities"] == BUSY_N + 1 and c["show_json"]["agent_ready"]
    assert c["diff"]["rc"] == 0 and c["diff"]["empty"]
    scrapes = [res["scrape"]["first"], *res["scrape"]["later"]]
    assert len(scrapes) == 3 and all(s["status"] == 200 and s["identities"] == BUSY_N + 1 for s in scrapes)
    # The later scrapes carry the backend counters the first one asked for.
    assert res["scrape"]["later"][-1]["backend_series"] == (BUSY_N + 1) * ids_mod.BACKENDS
    assert [r["identities"] for r in res["readback"]["runs"]] == [BUSY_N + 1]


def test_busy_section_is_written_once_into_the_report(busy: tuple[dict[str, Any], int], tmp_path: Path) -> None:
    res, _ = busy
    md = tmp_path / "BENCHMARKS.md"
    md.write_text("# natgw-agent benchmarks\n\n## Correctness checks made during this run\n\n1 checks passed, 0 failed.\n")
    results = tmp_path / "busy.json"
    results.write_text(json.dumps(res))
    for _ in range(2):  # written again, it replaces itself
        assert report.main(["--busy", str(results), str(tmp_path / "missing.json"), "--out", str(md)]) == 0
    text = md.read_text()
    assert text.count(report.BUSY_HEADING) == 1 and text.startswith("# natgw-agent benchmarks\n")
    assert "1 checks passed, 0 failed." in text
    section = report.busy_section_of(text)
    rows = [line for line in section.splitlines() if line.startswith("| ")]
    assert len(rows) == 1 + 13  # the header and one row per measurement
    assert all(line.count(" | ") == 2 for line in rows)  # measurement, target, one system
    assert "repair: flushed chain" in section and "FAILED" not in section


def test_busy_left_no_namespace_behind(busy: tuple[dict[str, Any], int]) -> None:
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    assert not [line for line in listed.splitlines() if line.startswith(f"nb{busy[0]['pid']}-")]


# --- the cleanup benchmark (bench/cleanup.py), small, beside its baseline -----------------

@pytest.fixture(scope="module")
def cleanup(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], int, Path]:
    assert os.geteuid() == 0, "the benchmark needs root (network namespaces, nftables)"
    raw = tmp_path_factory.mktemp("cleanup") / "cleanup.json"
    proc, stdout, stderr = _run_module("bench.cleanup", "--quick", "--baseline", cleanup_mod.BASELINE,
                                       "--json", str(raw))
    assert raw.exists(), stderr[-3000:]
    res = json.loads(raw.read_text())
    assert json.loads(stdout) == res
    return res, proc.returncode, raw


def test_cleanup_every_check_passed(cleanup: tuple[dict[str, Any], int, Path]) -> None:
    res, rc, _ = cleanup
    assert [k for k, ok in res["checks"].items() if not ok] == []
    assert rc == 0 and res["ok"]
    assert (res["n"], res["m"]) == (cleanup_mod.QUICK_N, cleanup_mod.QUICK_M)
    assert res["versions"][0]["commit"][:7] == cleanup_mod.BASELINE[:7]
    assert [v["label"].split(" (")[0] for v in res["versions"]] == ["before", "this tree"]


def test_cleanup_every_removed_flow_went_and_the_change_landed(cleanup: tuple[dict[str, Any], int, Path]) -> None:
    res, _, _ = cleanup
    n = res["n"]
    for v in res["versions"]:
        assert v["traffic"]["answered"] == n and v["traffic"]["by_backend"] == {"b1": n}  # real answered traffic
        assert v["flows_before"]["natted_ports"] == n  # a NATed flow per identity
        assert v["armed"]["flows"]["total"] >= n and v["armed"]["landed"] is None  # then, not yet the change
        assert v["removal"]["flows_gone_s"] is not None and v["flows_after"]["total"] == 0
        assert v["removal"]["flows_after"]["total"] == 0 and v["removal"]["toward_eip_after"] == []
        assert v["change"]["in_kernel_s"] is not None and "10.0.1.12" in v["change"]["element"]
        assert v["identities_before"] == n + 1 and v["identities_after"] == 1
        assert v["agent_log"]["change_sync"]["backends"] == 2 and v["agent_alive"]
        assert set(v["targets"]) == set(cleanup_mod.TARGETS)
    old, new = res["versions"]
    assert old["agent_log"]["removal_sync"]["flows_deleted"] == n  # the older code: conntrack -D in the sync
    cleaned = new["agent_log"]["cleaned_removal"]  # this tree: the cleanup thread's report
    assert cleaned["gone"] == n and cleaned["deleted"] == n and cleaned["kernel_filtered"] is True


def test_cleanup_decoders_read_every_entry(cleanup: tuple[dict[str, Any], int, Path]) -> None:
    d = cleanup[0]["decode"]
    assert d["held"] == d["m"] == cleanup_mod.QUICK_M
    assert set(d["decoders"]) == {"ctnetlink", "pyroute2_entries", "pyroute2_messages"}
    for r in d["decoders"].values():
        assert r["entries"] == [d["m"]] * d["reps"] and r["entries_per_s"] > 0


def test_cleanup_section_is_written_once_and_kept(cleanup: tuple[dict[str, Any], int, Path], tmp_path: Path) -> None:
    res, _, raw = cleanup
    md = tmp_path / "BENCHMARKS.md"
    md.write_text("# natgw-agent benchmarks\n\n## Correctness checks made during this run\n\n1 checks passed, 0 failed.\n"
                  "\n## Busy neighbour\n\nbusy text\n")
    for _ in range(2):  # written again, it replaces itself
        assert report.main(["--cleanup", str(raw), "--out", str(md)]) == 0
    assert report.main(["--cleanup", str(tmp_path / "missing.json"), "--out", str(md)]) == 1
    text = md.read_text()
    assert text.count(report.CLEANUP_HEADING + "\n") == 1 and text.startswith("# natgw-agent benchmarks\n")
    assert "1 checks passed, 0 failed." in text and report.busy_section_of(text) == "## Busy neighbour\n\nbusy text\n\n"
    section = report.section_of(text, report.CLEANUP_HEADING)
    rows = [line for line in section.splitlines() if line.startswith("| ")]
    assert len(rows) == 1 + 6 + 1 + 3  # two tables: a header and a row per measurement, per decoder
    assert all(line.count(" | ") == 4 for line in rows[:7])  # measurement, target, two versions, ratio
    assert "FAILED" not in section and f"{res['n']:,} removed identities" in section


def test_cleanup_left_no_namespace_behind(cleanup: tuple[dict[str, Any], int, Path]) -> None:
    res = cleanup[0]
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    names = [line.split()[0] for line in listed.splitlines() if line.strip()]
    assert not [x for x in names if x.startswith(f"nb{res['pid']}-") or any(x.startswith(v["lab"]) for v in res["versions"])]


# --- the footprint benchmark (bench/footprint.py), small ------------------------------------

FOOTPRINT_N = 300


@pytest.fixture(scope="module")
def footprint(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    assert os.geteuid() == 0, "the benchmark needs root (network namespaces, nftables)"
    raw = tmp_path_factory.mktemp("footprint") / "footprint.json"
    proc, stdout, stderr = _run_module("bench.footprint", "--quick", "--sizes", str(FOOTPRINT_N), "--reaction-at",
                                       str(FOOTPRINT_N), "--no-trace", "--json", str(raw))
    assert proc.returncode == 0 and raw.exists(), stderr[-3000:]
    return json.loads(raw.read_text())


def test_footprint_measured_memory_reaction_traffic_and_idle(footprint: dict[str, Any]) -> None:
    from bench.footprint import QUICK as counts

    (this,) = footprint["versions"]
    assert [(m["n"], m["affinity"]) for m in this["memory"]] == [(FOOTPRINT_N, False), (FOOTPRINT_N, True)]
    assert all(0 < m["rss_mb"] <= m["peak_mb"] for m in this["memory"])
    r = this["reaction"]
    assert r["syncs"] >= counts.events and r["waited"]["n"] >= counts.events  # every watch event applied, and timed
    assert len(r["transactions_per_burst"]) == counts.bursts and all(t >= 1 for t in r["transactions_per_burst"])
    assert sum(int(c > 0) for c in r["histogram"].values()) > 0
    assert this["traffic"]["reached"] == this["traffic"]["identities"] == counts.traffic  # each new identity answered
    assert this["idle"]["seconds"] >= counts.idle_seconds and this["idle"]["cpu_percent"] >= 0


def test_footprint_section_is_written_into_the_report(footprint: dict[str, Any], tmp_path: Path) -> None:
    from bench import footprint_report

    md = tmp_path / "BENCHMARKS.md"
    md.write_text("# natgw-agent benchmarks\n\n## Busy neighbour\n\nkept\n")
    results = tmp_path / "footprint.json"
    results.write_text(json.dumps(footprint))
    for _ in range(2):  # written again, it replaces itself
        assert footprint_report.main([str(results), "--out", str(md)]) == 0
    text = md.read_text()
    assert text.count(footprint_report.HEADING) == 1 and "## Busy neighbour\n\nkept" in text
    assert f"| {FOOTPRINT_N:,} | stateless |" in text and f"| {FOOTPRINT_N:,} | ClientIP |" in text


def test_the_memory_probe_answers_for_code_without_a_memory_query(tmp_path: Path) -> None:
    """bench/memprobe: a process with it on PYTHONPATH writes where its memory is on SIGUSR1
    (what footprint's traced run does for an agent before issue 13)."""
    import signal
    import time

    from bench.footprint import MEMPROBE

    out = tmp_path / "probe.json"
    env = {**os.environ, "PYTHONPATH": str(MEMPROBE), "NATGW_MEMPROBE": str(out), "PYTHONTRACEMALLOC": "1"}
    code = "import time\nheld = [bytes(1000) for _ in range(20000)]\nprint('up', flush=True)\ntime.sleep(60)\n"
    proc = subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "up"
        proc.send_signal(signal.SIGUSR1)
        deadline = time.monotonic() + 30
        while not out.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        report = json.loads(out.read_text())
    finally:
        proc.kill()
        proc.wait()
    assert report["rss_kib"] > 0 and report["python"]["traced_kib"] >= 20000 * 1000 // 1024
    assert report["python"]["by_file"][0]["file"] == "<string>"  # the list above, allocated by the -c code


# --- the health checks benchmark (bench/checks.py), small ------------------------------------

@pytest.fixture(scope="module")
def checks(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    assert os.geteuid() == 0, "the benchmark needs root (network namespaces, nftables)"
    raw = tmp_path_factory.mktemp("checks") / "checks.json"
    proc, stdout, stderr = _run_module("bench.checks", "--quick", "--json", str(raw))
    assert proc.returncode == 0 and raw.exists(), stderr[-3000:]
    res = json.loads(raw.read_text())
    assert json.loads(stdout) == res
    return res


def test_checks_ran_as_often_as_their_stretch_says_and_said_so(checks: dict[str, Any]) -> None:
    from bench.checks import QUICK

    off, on, small = checks["cases"]
    assert [(c["label"], c["n"], c["checks_on"]) for c in checks["cases"]] == [
        ("off", QUICK.n, False), ("on", QUICK.n, True), ("small", QUICK.small, True)]
    assert off["show"]["targets"] == 0  # --no-health-checks: nothing checked
    for c in (on, small):
        targets = c["n"] * ids_mod.BACKENDS
        assert c["targets"] == c["show"]["targets"] == targets
        assert c["down"] == 0 and c["fail_open"] == 0  # the listener answered every backend: the checks passed
        assert c["stretch"] >= 1.0 and c["stretch_start"] >= 1.0
        # as often as the stretch says, within a factor (it may restretch within the window)
        assert c["checks"] > 0 and 0.5 <= c["checks_per_s"] / c["expected_per_s"] <= 2.0, c
        if max(c["stretch"], c["stretch_start"]) > 1.0:  # stretched: the agent said so
            assert c["warned"]["times"] >= 1 and c["warned"]["last_stretch"] > 1.0
    assert on["cpu_ticks"] > off["cpu_ticks"]  # the checks' work was in the process measured
    assert on["loop_cpu_percent"] < on["cpu_percent"] - on["loop_cpu_percent"]  # and not on the loop's thread


def test_checks_agent_stayed_responsive_and_synced_a_change(checks: dict[str, Any]) -> None:
    import math

    for c in checks["cases"]:
        assert c["alive"] and c["agent_pid_measured"]  # the CPU read is the agent's own process
        assert c["show"]["rc"] == 0  # `show --json` answered after the window
        assert c["sync"]["logged_s"] is not None and c["sync"]["commands"] > 0  # the change was programmed
        assert math.isfinite(c["cpu_percent"]) and c["cpu_percent"] >= 0 and c["window_s"] > 0
    assert math.isfinite(checks["extra_cpu_percent"])


def test_checks_section_is_written_into_the_report(checks: dict[str, Any], tmp_path: Path) -> None:
    from bench import checks_report

    md = tmp_path / "BENCHMARKS.md"
    md.write_text("# natgw-agent benchmarks\n\n## Busy neighbour\n\nkept\n")
    results = tmp_path / "checks.json"
    results.write_text(json.dumps(checks))
    for _ in range(2):  # written again, it replaces itself
        assert checks_report.main([str(results), "--out", str(md)]) == 0
    text = md.read_text()
    assert text.count(checks_report.HEADING + "\n") == 1 and "## Busy neighbour\n\nkept" in text
    section = report.section_of(text, checks_report.HEADING)
    rows = [line for line in section.splitlines() if line.startswith("| ")]
    assert len(rows) == 1 + 15 and all(line.count(" | ") == len(checks["cases"]) for line in rows)
    assert "FAILED" not in section and "NOT logged" not in section
    memory = next(line for line in rows if line.startswith("| agent resident memory"))
    assert memory.count(" MB (") == len(checks["cases"]), memory  # every case's, read from /proc


def test_checks_left_no_namespace_behind(checks: dict[str, Any]) -> None:
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    assert not [line for line in listed.splitlines() if line.startswith(f"nb{checks['pid']}-")]
