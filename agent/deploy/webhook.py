"""`natgw-agent inject`: the mutating admission webhook that adds the agent to kube-ovn's
gateway pods as they are created (what it adds: agent/deploy/inject.py). An AdmissionReview
(admission.k8s.io/v1) in, the same with a JSON Patch out, over HTTPS; a handful of
threads at most, a timeout on every connection. Never refuses a pod: a request it cannot
read is allowed unchanged (the gateway then runs without the agent, as before it)."""
from __future__ import annotations

import base64
import json
import signal
import sys
import threading
from http.server import BaseHTTPRequestHandler
from typing import Any, Sequence

import structlog

from agent.ops.httpserve import BoundedServer, host_port, respond, tls_context
from agent.deploy.inject import Options, patch

log = structlog.get_logger()
MAX_BODY = 4 << 20  # an AdmissionReview of a pod is a few KiB
MAX_CONCURRENT = 8


def review(request: dict[str, Any], options: Options) -> dict[str, Any]:
    """The AdmissionReview answering `request` (one of kind AdmissionReview)."""
    req = request.get("request") or {}
    uid = req.get("uid", "")
    response: dict[str, Any] = {"uid": uid, "allowed": True}
    pod = req.get("object") if isinstance(req.get("object"), dict) else None
    ops = patch(pod, options) if pod is not None and req.get("operation", "CREATE") == "CREATE" else []
    if ops:
        response["patchType"] = "JSONPatch"
        response["patch"] = base64.b64encode(json.dumps(ops).encode()).decode()
        meta = pod.get("metadata") or {} if pod else {}
        log.info("agent added to a gateway pod", namespace=req.get("namespace", ""),
                 pod=meta.get("name") or meta.get("generateName", ""))
    return {"apiVersion": request.get("apiVersion", "admission.k8s.io/v1"), "kind": "AdmissionReview",
            "response": response}


def serve(address: tuple[str, int], cert: str, key: str, options: Options) -> BoundedServer:
    """Serve /mutate on `address` with TLS from a daemon thread; returns the server."""

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 (http.server's naming)
            length = int(self.headers.get("Content-Length") or 0)
            if self.path.split("?")[0] != "/mutate" or not 0 < length <= MAX_BODY:
                self._answer(400, {"error": "POST an AdmissionReview to /mutate"})
                return
            try:
                body = json.loads(self.rfile.read(length))
            except ValueError:
                body = {}
            self._answer(200, review(body if isinstance(body, dict) else {}, options))

        def _answer(self, code: int, body: dict[str, Any]) -> None:
            respond(self, code, "application/json", json.dumps(body).encode())

        def log_message(self, *args: Any) -> None:
            pass

    return BoundedServer(address, Handler, limit=MAX_CONCURRENT, timeout=10.0, tls=tls_context(cert, key)).start("webhook")


def run(*, listen: str, tls_cert: str, tls_key: str, agent_image: str, service_account: str, api_host: str,
        api_port: str, agent_args: Sequence[str], api_network: str, api_routes: Sequence[str]) -> int:
    """`natgw-agent inject`: serve until SIGTERM or SIGINT; 2 for options that do not go
    together (said on stderr)."""
    if not agent_image:
        print("natgw-agent inject: --agent-image (or NATGW_AGENT_IMAGE) is required", file=sys.stderr)
        return 2
    routes = tuple(tuple(r.split("=", 1)) for r in api_routes)
    if any(len(r) != 2 or not all(r) for r in routes) or (routes and not api_network):
        print("natgw-agent inject: --api-route takes DST=GW, and needs --api-network", file=sys.stderr)
        return 2
    options = Options(image=agent_image, service_account=service_account, api_host=api_host, api_port=api_port,
                      extra_args=tuple(agent_args), api_network=api_network,
                      api_routes=routes)  # type: ignore[arg-type]
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    server = serve(host_port(listen), tls_cert, tls_key, options)
    log.info("admission webhook serving", address=listen, image=agent_image)
    stop.wait()
    server.shutdown()
    return 0
