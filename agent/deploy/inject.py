"""What the admission webhook (agent/deploy/webhook.py) adds to a kube-ovn gateway pod: the agent
as a container of its own, as JSON Patch operations. Pure: no I/O.

kube-ovn's controller generates the gateway's StatefulSet (one replica) or, with replicas
> 1, a Deployment (HA, with a `bfdd` container), and regenerates it from its own template
whenever the gateway's spec changes: a patch of that workload would be lost, so pods are
mutated as they are created. Every gateway pod carries the label
`ovn.kubernetes.io/vpc-nat-gw: "true"` (the webhook's object selector) and the annotation
`ovn.kubernetes.io/vpc_nat_gw` with the gateway's name (there is no label with it), which
the downward API hands the agent as GATEWAY_NAME.

The agent runs in a container named `natgw-agent`, never as `vpc-nat-gw`'s process: the
controller recreates the whole pod (all flows lost) when `vpc-nat-gw` has restarted, while
a restart of another container is the kubelet's alone. Inside, `natgw-supervise`
restarts a dead worker at once (agent/deploy/supervise.py)."""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

CONTAINER = "natgw-agent"
GATEWAY_LABEL = "ovn.kubernetes.io/vpc-nat-gw"
GATEWAY_ANNOTATION = "ovn.kubernetes.io/vpc_nat_gw"
TOKEN_DIR = "/var/run/secrets/natgw-agent"  # not the automount path: that one may be taken
TOKEN_VOLUME = "natgw-agent-token"
STATE_VOLUME = "natgw-agent-state"
STATE_DIR = "/run/natgw-agent"
SERVICE_ACCOUNT = "natgw-agent"
# Set it on the VpcNatGateway (spec.annotations: kube-ovn copies those onto its pods) to
# decide masquerade for that gateway: "false" keeps client addresses in the HA form, "true"
# turns it on for one replica too. Absent (or any other value): the form decides (masquerades).
MASQUERADE_ANNOTATION = "natgw.kube-ovn.io/masquerade"


@dataclass(frozen=True)
class Options:
    image: str
    """The agent's image (`make image`: images/build.sh)."""

    service_account: str = SERVICE_ACCOUNT
    """Given to gateway pods that run under none or `default` (see account_ops); kube-ovn's
    `vpc-nat-gw`, set with its BGP speaker, is kept and bound to the agent's role too
    (images/kubernetes/rbac.yaml). It must exist in the gateway's namespace."""

    api_host: str = ""
    """KUBERNETES_SERVICE_HOST/_PORT for the agent, when the service address is not what a
    gateway pod reaches through kube-ovn's API attachment (apiNadProvider)."""

    api_port: str = ""

    extra_args: tuple[str, ...] = ()
    """More `natgw-agent run` arguments (e.g. --take-over-legacy)."""

    api_network: str = ""
    """A NetworkAttachmentDefinition ("namespace/name", a subnet of the default VPC, where
    the API server is) to attach gateway pods to, as kube-ovn's controller does itself
    only with its BGP speaker enabled (ConfigMap ovn-vpc-nat-config, apiNadProvider)."""

    api_routes: tuple[tuple[str, str], ...] = ()
    """(destination, gateway) routes through api_network, e.g. ("10.96.0.1/32", "100.64.0.1")."""

    memory_limit: str = "256Mi"
    """The container's memory limit (the agent is measured in BENCHMARKS.md)."""


def is_gateway_pod(pod: dict[str, Any]) -> bool:
    return (pod.get("metadata") or {}).get("labels", {}).get(GATEWAY_LABEL) == "true"


