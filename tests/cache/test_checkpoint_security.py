"""Checkpoints that storage cannot forge: a worker verifies what it fetches (MAC, block identity,
tensor layout) before anything touches a pool; a failure is a miss, counted and deleted. Real workers,
a real cache service and a real Redis; plus the pure seal/verify rules."""

from __future__ import annotations

import hashlib

import pytest
import torch

from cache_svc import keys
from gpu_worker.cache.blocks import chain_hashes
from gpu_worker.runner.checkpoint_io import (
    HEAD_BYTES,
    BlockCheckpoint,
    BlockIdentity,
    CheckpointLayout,
    Rejection,
    TensorSpec,
    seal,
    seal_body,
    verify,
)
from hybridserve.v1 import cache_pb2 as cpb
from tests.cache.test_prefix_caching import BLOCK, assert_same, run
from tests.worker.conftest import SHARED_ACCESS, prompt_of

KEY = b"k" * 32
IDENTITY = BlockIdentity(b"h" * 32, b"p" * 32, 16, "f" * 64)
LAYOUT = CheckpointLayout(
    TensorSpec((2, 2, 16, 2, 8), "F32"), TensorSpec((3, 40, 3), "F32"), TensorSpec((3, 4, 8, 16), "F32")
)


def block(seed: int = 0) -> BlockCheckpoint:
    g = torch.Generator().manual_seed(seed)
    return BlockCheckpoint(
        kv=torch.randn(2, 2, 16, 2, 8, generator=g), conv=torch.randn(3, 40, 3, generator=g),
        ssm=torch.randn(3, 4, 8, 16, generator=g),
    )  # fmt: skip


# ---- the pure rules ------------------------------------------------------------------------------
def test_a_sealed_checkpoint_verifies_to_the_same_tensors():
    original = block()
    got = verify(seal(original, IDENTITY, KEY), IDENTITY, LAYOUT, KEY)
    assert isinstance(got, BlockCheckpoint)
    assert torch.equal(got.kv, original.kv) and torch.equal(got.ssm, original.ssm)
    kv_only = verify(seal(BlockCheckpoint(original.kv, None, None), IDENTITY, KEY), IDENTITY, LAYOUT, KEY)
    assert isinstance(kv_only, BlockCheckpoint) and not kv_only.has_state


@pytest.mark.parametrize(
    ("forge", "reason"),
    [
        (lambda d: d[:-1] + bytes([d[-1] ^ 1]), "mac"),  # one bit of a tensor
        (lambda d: d[:60] + bytes([d[60] ^ 1]) + d[61:], "mac"),  # one bit of the header
        (lambda d: seal(block(), IDENTITY, b"another-key-of-32-bytes-long!!!!"), "mac"),  # a key no worker holds
        (lambda d: seal(block(), BlockIdentity(b"x" * 32, b"p" * 32, 16, "f" * 64), KEY), "identity"),
        (lambda d: seal(block(), BlockIdentity(b"h" * 32, b"q" * 32, 16, "f" * 64), KEY), "identity"),
        (lambda d: seal(block(), BlockIdentity(b"h" * 32, b"p" * 32, 32, "f" * 64), KEY), "identity"),
        (lambda d: seal(block(), BlockIdentity(b"h" * 32, b"p" * 32, 16, "0" * 64), KEY), "identity"),
        (lambda d: seal(BlockCheckpoint(torch.zeros(2, 2, 8, 2, 8), None, None), IDENTITY, KEY), "layout"),
        (lambda d: seal(BlockCheckpoint(block().kv.double(), None, None), IDENTITY, KEY), "layout"),
        (lambda d: seal(BlockCheckpoint(block().kv, block().conv, block().ssm[:2]), IDENTITY, KEY), "layout"),
        (lambda d: b"not a checkpoint at all", "format"),
        (lambda d: d[HEAD_BYTES:], "format"),  # the bare safetensors body, unsealed
        (lambda d: d[:10] + bytes([d[10] ^ 1]) + d[11:], "mac"),  # one bit of the salt
        (lambda d: d[:30] + bytes([d[30] ^ 1]) + d[31:], "mac"),  # one bit of the tag
        (lambda d: b"HSCKPT02" + d[8:], "format"),  # an earlier format version
    ],
)
def test_forged_or_foreign_checkpoints_are_rejected_with_a_reason(forge, reason):
    verdict = verify(forge(seal(block(), IDENTITY, KEY)), IDENTITY, LAYOUT, KEY)
    assert isinstance(verdict, Rejection) and verdict.reason == reason, verdict
    assert KEY.decode() not in str(verdict)


