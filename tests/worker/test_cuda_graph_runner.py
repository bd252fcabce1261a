"""The CUDA-graph decode runner on CPU: bucket selection, padding and static-buffer reuse, with a stand-in
capture that records what would be captured and runs each step eagerly; then the whole runner on the
CUDA backend's kernels (Triton's interpreter without a GPU) against the torch path."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from gpu_worker.model.backends import attach_kernels
from gpu_worker.model.context import ForwardContext
from gpu_worker.runner.batch import Batch, SequenceChunk
from gpu_worker.runner.cuda_graphs import DecodeGraphs, bucket_sizes, pick_bucket
from gpu_worker.runner.input_builder import build_inputs
from gpu_worker.runner.runner import ModelRunner
from gpu_worker.runner.settings import RunnerConfig
from hybridserve_cli.init_model import ModelSpec, write_random_checkpoint

CPU = torch.device("cpu")
VOCAB = 11


class RecordingCapture:
    """Stand-in for CudaGraphCapture: counts captures and replays, runs the step eagerly."""

    def __init__(self) -> None:
        self.num_captured = 0
        self.num_replays = 0

    def __call__(self, step: Callable[[], None]) -> Callable[[], None]:
        self.num_captured += 1
        step()

        def replay() -> None:
            self.num_replays += 1
            step()

        return replay


class FakeForward:
    """Records what each call saw: the batch width, the inputs and the buffers' addresses."""

    def __init__(self) -> None:
        self.calls: list[dict[str, object]] = []

    def __call__(self, input_ids: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        self.calls.append({
            "width": ctx.num_decode, "ids": input_ids.clone(), "positions": ctx.positions.clone(),
            "write": ctx.kv_write_slots.clone(), "state": ctx.decode_state_slots.clone(),
            "table": ctx.decode_page_table.clone(),
            "ptrs": (input_ids.data_ptr(), ctx.positions.data_ptr(), ctx.decode_page_table.data_ptr()),
        })  # fmt: skip
        return input_ids[:, None].float() * torch.arange(VOCAB, dtype=torch.float32)[None, :]


def test_bucket_sizes_cover_every_batch_with_bounded_padding() -> None:
    assert bucket_sizes(1) == (1,)
    assert bucket_sizes(5) == (1, 2, 4, 5)
    buckets = bucket_sizes(256)
    assert buckets[0] == 1 and buckets[-1] == 256 and list(buckets) == sorted(set(buckets))
    assert len(buckets) <= 28
    for n in range(1, 257):
        b = pick_bucket(buckets, n)
        assert b is not None and b >= n
        assert b == min(x for x in buckets if x >= n)
        assert n <= 8 or b <= 1.25 * n  # padding above 8 rows stays under a quarter
    assert pick_bucket(buckets, 257) is None
    assert bucket_sizes(300)[-1] == 300


def _decode_batch(starts: list[int], slots: list[int], page_ids: list[tuple[int, ...]]) -> Batch:
    return Batch(
        tuple(
            SequenceChunk((7 + i,), s, p, slot)
            for i, (s, slot, p) in enumerate(zip(starts, slots, page_ids, strict=True))
        )
    )


def test_capture_pads_and_replays_from_the_same_buffers() -> None:
    forward, capture = FakeForward(), RecordingCapture()
    graphs = DecodeGraphs(forward, max_batch=8, max_pages_per_seq=4, page_size_tokens=4, device=CPU, capture=capture)
    graphs.capture_all()
    assert [c["width"] for c in forward.calls] == [8, 4, 2, 1]  # largest first, one capture each
    for call in forward.calls:  # capture-time inputs touch no pool row
        assert (call["state"] == -1).all() and (call["write"] == -1).all() and (call["positions"] == -1).all()
    captured_ptrs = {c["width"]: c["ptrs"] for c in forward.calls}

    batch = _decode_batch([5, 0, 13], [6, 2, 0], [(9, 3), (4,), (1, 8, 11, 2)])  # holes in the page ids
    packed = build_inputs(batch, 4, 8, CPU)
    logits = graphs.run(packed)
    seen = forward.calls[-1]
    assert capture.num_replays == 1 and seen["width"] == 4  # 3 rows -> bucket 4
    assert seen["ptrs"] == captured_ptrs[4]  # the very buffers the graph was captured with
    # packed order is by state slot: slots 0, 2, 6 -> sequences 2, 1, 0; row 3 is padding
    assert seen["state"].tolist() == [0, 2, 6, -1]
    assert seen["positions"].tolist() == [13, 0, 5, -1]
    assert seen["write"].tolist() == [2 * 4 + 1, 4 * 4 + 0, 3 * 4 + 1, -1]
    assert seen["ids"].tolist() == [9, 8, 7, 0]
    assert seen["table"][:3].tolist() == [[1, 8, 11, 2], [4, 0, 0, 0], [9, 3, 0, 0]]
    assert logits.shape == (3, VOCAB) and logits[:, 1].tolist() == [9.0, 8.0, 7.0]

    graphs.run(build_inputs(_decode_batch([2], [5], [(10,)]), 4, 8, CPU))
    seen = forward.calls[-1]
    assert seen["width"] == 1 and seen["ptrs"] == captured_ptrs[1]
    assert seen["state"].tolist() == [5] and seen["table"][0, 0].item() == 10
    assert capture.num_captured == 4 and capture.num_replays == 2


def test_only_decode_batches_that_fit_replay() -> None:
    graphs = DecodeGraphs(FakeForward(), 8, 4, 4, CPU, RecordingCapture())
    one = _decode_batch([3], [0], [(0,)])
    assert graphs.can_run(one)
    assert not graphs.can_run(Batch(one.sequences, return_all_logits=True))
    assert not graphs.can_run(Batch((SequenceChunk((1, 2), 0, (0,), 0),)))  # a prefill chunk
    assert not graphs.can_run(_decode_batch([0] * 9, list(range(9)), [(i,) for i in range(9)]))  # > 8 rows
    assert not graphs.can_run(_decode_batch([16], [0], [(0, 1, 2, 3, 4)]))  # past the 4-page table
    assert graphs.can_run(_decode_batch([15], [0], [(0, 1, 2, 3)]))


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    spec = ModelSpec(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=3, attn_layer_indices=(1,),
        num_attention_heads=4, num_key_value_heads=2, mamba_n_heads=4, mamba_d_state=8, mamba_chunk_size=8,
    )  # fmt: skip
    return write_random_checkpoint(tmp_path_factory.mktemp("tiny"), spec, seed=3, with_tokenizer=False)


def _runner(path: Path) -> ModelRunner:
    cfg = RunnerConfig(memory_budget_bytes=4 << 20, kv_page_size_tokens=4, max_num_seqs=6, num_checkpoint_slots=2,
                       device="cpu", dtype="float32")  # fmt: skip
    return ModelRunner.from_model_dir(path, cfg)


def _drive(runner: ModelRunner) -> list[torch.Tensor]:
    """Three prompts prefilled eagerly, then decode steps of 3, 2 and 4 rows (a fresh 1-token prompt
    joins), with a checkpoint saved mid-decode; returns every step's logits."""
    kv, pool = runner.kv_pool, runner.state_pool
    filler = pool.allocate_slot()  # decode slots are then not one contiguous run
    slots = [pool.allocate_slot() for _ in range(4)]
    pages = [tuple(kv.allocate(6)) for _ in range(4)]
    prompts = [[3, 9, 27, 17, 51, 25, 11], [4, 8, 15, 16, 23], [42, 5, 6, 7, 8, 9, 10, 11, 12], [33]]
    out = [
        runner.forward(
            Batch(tuple(SequenceChunk(tuple(p), 0, pg, s) for p, pg, s in zip(prompts[:3], pages, slots, strict=False)))
        ).logits
    ]
    lens = [len(p) for p in prompts]
    steps = [(0, 1, 2), (2, 0), (0, 1, 2, 3), (3, 1)]
    ckpt = pool.allocate_checkpoint()
    for k, rows in enumerate(steps):
        seqs = []
        for i in rows:
            start = lens[i] - 1 if i == 3 and k == 2 else lens[i]
            save = ckpt if (k, i) == (1, 0) else None
            seqs.append(SequenceChunk((5 + i + k,), start, pages[i], slots[i], save))
            lens[i] = start + 1
        out.append(runner.forward(Batch(tuple(seqs))).logits)
    pool.restore_checkpoint(ckpt, filler)
    out.append(runner.forward(Batch((SequenceChunk((2,), lens[0] - 1, pages[0], filler),))).logits)
    return out


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU kernels need the interpreter; CUDA: test_gpu_backend")
def test_graphed_decode_on_the_kernels_matches_the_torch_path(tiny_model: Path) -> None:
    eager = _runner(tiny_model)
    graphed = _runner(tiny_model)
    attach_kernels(graphed.model, "triton")
    capture = RecordingCapture()
    graphed.decode_graphs = DecodeGraphs(graphed._decode_logits, 4, 8, 4, CPU, capture)
    graphed.decode_graphs.capture_all()
    want, got = _drive(eager), _drive(graphed)
    assert capture.num_replays == 5  # every decode step replayed; the prefill ran eagerly
    for i, (a, b) in enumerate(zip(want, got, strict=True)):
        assert (a - b).abs().max().item() <= 1e-4, f"step {i}"
