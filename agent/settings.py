"""All knobs of the agent in one place: one Settings object, passed whole; the
Kubernetes watch's knobs nested in it (settings.watch)."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class WatchSettings:
    """How the Kubernetes source lists and watches."""

    server_timeout: float = 300.0
    """Watch timeoutSeconds asked of the server; randomised up to 2x per request so many
    gateways do not reconnect in step (client-go does the same)."""

    connect_timeout: float = 10.0
    """Seconds to establish a connection to the API server."""

    inactivity_timeout: float = 660.0
    """Seconds without a byte on a watch before it is treated as dead and resumed: longer
    than the server timeout, so it only fires when the stream is wedged."""

    list_page_size: int = 500
    """Objects per page of a list (limit/continue); client-go's reflector asks for 500.
    Bounds what one answer costs in memory: ~1 MB of JSON at a time, not the whole list."""

    backoff_min: float = 0.8
    """First reconnect delay after a failure, in seconds (doubles, with jitter)."""

    backoff_max: float = 30.0
    """Cap of the reconnect delay, in seconds."""


@dataclass(frozen=True)
class Settings:
    gateway: str = ""
    """Name of the VPC NAT gateway this agent serves (IptablesEIP.spec.natGwDp); the
    command line defaults it to $GATEWAY_NAME."""

    from_dir: Path | None = None
    """Directory of IptablesDnatRule/IptablesEIP manifests; None means the Kubernetes API."""

    kubeconfig: Path | None = None
    """Kubeconfig for the Kubernetes source; None means the in-cluster service account."""

    token_dir: Path | None = None
    """Where the in-cluster token and ca.crt are, if not at the automount path (the
    injector mounts them at a path of the agent's own: agent/deploy/inject.py)."""

    event_namespace: str = "default"
    """Namespace of the Events the agent records (its objects are cluster-scoped)."""

    metrics_addr: str = "127.0.0.1:10299"
    """host:port of /metrics and the HTTP health endpoints (/healthz, /livez, /readyz).
    Loopback: in a gateway pod, reachable from the pod only. The pod's IP is on eth0, in the
    tenant's VPC: binding it exposes every identity and backend address to every workload
    there (the exec probes use the status socket, not this). 10299 is used by no Kubernetes
    component."""

    healthz_stale_after: float = 60.0
    """/healthz fails once a change has waited longer than this many seconds (kube-proxy:
    2 x its 30 s sync period)."""

    livez_wedged_after: float = 30.0
    """/livez fails when the loop has not turned for this many seconds."""

    state_dir: Path = Path("/run/natgw-agent")
    """Where the agent keeps its status socket (agent.sock): `natgw-agent health` and `show`
    ask it there; nothing about the agent's state is served on the network."""

    table: str = "natgw"
    """The one nftables table (family ip) the agent owns. It never touches any other."""

    priority: int = -160
    """Priority of the nat prerouting base chain: below the legacy kube-ovn table (-150),
    so the agent binds NAT first for the identities it serves."""

    poll_interval: float = 0.2
    """Seconds between scans of the rules directory where inotify is unavailable, and how
    long a file written in place (not closed, not renamed in) must hold still before it
    is read."""

    coalesce_window: float = 0.005
    """Changes arriving together go in one transaction: after a change, the loop waits
    while more keep coming (until 1 ms of quiet, 2.5 ms within a burst: agent/run/loop.py),
    at most this long."""

    idle_wakeup: float = 300.0
    """Longest the loop sleeps with nothing due (a safety net: sources, the kernel and
    liveness probes wake it, and systemd's watchdog is pinged at half its period). Every
    wake-up of an idle agent cost ~25 ms of CPU on this machine: 300 s keeps that at 0.01%."""

    resync_interval: float = 3600.0
    """Seconds between full resyncs (kernel read back, plan against it), as kube-proxy does."""

    retry_min: float = 0.5
    """First retry delay after a failed apply, in seconds; doubles on each failure."""

    retry_max: float = 30.0
    """Cap of the retry delay, in seconds."""

    retire_delay: float = 1.0
    """Seconds an emptied chain waits before it is deleted in a transaction of its own
    (kernels before 6.2 may refuse to delete it in the batch that unlinks it)."""

    max_transaction_elements: int = 10000
    """Most map elements in one transaction of a plan that only adds (a table programmed
    from empty): more go in further transactions, each with whole identities
    (plan.chunked). libnftables holds ~2.7 KB per element while it works."""

    max_backends: int = 256
    """Most backends one identity may have; beyond it the identity is rejected as a whole."""

    max_identities: int = 20000
    """Most identities one gateway serves; beyond it new identities are refused (each rule
    reported) until others go. Twice the 10,000 the agent is measured at."""

    affinity_set_size: int = 262144
    """Capacity of each shared ClientIP affinity set (one per backend slot); when full,
    new clients are still balanced, only without stickiness."""

    take_over_legacy: bool = False
    """Remove the legacy `ip kube-ovn` table's objects for the identities the agent
    programs, in the agent's own transaction (migration from nat-gateway.sh)."""

    conntrack: bool = True
    """Reconcile conntrack by state after each change (agent/core/flows.py): entries of removed
    identities go, and UDP entries not NATed to a current backend of their identity."""

    cleanup_slice: int = 2000
    """Most stale affinity entries deleted in one transaction, one per loop turn (~20 ms of
    libnftables at ~10 us an element), so a change never waits behind a long delete."""

    consistent_choice: bool = True
    """A ClientIP identity's client with no pin goes to the backend its address hashes to
    in a table computed from the backends alone (agent/core/consistent.py), the same on
    every replica of an HA gateway (issue 21). Off: a random backend, as kube-proxy picks,
    for 61 map elements less per ClientIP identity (10,000 of them: 610,000 elements, most
    of a full sync's time and memory, which a single-replica gateway need not pay)."""

    health_checks: bool = True
    """Check every TCP backend from the gateway (agent/core/health.py), as HAProxy's `check`
    does: one that fails `health_fall` times in a row leaves its identity's choice until it
    passes `health_rise` times. A rule's annotation natgw.kube-ovn.io/health-check overrides
    it (`off`, `tcp`, `http path=/healthz ...`). UDP backends only where a rule asks."""

    health_interval: float = 1.0
    """Seconds between two checks of one backend (HAProxy's `inter`)."""

    health_timeout: float = 1.0
    """Seconds a check may take: the connect, and for an http check its status line."""

    health_rise: int = 2
    """Passes in a row that bring a down backend back."""

    health_fall: int = 3
    """Failures in a row that take a backend down: with the interval and timeout, a dead
    backend stops getting new connections within ~3 s."""

    health_cpu_budget: float = 0.05
    """Share of one core the checks may use; beyond it their intervals stretch (and the
    agent says so), and checks start no faster than it pays for: 40,000 distinct backends
    cannot all be checked every second. Their pace aims at 90% of it, the rest for what
    the agent spends beside the checks themselves and for the estimate's swing."""

    hairpin_snat: bool = False
    """Provide the hairpin SNAT in the agent's table (outside Kubernetes): a client on the
    VPC side (`vpc_interface`) reaching an identity is SNATed to the EIP toward the
    backend, so the answer comes back through the gateway. kube-ovn's gateway installs its
    own (iptables, per EIP); with both, a flow is still SNATed once (the first binds)."""

    vpc_interface: str = "eth0"
    """The gateway's VPC-side interface (kube-ovn: eth0; net1 is the external one)."""

    hairpin_mark: int = 0x4000
    """Packet mark bits that carry "came in on the VPC side" from the identity's chain to
    the postrouting chain, on a hairpin flow's first packet only. kube-ovn's own hairpin
    rule uses 0x1; pick bits no policy routing rule of the gateway looks at."""

    masquerade: bool = False
    """SNAT every connection the agent DNATs that leaves by `vpc_interface` to this
    replica's own address there (nft `masquerade`), so the backend's answer comes back
    through the replica that holds the connection's conntrack entry. An HA gateway needs
    it: kube-ovn routes the VPC's traffic to its replicas by an ECMP hash of the source
    (the backend's) address, so an answer reaches another replica for two of three
    connections with three replicas, and is lost. Backends then see the replica's
    address, not the client's. The agent's identities only: kube-ovn's own rules are
    untouched; the choice (pins, buckets) still sees the client's address."""

    masquerade_mark: int = 0x4000
    """Conntrack mark bit that carries "DNATed by the agent" from the identity's slot chain
    to the postrouting chain (`ct mark set ct mark | M`, then `ct mark & M == M
    masquerade`). The connection's mark, not the packet's: kube-ovn owns the packet mark
    (its hairpin bit 0x1) and nothing in its gateway uses the conntrack mark."""

    watch: WatchSettings = field(default_factory=WatchSettings)
    """The Kubernetes source's list and watch (unused with from_dir)."""
