"""The engine never dies silently: a checkpoint in the shared tier that does not fit the model is a
miss, a step that raises fails only its requests (ABORTED), and an engine that stops anyway turns
liveness off and fails every live and new request with UNAVAILABLE at once."""

from __future__ import annotations

import hashlib
import threading
import time
from concurrent.futures import Future

import grpc
import pytest

from cache_svc import keys
from gpu_worker.api.server import engine_alive
from gpu_worker.cache.blocks import chain_hashes
from gpu_worker.runner.checkpoint_io import BlockCheckpoint, BlockIdentity, seal, verify
from hybridserve.children import free_port
from tests.worker.conftest import SCHEDULER, SHARED_ACCESS, collect, greedy_request, prompt_of

BLOCK = SCHEDULER.block_size
PREFIX = prompt_of(4 * BLOCK, 41)


def reshape_stored_checkpoints(redis_client, shared) -> int:
    """Rewrites every stored checkpoint of PREFIX as a well-formed, correctly sealed one (right
    identity, key and checksum) whose Mamba state has the wrong shape: what a buggy publisher holding
    the workers' key could store."""
    fingerprint = shared.fingerprint
    hashes = chain_hashes(PREFIX, BLOCK, fingerprint)
    count = 0
    for index, block_hash in enumerate(hashes):
        key = keys.block_key("hybridserve", fingerprint, block_hash)
        if not redis_client.exists(key):
            continue
        identity = BlockIdentity(block_hash, hashes[index - 1] if index else b"", BLOCK, fingerprint)
        stored = verify(redis_client.hget(key, keys.FIELD_DATA), identity, shared.layout, SHARED_ACCESS.checkpoint_key)
        assert isinstance(stored, BlockCheckpoint), stored
        conv = None if stored.conv is None else stored.conv[..., :-1].contiguous()  # one column short
        ssm = None if stored.ssm is None else stored.ssm[..., :-1].contiguous()
        forged = seal(BlockCheckpoint(kv=stored.kv, conv=conv, ssm=ssm), identity, SHARED_ACCESS.checkpoint_key)
        redis_client.hset(key, mapping={keys.FIELD_DATA: forged, keys.FIELD_SHA256: hashlib.sha256(forged).hexdigest()})
        count += 1
    return count


def test_a_wrong_shape_checkpoint_in_the_shared_tier_is_a_miss_and_the_worker_keeps_serving(
    start_worker, cache_service, redis_server
):
    publisher = start_worker(prefix_caching=True, cache_address=cache_service.address)
    collect(publisher.stub.Generate(greedy_request(PREFIX + prompt_of(3, 1), 4), timeout=60))
    assert publisher.engine.prefix.shared.flush()
    assert reshape_stored_checkpoints(redis_server.client(), publisher.engine.prefix.shared) >= 1
    cold = start_worker(prefix_caching=False)
    worker = start_worker(prefix_caching=True, cache_address=cache_service.address)  # empty local tier
    prompt = PREFIX + prompt_of(5, 2)
    tokens, messages = collect(worker.stub.Generate(greedy_request(prompt, 8), timeout=30))
    assert messages[-1].usage.cached_tokens == 0, "the forged blocks were not used"
    assert tokens == collect(cold.stub.Generate(greedy_request(prompt, 8), timeout=30))[0]
    assert engine_alive(worker.engine)
    again = prompt_of(9, 3)
    assert (
        collect(worker.stub.Generate(greedy_request(again, 4), timeout=30))[0]
        == collect(cold.stub.Generate(greedy_request(again, 4), timeout=30))[0]
    ), "later requests are served"
    info = worker.info()
    assert info.num_state_slots_free == info.num_state_slots_total


def test_a_step_that_raises_fails_its_requests_with_aborted_and_the_loop_goes_on(start_worker, monkeypatch):
    worker = start_worker()
    engine = worker.engine
    original = engine._apply
    calls = {"n": 0}

    def apply_failing_once(prepared, sampled):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("injected failure in apply")
        return original(prepared, sampled)

    monkeypatch.setattr(engine, "_apply", apply_failing_once)
    with pytest.raises(grpc.RpcError) as failed:
        collect(worker.stub.Generate(greedy_request(prompt_of(6, 4), 4), timeout=30))
    assert failed.value.code() == grpc.StatusCode.ABORTED
    assert "injected failure in apply" in failed.value.details()
    tokens, _ = collect(worker.stub.Generate(greedy_request(prompt_of(6, 4), 4), timeout=30))
    assert len(tokens) == 4
    assert engine_alive(engine)
    info = worker.info()
    assert (info.num_kv_pages_free, info.num_state_slots_free) == (info.num_kv_pages_total, info.num_state_slots_total)


