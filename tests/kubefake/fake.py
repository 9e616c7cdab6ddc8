"""FakeKube: the store and the listener together, with what tests drive and observe."""
from __future__ import annotations

import copy
import ssl
import threading
import time
from collections import deque
from typing import Any

from .crds import dnat_rule_crd
from .protocol import JSON, ApiError, Request, resource
from .listener import Listener
from .server import Handler
from .store import BREAK, END, Store


class FakeKube:
    """A fake Kubernetes API server (see the package's docstring for what it serves).

    ``sock``: an already-bound TCP socket to serve on (it may live in another network
    namespace), bound to an explicit port if ``set_down()`` is used; without it, a loopback
    port is chosen. ``bookmark_interval``: seconds between BOOKMARKs on watches that allow
    them; None sends them only on ``bookmark()``. ``tls``: a server context (see
    ``kubefake.tls``) to serve HTTPS with, as the API server does; plain HTTP without.
    """

    def __init__(self, sock: Any = None, *, bookmark_interval: float | None = None,
                 tls: ssl.SSLContext | None = None) -> None:
        self.bookmark_interval = bookmark_interval
        self.store = Store()
        self._lock = threading.Lock()
        self._requests: list[Request] = []
        self._failures: dict[str, deque[int]] = {}
        self._listener = Listener(sock, lambda conn, addr: Handler(conn, addr, self), tls)  # type: ignore[arg-type]
        host = self._listener.sock.getsockname()[0]
        host = "127.0.0.1" if host in ("0.0.0.0", "::", "") else host
        port = self._listener.port
        scheme = "https" if tls is not None else "http"
        self.url = f"{scheme}://[{host}]:{port}" if ":" in host else f"{scheme}://{host}:{port}"
        self.set_crd(dnat_rule_crd())  # a cluster with kube-ovn has it (the agent reads it to check the schema)

    # -- lifecycle ------------------------------------------------------------------------------

    def start(self) -> FakeKube:
        self._listener.start()
        return self

    def stop(self) -> None:
        """End open watches abruptly, drop connections, close the socket."""
        self.break_watches()
        self._listener.stop()

    def __enter__(self) -> FakeKube:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- failures -------------------------------------------------------------------------------

    def set_down(self, down: bool) -> None:
        """Down: connections are refused and every open one, keep-alive or watch, is cut
        without a terminating chunk. Up: served again at the same URL."""
        if down:
            self.break_watches()
            self._listener.down()
        else:
            self._listener.up()

    def fail_next(self, n: int, status: int = 500, verb: str = "list") -> None:
        """Answer the next ``n`` requests of RBAC verb ``verb`` with a Status ``status``."""
        with self._lock:
            self._failures.setdefault(verb, deque()).extend([status] * n)

    def take_failure(self, verb: str) -> None:
        with self._lock:
            pending = self._failures.get(verb)
            status = pending.popleft() if pending else None
        if status is not None:
            raise ApiError(status, f"injected failure for {verb} (FakeKube.fail_next)")

    def break_watches(self, plural: str | None = None) -> int:
        """Cut open watches without the terminating chunk, after the events already queued."""
        return self.store.push(plural, BREAK)

    def end_watches(self, plural: str | None = None) -> int:
        """End open watches cleanly, as the API server does when their timeout is up."""
        return self.store.push(plural, END)

    def send_raw(self, plural: str, line: JSON) -> int:
        """Send any event object to every open watch of ``plural``."""
        return self.store.push(resource(plural).plural, copy.deepcopy(line))

    def bookmark(self, plural: str | None = None) -> int:
        """A BOOKMARK at the current resourceVersion to the watches that allow them."""
        targets = [w for w in self.store.watchers(plural) if w.bookmarks]
        for watcher in targets:
            self.store.bookmark(watcher)
        return len(targets)

    def compact(self) -> None:
        """Forget all history up to now, like etcd compaction: a watch from an older version
        gets an ERROR 410 event, a list continued from one a 410 Expired."""
        self.store.compact()

    # -- observation ----------------------------------------------------------------------------

    @property
    def requests(self) -> list[Request]:
        with self._lock:
            return list(self._requests)

    def clear_requests(self) -> None:
        with self._lock:
            self._requests.clear()

    def log(self, req: Request) -> None:
        with self._lock:
            self._requests.append(req)

    @property
    def resource_version(self) -> str:
        return str(self.store.rv)

    def open_watches(self, plural: str | None = None) -> int:
        """Watches the client holds a stream of (their response headers sent). Counted from
        registration, a set_down() right after could cut a watch before its headers: the
        client then retried, was refused and raised MaxRetryError, not the stream's
        ProtocolError (seen twice in CI runs of the set_down test)."""
        return sum(w.answered for w in self.store.watchers(plural))

    def wait_for_watches(self, n: int, plural: str | None = None, timeout: float = 5.0) -> None:
        """Block until exactly ``n`` watches (of ``plural``) are open server-side."""
        deadline = time.monotonic() + timeout
        while self.open_watches(plural) != n:
            if time.monotonic() >= deadline:
                raise TimeoutError(f"expected {n} open watches of {plural or 'any resource'}, "
                                   f"have {self.open_watches(plural)}")
            time.sleep(0.01)

    # -- the world, set by tests (status is stored as given) ------------------------------------

    def create(self, plural: str, obj: JSON, namespace: str | None = None) -> JSON:
        return self.store.create(resource(plural), copy.deepcopy(obj), namespace, strict=False)

    def update(self, plural: str, obj: JSON, namespace: str | None = None) -> JSON:
        """Replace the object; its resourceVersion is not checked."""
        return self.store.update(resource(plural), copy.deepcopy(obj), namespace)

    def delete(self, plural: str, name: str, namespace: str | None = None) -> JSON:
        return self.store.delete(resource(plural), name, namespace)

    def get(self, plural: str, name: str, namespace: str | None = None) -> JSON:
        return self.store.get(resource(plural), name, namespace)

    def objects(self, plural: str, namespace: str | None = None) -> list[JSON]:
        return self.store.objects(resource(plural), namespace)

    def set_crd(self, crd: JSON) -> JSON:
        """Register (or replace) a CustomResourceDefinition, served by name over HTTP."""
        plural = "customresourcedefinitions"
        with self.store.lock:
            try:
                self.get(plural, crd["metadata"]["name"])
            except ApiError:
                return self.create(plural, crd)
            return self.update(plural, crd)
