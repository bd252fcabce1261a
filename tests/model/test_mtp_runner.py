"""The multi-token-prediction head in the runner (gpu_worker.runner.mtp), on Nemotron-H checkpoints with a
random MTP head: it loads without changing the model, and the drafts it proposes after each step are
those of a dense reference of the head (every position recomputed from scratch, no pages), through
chunked prefill, plain decodes and verified steps with drafts accepted and rejected, two requests
packed in one batch, chained drafts running past a request's pages into the scratch pages; with the
steps through the CPU's compiled programs too."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from gpu_worker.runner.batch import Batch, SequenceChunk
from gpu_worker.runner.runner import ModelRunner
from gpu_worker.runner.sampling import StepOutput, StepSampling
from gpu_worker.runner.settings import RunnerConfig
from hybridserve.errors import InvalidArgumentError
from hybridserve_cli.demo_model.mtp_head import dense_mtp_head
from tests.model.model_helpers import MTP_SPECS, Request, hf_logits, run_schedule

K = 4


def _runner(path: Path, mtp: int = K, sizes: str = "") -> ModelRunner:
    """With `sizes`, whole decode and verify steps compiled for those batch sizes (compiled_step), at warm-up."""
    cfg = RunnerConfig(
        memory_budget_bytes=8 << 20, kv_page_size_tokens=4, max_num_seqs=4, num_checkpoint_slots=2, device="cpu",
        dtype="float32", num_draft_rows=2 * K, mtp_draft_tokens=mtp, compile_step_sizes=sizes,
        verify_tokens=1 + K if sizes else 0,
    )  # fmt: skip
    runner = ModelRunner.from_model_dir(path, cfg)
    if sizes:
        runner.warm_up()
    return runner


def _reference_drafts(runner: ModelRunner, known: list[int], k: int) -> list[int]:
    """The k drafts after `known` (its last token the newest, not computed): the model's hidden states of
    every computed position from one prefill, the head over them, then chained on its own output."""
    model = runner.model
    req = Request(runner, known[:-1])
    out = runner.forward(Batch((req.chunk(len(known) - 1)._replace(mtp_drafts=0),)))  # keeps the hidden states
    assert out.hidden is not None
    req.release()
    hidden, tokens = out.hidden, torch.tensor(known[1:])
    drafts: list[int] = []
    with torch.inference_mode():
        for _ in range(k):
            y = dense_mtp_head(model, tokens, hidden)
            drafts.append(int(model.compute_logits(y[-1:]).argmax(-1)))
            hidden, tokens = torch.cat([hidden, y[-1:]]), torch.cat([tokens, torch.tensor(drafts[-1:])])
    return drafts


def _room(req: Request, chunk: SequenceChunk) -> SequenceChunk:
    """`chunk` with the request's pages grown to hold the head's chained drafts past it (the engine's job)."""
    need = req.runner.kv_pool.pages_for_tokens(chunk.start_pos + len(chunk.token_ids) + K) - len(req.page_ids)
    if need > 0:
        req.page_ids += req.runner.kv_pool.allocate(need)
    return chunk._replace(page_ids=tuple(req.page_ids))


def _continuation(runner: ModelRunner, known: list[int], n: int) -> list[int]:
    """The model's greedy tokens after `known` (a plain runner's prefill, then decodes)."""
    req = Request(runner, known)
    tokens = [runner.execute(Batch((req.chunk(len(known)),)), StepSampling((0,))).token_ids[0]]
    while len(tokens) < n:
        req.token_ids.append(tokens[-1])
        tokens.append(runner.execute(Batch((req.chunk(1),)), StepSampling((0,))).token_ids[0])
    req.release()
    return tokens


def test_the_head_loads_beside_an_unchanged_model(mtp_checkpoints) -> None:
    """The model's logits are transformers' (which leaves the head unread); the head's KV layers are in the
    pool only when it runs, and a checkpoint without a head is refused with a message."""
    hf, path = mtp_checkpoints["nemotron_moe"]
    ids = torch.randint(0, hf.config.vocab_size, (12,), generator=torch.Generator().manual_seed(1)).tolist()
    served = _runner(path)
    assert served.model.mtp is not None and len(served.kv_pool.layer_caches()) == 2
    assert (run_schedule(served, ids, [5, 7]) - hf_logits(hf, ids)).abs().max().item() <= 1e-5
    assert len(_runner(path, mtp=0).kv_pool.layer_caches()) == 1
    bare = path.parent / "bare"
    shutil.copytree(path, bare)
    raw = json.loads((bare / "config.json").read_text())
    (bare / "config.json").write_text(json.dumps(raw | {"num_nextn_predict_layers": 0}))
    assert _runner(bare, mtp=0).model.mtp is None  # its mtp.* tensors ignored
    with pytest.raises(InvalidArgumentError, match="no multi-token-prediction layers"):
        _runner(bare)


@pytest.mark.parametrize(
    ("name", "sizes"),
    [*((name, "") for name in MTP_SPECS), pytest.param("nemotron_dense", "1,2", marks=pytest.mark.slow)],
)
def test_drafts_are_a_dense_reference_heads(mtp_checkpoints, name: str, sizes: str) -> None:
    """`sizes`: the runner's decode and verify steps through their compiled programs, which return the
    hidden states the head reads (steps with a prefill chunk run the eager forward)."""
    hf, path = mtp_checkpoints[name]
    vocab = hf.config.vocab_size
    runner, reference = _runner(path, sizes=sizes), _runner(path)
    programs = runner.decode_steps
    calls: list[str] = []
    if sizes:
        assert programs is not None and programs.status == "ready" and programs.verify_buckets == (1, 2)
        programs.stance = "fail_on_recompile"  # every step below was compiled at warm-up
        decode, verify = programs._program, programs._verify
        programs._program = lambda *a: calls.append("decode") or decode(*a)  # type: ignore[method-assign]
        programs._verify = lambda *a: calls.append("verify") or verify(*a)  # type: ignore[method-assign]
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in (11, 6)]
    b = Request(runner, prompts[1])  # b takes the lower state slot: packed order differs from batch order
    a = Request(runner, prompts[0])
    # step 1: a's first chunk (mid-prompt: the head reads the prompt token after it), b's whole prompt
    ca = _room(a, a.chunk(6)._replace(mtp_drafts=K, next_token=a.token_ids[6]))
    cb = _room(b, b.chunk(6)._replace(mtp_drafts=K))
    out = runner.execute(Batch((ca, cb)), StepSampling((1,)))
    b.token_ids.append(out.token_ids[0])
    assert dict(out.proposals) == {0: tuple(_reference_drafts(reference, a.token_ids[:7], K)),
                                   1: tuple(_reference_drafts(reference, b.token_ids, K))}  # fmt: skip
    # step 2: a's last chunk; b verifies its drafts. Then steps that verify the head's drafts, with the
    # first or a later one made wrong so that some are rejected, and a plain decode.
    plan = [None, (0, 2), (1, 1), None, (2, 1), (0, 1)]  # per step: b's (accepted kept, then wrong) or plain
    a_chunk = _room(a, a.chunk(5)._replace(mtp_drafts=K))
    accepted_any = rejected_any = False
    a_out = -1
    for step, shape in enumerate(plan):
        chunks: list[SequenceChunk] = [a_chunk] if step == 0 else []
        if step > 0:
            a.token_ids.append(a_out)
            chunks.append(_room(a, a.chunk(1)._replace(mtp_drafts=K)))
        if shape is None:
            chunks.append(_room(b, b.chunk(1)._replace(mtp_drafts=K)))
        else:
            keep, wrong = shape  # the model's own next tokens, then wrong ones
            right = _continuation(reference, b.token_ids, keep + 1)
            drafts = right[:keep] + [(right[keep] + 1 + i) % vocab for i in range(wrong)]
            b.token_ids[b.num_computed + 1 :] = drafts
            chunk = b.chunk(1 + len(drafts))._replace(num_draft_tokens=len(drafts), mtp_drafts=K)
            b.num_computed -= len(drafts)
            chunks.append(_room(b, chunk))
        out: StepOutput = runner.execute(Batch(tuple(chunks)), StepSampling((0, 1)))
        a_out = out.token_ids[0]
        if shape is not None:
            (v,) = out.drafts
            b.num_computed += len(v.token_ids)
            del b.token_ids[b.num_computed :]
            accepted_any |= bool(v.token_ids)
            rejected_any |= len(v.token_ids) < v.num_drafted
        b.token_ids.append(out.token_ids[1])
        got = dict(out.proposals)
        assert all(len(d) == K for d in got.values())
        assert got[0] == tuple(_reference_drafts(reference, a.token_ids + [a_out], K)), f"{name}: a at step {step}"
        assert got[1] == tuple(_reference_drafts(reference, b.token_ids, K)), f"{name}: b at step {step}"
    assert accepted_any and rejected_any
    if sizes:  # steps 1 to 5: a plain row beside b's verify row (both programs), or two plain rows
        assert calls.count("verify") == 4 and calls.count("decode") == 5, calls
