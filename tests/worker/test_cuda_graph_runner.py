"""The CUDA-graph decode runner on CPU: bucket selection, padding and static-buffer reuse, with a stand-in
capture that records what would be captured and runs each step eagerly; then the whole runner on the
CUDA backend's kernels (Triton's interpreter without a GPU) against the torch path, for decode steps and
for speculative decoding's verify steps (cuda_graphs.VerifyGraphs) with their rollback."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from gpu_worker.model.backends import attach_kernels
from gpu_worker.model.context import ForwardContext
from gpu_worker.runner.batch import Batch, SequenceChunk
from gpu_worker.runner.cuda_graphs import DecodeGraphs, VerifyGraphs, bucket_sizes, pick_bucket
from gpu_worker.runner.input_builder import build_inputs, build_verify_inputs
from gpu_worker.runner.runner import ModelRunner
from gpu_worker.runner.settings import RunnerConfig
from gpu_worker.runner.speculation import Verified, roll_back
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


class FakeVerify:
    """Records what each verify call saw: the bucket, its columns and the buffers' addresses."""

    def __init__(self) -> None:
        self.calls: list[dict[str, object]] = []

    def __call__(self, *columns: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        ids, positions, writes, lengths, slots, table = columns
        self.calls.append({
            "rows": ids.shape[0], "columns": [c.clone() for c in columns], "ptrs": [c.data_ptr() for c in columns],
        })  # fmt: skip
        return ids[:, :, None].float() * torch.arange(VOCAB, dtype=torch.float32), [slots.clone()]


def test_verify_graphs_capture_on_scratch_and_replay_a_step_from_the_same_buffers() -> None:
    forward, capture = FakeVerify(), RecordingCapture()
    graphs = VerifyGraphs(forward, max_rows=4, length=3, max_pages_per_seq=5, page_size_tokens=4, device=CPU,
                          capture=capture)  # fmt: skip
    graphs.capture_all(scratch_slot=2, scratch_page=7)
    assert [c["rows"] for c in forward.calls] == [4, 2, 1]  # largest first, one capture each
    for call in forward.calls:  # one token at position 0 of the scratch slot and page, nothing else touched
        ids, positions, writes, lengths, slots, table = call["columns"]  # type: ignore[misc]
        assert (positions == 0).all() and (writes == 28).all() and (lengths == 1).all() and (slots == 2).all()
        assert (table == 7).all() and table.shape[1] == 5
    captured = {c["rows"]: c["ptrs"] for c in forward.calls}

    # a drafted row (newest token 9 at position 5, drafts 4 and 6) beside a plain decode: bucket 2
    seqs = (SequenceChunk((9, 4, 6), 5, (3, 1), 1, num_draft_tokens=2), SequenceChunk((8,), 2, (6,), 0))
    batch = Batch(seqs)
    assert graphs.can_run(batch)
    logits, spans = graphs.run(build_verify_inputs(batch, 4, 8, 3, 2, 2))
    seen = forward.calls[-1]
    assert capture.num_replays == 1 and seen["rows"] == 2 and seen["ptrs"] == captured[2]
    ids, positions, writes, lengths, slots, table = seen["columns"]  # type: ignore[misc]
    assert ids.tolist() == [[9, 4, 6], [8, 8, 8]]  # a plain row's padded positions repeat its token
    assert positions.tolist() == [[5, 6, 7], [2, 3, 4]]
    assert writes.tolist() == [[1 * 4 + 1, 1 * 4 + 2, 1 * 4 + 3], [6 * 4 + 2] * 3]  # padding: its last real slot
    assert lengths.tolist() == [3, 1] and slots.tolist() == [1, 0]
    assert table[:, :2].tolist() == [[3, 1], [6, 0]]
    assert logits.shape == (2, 3, VOCAB) and logits[0, :, 1].tolist() == [9.0, 4.0, 6.0]

    three = Batch(tuple(SequenceChunk((5, 1), 9, (0, 2, 4), slot, num_draft_tokens=1) for slot in (3, 5, 6)))
    graphs.run(build_verify_inputs(three, 4, 8, 3, 4, 2))  # three rows: one padding row first, repeating row 0
    seen = forward.calls[-1]
    assert seen["rows"] == 4 and seen["ptrs"] == captured[4]
    assert seen["columns"][4].tolist() == [3, 3, 5, 6]  # type: ignore[index]
    assert capture.num_captured == 3 and capture.num_replays == 2


def test_only_verify_steps_that_fit_replay() -> None:
    graphs = VerifyGraphs(FakeVerify(), 4, 3, 4, 4, CPU, RecordingCapture())
    drafted = SequenceChunk((1, 2, 3), 4, (0, 1), 0, num_draft_tokens=2)
    assert graphs.can_run(Batch((drafted, SequenceChunk((5,), 2, (2,), 1))))
    assert not graphs.can_run(Batch((drafted,), return_all_logits=True))
    assert not graphs.can_run(Batch((drafted._replace(token_ids=(1, 2, 3, 4), num_draft_tokens=3),)))  # > L
    assert not graphs.can_run(Batch((SequenceChunk((1, 2), 0, (0,), 0),)))  # a prefill chunk
    assert not graphs.can_run(Batch((SequenceChunk((7,), 0, (0,), 0, score=True),)))
    assert not graphs.can_run(Batch(tuple(SequenceChunk((1,), 0, (i,), i) for i in range(5))))  # > 4 rows
    assert not graphs.can_run(Batch((drafted._replace(start_pos=14, page_ids=(0, 1, 2, 3)),)))  # past the table
    assert graphs.can_run(Batch((drafted._replace(start_pos=13, page_ids=(0, 1, 2, 3)),)))


def _drive_verify(runner: ModelRunner) -> list[torch.Tensor]:
    """Three prompts prefilled, then a verify step (three drafts on one row, two on another, a plain decode
    beside them), the first row's drafts rejected after its first and rolled back, then two decode steps
    from the state the rollback left; returns each step's logits, every verified position's, and the
    rolled-back rows' states."""
    kv, pool = runner.kv_pool, runner.state_pool
    slots = [pool.allocate_slot() for _ in range(3)]
    pages = [tuple(kv.allocate(5)) for _ in range(3)]
    prompts = [[3, 9, 27, 17, 51, 25, 11], [4, 8, 15, 16, 23], [42, 5, 6, 7, 8, 9]]
    chunks = (SequenceChunk(tuple(p), 0, pg, s) for p, pg, s in zip(prompts, pages, slots, strict=True))
    out = [runner.forward(Batch(tuple(chunks))).logits]
    lens = [len(p) for p in prompts]
    verify = Batch((
        SequenceChunk((30, 31, 32, 33), lens[0], pages[0], slots[0], num_draft_tokens=3),
        SequenceChunk((40,), lens[1], pages[1], slots[1]),
        SequenceChunk((50, 51, 52), lens[2], pages[2], slots[2], num_draft_tokens=2),
    ))  # fmt: skip
    step = runner.forward(verify)
    out.append(step.logits)
    out.extend(logits for _, logits in step.draft_logits)
    verified = [Verified(0, 3, (31,), (0.0,), ((),)), Verified(2, 2, (51, 52), (0.0, 0.0), ((), ()))]
    roll_back(pool, verify, verified, step.draft_records)
    conv, ssm = pool.stacked_states()
    out.extend(t[:, slots].clone() for t in (conv, ssm))
    lens = [lens[0] + 2, lens[1] + 1, lens[2] + 3]
    for k in range(2):
        seqs = tuple(SequenceChunk((20 + i + k,), lens[i], pages[i], slots[i]) for i in range(3))
        out.append(runner.forward(Batch(seqs)).logits)
        lens = [n + 1 for n in lens]
    return out


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU kernels need the interpreter; CUDA: test_gpu_backend")
def test_graphed_verify_on_the_kernels_matches_the_torch_path_and_rolls_back_alike(tiny_model: Path) -> None:
    eager = _runner(tiny_model)
    graphed = _runner(tiny_model)
    attach_kernels(graphed.model, "triton")
    capture = RecordingCapture()
    graphed.verify_graphs = VerifyGraphs(graphed._verify_step, 4, 4, 8, 4, CPU, capture)
    graphed.verify_graphs.capture_all()
    assert capture.num_captured == 3  # buckets of 1, 2 and 4 rows
    want, got = _drive_verify(eager), _drive_verify(graphed)
    assert capture.num_replays == 1  # the verify step replayed (3 rows: bucket 4, one padding row)
    assert len(want) == len(got) == 8
    for i, (a, b) in enumerate(zip(want, got, strict=True)):
        assert a.shape == b.shape, f"output {i}"
        assert (a - b).abs().max().item() <= 1e-4, f"output {i}"
