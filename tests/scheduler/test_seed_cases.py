"""The micro-slicing livelock's cases, over a real in-process gRPC channel, plus the regression against the legacy
quantum rule that livelocked."""

from __future__ import annotations

import grpc
import pytest

from hybridserve.v1 import scheduler_pb2 as pb
from scheduler_svc import convert
from scheduler_svc.core import MambaCacheMode, StepInput, plan_step, rules
from tests.scheduler.helpers import SEED_CONFIG, config, decode, prefill, seed_step, step


def call(stub, s: StepInput) -> pb.PlanStepResponse:
    return stub.PlanStep(convert.step_to_pb(s), timeout=5)


def prefill_slices(resp: pb.PlanStepResponse) -> dict[str, int]:
    return {s.request_id: s.num_tokens for s in resp.slices if s.is_prefill}


def test_seed_budget_gives_two_full_blocks_and_rotates_the_third(stub):
    first = call(stub, seed_step(step_index=0))
    assert first.quantum == 2048
    assert prefill_slices(first) == {"p0": 2048, "p1": 2048}
    assert [s.request_id for s in first.slices if not s.is_prefill] == ["d0"]
    assert all(s.ends_on_checkpoint for s in first.slices if s.is_prefill)
    second = call(stub, seed_step(step_index=1))
    assert "p2" in prefill_slices(second), "the third prefill must be served the next step"
    assert sum(prefill_slices(second).values()) == 4096


def test_budget_not_a_multiple_of_the_quantum_is_rejected_with_field_value_and_quantum(stub):
    bad = step(config(max_num_prefill_tokens_per_step=2304), seed_step().running)
    with pytest.raises(grpc.RpcError) as err:
        call(stub, bad)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    message = err.value.details()
    assert "max_num_prefill_tokens_per_step" in message
    assert "2304" in message
    assert "2048" in message
    with pytest.raises(grpc.RpcError) as err2:
        stub.ValidateConfig(convert.config_to_pb(bad.config), timeout=5)
    assert err2.value.code() == grpc.StatusCode.INVALID_ARGUMENT


@pytest.mark.parametrize(
    "cfg",
    [
        config(max_num_batched_tokens=1024, long_prefill_token_threshold=0, max_num_prefill_tokens_per_step=0),
        config(long_prefill_token_threshold=1024, max_num_prefill_tokens_per_step=0),
    ],
    ids=["global-budget-1024", "threshold-1024"],
)
def test_sub_block_exception_gives_1024_token_slices(stub, cfg):
    valid = stub.ValidateConfig(convert.config_to_pb(cfg), timeout=5)
    assert valid.sub_block_exception and valid.quantum == 256
    s = step(cfg, [prefill("p0", 16384)])
    computed = 0
    for index in range(4):
        resp = call(stub, step(cfg, [prefill("p0", 16384, computed)], step_index=index))
        assert prefill_slices(resp) == {"p0": 1024}
        computed += 1024
        assert resp.slices[0].ends_on_checkpoint == (computed % 2048 == 0)
    assert s.config.sub_block_exception


def test_sub_block_exception_with_a_decode_and_micro_slicing(stub):
    cfg = config(max_num_batched_tokens=8192, long_prefill_token_threshold=1024, max_num_prefill_tokens_per_step=2048)
    running = [decode("d0")] + [prefill(f"p{i}", 16384, arrival=float(i)) for i in range(3)]
    resp = call(stub, step(cfg, running))
    assert resp.quantum == 256
    slices = prefill_slices(resp)
    assert sorted(slices.values()) == [512, 768, 768]  # 8 quanta of 256 over three prefills
    assert sum(slices.values()) == 2048


def test_none_mode_schedules_like_plain_chunked_prefill(stub):
    cfg = config(mamba_cache_mode=MambaCacheMode.NONE, max_num_batched_tokens=1000, max_num_prefill_tokens_per_step=0)
    resp = call(stub, step(cfg, [prefill("a", 700), prefill("b", 5000, arrival=1.0)]))
    # First come first served, chunks end anywhere: 700 then the 300 left, no grid.
    assert prefill_slices(resp) == {"a": 700, "b": 300}
    assert resp.quantum == 1
    assert not any(s.ends_on_checkpoint for s in resp.slices)
    resp = call(stub, step(cfg, [prefill("b", 5000, computed=300, arrival=1.0)]))
    assert prefill_slices(resp) == {"b": 1000}


def shares_after_alignment(s: StepInput, quantum: int) -> list[int]:
    """The micro-slicing allocation as the code before the fix did it: split the budget among the running
    prefills in quanta, then let the chunk aligner cut each share."""
    prefills = [r for r in s.running if r.is_prefill]
    shares = rules.split_quanta(s.config.max_num_prefill_tokens_per_step // quantum, len(prefills), s.step_index)
    return [
        rules.align_chunk(r.num_computed_tokens, share * quantum, r.num_prompt_tokens, s.config.block_size, False)
        for r, share in zip(prefills, shares, strict=True)
    ]


def test_legacy_quantum_livelocks_and_the_new_rule_does_not():
    """The old rule (lcm of the recurrent block sizes only) split 4096 into 1536/1280/1280 and the
    aligner zeroed each: no prefill advanced, step after step, while the decode kept every step
    mixed. The new quantum gives shares the aligner keeps whole."""
    legacy_quantum = rules.legacy_quantum_tokens(256)
    assert legacy_quantum == 256
    assert [q * 256 for q in rules.split_quanta(4096 // 256, 3, 0)] == [1536, 1280, 1280]
    for index in range(12):
        assert shares_after_alignment(seed_step(index), legacy_quantum) == [0, 0, 0]
        new_shares = shares_after_alignment(seed_step(index), SEED_CONFIG.quantum)
        assert sorted(new_shares) == [0, 2048, 2048]
        plan = plan_step(seed_step(index))
        granted = {s.request_id: s.num_tokens for s in plan.slices if s.is_prefill}
        prefills = [r.request_id for r in seed_step(index).running if r.is_prefill]
        assert granted == {rid: n for rid, n in zip(prefills, new_shares, strict=True) if n}
        assert not plan.stats.stalled


def test_kv_pages_are_counted_in_small_pages_not_blocks():
    """A 100-token prompt takes 7 pages of 16 tokens, not a 2048-token page."""
    plan = plan_step(step(SEED_CONFIG, waiting=[prefill("short", 100)], free_pages=7))
    assert [(s.request_id, s.num_tokens) for s in plan.slices] == [("short", 100)]
    assert plan.stats.num_kv_pages_allocated == 7
    plan = plan_step(step(SEED_CONFIG, waiting=[prefill("short", 100)], free_pages=6))
    assert plan.slices == ()
