"""The consistent choice of a backend for a client (issue 21). Pure: no I/O. The model
is checked against the kernel by netns-tests/test_jhash_kernel.py.

Every gateway replica must send a client with no pin to the same backend, whatever its
history. The kernel picks a bucket, the agent says which backend each bucket holds:

    bucket  = jhash ip saddr mod M seed SEED        (the kernel, in the ClientIP chain)
    backend = table(backends, M)[bucket]            (the agent, as M map elements)

`bucket` is a bit-exact model of the kernel's side (net/netfilter/nft_hash.c: jhash of
the source register's `len` bytes with the rule's seed, then `reciprocal_scale`;
include/linux/jhash.h: Jenkins' lookup3 with JHASH_INITVAL), so the agent and its tests
can say which backend a client reaches without asking the kernel. `table` is built from
the backend *set* only, so it does not depend on the order backends came, their slots
or a replica's restarts.

The table is rendezvous hashing with quotas rather than Maglev (Eisenbud et al., NSDI
2016; IPVS `mh`, Cilium): both keep shares within one bucket, but at the sizes a kernel
map can afford per identity Maglev moves about twice the clients. Points moved beyond
1/N on removing one of N backends, worst of 100 random backend sets per N = 2..8, over
10,000 clients: Maglev 41 at M=31, 33 at 61, 27 at 127, 39 at 251 (two backends with the
same skip share one preference cycle, which a third leaving reorders); this table 23,
15, 10, 7.

One seed for every identity, not one per identity: the jhash sits in a rule of a shared
pattern chain (layout.py: one chain serves every identity of a slot pattern), so a seed
per identity would cost a chain per identity. Nothing is lost: the table decorrelates
the bucket from the backend, and it differs with the backend set. Two identities with
the same backends send a client to the same backend, as kube-proxy's ClientIP does for
one Service's ports. The seed must be explicit: without one the kernel draws a random
seed per rule (measured here: 73 of 1,000 clients agreed across three namespaces)."""
from __future__ import annotations

import functools
from typing import Iterable, Sequence

from agent.core.model import Backend

# The table's size M, from measurements over 10,000 clients and 100 random backend sets
# for each N in 2..8 (tests/test_consistent.py checks a sample; bench/choice.py all of
# them): shares within 2.5 points of 1/N (promise 4); removing one of N moves 1/N + 4.0
# points on average, + 8.5 at p95, + 14.0 at worst (promise 15); adding one (no promise
# beyond pins), 1/(N+1) + 4.1, 8.5, 15.7. M=31 halves the map elements (10,000 identities:
# 610,000 -> 310,000) but reaches + 22.7 on removal (p95 13.0); M=127 reaches + 10.0, for
# twice the elements again.
SIZE = 61
# Any fixed value serves; a non-zero one, so no reader wonders whether `seed 0` is sent.
SEED = 0x6E677731  # "ngw1"
# The seeds of the table's own hashes (of a backend's name, of a bucket's number): part
# of the table's definition, like the seed: changing one moves clients on an upgrade.
_BACKEND_SEED = 1
_BUCKET_SEED = 2

JHASH_INITVAL = 0xDEADBEEF
_U32 = 0xFFFFFFFF
_U64 = 0xFFFFFFFFFFFFFFFF
_WIDE = 1 << 16  # buckets and backends are numbered in 16 bits of a pair


class NoBackends(ValueError):
    """A choice was asked of an identity with no backend."""


def _rol(word: int, shift: int) -> int:
    return ((word << shift) | (word >> (32 - shift))) & _U32


def _mix(a: int, b: int, c: int) -> tuple[int, int, int]:
    """__jhash_mix: mix three 32-bit values reversibly. Each of its six steps is
    `x -= z; x ^= rol32(z, r); z += y` on the values taken in turn (a, b, c), (b, c, a),
    (c, a, b), ..., so after six the names are back in place."""
    x, y, z = a, b, c
    for shift in (4, 6, 8, 16, 19, 4):
        x = ((x - z) & _U32) ^ _rol(z, shift)
        z = (z + y) & _U32
        x, y, z = y, z, x
    return x, y, z


def _final(a: int, b: int, c: int) -> int:
    """__jhash_final: the last mixing of (a, b, c) into c."""
    c = ((c ^ b) - _rol(b, 14)) & _U32
    a = ((a ^ c) - _rol(c, 11)) & _U32
    b = ((b ^ a) - _rol(a, 25)) & _U32
    c = ((c ^ b) - _rol(b, 16)) & _U32
    a = ((a ^ c) - _rol(c, 4)) & _U32
    b = ((b ^ a) - _rol(a, 14)) & _U32
    return ((c ^ b) - _rol(b, 24)) & _U32


