"""Whole decode steps compiled per batch-size bucket (gpu_worker.model.backends.cpu.compiled_step): the
compiled step's logits equal the eager step's within 1e-5 and the pools' state rows and KV within 1e-5,
for every family and a model of Mamba2 layers alone, on pages that are not consecutive and state slots out
of order, with a bucket's padding rows; the program's greedy tokens and log-normalisers are the sampler's
kernel's on its logits; a step outside the buckets runs the eager forward without compiling; the setting's
checks.

Two runners over one checkpoint step the same requests side by side: one eager (the reference), one
with programs for buckets of 1 and 4 rows (compile time bounded: two graphs per family)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from gpu_worker.model.backends.cpu import logit_stats
from gpu_worker.model.backends.cpu.compiled_step import parse_buckets
from gpu_worker.runner.batch import Batch
from gpu_worker.runner.runner import ModelRunner
from gpu_worker.runner.sampling import StepSampling
from gpu_worker.runner.settings import RunnerConfig
from hybridserve.errors import InvalidArgumentError
from tests.model.model_helpers import FAMILY_SPECS, Request

TOL = 1e-5


def _runner(path: Path, sizes: str) -> ModelRunner:
    cfg = RunnerConfig(
        memory_budget_bytes=8 << 20, kv_page_size_tokens=4, max_num_seqs=8, num_checkpoint_slots=2, device="cpu",
        dtype="float32", compile_step_sizes=sizes,
    )  # fmt: skip
    runner = ModelRunner.from_model_dir(path, cfg)
    runner.warm_up()
    return runner


def _pools(runner: ModelRunner) -> list[torch.Tensor]:
    return [t for pair in runner._kv_caches + runner._states for t in pair]


def _prompt(vocab: int, n: int, seed: int) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.slow
@pytest.mark.parametrize("name", FAMILY_SPECS)
def test_compiled_step_equals_the_eager_step(checkpoints, name: str) -> None:
    hf, path = checkpoints[name]
    vocab = hf.config.vocab_size
    eager, compiled = _runner(path, ""), _runner(path, "1,4")
    assert compiled.decode_steps is not None and compiled.decode_steps.status == "ready", compiled.describe()
    assert eager.decode_steps is None
    compiled.decode_steps.stance = "fail_on_recompile"  # every step below was compiled at warm-up
    prompts = [_prompt(vocab, 5 + 3 * i, seed=i) for i in range(4)]
    pairs = []
    for runner in (eager, compiled):
        spacer = [runner.kv_pool.allocate(1) for _ in range(3)]  # holes: the requests' pages are not consecutive
        runner.state_pool.allocate_slot()  # and their state slots start past 0
        reqs = []
        for i, p in enumerate(prompts):
            reqs.append(Request(runner, p + _prompt(vocab, 8, seed=50 + i)))
            runner.kv_pool.allocate(1)  # a page between each request's pages
        assert spacer
        runner.forward(Batch(tuple(r.chunk(len(p)) for r, p in zip(reqs, prompts, strict=True))))
        pairs.append(reqs)
    # 4 rows (its bucket, slots out of order), 3 (padded to 4), 1 (bucket 1), 2 (padded), then 4 again
    for order in ([2, 0, 3, 1], [3, 1, 0], [2], [1, 3], [0, 1, 2, 3], [3, 2, 1, 0]):
        forwards = [runner.forward(Batch(tuple(reqs[i].chunk(1) for i in order))) for runner, reqs in
                    zip((eager, compiled), pairs, strict=True)]  # fmt: skip
        outs = [f.logits for f in forwards]
        # the program's greedy tokens and log-normalisers: the sampler's kernel on the program's logits
        assert forwards[0].stats is None and forwards[1].stats is not None
        first_max, lse = logit_stats.stats(outs[1])
        assert torch.equal(forwards[1].stats[0], first_max) and torch.equal(forwards[1].stats[1], lse)
        assert torch.equal(first_max, outs[0].argmax(dim=-1)), f"{name}: rows {order}: greedy tokens differ"
        diff = (outs[0] - outs[1]).abs().max().item()
        assert diff <= TOL, f"{name}: rows {order}: logits differ by {diff}"
        for a, b in zip(_pools(eager), _pools(compiled), strict=True):
            assert torch.allclose(a, b, atol=TOL, rtol=TOL), f"{name}: rows {order}: pools differ"
    assert compiled.describe()["compile_step"] == "ready"
    assert compiled.describe()["compile_step_ssm"] == "kernel"  # the SSM state through ssm_update's kernel
    gaps = [b - a for r in pairs[1] for a, b in zip(r.page_ids, r.page_ids[1:], strict=False)]
    assert any(g != 1 for g in gaps), "the requests' pages were consecutive"


@pytest.mark.slow
def test_an_attention_free_model_compiles_its_steps(tmp_path: Path) -> None:
    """A model of Mamba2 layers alone (no KV pool layers) decodes through its programs as it does eagerly."""
    from hybridserve_cli.init_model import ModelSpec, write_random_checkpoint

    spec = ModelSpec(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=3, attn_layer_indices=(),
                     num_attention_heads=4, num_key_value_heads=2, mamba_n_heads=4, mamba_d_state=16,
                     mamba_chunk_size=64)  # fmt: skip
    path = write_random_checkpoint(tmp_path / "mamba_only", spec, seed=0, with_tokenizer=False)
    eager, compiled = _runner(path, ""), _runner(path, "1,2")
    assert compiled.decode_steps is not None and compiled.decode_steps.status == "ready", compiled.describe()
    compiled.decode_steps.stance = "fail_on_recompile"
    prompts = [_prompt(96, 5, seed=1), _prompt(96, 3, seed=2)]
    pairs = [[Request(r, p + _prompt(96, 4, seed=9)) for p in prompts] for r in (eager, compiled)]
    for runner, reqs in zip((eager, compiled), pairs, strict=True):
        runner.forward(Batch(tuple(r.chunk(len(p)) for r, p in zip(reqs, prompts, strict=True))))
    for rows in ([0, 1], [1], [1, 0]):
        outs = [runner.forward(Batch(tuple(reqs[i].chunk(1) for i in rows))) for runner, reqs in
                zip((eager, compiled), pairs, strict=True)]  # fmt: skip
        assert outs[1].stats is not None  # the program ran
        diff = (outs[0].logits - outs[1].logits).abs().max().item()
        assert diff <= TOL, f"rows {rows}: logits differ by {diff}"
        for a, b in zip(_pools(eager), _pools(compiled), strict=True):
            assert torch.allclose(a, b, atol=TOL, rtol=TOL), f"rows {rows}: pools differ"


@pytest.mark.slow
def test_a_step_outside_the_buckets_runs_eagerly_without_compiling(checkpoints) -> None:
    hf, path = checkpoints["gqa_groups2"]
    vocab = hf.config.vocab_size
    runner = _runner(path, "1")
    steps = runner.decode_steps
    assert steps is not None and steps.status == "ready"
    steps.stance = "fail_on_recompile"  # a compile would raise
    reqs = [Request(runner, _prompt(vocab, 12, seed=i)) for i in range(3)]
    runner.forward(Batch(tuple(r.chunk(6) for r in reqs)))
    calls = []
    program = steps._program
    steps._program = lambda *a: calls.append(a) or program(*a)  # type: ignore[method-assign]
    out = runner.forward(Batch(tuple(r.chunk(1) for r in reqs)))  # 3 rows: above the largest bucket
    assert out.logits.shape == (3, vocab) and not calls
    mixed = runner.forward(Batch((reqs[0].chunk(1), reqs[1].chunk(2))))  # a prefill chunk: eager too
    assert mixed.logits.shape == (2, vocab) and not calls
    runner.forward(Batch((reqs[2].chunk(1),)))  # one row: its program
    assert len(calls) == 1


@pytest.mark.slow
def test_decode_steps_on_every_thread_count_they_take_run_the_compiled_programs(checkpoints) -> None:
    """torch.compile's guards check torch's thread count: a program compiled on one thread and called on two
    runs eagerly. A runner whose decode steps take two threads while the other model processes are idle,
    and one otherwise (StepThreads.decode_counts), has its programs and its compiled Mamba step built for
    both: a step on either count runs without a recompile (a recompile raises here)."""
    hf, path = checkpoints["gqa_groups2"]
    vocab = hf.config.vocab_size
    before = torch.get_num_threads()
    try:
        cfg = RunnerConfig(
            memory_budget_bytes=8 << 20, kv_page_size_tokens=4, max_num_seqs=4, device="cpu", dtype="float32",
            compile_step_sizes="1", decode_compile="on", cpu_threads=1, cpu_decode_threads=2,
        )  # fmt: skip
        runner = ModelRunner.from_model_dir(path, cfg)
        assert runner.step_threads is not None
        idle = [True]
        runner.step_threads.others_idle = lambda: idle[0]  # as in a model process among several
        runner.warm_up()
        steps, mixer = runner.decode_steps, runner.decode_compiler
        assert steps is not None and steps.status == "ready" and steps.threads == (1, 2)
        assert mixer is not None and mixer.compiled is not None and runner.describe()["compile_step_threads"] == "1/2"
        steps.stance = mixer.compiled.stance = "fail_on_recompile"
        calls = []
        program = steps._program
        steps._program = lambda *a: calls.append(torch.get_num_threads()) or program(*a)  # type: ignore[method-assign]
        reqs = [Request(runner, _prompt(vocab, 12, seed=i)) for i in range(2)]
        runner.forward(Batch(tuple(r.chunk(6) for r in reqs)))
        for others_idle in (True, False, True):
            idle[0] = others_idle
            runner.forward(Batch((reqs[0].chunk(1),)))  # one row: its program
            runner.forward(Batch(tuple(r.chunk(1) for r in reqs)))  # two rows: eager, the compiled Mamba step
        assert calls == [2, 1, 2]
    finally:
        torch.set_num_threads(before)


def test_compile_step_sizes_setting() -> None:
    assert parse_buckets("", 32) == () and parse_buckets("off", 32) == ()
    assert parse_buckets("auto", 32) == (1, 2, 4, 8, 16, 32)
    assert parse_buckets("auto", 256) == (1, 2, 4, 8, 16, 32)
    assert parse_buckets("auto", 20) == (1, 2, 4, 8, 16, 20)
    assert parse_buckets("auto", 6) == (1, 2, 4, 6)
    assert parse_buckets("8,2, 2", 32) == (2, 8)
    for bad in ("0,2", "one", "2,,x"):
        with pytest.raises(InvalidArgumentError, match="compile_step_sizes"):
            RunnerConfig(compile_step_sizes=bad)


def _speculating(path: Path, sizes: str) -> ModelRunner:
    """A runner whose steps may verify 3 drafts a row, 2 rows a step; with `sizes`, compiled programs."""
    cfg = RunnerConfig(
        memory_budget_bytes=8 << 20, kv_page_size_tokens=4, max_num_seqs=4, num_checkpoint_slots=2, device="cpu",
        dtype="float32", compile_step_sizes=sizes, num_draft_rows=3 * 2, verify_tokens=4,
    )  # fmt: skip
    runner = ModelRunner.from_model_dir(path, cfg)
    runner.warm_up()
    return runner


@pytest.mark.slow
@pytest.mark.parametrize("name", FAMILY_SPECS)
def test_compiled_verify_steps_equal_the_eager_verify_steps(checkpoints, name: str) -> None:
    """Verify steps (rows of the newest token and its drafts) through the verify program of a bucket of 2
    rows, and the plain decodes beside them through the decode program: the same tokens and accepted
    drafts as the eager verify step, logits at every drafted position within 1e-5, and after each step's
    rollback the same pools, with drafts all accepted, none, and some; a drafted row alone (padded to the
    bucket), beside a plain row, and two of different lengths."""
    hf, path = checkpoints[name]
    vocab = hf.config.vocab_size
    plain = ModelRunner.from_model_dir(path, RunnerConfig(
        memory_budget_bytes=8 << 20, kv_page_size_tokens=4, max_num_seqs=2, num_checkpoint_slots=0, device="cpu",
        dtype="float32",
    ))  # fmt: skip
    greedy = StepSampling((0,))
    prompts = [_prompt(vocab, 6 + 3 * i, seed=10 + i) for i in range(2)]
    continuations = []  # each prompt's greedy continuation, a token a step (what right drafts are)
    for p in prompts:
        ref = Request(plain, p)
        tokens = [plain.execute(Batch((ref.chunk(len(p)),)), greedy).token_ids[0]]
        for _ in range(12):
            ref.token_ids.append(tokens[-1])
            tokens.append(plain.execute(Batch((ref.chunk(1),)), greedy).token_ids[0])
        continuations.append(tokens)
        ref.release()
    eager, compiled = _speculating(path, ""), _speculating(path, "2")
    programs = compiled.decode_steps
    assert programs is not None and programs.verify_buckets == (2,), compiled.describe()
    programs.stance = "fail_on_recompile"  # every verify step below was compiled at warm-up
    calls = []
    verify = programs._verify
    programs._verify = lambda *a: calls.append(a) or verify(*a)  # type: ignore[method-assign]
    pairs = []
    for runner in (eager, compiled):
        forward = runner.forward
        runner.forwards = []  # type: ignore[attr-defined]
        runner.forward = lambda batch, w=None, f=forward, r=runner: r.forwards.append(f(batch, w)) or r.forwards[-1]  # type: ignore[method-assign]
        runner.kv_pool.allocate(3)  # the requests' pages are not the pool's first
        runner.state_pool.allocate_slot()
        reqs = [Request(runner, p) for p in prompts]
        runner.forward(Batch(tuple(r.chunk(len(p)) for r, p in zip(reqs, prompts, strict=True))))
        for r, tokens in zip(reqs, continuations, strict=True):
            r.token_ids.append(tokens[0])
        pairs.append(reqs)
    done = [0, 0]  # each request's continuation tokens accepted so far (tokens[done] is its newest)
    # per step: (request, right drafts, wrong drafts) for its rows; -1 right = a plain decode
    schedule = [[(0, 3, 0), (1, -1, 0)], [(1, 0, 2)], [(0, 1, 1), (1, 2, 0)], [(0, -1, 0), (1, 0, 3)]]
    for step, rows in enumerate(schedule):
        outs = []
        for runner, reqs in zip((eager, compiled), pairs, strict=True):
            chunks = []
            for i, right, wrong in rows:
                req, tokens, k = reqs[i], continuations[i], done[i]
                if right < 0:
                    chunks.append(req.chunk(1))
                    continue
                drafts = tokens[k + 1 : k + 1 + right] + [(tokens[k + 1 + right] + 1) % vocab] * wrong
                req.token_ids[req.num_computed + 1 :] = drafts
                chunks.append(req.chunk(1 + len(drafts))._replace(num_draft_tokens=len(drafts)))
                req.num_computed -= len(drafts)
            batch = Batch(tuple(chunks))
            before = len(calls)
            outs.append(runner.execute(batch, StepSampling(tuple(range(len(rows))))))
            assert (len(calls) > before) == (runner is compiled), f"{name}: step {step} took the wrong path"
        forwards = [r.forwards[-1] for r in (eager, compiled)]
        for (row, a), (_, b) in zip(forwards[0].draft_logits, forwards[1].draft_logits, strict=True):
            diff = (a - b).abs().max().item()
            assert diff <= TOL, f"{name}: step {step} row {row}: drafted positions' logits differ by {diff}"
        assert (forwards[0].logits - forwards[1].logits).abs().max().item() <= TOL
        sampled = outs
        assert sampled[0].token_ids == sampled[1].token_ids, f"{name}: step {step}"
        assert [v.token_ids for v in sampled[0].drafts] == [v.token_ids for v in sampled[1].drafts]
        for (i, right, _), token in zip(rows, sampled[1].token_ids, strict=True):
            accepted = max(right, 0)
            assert token == continuations[i][done[i] + 1 + accepted], f"{name}: step {step}: not the greedy token"
            done[i] += 1 + accepted
            for reqs in pairs:
                reqs[i].num_computed += accepted
                reqs[i].token_ids[reqs[i].num_computed :] = [token]
        for a, b in zip(_pools(eager), _pools(compiled), strict=True):
            assert torch.allclose(a, b, atol=TOL, rtol=TOL), f"{name}: step {step}: pools differ after the rollback"
    assert len(calls) == len(schedule)


def test_a_served_worker_compiles_its_steps_by_default(monkeypatch) -> None:
    """The worker's flag defaults to auto (the tests' workers turn it off through the environment); a runner
    built in process compiles nothing unless asked."""
    from gpu_worker.api.server import settings_from_args
    from hybridserve_cli import build_parser

    monkeypatch.delenv("HYBRIDSERVE_WORKER_COMPILE_STEP_SIZES", raising=False)
    args = build_parser(only="worker").parse_args(["worker"])
    assert settings_from_args(args).runner.compile_step_sizes == "auto"
    assert RunnerConfig().compile_step_sizes == ""
