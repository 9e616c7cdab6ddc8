"""The IPVS `mh` model (bench/ipvs_mh.py) and the consistent choice's comparison
(bench/choice.py): the hash against the kernel's published vectors, the table against the
properties of the kernel's construction and against a line-by-line transcription of
ip_vs_mh_populate, and the comparison's quick mode against what must hold whatever the
numbers."""
from __future__ import annotations

import random
from collections import Counter

import pytest

from bench import choice, choice_report, ipvs_mh
from bench.ipvs_mh import HASH1, HASH2, hashkey, hsiphash, list_order, lookup, permutation, populate, siphash, turns

# lib/siphash_kunit.c: the key bytes 0..15, input i is the bytes 0..i-1 (from the SipHash
# reference implementation); hsiphash's are the 64-bit build's (SipHash-1-3, low 32 bits).
KEY = (0x0706050403020100, 0x0F0E0D0C0B0A0908)
HSIPHASH_VECTORS = (
    0x050FC4DC, 0x7D57CA93, 0x4DC7D44D, 0xE7DDF7FB, 0x88D38328, 0x49533B67, 0xC59F22A7, 0x9BB11140,
    0x8D299A8E, 0x6C063DE4, 0x92FF097F, 0xF94DC352, 0x57B4D9A2, 0x1229FFA7, 0xC0F95D34, 0x2A519956,
    0x7D908B66, 0x63DBD80C, 0xB473E63E, 0x8D297D1C, 0xA6CCE040, 0x2B45F844, 0xA320872E, 0xDAE6C123,
    0x67349C8C, 0x705B0979, 0xCA9913A5, 0x4ADE3B35, 0xEF6CD00D, 0x4AB1E1F4, 0x43C5E663, 0x8C21D1BC,
    0x16A7B60D, 0x7A8FF9BF, 0x1F2A753E, 0xBF186B91, 0xADA26206, 0xA3C33057, 0xAE3A36A1, 0x7B108392,
    0x99E41531, 0x3F1AD944, 0xC8138825, 0xC28949A6, 0xFAF8876B, 0x9F042196, 0x68B1D623, 0x8B5114FD,
    0xDF074C46, 0x12CC86B3, 0x0A52098F, 0x9D292F9A, 0xA2F41F12, 0x43A71ED0, 0x73F0BCE6, 0x70A7E980,
    0x243C6D75, 0xFDB71513, 0xA67D8A08, 0xB7E8F148, 0xF7A644EE, 0x0F1837F2, 0x4B6694E0, 0xB7BBB3A8,
)
SIPHASH_2_4_VECTORS = {  # a sample of the same file's siphash (2-4) vectors: the rounds with other counts
    0: 0x726FDB47DD0E0E31, 1: 0x74F839C593DC67FD, 7: 0xAB0200F58B01D137, 8: 0x93F5F5799A932462,
    15: 0xA129CA6149BE45E5, 16: 0x3F2ACC7F57C29BDB, 31: 0x32D892FAD841C342, 63: 0x958A324CEB064572,
}


def reals_of(count: int, rng: random.Random) -> list[tuple[str, int]]:
    return [(b.ip, b.port) for b in choice.backends_of(count, rng)]


# --- the hash -----------------------------------------------------------------------------

@pytest.mark.parametrize("length", range(64))
def test_hsiphash_gives_the_kernels_published_vectors(length: int) -> None:
    assert hsiphash(bytes(range(length)), KEY) == HSIPHASH_VECTORS[length]


@pytest.mark.parametrize("length, expected", sorted(SIPHASH_2_4_VECTORS.items()))
def test_siphash_2_4_gives_the_kernels_published_vectors(length: int, expected: int) -> None:
    assert siphash(bytes(range(length)), KEY, 2, 4) == expected