def jhash(data: bytes, initval: int) -> int:
    """The kernel's jhash(key, length, initval) over these bytes.

    The kernel reads whole 12-byte blocks in the CPU's byte order and the last block byte
    by byte, little-endian; this model reads both little-endian, as x86 and arm64 do. A
    key of 12 bytes or fewer (an IPv4 address is 4) takes only the byte-by-byte path, so
    its hash is the same on every CPU."""
    length = len(data)
    a = b = c = (JHASH_INITVAL + length + initval) & _U32
    k = 0
    while length - k > 12:
        a = (a + int.from_bytes(data[k:k + 4], "little")) & _U32
        b = (b + int.from_bytes(data[k + 4:k + 8], "little")) & _U32
        c = (c + int.from_bytes(data[k + 8:k + 12], "little")) & _U32
        a, b, c = _mix(a, b, c)
        k += 12
    if k == length:
        return c  # case 0: nothing left, no final mix
    tail = data[k:] + bytes(12 - (length - k))  # the missing bytes add nothing
    a = (a + int.from_bytes(tail[0:4], "little")) & _U32
    b = (b + int.from_bytes(tail[4:8], "little")) & _U32
    c = (c + int.from_bytes(tail[8:12], "little")) & _U32
    return _final(a, b, c)


def reciprocal_scale(value: int, size: int) -> int:
    """The kernel's reciprocal_scale: a 32-bit value scaled into [0, size) by the high
    half of a 64-bit product (not `%`: the buckets are ranges of the hash)."""
    return (value * size) >> 32


def address_bytes(address: str) -> bytes:
    """An IPv4 address as nftables holds `ip saddr` in a register: 4 bytes, network order."""
    octets = address.split(".")
    if len(octets) != 4 or not all(o.isdigit() and int(o) < 256 for o in octets):
        raise ValueError(f"not an IPv4 address: {address!r}")
    return bytes(int(o) for o in octets)


def bucket(client: str, size: int = SIZE, seed: int = SEED, offset: int = 0) -> int:
    """What `jhash ip saddr mod <size> seed <seed> offset <offset>` gives for a packet
    from this client address."""
    return reciprocal_scale(jhash(address_bytes(client), seed), size) + offset


def _order(backend: Backend) -> tuple[int, ...]:
    return (*address_bytes(backend.ip), backend.port)


@functools.lru_cache(maxsize=16)
def _bucket_keys(size: int) -> tuple[int, ...]:
    return tuple(jhash(i.to_bytes(4, "big"), _BUCKET_SEED) for i in range(size))


def _pairs(backend: Backend, index: int, keys: tuple[int, ...]) -> list[int]:
    """A backend's pairs with every bucket, each one int that sorts by score first:
    score << 32 | bucket << 16 | index (ints sort 3x faster than tuples). The score is
    splitmix64's finalizer over the hash of the backend's canonical name "ip:port" beside
    the bucket's key: a multiply chain, where a jhash per pair would cost 3x the time."""
    high = jhash(str(backend).encode(), _BACKEND_SEED) << 32
    pairs = []
    for bucket_, key in enumerate(keys):
        z = (high | key) + 0x9E3779B97F4A7C15
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _U64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _U64
        pairs.append((z ^ (z >> 31)) << 32 | bucket_ << 16 | index)
    return pairs


def table(backends: Iterable[Backend], size: int = SIZE) -> tuple[Backend, ...]:
    """The lookup table: entry i is the backend of bucket i.

    Rendezvous hashing with quotas: every (bucket, backend) pair has a score; pairs are
    taken best first, and a pair gives its bucket to its backend unless the bucket is
    already given or the backend holds its quota (size // N buckets, one more for the
    first size % N backends to fill theirs). So shares differ by one bucket at most, and
    a backend that leaves frees its own buckets while the others keep theirs, but for the
    few that the changed quotas shift. Duplicates count once; the order given does not
    matter. With more backends than buckets, each bucket goes to a different backend."""
    members = sorted(set(backends), key=_order)
    if not members:
        return ()
    if not 1 <= size < _WIDE or len(members) >= _WIDE:
        raise ValueError(f"a table of {size} buckets for {len(members)} backends is out of range")
    keys = _bucket_keys(size)
    pairs = [pair for index, member in enumerate(members) for pair in _pairs(member, index, keys)]
    pairs.sort(reverse=True)
    quota, extra = divmod(size, len(members))
    owner = [-1] * size
    held = [0] * len(members)
    left = size
    for pair in pairs:
        bucket_, index = (pair >> 16) & 0xFFFF, pair & 0xFFFF
        if owner[bucket_] >= 0 or held[index] > quota or (held[index] == quota and not extra):
            continue
        if held[index] == quota:
            extra -= 1
        owner[bucket_] = index
        held[index] += 1
        left -= 1
        if not left:
            break
    return tuple(members[index] for index in owner)


def choose(backends: Iterable[Backend], client: str, size: int = SIZE, seed: int = SEED) -> Backend:
    """The backend a client with no pin reaches: the same on every replica."""
    return lookup(table(backends, size), client, seed)


def lookup(entries: Sequence[Backend], client: str, seed: int = SEED) -> Backend:
    """The backend of a client in a table already built (its length is its size)."""
    if not entries:
        raise NoBackends(f"no backend for client {client}")
    return entries[bucket(client, len(entries), seed)]