def test_every_seal_draws_its_own_salt():
    one = block()
    first, second = seal(one, IDENTITY, KEY), seal(one, IDENTITY, KEY)
    assert first[8:24] != second[8:24]  # the salts
    for data in (first, second):
        assert not isinstance(verify(data, IDENTITY, LAYOUT, KEY), Rejection)
    spliced = second[: HEAD_BYTES - 16] + first[HEAD_BYTES - 16 :]  # second's salt with first's tag
    verdict = verify(spliced, IDENTITY, LAYOUT, KEY)
    assert isinstance(verdict, Rejection) and verdict.reason == "mac"


def test_a_sealed_but_malformed_body_is_a_format_rejection():
    body = (10**9).to_bytes(8, "little") + b"{}"  # a header length far past the bytes
    data = seal_body(body, KEY)
    verdict = verify(data, IDENTITY, LAYOUT, KEY)
    assert isinstance(verdict, Rejection) and verdict.reason == "format"


def _resealed(mutate) -> bytes:
    """A checkpoint whose safetensors header was changed by `mutate` and then sealed with the key."""
    import json
    import struct

    body = seal(block(), IDENTITY, KEY)[HEAD_BYTES:]
    (length,) = struct.unpack("<Q", body[:8])
    header = json.loads(body[8 : 8 + length])
    mutate(header)
    encoded = json.dumps(header).encode()
    encoded += b" " * (-len(encoded) % 8)
    new_body = struct.pack("<Q", len(encoded)) + encoded + body[8 + length :]
    return seal_body(new_body, KEY)


@pytest.mark.parametrize(
    "mutate",
    [
        lambda h: h["kv"].update(data_offsets=[0, 10**9]),  # past the data section
        lambda h: h["ssm"].update(data_offsets=[4, h["ssm"]["data_offsets"][1]]),  # too few bytes
        lambda h: h["conv"].update(data_offsets=[-8, h["conv"]["data_offsets"][1]]),
        lambda h: h["conv"].update(data_offsets="0-10"),
    ],
    ids=["past the data", "too few bytes", "negative start", "not a pair"],
)
def test_a_sealed_checkpoint_whose_byte_ranges_do_not_fit_is_a_format_rejection(mutate):
    """Only a key holder can get here (a buggy worker): the tensors are views of the bytes, so a
    range outside the data must be refused before any view is made."""
    verdict = verify(_resealed(mutate), IDENTITY, LAYOUT, KEY)
    assert isinstance(verdict, Rejection) and verdict.reason == "format", verdict


def test_verified_tensors_are_views_of_the_checkpoint_bytes_and_import_copies_them():
    data = seal(block(3), IDENTITY, KEY)
    got = verify(data, IDENTITY, LAYOUT, KEY)
    assert isinstance(got, BlockCheckpoint)
    assert torch.equal(got.conv, block(3).conv) and torch.equal(got.kv, block(3).kv)
    del data  # the views keep the bytes alive
    assert torch.equal(got.ssm.clone(), block(3).ssm)


# ---- real workers, cache service and Redis -----------------------------------------------------
def assert_genuine(redis_client, worker, hashes: list[bytes]) -> None:
    """The forged entries were deleted, and what is stored now is each block's own checkpoint."""
    shared = worker.engine.prefix.shared
    for index, h in enumerate(hashes):
        data = redis_client.hget(keys.block_key("hybridserve", shared.fingerprint, h), keys.FIELD_DATA)
        identity = BlockIdentity(h, hashes[index - 1] if index else b"", BLOCK, shared.fingerprint)
        assert isinstance(verify(data, identity, shared.layout, SHARED_ACCESS.checkpoint_key), BlockCheckpoint)


