"""The webhook over real HTTPS: an AdmissionReview in, a JSON Patch out; never a refusal."""
from __future__ import annotations

import base64
import json
import ssl
import subprocess
import urllib.request
from pathlib import Path
from typing import Any

import jsonpatch
import pytest
import yaml

from agent.deploy.inject import CONTAINER, Options
from agent.deploy.webhook import review, serve

FIXTURES = Path(__file__).parent / "fixtures" / "kube-ovn"
OPTIONS = Options(image="registry.example/natgw-agent:1.0")


def admission(pod: dict[str, Any], operation: str = "CREATE") -> dict[str, Any]:
    return {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
            "request": {"uid": "705ab4f5-6393-11e8-b7cc-42010a800002", "operation": operation,
                        "namespace": pod["metadata"]["namespace"], "object": pod,
                        "kind": {"group": "", "version": "v1", "kind": "Pod"}}}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Any:
    d = tmp_path_factory.mktemp("tls")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1",
                    "-keyout", str(d / "tls.key"), "-out", str(d / "tls.crt")], check=True, capture_output=True)
    srv = serve(("127.0.0.1", 0), str(d / "tls.crt"), str(d / "tls.key"), OPTIONS)
    yield srv, d / "tls.crt"
    srv.shutdown()


def post(server: Any, body: bytes) -> tuple[int, dict[str, Any]]:
    srv, ca = server
    context = ssl.create_default_context(cafile=str(ca))
    req = urllib.request.Request(f"https://127.0.0.1:{srv.server_address[1]}/mutate", data=body,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, context=context, timeout=5) as answer:
            return answer.status, json.loads(answer.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def test_a_gateway_pod_gets_the_agent_over_https(server: Any) -> None:
    pod = yaml.safe_load((FIXTURES / "statefulset-pod.yaml").read_text())
    status, answer = post(server, json.dumps(admission(pod)).encode())
    assert status == 200 and answer["kind"] == "AdmissionReview"
    response = answer["response"]
    assert response["uid"] == "705ab4f5-6393-11e8-b7cc-42010a800002" and response["allowed"] is True
    assert response["patchType"] == "JSONPatch"
    after = jsonpatch.apply_patch(pod, json.loads(base64.b64decode(response["patch"])))
    assert [c["name"] for c in after["spec"]["containers"]] == ["vpc-nat-gw", CONTAINER]


def test_anything_else_is_allowed_unchanged(server: Any) -> None:
    pod = yaml.safe_load((FIXTURES / "statefulset-pod.yaml").read_text())
    for body in (admission(pod, "UPDATE"), admission({**pod, "metadata": {**pod["metadata"], "labels": {}}}), {}):
        status, answer = post(server, json.dumps(body).encode())
        assert status == 200 and answer["response"]["allowed"] is True and "patch" not in answer["response"]
    status, answer = post(server, b"not json")
    assert status == 200 and answer["response"]["allowed"] is True
    assert review({"request": {"uid": "x", "object": "nonsense"}}, OPTIONS)["response"] == {"uid": "x", "allowed": True}