def agent_container(options: Options, routed: bool = False, masquerade: bool = False) -> dict[str, Any]:
    """`masquerade`: the agent runs with --masquerade (masquerades()).

    `routed`: the pod's readiness decides its traffic (routes_by_readiness). Then the
    readiness probe asks only whether this pod's data plane was programmed whole once
    (`health --routable`): a fresh replica takes no traffic it cannot serve, and a
    programmed one never leaves the routes because the API blinked, the CRD check failed
    or a worker restarted. Else it asks the agent whether it is ready (`health --ready`:
    problems show in `kubectl get pod`, and nothing is routed by it)."""
    env = [
        {"name": "GATEWAY_NAME",
         "valueFrom": {"fieldRef": {"fieldPath": f"metadata.annotations['{GATEWAY_ANNOTATION}']"}}},
        {"name": "POD_NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
        {"name": "NATGW_TOKEN_DIR", "value": TOKEN_DIR},
    ]
    if options.api_host:
        env.append({"name": "KUBERNETES_SERVICE_HOST", "value": options.api_host})
    if options.api_port:
        env.append({"name": "KUBERNETES_SERVICE_PORT", "value": options.api_port})
    probe = {"timeoutSeconds": 2, "periodSeconds": 10}
    # Routed: asked every 2 s, so a fresh replica joins the routes within ~2 s of its sync.
    ready = {"readinessProbe": {"exec": {"command": ["natgw-agent", "health", "--routable" if routed else "--ready",
                                                     "--state-dir", STATE_DIR]},
                                **probe, **({"periodSeconds": 2} if routed else {}), "failureThreshold": 1}}
    return {
        "name": CONTAINER,
        "image": options.image,
        "imagePullPolicy": "IfNotPresent",
        "command": ["natgw-supervise", "--log-format", "json", "run", "--state-dir", STATE_DIR,
                    *(["--masquerade"] if masquerade and "--masquerade" not in options.extra_args else []),
                    *options.extra_args],
        "env": env,
        # nftables and conntrack over netlink need CAP_NET_ADMIN, nothing more; the pod's
        # network namespace is the gateway's (every container of a pod shares it).
        "securityContext": {"runAsUser": 0, "allowPrivilegeEscalation": False,
                            "capabilities": {"drop": ["ALL"], "add": ["NET_ADMIN"]}},
        **ready,
        # Only a wedged loop (no turn for 30 s with work due): 6 x 10 s before the kubelet
        # restarts this container -- never the gateway's.
        "livenessProbe": {"exec": {"command": ["natgw-agent", "health", "--live", "--state-dir", STATE_DIR]},
                          **probe, "initialDelaySeconds": 10, "failureThreshold": 6},
        "resources": {"requests": {"cpu": "20m", "memory": "64Mi"}, "limits": {"memory": options.memory_limit}},
        "volumeMounts": [{"name": TOKEN_VOLUME, "mountPath": TOKEN_DIR, "readOnly": True},
                         {"name": STATE_VOLUME, "mountPath": STATE_DIR}],
    }


def token_volume() -> dict[str, Any]:
    """The pod's service account token, its CA and namespace, as the kubelet's automount
    lays them out, at a path of the agent's own. Why not the automount: ServiceAccount
    admission mounted it before the webhook, into the containers there were then, and
    not at all where automountServiceAccountToken is false."""
    return {"name": TOKEN_VOLUME, "projected": {"defaultMode": 0o444, "sources": [
        {"serviceAccountToken": {"path": "token", "expirationSeconds": 3607}},
        {"configMap": {"name": "kube-root-ca.crt", "items": [{"key": "ca.crt", "path": "ca.crt"}]}},
        {"downwardAPI": {"items": [{"path": "namespace", "fieldRef": {"fieldPath": "metadata.namespace"}}]}},
    ]}}


def patch(pod: dict[str, Any], options: Options) -> list[dict[str, Any]]:
    """JSON Patch operations adding the agent to a gateway pod; none for any other pod, or
    for one that already has it (a reinvocation)."""
    if not is_gateway_pod(pod):
        return []
    spec = pod.get("spec") or {}
    containers = spec.get("containers") or []
    if any(c.get("name") == CONTAINER for c in containers):
        return []
    container = agent_container(options, routed=routes_by_readiness(pod), masquerade=masquerades(pod))
    ops: list[dict[str, Any]] = [{"op": "add", "path": "/spec/containers/-", "value": container}]
    volumes = [token_volume(), {"name": STATE_VOLUME, "emptyDir": {"medium": "Memory", "sizeLimit": "1Mi"}}]
    if "volumes" in spec:
        ops += [{"op": "add", "path": "/spec/volumes/-", "value": v} for v in volumes]
    else:
        ops.append({"op": "add", "path": "/spec/volumes", "value": volumes})
    ops += account_ops(spec, options.service_account)
    if options.api_network:
        ops += _api_network(pod, options)
    return ops


def routes_by_readiness(pod: dict[str, Any]) -> bool:
    """Whether the pod's readiness decides if it carries traffic: anything but a
    StatefulSet's pod. kube-ovn routes an HA gateway (a Deployment's ReplicaSet) only
    through its Ready replicas (getNatGwNextHops), so its readiness must say whether its
    data plane serves (agent_container's `routed`); a StatefulSet's gateway is routed by
    its fixed LAN IP whatever its readiness, and there a not-ready agent shows in
    `kubectl get pod`."""
    owners = (pod.get("metadata") or {}).get("ownerReferences") or []
    return not any(o.get("controller") and o.get("kind") == "StatefulSet" for o in owners)


def masquerades(pod: dict[str, Any]) -> bool:
    """Whether the agent masquerades (settings.masquerade): by default in the HA form only
    (a pod of a ReplicaSet: the gateway's Deployment), where kube-ovn routes a backend's
    answer to the replica its address hashes to, not the one that NATed the connection; a
    StatefulSet's single replica gets every answer and keeps client addresses. The pod's
    annotation MASQUERADE_ANNOTATION, "true" or "false", decides instead."""
    said = ((pod.get("metadata") or {}).get("annotations") or {}).get(MASQUERADE_ANNOTATION)
    if said in ("true", "false"):
        return said == "true"
    owners = (pod.get("metadata") or {}).get("ownerReferences") or []
    return any(o.get("controller") and o.get("kind") == "ReplicaSet" for o in owners)


def account_ops(spec: dict[str, Any], account: str) -> list[dict[str, Any]]:
    """The pod's service account for the agent's token. The API server's ServiceAccount
    admission runs before mutating webhooks, so a pod that named none arrives as
    `default` (its kube-api-access-* volume already added): that is replaced, any other
    account (kube-ovn's `vpc-nat-gw` with its BGP speaker) was chosen and is kept. The
    deprecated `serviceAccount`, when present, is made to agree (else it contradicts the
    name kubectl and the kubelet read). Tokens follow the pod's account, so the
    automount volume and the agent's own (token_volume) both carry the one kept here."""
    chosen = spec.get("serviceAccountName") or spec.get("serviceAccount") or ""
    wanted = account if chosen in ("", "default") else chosen
    return [{"op": "add", "path": f"/spec/{field}", "value": wanted}
            for field in ("serviceAccountName", "serviceAccount")
            if spec.get(field) != wanted and (field == "serviceAccountName" or field in spec)]


NETWORKS = "k8s.v1.cni.cncf.io/networks"


def _api_network(pod: dict[str, Any], options: Options) -> list[dict[str, Any]]:
    """The API attachment and its routes, as kube-ovn's setNatGwAPIAccess would add them."""
    annotations = (pod.get("metadata") or {}).get("annotations") or {}
    namespace, _, name = options.api_network.partition("/")
    attached = [n.strip() for n in annotations.get(NETWORKS, "").split(",") if n.strip()]
    ops: list[dict[str, Any]] = []
    if not annotations:
        ops.append({"op": "add", "path": "/metadata/annotations", "value": {}})
    if options.api_network not in attached:
        ops.append({"op": "add", "path": f"/metadata/annotations/{_pointer(NETWORKS)}",
                    "value": ",".join([*attached, options.api_network])})
    if options.api_routes:
        key = f"{name}.{namespace}.ovn.kubernetes.io/routes"  # the provider name.namespace.ovn's
        routes = json.dumps([{"dst": dst, "gw": gw} for dst, gw in options.api_routes], separators=(",", ":"))
        ops.append({"op": "add", "path": f"/metadata/annotations/{_pointer(key)}", "value": routes})
    return ops


def _pointer(key: str) -> str:
    """A map key as one JSON Pointer token (RFC 6901)."""
    return key.replace("~", "~0").replace("/", "~1")