def test_a_genuine_checkpoint_republished_under_another_prefix_is_a_miss(
    start_worker, cold, cache_service, redis_server
):
    """The poisoning: blocks of prefix A, fetched and re-published under prefix B's hashes, must not
    give B the tokens that follow A."""
    first = start_worker(prefix_caching=True, cache_address=cache_service.address)
    prefix_a, prefix_b = prompt_of(4 * BLOCK, 301), prompt_of(4 * BLOCK, 302)
    run(first, prefix_a + prompt_of(3, 1))
    assert first.engine.prefix.shared.flush()
    fingerprint = first.engine.prefix.fingerprint
    hashes_a = chain_hashes(prefix_a, BLOCK, fingerprint)
    hashes_b = chain_hashes(prefix_b, BLOCK, fingerprint)
    stub = cache_service.stub
    for index, (a, b) in enumerate(zip(hashes_a, hashes_b, strict=True)):
        chunks = stub.Fetch(cpb.FetchRequest(model_fingerprint=fingerprint, block_hash=a), timeout=10)
        data = b"".join(c.data for c in chunks)
        stub.Publish(
            cpb.PublishRequest(
                model_fingerprint=fingerprint, block_hash=b, parent_hash=hashes_b[index - 1] if index else b"",
                block_size=BLOCK, checkpoint=data, checksum=hashlib.sha256(data).digest(),
            ),
            timeout=10,
        )  # fmt: skip
    lookup = stub.Lookup(cpb.LookupRequest(model_fingerprint=fingerprint, block_hashes=hashes_b), timeout=10)
    assert lookup.num_hit_blocks == 4, "the poisoned blocks are in the shared tier"

    second = start_worker(prefix_caching=True, cache_address=cache_service.address)
    prompt = prefix_b + prompt_of(5, 2)
    tokens, logprobs, usage = run(second, prompt)
    assert usage.cached_tokens == 0
    assert_same((tokens, logprobs), cold(prompt))
    shared = second.engine.prefix.shared
    assert shared.rejected["identity"] >= 1 and second.engine.prefix.num_shared_hits == 0
    assert shared.flush()  # the cold run published B's genuine blocks in place of the deleted ones
    assert_genuine(redis_server.client(), second, hashes_b)
    third = start_worker(prefix_caching=True, cache_address=cache_service.address)
    tokens, logprobs, usage = run(third, prompt)
    assert usage.cached_tokens == 4 * BLOCK, "healed: B's own blocks now hit"
    assert_same((tokens, logprobs), cold(prompt))


@pytest.mark.parametrize("signed", [True, False], ids=["sealed-with-the-key", "unsealed"])
def test_a_wrong_shape_checkpoint_written_into_redis_is_a_miss(start_worker, cold, cache_service, redis_server, signed):
    first = start_worker(prefix_caching=True, cache_address=cache_service.address)
    prefix = prompt_of(4 * BLOCK, 303)
    run(first, prefix + prompt_of(3, 3))
    assert first.engine.prefix.shared.flush()
    fingerprint = first.engine.prefix.fingerprint
    hashes = chain_hashes(prefix, BLOCK, fingerprint)
    client = redis_server.client()
    for index, h in enumerate(hashes):
        identity = BlockIdentity(h, hashes[index - 1] if index else b"", BLOCK, fingerprint)
        wrong = BlockCheckpoint(torch.zeros(2, 2, BLOCK * 2, 3, 5), torch.zeros(1, 7, 3), torch.zeros(1, 2, 2, 2))
        data = seal(wrong, identity, SHARED_ACCESS.checkpoint_key if signed else b"x" * 32)
        client.hset(
            keys.block_key("hybridserve", fingerprint, h),
            mapping={keys.FIELD_DATA: data, keys.FIELD_SHA256: hashlib.sha256(data).hexdigest()},
        )
    shared = first.engine.prefix.shared
    assert shared.fetch_prefix("forged", hashes, 0).result(timeout=30).blocks == []
    assert shared.rejected["layout" if signed else "mac"] == 1
    assert not client.exists(keys.block_key("hybridserve", fingerprint, hashes[0])), "the forged block was deleted"
    second = start_worker(prefix_caching=True, cache_address=cache_service.address)
    prompt = prefix + prompt_of(6, 4)
    tokens, logprobs, usage = run(second, prompt)
    assert usage.cached_tokens == 0
    assert_same((tokens, logprobs), cold(prompt))
    assert second.engine.prefix.shared.flush()
    assert_genuine(client, second, hashes)
    assert_same(run(second, prompt)[:2], cold(prompt)), "the worker still serves"


@pytest.fixture
def cold(start_worker):
    worker = start_worker(prefix_caching=False)
    return lambda prompt: run(worker, prompt)[:2]
