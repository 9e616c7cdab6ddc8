"""HTTP/1.1 for the fake: the handler of one connection, which logs each request, routes it to
the store and writes watches as chunked streams of JSON lines, the way the API server does."""
from __future__ import annotations

import json
import queue
import select
import socket
import ssl
import time
import traceback
from http.server import BaseHTTPRequestHandler
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qs, urlsplit

from .protocol import RESOURCES, ApiError, Request, ResourceType, bool_param, parse_request
from .store import BREAK, END, Item

if TYPE_CHECKING:
    from .fake import FakeKube


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive and chunked encoding, like the API server
    # TCP_NODELAY, as Go's net/http sets it: else the body waits behind the headers for the
    # client's delayed ACK, 40 ms an answer (3 s of a 40,000-rule list in pages of 500).
    disable_nagle_algorithm = True
    server: FakeKube  # type: ignore[assignment]  # the fake stands in for socketserver's server

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - inherited signature
        pass  # the structured request log is FakeKube.requests

    def _dispatch(self) -> None:
        split = urlsplit(self.path)
        query = {k: v[-1] for k, v in parse_qs(split.query, keep_blank_values=True).items()}
        req, version = parse_request(self.command, split.path, query)
        self.server.log(req)
        self._streaming = False
        try:
            self._route(req, version, query, self._read_body())
        except ApiError as exc:
            self._send_json(exc.code, exc.status())
        except OSError:
            raise  # a cut connection; the listener keeps quiet about it
        except Exception as exc:  # a bug in the fake: loud, and a 500 rather than a dropped
            traceback.print_exc()  # connection (which urllib3 would silently retry)
            self.close_connection = True
            if not self._streaming:
                self._send_json(500, ApiError(500, f"FakeKube bug: {exc!r}").status())

    do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = _dispatch

    def _route(self, req: Request, version: str, query: dict[str, str], body: bytes) -> None:
        rtype = RESOURCES.get(req.resource or "")
        if (rtype is None or (rtype.group, rtype.version) != (req.api_group, version)
                or rtype.namespaced != (req.namespace is not None)):
            raise ApiError(404, "the server could not find the requested resource")
        if req.verb not in rtype.verbs or (req.verb == "get") != (req.name is not None):
            raise ApiError(405, f"FakeKube does not serve {req.verb} on {req.path}")
        self.server.take_failure(req.verb)
        store = self.server.store
        if req.verb == "list":
            token, rv = query.get("continue", ""), query.get("resourceVersion", "")
            if token and rv not in ("", "0"):
                raise ApiError(400, "specifying resource version is not allowed when using continue")
            if rv and not token:
                raise ApiError(400, f"FakeKube lists only at the latest version, not resourceVersion={rv!r}")
            self._send_json(200, store.list(rtype, _int(query, "limit"), token))
        elif req.verb == "watch":
            self._stream_watch(rtype, query)
        elif req.verb == "create":
            self._send_json(201, store.create(rtype, _object(body), req.namespace, strict=True))
        else:
            self._send_json(200, store.get(rtype, req.name or "", req.namespace))

    def _read_body(self) -> bytes:
        if "chunked" in (self.headers.get("Transfer-Encoding") or "").lower():
            self.close_connection = True  # the fake cannot find where it ends
            raise ApiError(400, "chunked request bodies are not supported by FakeKube")
        return self.rfile.read(int(self.headers.get("Content-Length") or 0))

    def _send_json(self, code: int, obj: Any) -> None:
        data = json.dumps(obj).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    # -- watch ----------------------------------------------------------------------------------

    def _stream_watch(self, rtype: ResourceType, query: dict[str, str]) -> None:
        rv = query.get("resourceVersion", "")
        if rv in ("", "0"):
            raise ApiError(400, "FakeKube watches only from a resourceVersion (a list's), not from "
                                f"resourceVersion={rv!r}")
        if not rv.isdigit():
            raise ApiError(400, f"invalid resource version: {rv!r}")
        timeout = _int(query, "timeoutSeconds")
        fake = self.server
        watcher = fake.store.open_watch(rtype, int(rv), bool_param(query.get("allowWatchBookmarks")))
        self._streaming, clean = True, False
        try:
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            watcher.answered = True
            now = time.monotonic()
            deadline = now + timeout if timeout > 0 else None  # then a clean end, like the API server
            interval = fake.bookmark_interval if watcher.bookmarks else None
            next_bookmark = now + interval if interval else None
            while True:
                now = time.monotonic()
                if next_bookmark is not None and interval and now >= next_bookmark:
                    fake.store.bookmark(watcher)  # queued: it follows any pending event
                    next_bookmark = now + interval
                wait = min([0.25] + [max(t - now, 0.0) for t in (deadline, next_bookmark) if t is not None])
                try:
                    item: Item = END if deadline is not None and now >= deadline else watcher.queue.get(timeout=wait)
                except queue.Empty:
                    if self._client_gone():
                        break
                    continue
                if item in (END, BREAK):
                    fake.store.close_watch(watcher)  # before the client can see the end: tests
                    #                                  wait on open watches for its next one
                if item == END:
                    self.wfile.write(b"0\r\n\r\n")
                    clean = True
                    break
                if item == BREAK:
                    self.connection.shutdown(socket.SHUT_RDWR)
                    break
                line = json.dumps(item).encode() + b"\n"
                self.wfile.write(b"%x\r\n%s\r\n" % (len(line), line))
        except OSError:
            pass  # the client went away, or the connection was cut under us
        finally:
            fake.store.close_watch(watcher)
            self.close_connection = not clean

    def _client_gone(self) -> bool:
        # A watch client that hung up shows as a readable socket with nothing to read. Over
        # TLS it cannot be peeked at, and a client in a watch sends nothing until it hangs up
        # (a close_notify alert, or the end of the stream): readable is gone.
        try:
            readable, _, _ = select.select([self.connection], [], [], 0)
            if readable and isinstance(self.connection, ssl.SSLSocket):
                return True
            return bool(readable) and self.connection.recv(1, socket.MSG_PEEK) == b""
        except (OSError, ValueError):
            return True


def _int(query: dict[str, str], name: str) -> int:
    try:
        return int(query.get(name) or 0)
    except ValueError:
        raise ApiError(400, f"invalid {name}: {query[name]!r}") from None


def _object(body: bytes) -> Any:
    try:
        obj = json.loads(body)
    except ValueError:
        raise ApiError(400, "request body is not valid JSON") from None
    if not isinstance(obj, dict):
        raise ApiError(400, "request body must be a JSON object")
    return obj
