"""Active health checks with real servers (issue 23): a backend whose server dies leaves
its identities' choice within 5 s and comes back within 5 s of answering again; a pinned
ClientIP client moves once and sticks; a check switched off by annotation changes
nothing; an http check on a backend answering 500 takes it out; a backend that does not
complete the handshake within the timeout is down; when every backend is down, all stay;
a restarted agent keeps out what it had found down.

Each backend runs servers of the test's own beside the lab's, so the test can kill and
restart one: `lab.traffic serve` on :8081 (the identities' backends) and a small HTTP
server on :8082 (200, or 500 on b3) that the http identity's checks ask (`port=8082`)."""
from __future__ import annotations

import json
import subprocess
import sys
import time
from typing import Any

from gwtest import (BACKENDS, CLIENTS, EIP, GATEWAY, ROOT, agent_status, eip_doc, ns_run, program, rule_doc, wait_for,
                    yaml_docs)

SERVED, HTTP = 8081, 8082
WEB, APP, OFF, CHECKED_HTTP = 80, 443, 81, 82
HTTP_SERVER = """
import http.server, sys
status = int(sys.argv[2])
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(status); self.end_headers(); self.wfile.write(b"x")
    def log_message(self, *a): pass
class S(http.server.ThreadingHTTPServer):
    def handle_error(self, *a):  # the checks close once they have the status line: resets
        if not isinstance(sys.exc_info()[1], (ConnectionResetError, BrokenPipeError)):
            super().handle_error(*a)
s = S(("0.0.0.0", int(sys.argv[1])), H)
print("ready", flush=True)
s.serve_forever()
"""


def annotated(doc: dict[str, Any], value: str) -> dict[str, Any]:
    doc["metadata"]["annotations"] = {"natgw.kube-ovn.io/health-check": value}
    return doc


def start(lab: Any, name: str, argv: list[str]) -> subprocess.Popen[bytes]:
    ns = lab.backend_ns[lab.backend_names.index(name)]
    proc = lab.popen_in(ns, argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, cwd=ROOT)
    assert proc.stdout is not None and proc.stdout.readline().strip() == b"ready", name
    return proc


def serve(lab: Any, name: str) -> subprocess.Popen[bytes]:
    return start(lab, name, [sys.executable, "-m", "lab.traffic", "serve", "--name", name, "--tcp-port", str(SERVED)])


def kill(proc: subprocess.Popen[bytes]) -> None:
    proc.kill()
    proc.wait(5)


def backends(agent: Any) -> dict[int, set[str]]:
    """Port -> the backend names the kernel's table holds for EIP:port (`natgw-agent show`)."""
    out = ns_run(agent.ns, sys.executable, "-m", "agent.cli", "show", "--json", "--state-dir", str(agent.state_dir))
    names = {ip: n for n, ip in BACKENDS.items()}
    found: dict[int, set[str]] = {}
    for ident in json.loads(out)["identities"]:
        port = int(ident["identity"].split(":")[1].split("/")[0])
        found[port] = {names[b["backend"].split(":")[0]] for b in ident["backends"]}
    return found


def health(agent: Any) -> dict[str, Any]:
    out = ns_run(agent.ns, sys.executable, "-m", "agent.cli", "show", "--json", "--state-dir", str(agent.state_dir))
    return json.loads(out)["agent"]["health"]


def timed(check: Any, timeout: float, what: str) -> float:
    started = time.monotonic()
    wait_for(check, timeout, interval=0.1, what=what)
    return time.monotonic() - started


