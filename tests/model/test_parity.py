"""Runner logits vs transformers (float32, CPU) for every family (BambaForCausalLM,
GraniteMoeHybridForCausalLM dense and MoE, NemotronHForCausalLM with and without MoE) under every
chunking the scheduler can produce: whole prompts, fixed and random chunk schedules, stepwise decode,
packed mixed batches, checkpoint restores."""

from __future__ import annotations

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpu_worker.runner.batch import Batch
from tests.model.model_helpers import SPECS, Request, hf_logits, make_runner, run_schedule

TOL = 1e-4


def _prompt(vocab: int, n: int, seed: int) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_full_prefill_matches_reference(checkpoint) -> None:
    hf, path = checkpoint
    runner = make_runner(path)
    for n, seed in ((1, 0), (7, 1), (45, 2)):
        ids = _prompt(hf.config.vocab_size, n, seed)
        diff = (run_schedule(runner, ids, [n]) - hf_logits(hf, ids)).abs().max().item()
        assert diff <= TOL, f"prompt of {n}: max abs diff {diff}"


def test_fixed_chunk_schedules(checkpoint) -> None:
    """1-token chunks, sub-page chunks, chunks ending exactly on page (4) and scan-chunk (8/16/5) edges."""
    hf, path = checkpoint
    runner = make_runner(path, page_size=4)
    ids = _prompt(hf.config.vocab_size, 48, 3)
    ref = hf_logits(hf, ids)
    for schedule in ([1] * 48, [3, 1, 2, 6, 4, 8, 16, 8], [16, 16, 16], [4] * 12, [5, 11, 1, 31], [47, 1]):
        diff = (run_schedule(runner, ids, schedule) - ref).abs().max().item()
        assert diff <= TOL, f"schedule {schedule}: max abs diff {diff}"


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_random_chunk_schedules(family_checkpoint, data) -> None:
    hf, path = family_checkpoint
    n = data.draw(st.integers(2, 40), label="prompt_len")
    cuts = sorted(data.draw(st.sets(st.integers(1, n - 1), max_size=8), label="cuts"))
    schedule = [b - a for a, b in zip([0, *cuts], [*cuts, n], strict=True)]
    page_size = data.draw(st.sampled_from([1, 2, 4, 16]), label="page_size")
    ids = _prompt(hf.config.vocab_size, n, data.draw(st.integers(0, 1000), label="seed"))
    runner = make_runner(path, page_size=page_size)
    diff = (run_schedule(runner, ids, schedule) - hf_logits(hf, ids)).abs().max().item()
    assert diff <= TOL, f"schedule {schedule}, page {page_size}: max abs diff {diff}"


def test_long_chunks_match_reference(family_checkpoint) -> None:
    """Chunks long enough for the CPU fast paths (oneDNN projections and query-blocked attention, the
    packed scan over many scan chunks), whole and continuing on a cached prefix."""
    hf, path = family_checkpoint
    runner = make_runner(path, page_size=16)
    ids = _prompt(hf.config.vocab_size, 600, 8)
    ref = hf_logits(hf, ids)
    for schedule in ([600], [300, 300], [344, 256]):
        diff = (run_schedule(runner, ids, schedule) - ref).abs().max().item()
        assert diff <= TOL, f"schedule {schedule}: max abs diff {diff}"


def test_packed_batch_gives_each_request_its_own_logits(checkpoint) -> None:
    """Four requests at different phases in one forward: mid-prefill chunk, decode, fresh prefill, decode."""
    hf, path = checkpoint
    runner = make_runner(path, page_size=4)
    vocab = hf.config.vocab_size
    seqs = {name: _prompt(vocab, n, seed) for name, n, seed in (("a", 30, 1), ("b", 24, 2), ("c", 9, 3), ("d", 26, 4))}
    refs = {name: hf_logits(hf, ids) for name, ids in seqs.items()}
    reqs = {name: Request(runner, ids) for name, ids in seqs.items()}
    # warm-up phases, each request alone: a 13 tokens in; b 20 in (decoding); d 25 in
    runner.forward(Batch((reqs["a"].chunk(13),)))
    runner.forward(Batch((reqs["b"].chunk(17),)))
    for _ in range(3):
        runner.forward(Batch((reqs["b"].chunk(1),)))
    runner.forward(Batch((reqs["d"].chunk(25),)))
    order = ("d", "a", "c", "b")
    chunks = {"a": reqs["a"].chunk(10), "b": reqs["b"].chunk(1), "c": reqs["c"].chunk(9), "d": reqs["d"].chunk(1)}
    out = runner.forward(Batch(tuple(chunks[n] for n in order), return_all_logits=True))
    assert out.all_logits is not None
    for i, name in enumerate(order):
        start, length = chunks[name].start_pos, len(chunks[name].token_ids)
        ref = refs[name][start : start + length]
        assert (out.all_logits[i] - ref).abs().max().item() <= TOL, name
        assert (out.logits[i] - ref[-1]).abs().max().item() <= TOL, name
    # a second mixed step: a finishes its prompt while b decodes
    step2 = (reqs["a"].chunk(7), reqs["b"].chunk(1))
    out = runner.forward(Batch(step2, return_all_logits=True))
    assert out.all_logits is not None
    for chunk, name, logits in zip(step2, ("a", "b"), out.all_logits, strict=True):
        ref = refs[name][chunk.start_pos : chunk.start_pos + len(chunk.token_ids)]
        assert (logits - ref).abs().max().item() <= TOL, name


