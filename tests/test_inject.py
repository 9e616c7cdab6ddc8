"""The injection, on gateway pods exactly as kube-ovn's controller makes them (both forms:
tests/fixtures/kube-ovn/), patched by an independent JSON Patch implementation as the API
server would, then checked field by field and through the kubernetes client's own model."""
from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import jsonpatch
import pytest
import yaml
from kubernetes.client import ApiClient

from agent.deploy.inject import (CONTAINER, GATEWAY_ANNOTATION, MASQUERADE_ANNOTATION, STATE_DIR, TOKEN_DIR, Options,
                                 patch)
from tests.builders import ROOT

FIXTURES = Path(__file__).parent / "fixtures" / "kube-ovn"
OPTIONS = Options(image="registry.example/natgw-agent:1.0")
FORMS = ["statefulset-pod.yaml", "deployment-pod.yaml", "deployment-bgp-pod.yaml"]
AUTOMOUNT = "/var/run/secrets/kubernetes.io/serviceaccount"


def pod(name: str) -> dict[str, Any]:
    return yaml.safe_load((FIXTURES / name).read_text())


def mutated(original: dict[str, Any], options: Options = OPTIONS) -> dict[str, Any]:
    return jsonpatch.apply_patch(original, patch(original, options))


@pytest.mark.parametrize("name", FORMS)
def test_the_agent_joins_the_gateway_pod_as_a_container_of_its_own(name: str) -> None:
    original = pod(name)
    after = mutated(original)
    containers = {c["name"]: c for c in after["spec"]["containers"]}
    # Everything kube-ovn put there stays exactly as it was, first in line.
    assert after["spec"]["containers"][:len(original["spec"]["containers"])] == original["spec"]["containers"]
    assert containers["vpc-nat-gw"]["command"] == ["sleep", "infinity"]
    agent = containers[CONTAINER]
    assert agent["image"] == OPTIONS.image and agent["command"][0] == "natgw-supervise"
    env = {e["name"]: e for e in agent["env"]}
    assert env["GATEWAY_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == f"metadata.annotations['{GATEWAY_ANNOTATION}']"
    assert original["metadata"]["annotations"][GATEWAY_ANNOTATION]  # ... which the controller sets
    assert env["POD_NAMESPACE"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.namespace"
    assert env["NATGW_TOKEN_DIR"]["value"] == TOKEN_DIR
    assert agent["livenessProbe"]["exec"]["command"][:3] == ["natgw-agent", "health", "--live"]
    assert "ports" not in agent  # nothing on the tenant's network
    assert agent["securityContext"]["capabilities"] == {"drop": ["ALL"], "add": ["NET_ADMIN"]}
    volumes = {v["name"]: v for v in after["spec"]["volumes"]}
    for mount in agent["volumeMounts"]:
        assert mount["name"] in volumes
    token = volumes[agent["volumeMounts"][0]["name"]]["projected"]["sources"]
    assert {"serviceAccountToken": {"path": "token", "expirationSeconds": 3607}} in token
    # The agent's token is its own volume's: admission mounted kube-api-access-* before the
    # webhook, into kube-ovn's containers only, and those mounts stay as they were.
    assert agent["volumeMounts"][0]["mountPath"] == TOKEN_DIR != AUTOMOUNT
    assert not any(m["name"].startswith("kube-api-access-") for m in agent["volumeMounts"])
    assert all(any(m["mountPath"] == AUTOMOUNT for m in c["volumeMounts"]) for c in original["spec"]["containers"])
    # No mount path taken twice in any container (the automount path stays kube-ovn's).
    for c in after["spec"]["containers"]:
        paths = [m["mountPath"] for m in c.get("volumeMounts", [])]
        assert len(paths) == len(set(paths)), c["name"]
    assert len(volumes) == len(after["spec"]["volumes"])  # no volume name twice
    # The client's own model keeps every field: none misspelt or misplaced.
    client = ApiClient()
    model = client._ApiClient__deserialize(copy.deepcopy(after), "V1Pod")  # type: ignore[attr-defined]
    assert client.sanitize_for_serialization(model)["spec"]["containers"][-1] == agent


def account(after: dict[str, Any]) -> tuple[str, str | None]:
    return after["spec"]["serviceAccountName"], after["spec"].get("serviceAccount")


def test_the_default_account_admission_gave_is_replaced_and_a_chosen_one_kept() -> None:
    for name in ("statefulset-pod.yaml", "deployment-pod.yaml"):  # `default`, as the webhook receives them
        assert account(pod(name)) == ("default", "default")
        assert account(mutated(pod(name))) == (OPTIONS.service_account, OPTIONS.service_account)
    bgp = pod("deployment-bgp-pod.yaml")  # kube-ovn's BGP speaker needs its own account
    assert account(mutated(bgp)) == ("vpc-nat-gw", "vpc-nat-gw")
    assert not [op for op in patch(bgp, OPTIONS) if op["path"].startswith("/spec/serviceAccount")]


def test_the_deprecated_account_field_never_contradicts() -> None:
    bare = pod("statefulset-pod.yaml")  # ServiceAccount admission off: neither field
    del bare["spec"]["serviceAccountName"], bare["spec"]["serviceAccount"]
    assert account(mutated(bare)) == (OPTIONS.service_account, None)
    stale = pod("deployment-bgp-pod.yaml")
    stale["spec"]["serviceAccount"] = "default"  # the name wins in the API server: make them agree
    assert account(mutated(stale)) == ("vpc-nat-gw", "vpc-nat-gw")
    alias = pod("statefulset-pod.yaml")
    alias["spec"]["serviceAccountName"], alias["spec"]["serviceAccount"] = "", "speaker"  # only the old field
    assert account(mutated(alias)) == ("speaker", "speaker")


def test_every_account_a_gateway_pod_ends_up_with_is_bound_to_the_agents_roles() -> None:
    docs = list(yaml.safe_load_all((ROOT / "images" / "kubernetes" / "rbac.yaml").read_text()))
    for kind in ("ClusterRoleBinding", "RoleBinding"):
        (binding,) = [d for d in docs if d["kind"] == kind]
        bound = {s["name"] for s in binding["subjects"] if s["kind"] == "ServiceAccount"}
        assert {account(mutated(pod(name)))[0] for name in FORMS} <= bound, kind


def test_readiness_routes_a_replica_once_programmed_and_asks_the_agent_where_it_routes_nothing() -> None:
    sts = mutated(pod("statefulset-pod.yaml"))["spec"]["containers"][-1]  # routed by its fixed LAN IP
    assert sts["readinessProbe"]["exec"]["command"][:3] == ["natgw-agent", "health", "--ready"]
    for name in ("deployment-pod.yaml", "deployment-bgp-pod.yaml"):
        # HA: kube-ovn routes through Ready replicas only: a fresh replica not before its
        # first full sync, a programmed one whatever the API or a restarting worker does.
        containers = mutated(pod(name))["spec"]["containers"]
        probe = containers[-1]["readinessProbe"]
        assert probe["exec"]["command"][:3] == ["natgw-agent", "health", "--routable"] and containers[-1]["livenessProbe"]
        assert probe["exec"]["command"][-2:] == ["--state-dir", STATE_DIR]  # the pod's state volume: survives a worker
        assert containers[:-1] == pod(name)["spec"]["containers"]  # bfdd's readiness stays kube-ovn's
    orphan = pod("statefulset-pod.yaml")
    del orphan["metadata"]["ownerReferences"]  # not known to be routed by its IP: the safe side
    assert "--routable" in mutated(orphan)["spec"]["containers"][-1]["readinessProbe"]["exec"]["command"]


def test_other_pods_and_already_injected_ones_are_left_alone() -> None:
    other = pod("statefulset-pod.yaml")
    del other["metadata"]["labels"]["ovn.kubernetes.io/vpc-nat-gw"]
    assert patch(other, OPTIONS) == []
    once = mutated(pod("statefulset-pod.yaml"))
    assert patch(once, OPTIONS) == []  # a reinvocation adds nothing twice


def test_options_reach_the_container() -> None:
    options = Options(image="i:1", api_host="10.96.0.1", api_port="443", extra_args=("--take-over-legacy",))
    agent = mutated(pod("statefulset-pod.yaml"), options)["spec"]["containers"][-1]
    env = {e["name"]: e.get("value") for e in agent["env"]}
    assert env["KUBERNETES_SERVICE_HOST"] == "10.96.0.1" and env["KUBERNETES_SERVICE_PORT"] == "443"
    assert agent["command"][-1] == "--take-over-legacy"


def test_the_api_attachment_kube_ovn_adds_only_with_its_bgp_speaker() -> None:
    options = Options(image="i:1", api_network="default/api-net", api_routes=(("10.96.0.1/32", "100.64.0.1"),))
    after = mutated(pod("statefulset-pod.yaml"), options)
    annotations = after["metadata"]["annotations"]
    assert annotations["k8s.v1.cni.cncf.io/networks"] == "kube-system/ovn-vpc-external-network,default/api-net"
    assert annotations["api-net.default.ovn.kubernetes.io/routes"] == '[{"dst":"10.96.0.1/32","gw":"100.64.0.1"}]'
    already = mutated(pod("deployment-bgp-pod.yaml"), options)["metadata"]["annotations"]  # BGP: attached already
    assert already["k8s.v1.cni.cncf.io/networks"] == "kube-system/ovn-vpc-external-network,default/api-net"


def test_the_ha_form_masquerades_unless_its_gateway_says_not_to() -> None:
    """Issue 29: a Deployment's replica (kube-ovn routes answers by the backend's address,
    not to the replica that NATed) runs with --masquerade; a StatefulSet's keeps client
    addresses; the gateway's annotation (VpcNatGateway spec.annotations, copied onto its
    pods) decides either way; anything else it says leaves the form's default."""
    def command(name: str, said: str | None = None, options: Options = OPTIONS) -> list[str]:
        original = pod(name)
        if said is not None:
            original["metadata"].setdefault("annotations", {})[MASQUERADE_ANNOTATION] = said
        return mutated(original, options)["spec"]["containers"][-1]["command"]

    for name in ("deployment-pod.yaml", "deployment-bgp-pod.yaml"):
        assert "--masquerade" in command(name)
        assert "--masquerade" not in command(name, "false")
        assert "--masquerade" in command(name, "False")  # not a value it knows: the form's default
    assert "--masquerade" not in command("statefulset-pod.yaml")
    assert "--masquerade" in command("statefulset-pod.yaml", "true")
    twice = command("deployment-pod.yaml", options=Options(image="i:1", extra_args=("--masquerade",)))
    assert twice.count("--masquerade") == 1
