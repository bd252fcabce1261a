"""Properties of the pure routing functions and the prefix table."""

from __future__ import annotations

from hypothesis import assume, given, settings
from hypothesis import strategies as st

from gateway.affinity import PrefixTable
from gateway.routing import (
    Candidate,
    RoutingPolicy,
    choose_worker,
    cost_tokens,
    prefix_block_hashes,
    rendezvous_weight,
    round_robin,
)

addresses = st.lists(st.from_regex(r"10\.0\.0\.[0-9]{1,3}:[0-9]{2,5}", fullmatch=True), min_size=1, max_size=6,
                     unique=True)  # fmt: skip
policies = st.builds(RoutingPolicy, block_size_tokens=st.sampled_from([1, 16, 256, 2048]),
                     request_cost_tokens=st.integers(0, 4096), prefix_aware=st.booleans())  # fmt: skip


@st.composite
def routing_cases(draw):
    names = draw(addresses)
    num_blocks = draw(st.integers(0, 64))
    candidates = [
        Candidate(a, draw(st.integers(0, num_blocks)), draw(st.integers(0, 50)), draw(st.integers(0, 10_000)))
        for a in names
    ]
    return candidates, num_blocks, draw(st.integers(0, 2**64)), draw(policies)


@given(routing_cases())
def test_the_choice_is_a_cheapest_candidate(case):
    candidates, num_blocks, key, policy = case
    chosen = choose_worker(candidates, key, num_blocks, policy)
    costs = {c.address: cost_tokens(c, num_blocks, policy) for c in candidates}
    assert chosen in costs and costs[chosen] == min(costs.values())
    assert choose_worker(list(reversed(candidates)), key, num_blocks, policy) == chosen  # order-free


@given(routing_cases())
def test_removing_another_candidate_keeps_the_choice(case):
    candidates, num_blocks, key, policy = case
    chosen = choose_worker(candidates, key, num_blocks, policy)
    others = [c for c in candidates if c.address != chosen]
    assume(others)
    fewer = [c for c in candidates if c.address != others[0].address]
    assert choose_worker(fewer, key, num_blocks, policy) == chosen


@given(routing_cases(), st.integers(1, 64))
def test_affinity_wins_at_equal_load(case, num_blocks):
    candidates, _, key, policy = case
    assume(policy.prefix_aware and len(candidates) > 1)
    load = candidates[0].num_active_requests
    warm = Candidate(candidates[-1].address, num_blocks, load)
    cold = [Candidate(c.address, 0, load) for c in candidates[:-1]]
    assert choose_worker([*cold, warm], key, num_blocks, policy) == warm.address


@given(routing_cases(), st.integers(1, 64))
def test_load_outweighs_a_prefix_worth_less_than_it(case, num_blocks):
    """A warm worker loses to an idle cold one once its extra load costs more than the prefill saved."""
    candidates, _, key, policy = case
    assume(len(candidates) > 1 and policy.request_cost_tokens > 0)
    saved = num_blocks * policy.block_size_tokens if policy.prefix_aware else 0
    extra = saved // policy.request_cost_tokens + 1
    warm = Candidate(candidates[0].address, num_blocks, extra)
    idle = Candidate(candidates[1].address, 0, 0)
    assert choose_worker([warm, idle], key, num_blocks, policy) == idle.address


def test_distinct_prefixes_spread_evenly_over_equal_workers():
    workers = [Candidate(f"10.0.0.{i}:50052", 0, 0) for i in range(2)]
    policy = RoutingPolicy(block_size_tokens=16)
    chosen = [choose_worker(workers, key, 4, policy) for key in range(2000)]
    assert 0.45 < chosen.count(workers[0].address) / len(chosen) < 0.55


@given(st.integers(0, 2**64), addresses)
def test_rendezvous_weight_is_stable(key, names):
    assert [rendezvous_weight(key, a) for a in names] == [rendezvous_weight(key, a) for a in names]


@given(st.lists(st.integers(0, 300), max_size=200), st.lists(st.integers(0, 300), max_size=200),
       st.sampled_from([1, 4, 16]))  # fmt: skip
def test_block_hashes_agree_exactly_on_shared_leading_blocks(a, b, block_size):
    ha, hb = prefix_block_hashes(a, block_size), prefix_block_hashes(b, block_size)
    assert len(ha) == len(a) // block_size and len(hb) == len(b) // block_size
    for i in range(min(len(ha), len(hb))):
        shared = a[: (i + 1) * block_size] == b[: (i + 1) * block_size]
        assert (ha[i] == hb[i]) == shared


def test_block_hashes_of_text_and_the_cap():
    assert prefix_block_hashes("abcdefgh", 4) == prefix_block_hashes("abcdefghij", 4)
    assert prefix_block_hashes("abcdefgh", 4)[0] == prefix_block_hashes("abcdXXXX", 4)[0]
    assert len(prefix_block_hashes(list(range(100)), 1, max_blocks=10)) == 10
    assert prefix_block_hashes([1, 2, 3], 0) == ()


@given(addresses, st.integers(0, 1000))
def test_round_robin_visits_every_worker_in_turn(names, start):
    picked = [round_robin(names, start + i) for i in range(len(names))]
    assert sorted(picked) == sorted(names)


@given(st.lists(st.integers(), min_size=1, max_size=20, unique=True), st.integers(0, 20))
def test_prefix_table_matches_the_recorded_run(hashes, cut):
    table = PrefixTable()
    table.record(hashes[:cut], "a:1")
    assert table.num_matched_blocks(hashes, "a:1") == min(cut, len(hashes))
    assert table.num_matched_blocks(hashes, "b:2") == 0
    table.record(hashes, "b:2")  # the prefix moved: one owner per block
    assert table.num_matched_blocks(hashes, "a:1") == 0 and table.num_matched_blocks(hashes, "b:2") == len(hashes)
    table.forget("a:1")
    assert table.num_matched_blocks(hashes, "b:2") == len(hashes)
    table.forget("b:2")
    assert table.num_matched_blocks(hashes, "b:2") == 0 and len(table) == 0


@settings(max_examples=50)
@given(st.integers(1, 50))
def test_prefix_table_stays_bounded(max_entries):
    table = PrefixTable(max_entries)
    for start in range(0, 200, 10):
        table.record(list(range(start, start + 10)), "a:1")
    assert len(table) <= max_entries
    assert table.num_matched_blocks(list(range(190, 200))[-min(max_entries, 10) :], "a:1") >= 1


@given(routing_cases(), st.integers(1, 64))
def test_a_prefix_sticks_until_the_queue_there_costs_more_than_its_prefill(case, num_blocks):
    candidates, _, key, policy = case
    assume(len(candidates) > 1 and policy.prefix_aware)
    saved = num_blocks * policy.block_size_tokens
    idle = Candidate(candidates[1].address, 0, 0)
    shorter = Candidate(candidates[0].address, num_blocks, 0, saved - 1)
    longer = Candidate(candidates[0].address, num_blocks, 0, saved + 1)
    assert choose_worker([shorter, idle], key, num_blocks, policy) == shorter.address
    assert choose_worker([longer, idle], key, num_blocks, policy) == idle.address
