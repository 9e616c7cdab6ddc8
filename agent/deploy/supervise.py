"""`natgw-supervise ARGS...` (also `natgw-agent supervise ARGS...`): the agent container's
main process. It runs `natgw-agent ARGS...` as a worker and starts it again at once when it
dies, so that a crash, an OOM kill or a SIGKILL of the worker costs a second of programming,
not the container's restart (the kubelet backs that off up to 5 minutes). The data plane
does not care either way: the kernel keeps the table and its flows; a restarted worker reads
the table back and sends nothing when nothing changed.

Why a container of its own at all (images/kubernetes/injector.yaml adds it to gateway pods):
kube-ovn's controller recreates the whole gateway pod, cutting every flow, when the
container named `vpc-nat-gw` has restarted (kube-ovn #5072); a restart of any other
container of the pod is the kubelet's business only. As PID 1 of that container the
supervisor also reaps orphans, and passes SIGTERM/SIGINT on to the worker and ends with
it. Standard library only: it must not fail where the worker might, and it stays resident.
Its own entry point (`natgw-supervise`, this module's `main`) loads no other agent module:
its resident memory beside a running worker, measured here, is 13.7 MB, against 32.5 MB
started through agent.cli (structlog, prometheus_client and the agent's modules)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from typing import Sequence

USAGE = 2  # the worker's exit code for bad arguments or settings: starting it again will not help
FIRST_DELAY = 0.2  # seconds before the first restart, doubling to MAX_DELAY
MAX_DELAY = 10.0
STEADY = 60.0  # a worker that ran this long resets the delay
HELP_FLAGS = frozenset({"-h", "--help"})
# What `natgw-supervise --help` and `natgw-agent supervise --help` say (both entry points).
DESCRIPTION = ("Run `natgw-agent ARGS...` as a worker and start it again when it dies (after 0.2 s, doubling "
               "to 10 s; reset once a worker ran 60 s). SIGTERM and SIGINT go on to the worker and end the "
               "supervisor with it; a worker that refuses its arguments (exit 2) is not started again. The agent "
               "container's main process in a gateway pod.")
ARGS_HELP = ("every argument is the worker's, options included, e.g. `--log-format json run`; "
             "-h/--help alone (first) prints this help, and a worker asked for its own --help runs once")


def _log(event: str, **fields: object) -> None:
    """A JSON log line on stderr, the worker's format."""
    print(json.dumps({"event": f"supervisor: {event}", "level": "info", **fields}), file=sys.stderr, flush=True)


def supervise(argv: Sequence[str], python: str = sys.executable) -> int:
    """Run `python -m agent.cli ARGV` until told to stop; returns the exit code to end with."""
    if HELP_FLAGS & set(argv):  # the worker prints its help and ends: once, not in a loop
        return subprocess.call([python, "-m", "agent.cli", *argv])
    stopping: list[int] = []
    worker: subprocess.Popen[bytes] | None = None

    def stop(signum: int, _frame: object) -> None:
        stopping.append(signum)
        if worker is not None and worker.poll() is None:
            worker.send_signal(signum)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    delay = FIRST_DELAY
    restarts = 0
    while not stopping:
        started = time.monotonic()
        worker = subprocess.Popen([python, "-m", "agent.cli", *argv], preexec_fn=_die_with_parent)
        _log("worker started", pid=worker.pid, restarts=restarts)
        code = _wait(worker)
        if stopping:
            return 0 if code in (0, -signal.SIGTERM, -signal.SIGINT) else code
        if code == USAGE:
            _log("worker refused its arguments; not starting it again", code=code)
            return USAGE
        ran = time.monotonic() - started
        delay = FIRST_DELAY if ran >= STEADY else delay
        _log("worker ended; starting it again", code=code, ran_s=round(ran, 1), retry_in=round(delay, 2))
        deadline = time.monotonic() + delay
        while not stopping and time.monotonic() < deadline:
            time.sleep(min(0.05, max(0.0, deadline - time.monotonic())))
            _reap()
        delay = min(delay * 2, MAX_DELAY)
        restarts += 1
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """`natgw-supervise ARGS...`: everything after it is the worker's, options included."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] and args[0] in HELP_FLAGS:
        print(f"usage: natgw-supervise [-h] ARGS...\n\n{DESCRIPTION}\n\narguments:\n  ARGS...     {ARGS_HELP}")
        return 0
    if not args:
        print("usage: natgw-supervise [-h] ARGS...  (e.g. natgw-supervise --log-format json run)", file=sys.stderr)
        return USAGE
    return supervise(args)


def _die_with_parent() -> None:
    """In the worker, before it runs: SIGTERM when the supervisor dies, however it dies
    (in a container the whole namespace goes with PID 1; elsewhere nothing would stop an
    orphaned worker programming on)."""
    import ctypes

    try:
        ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _wait(worker: subprocess.Popen[bytes]) -> int:
    """The worker's exit code, reaping any orphan meanwhile (as PID 1 they are ours)."""
    while True:
        try:
            pid, status = os.waitpid(-1, 0)
        except ChildProcessError:
            return worker.poll() if worker.poll() is not None else 0
        except InterruptedError:
            continue
        if pid == worker.pid:
            worker.returncode = os.waitstatus_to_exitcode(status)
            return worker.returncode


def _reap() -> None:
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


if __name__ == "__main__":
    sys.exit(main())