def test_checkpoint_restore_continues_exactly(checkpoint) -> None:
    """A checkpoint at a block boundary (16 tokens, a multiple of the 4-token page) plus the shared KV
    pages of that prefix lets a second request skip the prefix and get the uninterrupted logits."""
    hf, path = checkpoint
    runner = make_runner(path, page_size=4)
    vocab, block = hf.config.vocab_size, 16
    first = _prompt(vocab, 37, 5)
    second = first[:block] + _prompt(vocab, 15, 6)  # same prefix, different continuation
    ckpt = runner.state_pool.allocate_checkpoint()
    a = Request(runner, first)
    runner.forward(Batch((a.chunk(block, save_checkpoint_id=ckpt),)))
    tail = runner.forward(Batch((a.chunk(len(first) - block),), return_all_logits=True))
    assert tail.all_logits is not None
    assert (tail.all_logits[0] - hf_logits(hf, first)[block:]).abs().max().item() <= TOL

    b = Request(runner, second)
    prefix_pages = a.page_ids[: block // 4]
    runner.kv_pool.share(prefix_pages)
    b.page_ids = list(prefix_pages)
    b.num_computed = block
    runner.state_pool.restore_checkpoint(ckpt, b.slot)
    got = []
    for n in (3, 1, 11):  # continue from the restored state: a prefill chunk, a decode, the rest
        out = runner.forward(Batch((b.chunk(n),), return_all_logits=True))
        assert out.all_logits is not None
        got.append(out.all_logits[0])
    ref = hf_logits(hf, second)[block:]
    assert (torch.cat(got) - ref).abs().max().item() <= TOL
    uninterrupted = run_schedule(runner, second, [len(second)])[block:]
    assert (torch.cat(got) - uninterrupted).abs().max().item() <= 1e-5
    assert runner.kv_pool.ref_count(prefix_pages[0]) == 2


def test_spec_table_covers_the_interesting_shapes() -> None:
    """Guards the fixture table: every family, dense and MoE, GQA and MHA, 1 and several groups, odd scan
    chunk, tied embeddings."""
    specs = SPECS.values()
    assert {s.family for s in specs} == {"bamba", "granitemoehybrid", "nemotron_h"}
    assert {(s.family, s.num_experts > 0) for s in specs} >= {
        ("granitemoehybrid", True),
        ("nemotron_h", True),
        ("granitemoehybrid", False),
        ("nemotron_h", False),
    }
    assert any(s.rope for s in specs) and any(s.n_group > s.topk_group for s in specs)
    assert {s.mamba_n_groups for s in specs} >= {1, 2}
    assert any(s.num_attention_heads != s.num_key_value_heads for s in specs)
    assert any(s.tie_word_embeddings for s in specs)
    assert any(s.mamba_chunk_size % 2 for s in specs)


@settings(max_examples=20, deadline=None)
@given(st.integers(1, 300), st.sampled_from([5, 16, 64, 256]), st.integers(0, 10_000))
def test_ssd_scan_does_not_depend_on_its_chunk_length(length, chunk, seed) -> None:
    """The runner shortens the scan chunk on CPU; every chunk length must give the same result."""
    from gpu_worker.model.ssd import ssd_scan

    g = torch.Generator().manual_seed(seed)
    heads, head_dim, groups, state = 4, 8, 2, 16
    x = torch.randn(length, heads, head_dim, generator=g)
    dt = torch.rand(length, heads, generator=g) * 0.5
    A = -torch.rand(heads, generator=g) * 4
    B = torch.randn(length, groups, state, generator=g)
    C = torch.randn(length, groups, state, generator=g)
    D = torch.randn(heads, generator=g)
    initial = torch.randn(heads, head_dim, state, generator=g)
    y_ref, s_ref = ssd_scan(x, dt, A, B, C, D, initial, 1)  # one token per chunk: the plain recurrence
    y, s = ssd_scan(x, dt, A, B, C, D, initial, chunk)
    assert torch.allclose(y, y_ref, atol=1e-4, rtol=1e-4)
    assert torch.allclose(s, s_ref, atol=1e-4, rtol=1e-4)