def test_a_reals_hash_is_of_its_address_plus_its_port_as_one_32_bit_number() -> None:
    # ip_vs_mh_hashkey: v = offset + ntohs(port) + ntohl(addr), hashed as the u32 in memory
    assert hashkey("10.0.0.1", 8080, HASH1) == hsiphash((0x0A000001 + 8080).to_bytes(4, "little"), HASH1)
    assert hashkey("10.0.0.1", 8080, HASH1) == hashkey("10.0.0.2", 8079, HASH1)
    assert permutation(("10.0.0.1", 8080)) == permutation(("10.0.0.2", 8079))
    assert hashkey("255.255.255.255", 2, HASH2) == hashkey("0.0.0.1", 0, HASH2)  # 32 bits wrap
    assert hashkey("10.0.0.1", 0, HASH1, offset=5) == hashkey("10.0.0.6", 0, HASH1)


def test_the_table_size_is_a_prime_from_the_kernels_list() -> None:
    assert ipvs_mh.TAB_SIZE == ipvs_mh.tab_size(12) == 4093 and ipvs_mh.tab_bits(12) == 6
    assert [ipvs_mh.tab_size(i) for i in (8, 17)] == [251, 131071]
    for bad in (7, 18):
        with pytest.raises(ValueError):
            ipvs_mh.tab_size(bad)
    assert all(p > 2 and all(p % d for d in range(2, int(p ** 0.5) + 1)) for p in ipvs_mh.PRIMES)


# --- the table ------------------------------------------------------------------------------

@pytest.mark.parametrize("size", [251, 4093])
def test_each_reals_preference_list_is_a_permutation_of_the_table(size: int) -> None:
    for real in reals_of(8, random.Random(size)):
        offset, skip = permutation(real, size)
        assert 0 <= offset < size and 1 <= skip < size
        assert len({(offset + j * skip) % size for j in range(size)}) == size


@pytest.mark.parametrize("size, count", [(251, 1), (251, 3), (251, 8), (4093, 5), (4093, 7), (509, 251)])
def test_equal_weights_fill_every_entry_floor_or_ceil_first_in_list_order(size: int, count: int) -> None:
    """One entry per real per round, rounds until the table is full: the first size % N
    reals of the list get one entry more."""
    reals = reals_of(count, random.Random(size + count))
    held = Counter(populate(reals, size))
    assert None not in held and sum(held.values()) == size
    quota, extra = divmod(size, count)
    assert [held[r] for r in reals] == [quota + 1] * extra + [quota] * (count - extra)


def test_weights_become_turns_by_gcd_and_shift() -> None:
    # ip_vs_mh_permutate's turns: (weight / gcd) >> shift, or 1 for a weight shifted to 0;
    # shift = fls(max weight / gcd) - IP_VS_MH_TAB_BITS (6 by default), at least 0
    assert turns([4, 2, 0]) == [2, 1, 0]
    assert turns([63, 1]) == [63, 1]
    assert turns([64, 1]) == [32, 1]
    assert turns([100, 1]) == [50, 1]
    assert turns([100, 1], bits=8) == [100, 1]
    assert turns([0, 0]) == [0, 0] and turns([]) == []


def _transcribed_populate(reals: list[tuple[str, int]], size: int, weights: list[int]) -> list[object]:
    """ip_vs_mh_populate line by line, the list walked as the kernel walks it (p, ds,
    dt_count, the bitmap): an oracle for bench/ipvs_mh.py's loop."""
    head = len(reals)  # p == &svc->destinations
    setup = [[*permutation(r, size), t] for r, t in zip(reals, turns(weights))]  # offset -> perm, skip, turns
    table = [False] * size
    lookup_: list[object] = [None] * size
    p, n, dt_count = head, 0, 0
    while n < size:
        if p == head:
            p = 0
        ds = 0
        while p != head:
            if setup[ds][2] < 1:
                p, ds = p + 1, ds + 1
                continue
            c = setup[ds][0]
            while table[c]:
                setup[ds][0] += setup[ds][1]
                if setup[ds][0] >= size:
                    setup[ds][0] -= size
                c = setup[ds][0]
            table[c] = True
            lookup_[c] = reals[p]
            n += 1
            if n == size:
                return lookup_
            dt_count += 1
            if dt_count >= setup[ds][2]:
                dt_count = 0
                p, ds = p + 1, ds + 1
    return lookup_


