"""KV page pool and Mamba state pool lifetimes; runner sizing and batch validation."""

from __future__ import annotations

import pytest
import torch

from gpu_worker.runner.batch import Batch, SequenceChunk
from gpu_worker.runner.kv_pool import KVPagePool
from gpu_worker.runner.runner import ModelRunner
from gpu_worker.runner.settings import RunnerConfig
from gpu_worker.runner.state_pool import MambaStatePool
from hybridserve.errors import InvalidArgumentError, ResourceExhaustedError

CPU = torch.device("cpu")


def test_kv_pool_allocate_share_free() -> None:
    pool = KVPagePool(4, 16, num_layers=2, num_kv_heads=2, head_dim=8, dtype=torch.float32, device=CPU)
    assert pool.pages_for_tokens(1) == 1 and pool.pages_for_tokens(16) == 1 and pool.pages_for_tokens(17) == 2
    pages = pool.allocate(3)
    assert len(set(pages)) == 3 and pool.num_free_pages == 1
    with pytest.raises(ResourceExhaustedError):
        pool.allocate(2)
    pool.share(pages[:1])
    pool.free(pages)
    assert pool.num_free_pages == 3 and pool.ref_count(pages[0]) == 1
    pool.free(pages[:1])
    assert pool.num_free_pages == 4
    with pytest.raises(InvalidArgumentError):
        pool.free(pages[:1])
    with pytest.raises(InvalidArgumentError):
        pool.share(pages[:1])
    k, v = pool.layer_caches()[1]
    assert k.shape == (64, 2, 8) and v.shape == (64, 2, 8)
    assert KVPagePool.bytes_per_token(2, 2, 8, torch.bfloat16) == 2 * 2 * 2 * 8 * 2


def test_kv_pool_hands_freed_pages_back_in_order() -> None:
    """A freed page table comes back in the order it was held, so consecutive pages stay consecutive and
    ascending (the decode attention reads such a sequence's pages in place)."""
    pool = KVPagePool(16, 16, num_layers=1, num_kv_heads=2, head_dim=8, dtype=torch.float32, device=CPU)
    first = pool.allocate(6)
    assert first == [0, 1, 2, 3, 4, 5]
    pool.free(first)
    again = pool.allocate(8)
    assert again[:6] == first and again == list(range(again[0], again[0] + 8))
    pool.free([again[2], again[1]])  # freed out of order: handed back in the order given
    assert pool.allocate(2) == [again[2], again[1]]
    with pytest.raises(InvalidArgumentError):
        pool.free([again[3], 15])  # page 15 was never allocated: page again[3] is free all the same
    assert pool.ref_count(again[3]) == 0 and pool.allocate(1) == [again[3]]


def test_state_pool_checkpoints_round_trip() -> None:
    pool = MambaStatePool(2, 2, num_layers=3, conv_shape=(5, 3), ssm_shape=(2, 4, 6), conv_dtype=torch.float32,
                          device=CPU)  # fmt: skip
    slot, other = pool.allocate_slot(), pool.allocate_slot()
    with pytest.raises(ResourceExhaustedError):
        pool.allocate_slot()
    for conv, ssm in pool.layer_states():
        conv[slot].normal_()
        ssm[slot].normal_()
    ckpt = pool.allocate_checkpoint()
    pool.save_checkpoint(slot, ckpt)
    conv0 = pool.layer_states()[0][0][slot].clone()
    pool.zero_slots(torch.tensor([slot]))
    assert pool.layer_states()[0][0][slot].abs().sum() == 0
    pool.restore_checkpoint(ckpt, other)
    assert torch.equal(pool.layer_states()[0][0][other], conv0)
    conv, ssm = pool.export_checkpoint(ckpt)
    assert conv.shape == (3, 5, 3) and ssm.shape == (3, 2, 4, 6) and ssm.dtype == torch.float32
    ckpt2 = pool.allocate_checkpoint()
    pool.import_checkpoint(ckpt2, conv, ssm)
    pool.restore_checkpoint(ckpt2, slot)
    assert torch.equal(pool.layer_states()[2][1][slot], pool.layer_states()[2][1][other])
    with pytest.raises(InvalidArgumentError, match="do not match"):
        pool.import_checkpoint(ckpt2, conv[:, :2], ssm)
    pool.free_checkpoint(ckpt)
    with pytest.raises(InvalidArgumentError, match="freed twice"):
        pool.free_checkpoint(ckpt)
    assert MambaStatePool.bytes_per_slot(3, (5, 3), (2, 4, 6), torch.float32) == 3 * (15 * 4 + 48 * 4)


def test_runner_sizes_pools_from_the_budget(small_checkpoint) -> None:
    _, path = small_checkpoint
    cfg = RunnerConfig(memory_budget_bytes=4 << 20, kv_page_size_tokens=8, max_num_seqs=4, num_checkpoint_slots=2,
                       device="cpu")  # fmt: skip
    runner = ModelRunner.from_model_dir(path, cfg)
    c = runner.config
    assert runner.kv_bytes_per_token == 2 * c.num_attention_layers * c.num_key_value_heads * c.head_dim * 4
    state = runner.state_bytes_per_request * 6
    assert runner.kv_pool.num_pages == (cfg.memory_budget_bytes - state) // (runner.kv_bytes_per_token * 8)
    assert runner.describe()["dtype"] == "float32"
    with pytest.raises(InvalidArgumentError, match="memory_budget_bytes"):
        ModelRunner.from_model_dir(path, RunnerConfig(memory_budget_bytes=1000, device="cpu"))


def test_batch_validation(small_checkpoint) -> None:
    _, path = small_checkpoint
    runner = ModelRunner.from_model_dir(path, RunnerConfig(memory_budget_bytes=4 << 20, kv_page_size_tokens=4,
                                                           max_num_seqs=4, device="cpu"))  # fmt: skip
    with pytest.raises(InvalidArgumentError, match="cannot hold"):
        runner.forward(Batch((SequenceChunk((1, 2, 3, 4, 5), 0, (0,), 0),)))
    with pytest.raises(InvalidArgumentError, match="more than one"):
        runner.forward(Batch((SequenceChunk((1,), 0, (0,), 0), SequenceChunk((1,), 0, (1,), 0))))
    with pytest.raises(InvalidArgumentError, match="no tokens"):
        runner.forward(Batch((SequenceChunk((), 0, (0,), 0),)))
    with pytest.raises(InvalidArgumentError, match="outside"):
        runner.forward(Batch((SequenceChunk((1,), 0, (0,), 9),)))
    with pytest.raises(InvalidArgumentError, match="no sequences"):
        runner.forward(Batch(()))


def test_fresh_sequence_ignores_stale_slot_contents(small_checkpoint) -> None:
    _, path = small_checkpoint
    runner = ModelRunner.from_model_dir(path, RunnerConfig(memory_budget_bytes=4 << 20, kv_page_size_tokens=4,
                                                           max_num_seqs=4, device="cpu"))  # fmt: skip
    batch = Batch((SequenceChunk((5, 6, 7), 0, (0,), 1),))
    first = runner.forward(batch).logits
    for conv, ssm in runner.state_pool.layer_states():
        conv.normal_()
        ssm.normal_()
    assert torch.equal(runner.forward(batch).logits, first)