def test_backends_leave_when_their_checks_fail_and_come_back(lab, agent):
    servers = {n: serve(lab, n) for n in BACKENDS}
    for n in BACKENDS:
        start(lab, n, [sys.executable, "-c", HTTP_SERVER, str(HTTP), "500" if n == "b3" else "200"])
    docs = [eip_doc()]
    for n, ip in BACKENDS.items():
        docs += [rule_doc(f"web-{n}", WEB, ip, SERVED),
                 rule_doc(f"app-{n}", APP, ip, SERVED, affinity="ClientIP", timeout=600),
                 annotated(rule_doc(f"off-{n}", OFF, ip, SERVED), "off"),
                 annotated(rule_doc(f"http-{n}", CHECKED_HTTP, ip, SERVED), f"http path=/healthz port={HTTP}")]
    program(agent, *docs[1:], identities=4)
    everyone = set(BACKENDS)

    # An http check that gets 500 takes b3 out of the http identity only.
    timed(lambda: backends(agent)[CHECKED_HTTP] == everyone - {"b3"}, 6, "b3's http check (500) to take it out")
    assert backends(agent)[WEB] == everyone
    pinned = lab.tcp_connect(EIP, APP, 40, sources=CLIENTS)
    assert pinned["failed"] == 0, pinned
    on_b2 = [c for c, seen in pinned["by_source"].items() if set(seen) == {"b2"}]
    assert on_b2, pinned["by_source"]  # 20 clients over three backends: some are pinned to b2

    # b2's server dies: new connections avoid it within 5 s, and none fails after that.
    kill(servers["b2"])
    took = timed(lambda: "b2" not in backends(agent)[WEB], 5, "dead b2 to leave")
    after = lab.tcp_connect(EIP, WEB, 60)
    assert after["failed"] == 0 and after["by_backend"]["b2"] == 0, (took, after)
    assert backends(agent)[OFF] == everyone  # checks off: the rule's backend stays, dead or not
    diff = lab.run_in(agent.ns, [sys.executable, "-m", "agent.cli", "diff", "--gateway", GATEWAY, "--from-dir",
                                 str(agent.rules_dir), "--state-dir", str(agent.state_dir)],
                      capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert (diff.returncode, diff.stdout) == (0, ""), diff.stderr  # what the checks took out is no drift
    assert "b2" in backends(agent)[CHECKED_HTTP]  # its checks ask :8082, which still answers
    row = next(r for r in health(agent)["targets"] if r["backend"] == f"{BACKENDS['b2']}:{SERVED}")
    assert not row["up"] and "refused" in row["lastFailure"], row
    # Its pinned clients pick again at their next connection, once, then stick.
    moved = lab.tcp_connect(EIP, APP, 4 * len(on_b2), sources=on_b2)
    assert moved["failed"] == 0, moved
    assert all(len(seen) == 1 and "b2" not in seen for seen in moved["by_source"].values()), moved["by_source"]

    # A restarted agent remembers what it found down: b2 stays out from its first sync on.
    assert agent.stop() == 0
    agent.start()
    wait_for(lambda: (agent_status(agent) or {}).get("ready"), 10, 0.05, what="the restarted agent ready")
    assert "b2" not in backends(agent)[WEB]

    # Restored: back within 5 s.
    servers["b2"] = serve(lab, "b2")
    back = timed(lambda: "b2" in backends(agent)[WEB], 5, "restored b2 to return")
    print(f"dead b2 out of the choice in {took:.1f} s after its server died, back {back:.1f} s after it restarted")
    assert lab.tcp_connect(EIP, WEB, 60)["by_backend"]["b2"] > 0

    # A backend that does not complete the handshake within the timeout (its SYNs dropped,
    # as a listener with a full accept queue drops them) is down too.
    ns_run(lab.backend_ns[0], "nft", "add table ip slow; add chain ip slow in { type filter hook input priority 0; };"
           f" add rule ip slow in tcp dport {SERVED} drop")
    timed(lambda: "b1" not in backends(agent)[WEB], 7, "b1, too slow, to leave")
    row = next(r for r in health(agent)["targets"] if r["backend"] == f"{BACKENDS['b1']}:{SERVED}")
    assert "timed out" in row["lastFailure"], row

    # Every backend down: all of them stay (fail open), and the agent says so.
    kill(servers["b2"])
    kill(servers["b3"])
    wait_for(lambda: f"{EIP}:{WEB}/tcp" in health(agent)["failOpen"], 7, interval=0.2, what="fail open")
    assert backends(agent)[WEB] == everyone
    assert any(e.get("event", "").startswith("every backend") for e in agent.logs())
    downs = [e for e in agent.logs() if e.get("event") == "backend down"]
    assert {e["backend"] for e in downs} >= {f"{BACKENDS[n]}:{SERVED}" for n in BACKENDS}, downs
