"""HTTP servers with bounds: at most `limit` requests in flight (more are refused at once,
never queued behind a slow one), `timeout` seconds for a whole request (TLS handshake,
reading, answering), optional TLS with the handshake in the request's own thread. For the
metrics endpoint and the admission webhook: neither may pile up threads or hold the agent."""
from __future__ import annotations

import socket
import ssl
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

_IDLE_POLL = 3600.0  # seconds serve_forever waits in select() before looking at its shutdown flag


class BoundedServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, address: tuple[str, int], handler: type[BaseHTTPRequestHandler], limit: int = 4,
                 timeout: float = 5.0, tls: ssl.SSLContext | None = None) -> None:
        super().__init__(address, handler)
        self._slots = threading.BoundedSemaphore(limit)
        self._timeout = timeout
        if tls is not None:
            # The handshake happens on the first read, in the request's thread, under its
            # timeout: a client that never finishes it cannot stall accept().
            self.socket = tls.wrap_socket(self.socket, server_side=True, do_handshake_on_connect=False)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            self.shutdown_request(request)  # busy: refuse now rather than queue
            return
        request.settimeout(self._timeout)
        super().process_request(request, client_address)

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        # A timeout per socket operation alone lets a client sending a byte every few
        # seconds hold a slot for ever: at the deadline the socket is shut, which ends the
        # read or write in progress (and every later one) in this thread.
        deadline = threading.Timer(self._timeout, _cut, args=(request,))
        deadline.daemon = True
        deadline.start()
        try:
            super().process_request_thread(request, client_address)
        finally:
            deadline.cancel()
            self._slots.release()

    def handle_error(self, request: Any, client_address: Any) -> None:
        pass  # a client that went away or timed out: nothing to report

    def start(self, name: str) -> BoundedServer:
        # socketserver's default polls twice a second for a shutdown: on this machine every
        # wake-up of a thread costs ~1.7 ms of CPU, so that alone kept an idle agent at
        # 0.34% of a core. An hour instead; shutdown() ends the wait itself.
        threading.Thread(target=self.serve_forever, args=(_IDLE_POLL,), name=name, daemon=True).start()
        return self

    def shutdown(self) -> None:
        """Stop serve_forever at once: the flag is set (by socketserver's own shutdown, in a
        thread, as it waits for the loop to end), and shutting the listening socket down
        ends the loop's wait in select() (Linux wakes a poll on a listening socket shut
        down; its accept then fails, which the loop takes in its stride). Not by connecting
        to it: in a network namespace whose lo is down (a fresh one) that never arrives,
        and the agent waited out its hour-long select on SIGTERM."""
        stopper = threading.Thread(target=super().shutdown, daemon=True)
        stopper.start()
        while stopper.is_alive():
            try:
                socket.socket.shutdown(self.socket, socket.SHUT_RDWR)  # the plain one, also under TLS
            except OSError:
                pass  # not connected (some kernels), or closed already: the join below decides
            stopper.join(0.05)


def _cut(request: socket.socket) -> None:
    try:
        # The plain socket's shutdown, also under TLS: SSLSocket's own would drop its TLS
        # state under the request's thread.
        socket.socket.shutdown(request, socket.SHUT_RDWR)
    except OSError:
        pass  # already closed: the request ended just now


def respond(handler: BaseHTTPRequestHandler, code: int, content_type: str, data: bytes) -> None:
    """One whole answer: status, type and length, body."""
    handler.send_response(code)
    handler.send_header("Content-Type", content_type)
    handler.send_header("Content-Length", str(len(data)))
    handler.end_headers()
    handler.wfile.write(data)


def tls_context(cert: str, key: str) -> ssl.SSLContext:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.load_cert_chain(cert, key)
    return context


def host_port(address: str) -> tuple[str, int]:
    """("host", port) from "host:port" or "[v6]:port"."""
    host, _, port = address.rpartition(":")
    return host.strip("[]") or "0.0.0.0", int(port)



