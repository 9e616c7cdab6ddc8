"""A model of IPVS's `mh` scheduler (Maglev hashing), as the kernel builds its table: the
anchor beside the agent's consistent table in bench/choice.py. Pure, standard library only.

Mirrors, function by function (Linux's source as stored for torvalds/linux; ip_vs_mh.c at
2cc2c3cb, lib/siphash.c at 24cbee66, lib/siphash_kunit.c, whose vectors the tests use):
  net/netfilter/ipvs/ip_vs_mh.c   primes[], IP_VS_MH_TAB_SIZE, generate_hash_secret,
                                  ip_vs_mh_hashkey, ip_vs_mh_gcd_weight, ip_vs_mh_shift_weight,
                                  ip_vs_mh_permutate, ip_vs_mh_populate, ip_vs_mh_get
  net/netfilter/ipvs/Kconfig      CONFIG_IP_VS_MH_TAB_INDEX: range 8..17, default 12
  net/netfilter/ipvs/ip_vs_ctl.c  __ip_vs_update_dest: list_add_rcu puts a new real at the
                                  *head* of svc->destinations; last_weight keeps the last
                                  non-zero weight (a quiesced real keeps its entries)
  lib/siphash.c                   hsiphash on a 64-bit kernel: SipHash-1-3, low 32 bits

What the kernel does that a reader may not expect, all modelled:
- The keys are not random. generate_hash_secret sets the same constants for every service
  on every machine (hash1 = {2654435761, 2654435761}, hash2 = {2654446892, 2654446892}), so
  two directors with the same reals *in the same list order* build the same table. The
  functions still take the keys as parameters (other keys: other tables, the same statistics).
- The table size is one compile-time prime for every service: 4093 by default, 251 at the
  smallest (no 61).
- A real is hashed as one 32-bit number, ntohl(address) + port: 10.0.0.1:8080 and
  10.0.0.2:8079 get the same permutation. A client is hashed the same way with hash1 (the
  offsets' key) and port 0 (its source port with `mh-port`), then `% size`.
- The table depends on the order of the reals in the service's list (each round, the first
  real picks first), and that list is newest first.

Left out: a real's availability at lookup (weight now 0, or overloaded: the kernel then
finds no real, or with the `mh-fallback` flag rehashes with other offsets for another),
IPv6 (the address folded by XOR of its four words), 32-bit kernels (HalfSipHash-1-3 there:
other tables). The `mh-port` flag is `lookup`'s `port` (0 without it, as the kernel passes)."""
from __future__ import annotations

import ipaddress
import math
from typing import Sequence, TypeVar

# ip_vs_mh.c: `static int primes[]`; the table is primes[CONFIG_IP_VS_MH_TAB_INDEX - 8].
PRIMES = (251, 509, 1021, 2039, 4093, 8191, 16381, 32749, 65521, 131071)
TAB_INDEX = 12  # Kconfig's default (range 8..17)
# generate_hash_secret: fixed words, the same for every service (2654435761 is Knuth's
# multiplicative hash constant, 2^32 / phi).
HASH1 = (2654435761, 2654435761)
HASH2 = (2654446892, 2654446892)

_U64 = 0xFFFFFFFFFFFFFFFF
_U32 = 0xFFFFFFFF

R = TypeVar("R", bound=tuple)  # a real: (address, port, ...), e.g. agent.core.model.Backend


def tab_size(index: int = TAB_INDEX) -> int:
    """IP_VS_MH_TAB_SIZE for a CONFIG_IP_VS_MH_TAB_INDEX."""
    if not 8 <= index <= 17:
        raise ValueError(f"CONFIG_IP_VS_MH_TAB_INDEX is 8..17, not {index}")
    return PRIMES[index - 8]


def tab_bits(index: int = TAB_INDEX) -> int:
    """IP_VS_MH_TAB_BITS: how many bits of weight/gcd a real's turns keep."""
    return index // 2


TAB_SIZE = tab_size()


def _rol(word: int, shift: int) -> int:
    return ((word << shift) | (word >> (64 - shift))) & _U64


def _rounds(v0: int, v1: int, v2: int, v3: int, count: int) -> tuple[int, int, int, int]:
    """SIPROUND, `count` times."""
    for _ in range(count):
        v0 = (v0 + v1) & _U64
        v1 = _rol(v1, 13) ^ v0
        v0 = _rol(v0, 32)
        v2 = (v2 + v3) & _U64
        v3 = _rol(v3, 16) ^ v2
        v0 = (v0 + v3) & _U64
        v3 = _rol(v3, 21) ^ v0
        v2 = (v2 + v1) & _U64
        v1 = _rol(v1, 17) ^ v2
        v2 = _rol(v2, 32)
    return v0, v1, v2, v3


