"""The benchmark's identities, the same for every approach, and their manifests.

Identity i (0-based) is `172.18.<e // 250>.<e % 250 + 1>:<1000 + i % 100>/tcp` with
e = i // 100: 100 ports per EIP, so 10,000 identities use 100 EIPs. Its 4 backends are
`10.1.<k // 250>.<k % 250 + 1>:8080` for k = 4i .. 4i+3, all distinct (from k = 62,500 on,
10.11.x.y and up). ClientIP runs give
every identity a 600 s timeout."""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, replace
from pathlib import Path

BACKENDS = 4
BACKEND_PORT = 8080
TIMEOUT = 600
# Identities per manifest file: a change rewrites one file, which the source reads again
# before the sync; 100 (400 rules), so one change is the same work at every size from 100
# up (with 1,000 per file, the read before a change at 10,000 was 10x the one at 100, and
# the sync after it ran in colder caches: 1.3 ms, 2x the 0.63 ms at 100).
RULES_PER_FILE_IDENTITIES = 100


@dataclass(frozen=True)
class Identity:
    index: int
    eip: str
    port: int
    proto: str
    backends: tuple[tuple[str, int], ...]
    affinity: bool

    @property
    def h(self) -> str:
        """The legacy script's chain hash: md5("eip:port:proto")[:12]."""
        return hashlib.md5(f"{self.eip}:{self.port}:{self.proto}".encode()).hexdigest()[:12]

    def rule_name(self, j: int) -> str:
        return f"r{self.index}-{j}"

    def eip_name(self) -> str:
        return "eip-" + self.eip.replace(".", "-")


def backend_hash(ip: str, port: int) -> str:
    """The legacy script's per-backend hash: md5("ip:port")[:8]."""
    return hashlib.md5(f"{ip}:{port}".encode()).hexdigest()[:8]


def _eip(e: int) -> str:
    return f"172.18.{e // 250}.{e % 250 + 1}"


def _backend_ip(k: int) -> str:
    # 10.1.0.1 .. 10.1.249.250 for the first 62,500 backends (15,625 identities: every
    # size measured before 20,000), then 10.11.x.y, 10.12.x.y, ... (10.2 and 10.3 are
    # the changed backends' addresses).
    octet = 1 if k < 62500 else 10 + k // 62500
    return f"10.{octet}.{(k // 250) % 250}.{k % 250 + 1}"


def identities(n: int, affinity: bool) -> list[Identity]:
    return [
        Identity(i, _eip(i // 100), 1000 + i % 100, "tcp",
                 tuple((_backend_ip(BACKENDS * i + j), BACKEND_PORT) for j in range(BACKENDS)), affinity)
        for i in range(n)
    ]


CHANGED_IP = "10.2.0.1"
CHANGED_IP_2 = "10.2.0.2"  # the agent's second change (through the run loop's incremental path)


def changed(identity: Identity, ip: str = CHANGED_IP) -> Identity:
    """The one-change case: the identity's last backend replaced by another address."""
    return replace(identity, backends=identity.backends[:-1] + ((ip, BACKEND_PORT),))


def changed_index(n: int) -> int:
    return n // 2


# --- manifests for the agent (IptablesEIP + IptablesDnatRule, as the API returns them) ---

def _rule_object(ident: Identity, j: int, backend: tuple[str, int]) -> dict:
    spec = {
        "eip": ident.eip_name(),
        "externalPort": str(ident.port),
        "protocol": ident.proto,
        "internalIp": backend[0],
        "internalPort": str(backend[1]),
        "type": "share",
    }
    if ident.affinity:
        spec["sessionAffinity"] = "ClientIP"
        spec["sessionAffinityTimeoutSeconds"] = TIMEOUT
    return {
        "apiVersion": "kubeovn.io/v1",
        "kind": "IptablesDnatRule",
        "metadata": {
            "name": ident.rule_name(j),
            "resourceVersion": "1",
            "finalizers": ["kubeovn.io/kube-ovn-controller"],
            "labels": {"ovn.kubernetes.io/vpc-nat-gw-name": "gw1", "ovn.kubernetes.io/vpc_dnat_eport": str(ident.port)},
        },
        "spec": spec,
        "status": {"ready": True, "v4ip": ident.eip, "natGwDp": "gw1"},
    }


def _eip_object(name: str, address: str) -> dict:
    return {
        "apiVersion": "kubeovn.io/v1",
        "kind": "IptablesEIP",
        "metadata": {"name": name, "resourceVersion": "1"},
        "spec": {"v4ip": address, "natGwDp": "gw1", "externalSubnet": "ovn-vpc-external-network"},
        "status": {"ready": True, "ip": address},
    }


def _write_atomic(path: Path, doc: dict) -> None:
    tmp = path.with_name("." + path.name + ".tmp")
    tmp.write_text(json.dumps(doc, separators=(",", ":")), encoding="utf-8")
    tmp.replace(path)  # a new inode: the directory source sees the change for sure


def rules_file(directory: Path, chunk: int) -> Path:
    return directory / f"rules-{chunk:03d}.json"


def write_rules_chunk(directory: Path, idents: list[Identity], chunk: int) -> None:
    lo = chunk * RULES_PER_FILE_IDENTITIES
    items = [_rule_object(x, j, b) for x in idents[lo:lo + RULES_PER_FILE_IDENTITIES] for j, b in enumerate(x.backends)]
    _write_atomic(rules_file(directory, chunk), {"apiVersion": "v1", "kind": "List", "items": items})


def write_manifests(directory: Path, idents: list[Identity]) -> int:
    """eips.json (every EIP) and rules-NNN.json (1,000 identities = 4,000 rules each), all
    `kind: List` JSON. Returns the number of files."""
    directory.mkdir(parents=True, exist_ok=True)
    eips = sorted({(x.eip_name(), x.eip) for x in idents})
    _write_atomic(directory / "eips.json", {"apiVersion": "v1", "kind": "List", "items": [_eip_object(*e) for e in eips]})
    chunks = (len(idents) + RULES_PER_FILE_IDENTITIES - 1) // RULES_PER_FILE_IDENTITIES
    for c in range(chunks):
        write_rules_chunk(directory, idents, c)
    return chunks + 1
