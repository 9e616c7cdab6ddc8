"""The fake API server over TLS, as the agent in its container reaches the API: the
kubernetes client verifies the fake's certificate against the CA it is given (the pod's
ca.crt), lists and watches; a client that does not trust the CA is refused; an outage cuts
a watch over TLS as it does one over plain HTTP."""
from __future__ import annotations

from pathlib import Path
from typing import Iterator

import pytest
import urllib3
from kubernetes import client

from tests.kubefake import FakeKube
from tests.kubefake.tls import Certs, make_certs

G, V, RULES = "kubeovn.io", "v1", "iptables-dnat-rules"


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Certs:
    return make_certs(tmp_path_factory.mktemp("certs"), "127.0.0.1")


@pytest.fixture
def fake(certs: Certs) -> Iterator[FakeKube]:
    with FakeKube(tls=certs.server_context()) as fk:
        yield fk


def api(url: str, ca: Path | None) -> client.ApiClient:
    cfg = client.Configuration()
    cfg.host, cfg.proxy, cfg.retries = url, None, False
    cfg.ssl_ca_cert = str(ca) if ca else None
    return client.ApiClient(cfg)


def rule(name: str) -> dict[str, object]:
    return {"apiVersion": f"{G}/{V}", "kind": "IptablesDnatRule", "metadata": {"name": name}, "spec": {}}


def test_a_client_trusting_the_ca_lists_and_watches_over_tls(fake: FakeKube, certs: Certs) -> None:
    assert fake.url.startswith("https://127.0.0.1:")
    fake.create(RULES, rule("r1"))
    with api(fake.url, certs.ca) as c:
        crd = client.CustomObjectsApi(c)
        listed = crd.list_cluster_custom_object(G, V, RULES)
        assert [o["metadata"]["name"] for o in listed["items"]] == ["r1"]
        fake.create(RULES, rule("r2"))
        stream = crd.list_cluster_custom_object(G, V, RULES, watch=True, resource_version=listed["metadata"][
            "resourceVersion"], _preload_content=False, timeout_seconds=2)
        line = next(stream.stream(decode_content=False))
        assert b'"r2"' in line
        fake.set_down(True)  # the outage cuts the TLS watch
        with pytest.raises((urllib3.exceptions.ProtocolError, StopIteration)):
            for _ in range(100):
                next(stream.stream())
        fake.set_down(False)
    assert [r.verb for r in fake.requests] == ["list", "watch"]


def test_a_client_not_trusting_the_ca_is_refused(fake: FakeKube) -> None:
    with api(fake.url, None) as c, pytest.raises(client.ApiException, match="CERTIFICATE_VERIFY_FAILED"):
        client.CustomObjectsApi(c).list_cluster_custom_object(G, V, RULES)
