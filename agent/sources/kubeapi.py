"""The agent's calls to the Kubernetes API, through the official client's ApiClient (its
auth, TLS and proxy settings, its watch): list and watch of cluster-scoped custom
objects, an Event's create, the CRD's get. Answers are parsed as JSON, never into models.

Only the client's parts the agent uses are imported. `import kubernetes.<anything>` first
runs kubernetes/__init__.py, which imports every part of the client: the kubeconfig
loader's OIDC and Azure helpers (requests, oauthlib), the websocket stream, the dynamic
client, leader election, informers; and the typed APIs build a pydantic validator per
method. Measured in the agent: 16 MB of its memory; the parts used here, 10 MB. So the
packages `kubernetes`, `kubernetes.config` and `kubernetes.utils` are entered without running their
__init__ (their submodules import as usual), unless something imported them already.
Takes the client as Debian 13 packages it (30.1: the older ApiClient.call_api; its
kubernetes.client imports every API and model, ~6 MB more) and as PyPI has it (>= 37:
ApiClient.param_serialize, the lazy kubernetes.client)."""
from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from typing import Any

TIMEOUT = (10.0, 20.0)  # connect, read: never wait unbounded
GROUP, VERSION = "kubeovn.io", "v1"


def _enter_packages() -> None:
    for name in ("kubernetes", "kubernetes.config", "kubernetes.utils"):
        if name in sys.modules:
            continue
        spec = importlib.util.find_spec(name)
        if spec is None or spec.submodule_search_locations is None:
            return  # not installed: the imports below say so
        package = importlib.util.module_from_spec(spec)  # its __path__, without running its __init__
        sys.modules[name] = package
        if "." in name:
            parent, child = name.rsplit(".", 1)
            setattr(sys.modules[parent], child, package)


_enter_packages()

from kubernetes.client.api_client import ApiClient  # noqa: E402
from kubernetes.client.configuration import Configuration  # noqa: E402
from kubernetes.client.exceptions import ApiException  # noqa: E402
from kubernetes.watch import Watch  # noqa: E402

__all__ = ["ApiClient", "ApiException", "Configuration", "Watch", "api_client", "lister", "request"]


def api_client(kubeconfig: Path | None, token_dir: Path | None) -> ApiClient:
    """A client from a kubeconfig file, else the pod's service account (its token and CA
    at `token_dir` if given: the injector mounts them at a path of the agent's own)."""
    if kubeconfig is not None:
        from kubernetes.config.kube_config import new_client_from_config  # the heavy loader, off the pod's path

        return new_client_from_config(config_file=str(kubeconfig))
    from kubernetes.config.incluster_config import InClusterConfigLoader, load_incluster_config

    configuration = Configuration()
    if token_dir is not None:
        InClusterConfigLoader(token_filename=str(token_dir / "token"),
                              cert_filename=str(token_dir / "ca.crt")).load_and_set(configuration)
    else:
        load_incluster_config(client_configuration=configuration)
    return ApiClient(configuration)


def request(api: ApiClient, method: str, path: str, body: dict[str, Any] | None = None,
            query: list[tuple[str, Any]] | None = None, timeout: Any = TIMEOUT) -> Any:
    """One call, its answer parsed; raises ApiException on an error status, urllib3's
    errors when the API cannot be reached."""
    response = _call(api, method, path, body, query, timeout)
    response.read()
    if not 200 <= response.status < 300:
        raise ApiException(http_resp=response)
    return json.loads(response.data) if response.data else None


def _call(api: ApiClient, method: str, path: str, body: dict[str, Any] | None, query: list[tuple[str, Any]] | None,
          timeout: Any) -> Any:
    """The open response: its status, read(), data, and the urllib3 response under it."""
    headers = {"Accept": "application/json", **({"Content-Type": "application/json"} if body is not None else {})}
    if hasattr(api, "param_serialize"):
        params = api.param_serialize(method, path, query_params=query or [], header_params=headers, body=body,
                                     auth_settings=["BearerToken"])
        return api.call_api(*params, _request_timeout=timeout)
    # The older client (Debian's 30.1): one call does both, and raises ApiException on an
    # error status itself.
    return _Opened(api.call_api(path, method, query_params=query or [], header_params=headers, body=body,
                                auth_settings=["BearerToken"], _preload_content=False, _return_http_data_only=True,
                                _request_timeout=timeout))


class _Opened:
    """An older client's raw urllib3 response, as the newer one hands it over."""

    def __init__(self, raw: Any) -> None:
        self.response, self.status = raw, raw.status
        self.data = b""

    def read(self) -> bytes:
        self.data = self.response.data
        return self.data


def lister(api: ApiClient, plural: str) -> Any:
    """list_cluster_custom_object for one resource, as kubernetes.watch.Watch.stream calls
    an API function: keyword arguments in the client's spelling; with _preload_content
    False the open HTTP response (for the watch to read line by line), else the list."""
    path = f"/apis/{GROUP}/{VERSION}/{plural}"

    def list_objects(*, watch: bool | None = None, limit: int | None = None, _continue: str | None = None,
                     resource_version: str | None = None, allow_watch_bookmarks: bool | None = None,
                     timeout_seconds: int | None = None, _preload_content: bool = True,
                     _request_timeout: Any = TIMEOUT):  # type: ignore[no-untyped-def]
        # No return annotation, no ":return:" line: Watch then hands events over as parsed
        # JSON, without a second pass through the client's deserializer.
        # Booleans spelled as the API's own clients do ("true": older clients send "True").
        query = [(key, str(value).lower() if isinstance(value, bool) else value) for key, value in (
            ("allowWatchBookmarks", allow_watch_bookmarks), ("continue", _continue), ("limit", limit),
            ("resourceVersion", resource_version), ("timeoutSeconds", timeout_seconds), ("watch", watch))
            if value is not None]
        if _preload_content:
            return request(api, "GET", path, query=query, timeout=_request_timeout)
        response = _call(api, "GET", path, None, query, _request_timeout)
        if not 200 <= response.status < 300:
            response.read()
            raise ApiException(http_resp=response)
        return response.response

    return list_objects