def test_an_engine_whose_loop_ends_fails_live_and_new_requests_with_unavailable(start_worker, monkeypatch):
    worker = start_worker()
    engine = worker.engine
    started = threading.Event()
    errors: list[grpc.RpcError] = []

    def stream() -> None:
        try:
            started.set()
            collect(worker.stub.Generate(greedy_request(prompt_of(6, 5), 100), timeout=60))
        except grpc.RpcError as exc:
            errors.append(exc)

    def broken_guard(exc: Exception) -> None:  # the guard itself fails: the loop must end loudly
        raise SystemError("the guard failed too")

    def failing_step(pending):
        raise RuntimeError("injected step failure")

    monkeypatch.setattr(engine, "_fail_involved", broken_guard)
    monkeypatch.setattr(engine, "_step", failing_step)
    client = threading.Thread(target=stream)
    client.start()
    started.wait(5)
    client.join(30)
    assert not client.is_alive(), "the live request ended"
    assert [e.code() for e in errors] == [grpc.StatusCode.UNAVAILABLE]
    deadline = time.monotonic() + 5
    while engine_alive(engine) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not engine_alive(engine)
    with pytest.raises(grpc.RpcError) as new:
        collect(worker.stub.Generate(greedy_request(prompt_of(6, 6), 4), timeout=30))
    assert new.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "engine stopped" in new.value.details()


class ForgingSharedTier:
    """A shared tier that answers every fetch with blocks whose Mamba state has the wrong shape
    (whatever checks the real tier makes, the engine must survive an import that raises)."""

    def __init__(self, runner) -> None:
        self.runner = runner
        self.num_fetches = 0

    def fetch_prefix(self, request_id, block_hashes, num_local_blocks, trace_context=None, policy=None):
        import torch

        from gpu_worker.cache.remote import FetchedBlock, FetchResult
        from gpu_worker.runner.checkpoint_io import BlockCheckpoint

        self.num_fetches += 1
        caches = self.runner.kv_pool.layer_caches()
        kv = torch.zeros(len(caches), 2, BLOCK, *caches[0][0].shape[1:])
        slot = self.runner.state_pool.allocate_checkpoint()  # a slot's shapes, then given back
        conv, ssm = self.runner.state_pool.export_checkpoint(slot)
        self.runner.state_pool.free_checkpoint(slot)
        forged = BlockCheckpoint(kv=kv, conv=conv[..., :-1], ssm=ssm[..., :-1])
        done: Future = Future()
        blocks = [FetchedBlock(h, b"", forged) for h in block_hashes[num_local_blocks:]]
        done.set_result(FetchResult(request_id, blocks, None, "fetch", len(blocks)))
        return done

    def publish(self, *args) -> None:
        pass

    def close(self) -> None:
        pass


def test_an_import_that_raises_is_a_miss_and_frees_what_it_took(start_worker):
    worker = start_worker(prefix_caching=True)
    cold = start_worker(prefix_caching=False)
    tier = ForgingSharedTier(worker.engine.runner)
    worker.engine.prefix.shared = tier
    before = worker.info()
    prompt = PREFIX + prompt_of(5, 7)
    tokens, messages = collect(worker.stub.Generate(greedy_request(prompt, 6), timeout=30))
    assert tier.num_fetches == 1
    assert worker.engine.prefix.num_rejected_blocks == 1, "the first forged block failed and the rest were skipped"
    assert messages[-1].usage.cached_tokens == 0
    assert tokens == collect(cold.stub.Generate(greedy_request(prompt, 6), timeout=30))[0]
    after = worker.info()
    assert after.num_kv_pages_free + worker.engine.prefix.local.reclaimable_pages() == before.num_kv_pages_free
    reasons = dict(after.prefix_cache_miss_reasons)
    assert (
        reasons.get("failed_verification", 0)
        == dict(before.prefix_cache_miss_reasons).get("failed_verification", 0) + 1
    )
    assert engine_alive(worker.engine)


def test_stopping_an_engine_that_waits_for_a_scheduler_ends_its_requests_at_once(start_worker):
    worker = start_worker(scheduler_addresses=(f"127.0.0.1:{free_port()}",), scheduler_give_up_s=5.0)
    errors: list[grpc.RpcError] = []

    def stream() -> None:
        try:
            collect(worker.stub.Generate(greedy_request(prompt_of(6, 8), 4), timeout=30))
        except grpc.RpcError as exc:
            errors.append(exc)

    client = threading.Thread(target=stream)
    client.start()
    deadline = time.monotonic() + 10
    while worker.engine.num_live == 0:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    worker.engine.stop(timeout_s=0.5)  # the loop is inside a PlanStep wait: it cannot end in time
    client.join(3)
    assert not client.is_alive()
    assert [e.code() for e in errors] == [grpc.StatusCode.UNAVAILABLE]
    assert "shutting down" in errors[0].details()