@pytest.mark.parametrize("seed", range(12))
def test_the_table_is_the_kernels_populate_loop(seed: int) -> None:
    rng = random.Random(seed)
    size = rng.choice((251, 509))
    reals = reals_of(rng.randrange(1, 9), rng)
    weights = [rng.choice((0, 1, 2, 3, 5, 8, 100, 300)) for _ in reals]
    weights[0] = weights[0] or 1  # at least one real with a weight: else no table at all
    assert list(populate(reals, size, weights)) == _transcribed_populate(reals, size, weights)


def test_weighted_shares_follow_the_turns() -> None:
    reals = reals_of(3, random.Random(3))
    held = Counter(populate(reals, 4093, [3, 2, 1]))
    for real, t in zip(reals, [3, 2, 1]):
        assert abs(held[real] - 4093 * t / 6) <= t


def test_no_weight_no_table_and_too_many_reals_refused() -> None:
    reals = reals_of(3, random.Random(1))
    assert populate(reals, 251, [0, 0, 0]) == (None,) * 251
    assert populate([], 251) == (None,) * 251
    with pytest.raises(ValueError):
        populate(reals_of(252, random.Random(2)), 251)


def test_the_lookup_is_the_clients_hash_mod_the_size_and_the_port_only_when_asked() -> None:
    table = populate(reals_of(4, random.Random(4)), 251)
    clients = [f"198.51.100.{i}" for i in range(200)]
    for client in clients:
        assert lookup(table, client) == table[hashkey(client, 0, HASH1) % 251]
    assert sum(lookup(table, c) != lookup(table, c, port=40000) for c in clients) > 50


def test_the_table_follows_the_list_order_newest_first() -> None:
    added = reals_of(5, random.Random(5))
    assert list_order(added) == added[::-1]
    # 251 % 5 == 1: the extra entry goes to the real first in the list, so orders differ
    assert populate(list_order(added), 251) != populate(added, 251)
    assert Counter(populate(list_order(added), 251))[added[-1]] == 51


# --- the comparison ---------------------------------------------------------------------------

def test_the_quick_comparison_runs_and_its_numbers_hold_what_must_hold() -> None:
    res = choice.run(choice.QUICK, log=lambda _: None)
    counts = choice.QUICK.counts
    assert [s["key"] for s in res["schemes"]] == [s.key for s in choice.SCHEMES]
    for s in res["schemes"]:
        for key in ("remove", "remove_others", "add"):
            assert 0 <= s[key]["mean"] <= s[key]["p95"] <= s[key]["worst"] <= 1, (s["key"], key)
        for key in ("remove_beyond", "add_beyond"):
            assert -1 <= s[key]["mean"] <= s[key]["p95"] <= s[key]["worst"] <= 1, (s["key"], key)
        assert s["remove_others_least"] >= 0  # a removed backend's clients all move
        assert s["remove"]["mean"] > s["remove_others"]["mean"]
        assert s["remove"]["worst"] >= 1 / 2  # removing one of two moves about half
        assert 0 <= s["balance_mean"] <= s["balance_worst"] < 0.1
        assert len(s["remove_beyond_worst_by_n"]) == len(counts)
        if s["key"].startswith("agent"):
            assert s["order"]["worst"] == 0
        else:
            assert s["order"]["mean"] > 0  # IPVS builds from its list: the order shows
    assert [what for ok, what in choice_report.checks(res) if not ok] == []
    md = "\n".join(choice_report.markdown(res))
    assert md.startswith(choice_report.HEADING) and all(f"| {s['label']} |" in md for s in res["schemes"])
    assert "nan" not in md


def test_the_checks_can_fail() -> None:
    res = choice.run(choice.Config(counts=(2, 3), sets=2, clients=300), log=lambda _: None)
    res["schemes"][0]["order"]["worst"] = 0.01
    res["schemes"][1]["remove_others_least"] = -0.01
    failed = [what for ok, what in choice_report.checks(res) if not ok]
    assert len(failed) == 2 and "order" in failed[0] and "own clients" in failed[1]