def siphash(data: bytes, key: tuple[int, int], compress: int, finish: int) -> int:
    """SipHash-c-d over these bytes with a key of two 64-bit words (lib/siphash.c's
    PREAMBLE, the 8-byte blocks little-endian, the tail and length in `b`, POSTAMBLE)."""
    v0 = 0x736F6D6570736575 ^ key[0]
    v1 = 0x646F72616E646F6D ^ key[1]
    v2 = 0x6C7967656E657261 ^ key[0]
    v3 = 0x7465646279746573 ^ key[1]
    whole = len(data) - len(data) % 8
    for k in range(0, whole, 8):
        m = int.from_bytes(data[k:k + 8], "little")
        v0, v1, v2, v3 = _rounds(v0, v1, v2, v3 ^ m, compress)
        v0 ^= m
    b = (len(data) & 0xFF) << 56 | int.from_bytes(data[whole:], "little")
    v0, v1, v2, v3 = _rounds(v0, v1, v2, v3 ^ b, compress)
    v0, v1, v2, v3 = _rounds(v0 ^ b, v1, v2 ^ 0xFF, v3, finish)
    return v0 ^ v1 ^ v2 ^ v3


def hsiphash(data: bytes, key: tuple[int, int]) -> int:
    """The kernel's hsiphash on a 64-bit build: "we make HalfSipHash1-3 actually be
    SipHash1-3, for performance reasons", returned as u32 (the low half)."""
    return siphash(data, key, 1, 3) & _U32


def hashkey(address: str, port: int, key: tuple[int, int], offset: int = 0) -> int:
    """ip_vs_mh_hashkey for IPv4: v = offset + ntohs(port) + ntohl(addr) as an unsigned
    int, hashed as its 4 bytes in memory (little-endian, as x86 and arm64 hold it)."""
    v = (offset + port + int(ipaddress.IPv4Address(address))) & _U32
    return hsiphash(v.to_bytes(4, "little"), key)


def turns(weights: Sequence[int], bits: int = tab_bits()) -> list[int]:
    """Each real's entries per round: ip_vs_mh_gcd_weight, ip_vs_mh_shift_weight and the
    `turns` of ip_vs_mh_permutate. Weights are divided by their gcd, then shifted right
    until the largest fits in `bits` bits; a real with weight left at 0 gets one turn,
    one with weight 0 none."""
    g = 0
    for w in weights:
        if w > 0:
            g = math.gcd(w, g) if g > 0 else w
    if g < 1:
        return [0] * len(weights)
    shift = max(0, (max(weights) // g).bit_length() - bits)
    return [((w // g) >> shift) or int(w != 0) for w in weights]


def permutation(real: tuple, size: int = TAB_SIZE, hash1: tuple[int, int] = HASH1,
                hash2: tuple[int, int] = HASH2) -> tuple[int, int]:
    """A real's (offset, skip) (ip_vs_mh_permutate): its preference list is offset,
    offset + skip, offset + 2 skip, ... mod size, which visits every entry once (the size
    is prime and 1 <= skip < size)."""
    offset = hashkey(real[0], real[1], hash1) % size
    skip = hashkey(real[0], real[1], hash2) % (size - 1) + 1
    return offset, skip


def populate(reals: Sequence[R], size: int = TAB_SIZE, weights: Sequence[int] | None = None,
             hash1: tuple[int, int] = HASH1, hash2: tuple[int, int] = HASH2) -> tuple[R | None, ...]:
    """The lookup table (ip_vs_mh_populate): entry i is the real of bucket i.

    `reals` in the order of svc->destinations, newest first (see `list_order`). Rounds go
    down the list; in each, a real takes its `turns` next free entries of its preference
    list, until every entry is taken. No real with a positive weight: every entry empty
    (ip_vs_mh_reset); more reals than entries: refused (-EINVAL in ip_vs_mh_reassign)."""
    if len(reals) > size:
        raise ValueError(f"{len(reals)} reals do not fit a table of {size}")
    counts = turns([1] * len(reals) if weights is None else list(weights))
    if not any(counts):
        return (None,) * size
    setup = [[*permutation(r, size, hash1, hash2), t] for r, t in zip(reals, counts) if t > 0]
    members = [r for r, t in zip(reals, counts) if t > 0]
    owner: list[int] = [-1] * size
    left = size
    while True:
        for index, ds in enumerate(setup):
            perm, skip, count = ds
            for _ in range(count):
                while owner[perm] >= 0:
                    perm += skip
                    if perm >= size:
                        perm -= size
                owner[perm] = index
                left -= 1
                if not left:
                    return tuple(members[i] for i in owner)
            ds[0] = perm


def lookup(table: Sequence[R | None], client: str, port: int = 0, hash1: tuple[int, int] = HASH1) -> R | None:
    """The real a client reaches (ip_vs_mh_get, without `mh-fallback`): the hash of its
    address (and of its source port only with `mh-port`), mod the table's size."""
    return table[hashkey(client, port, hash1) % len(table)]


def list_order(added: Sequence[R]) -> list[R]:
    """svc->destinations after adding reals in this order: list_add_rcu inserts at the
    head, so the newest real is first."""
    return list(reversed(added))
