"""The runner boundary (gpu_worker.runner.protocol): every runner executes a step and samples it where the
logits are. With a vocabulary of 100,352 tokens (Granite-4.0-H's), a step of 32 rows over 2,000-token
contexts moves a few kilobytes between the worker and its model processes, not the 12.8 MB of its logits;
and a seeded request samples the same tokens in process, in one model process or split over two, alone or
beside any mates."""

from __future__ import annotations

import pickle
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from gpu_worker.runner.batch import Batch
from gpu_worker.runner.model_process import ProcessRunner, build_runner
from gpu_worker.runner.protocol import Pools, Runner
from gpu_worker.runner.runner import ModelRunner
from gpu_worker.runner.sampling import SamplingParams, StepSampling, sample_rows
from gpu_worker.runner.settings import RunnerConfig
from gpu_worker.runner.token_masks import apply_token_masks, mask_words
from hybridserve_cli.init_model import ModelSpec, write_random_checkpoint
from tests.model.model_helpers import Request

VOCAB = 100_352
MOST_BYTES_PER_STEP = 64 << 10
CONFIG = RunnerConfig(
    memory_budget_bytes=64 << 20, kv_page_size_tokens=16, max_num_seqs=34, num_checkpoint_slots=0, device="cpu",
    dtype="float32", cpu_threads=1, model_processes=1,
)  # fmt: skip
PARAMS = {  # per request: its sampling
    "greedy": SamplingParams(),
    "greedy-top": SamplingParams(num_logprobs=3),
    "seeded": SamplingParams(temperature=1.0, seed=7),
    "seeded-top-k": SamplingParams(temperature=1.2, top_k=50, seed=8, num_logprobs=2),
    "seeded-top-p": SamplingParams(temperature=0.9, top_p=0.9, seed=9),
}


@pytest.fixture(scope="module")
def big_vocab(tmp_path_factory: pytest.TempPathFactory) -> Path:
    spec = ModelSpec(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, attn_layer_indices=(1,),
        num_attention_heads=2, num_key_value_heads=1, mamba_n_heads=2, mamba_d_state=16, init_std=0.5,
        arch="granitemoehybrid",
    )  # fmt: skip
    return write_random_checkpoint(tmp_path_factory.mktemp("vocab-100k"), spec, seed=3, with_tokenizer=False)


@pytest.fixture(scope="module")
def runners(big_vocab: Path) -> Iterator[dict[str, Runner]]:
    one = build_runner(big_vocab, replace(CONFIG, model_process="on"))
    two = build_runner(
        big_vocab,
        replace(CONFIG, model_process="on", model_processes=2, model_process_split_min_tokens=1, cpu_threads=1),
    )
    assert isinstance(one, ProcessRunner) and isinstance(two, ProcessRunner) and len(two.pids) == 2
    yield {"here": ModelRunner.from_model_dir(big_vocab, CONFIG), "one process": one, "two processes": two}
    one.close()
    two.close()


def generate(runner: Runner, names: list[str], steps: int = 5) -> dict[str, tuple[list[int], list[float]]]:
    """The requests `names` together: one prefill chunk each (different lengths, so that two model processes
    split them), then `steps` decode steps; each request's sampled tokens and log-probabilities."""
    assert isinstance(runner, ModelRunner | ProcessRunner)
    requests = {n: Request(runner, [(17 * i + 31 * len(n)) % VOCAB for i in range(20 + 9 * len(n))]) for n in names}
    out: dict[str, tuple[list[int], list[float]]] = {n: ([], []) for n in names}
    try:
        first = True
        for _ in range(steps + 1):
            chunks = [r.chunk(len(r.token_ids) if first else 1) for r in requests.values()]
            first = False
            sampled = runner.execute(
                Batch(tuple(chunks)), StepSampling.of(range(len(names)), [PARAMS[n] for n in names])
            )
            for n, token, logprob in zip(names, sampled.token_ids, sampled.logprobs, strict=True):
                requests[n].token_ids.append(token)
                out[n][0].append(token)
                out[n][1].append(logprob)
            if any(PARAMS[n].num_logprobs for n in names):
                assert sampled.top_logprobs is not None
                for n, top in zip(names, sampled.top_logprobs, strict=True):
                    assert len(top) == PARAMS[n].num_logprobs
    finally:
        for r in requests.values():
            r.release()
    return out


def test_seeded_samples_are_the_same_in_every_runner_and_beside_any_mates(runners: dict[str, Runner]) -> None:
    assert all(isinstance(r, Runner) and isinstance(r.pools, Pools) for r in runners.values())
    names = list(PARAMS)
    expected = generate(runners["here"], names)
    assert len(set(expected["seeded"][0])) > 1, "a temperature of 1 over 100k tokens should vary"
    for label, runner in runners.items():
        for together in (names, names[::-1], ["seeded", "greedy"]):
            got = generate(runner, together)
            for n in together:
                assert got[n][0] == expected[n][0], (label, together, n)
                assert got[n][1] == pytest.approx(expected[n][1], abs=1e-4), (label, together, n)
        alone = {n: generate(runner, [n])[n][0] for n in ("seeded", "seeded-top-k")}
        assert alone == {n: expected[n][0] for n in alone}, label
    assert runners["two processes"].steps_shared > 0  # type: ignore[attr-defined]


def test_a_step_of_32_rows_at_100k_vocab_moves_under_64_kb(runners: dict[str, Runner]) -> None:
    runner = runners["two processes"]
    assert isinstance(runner, ProcessRunner)
    context = 2000
    requests = [Request(runner, [(i * 13 + j) % VOCAB for j in range(context)]) for i in range(32)]
    params = [PARAMS[list(PARAMS)[i % len(PARAMS)]] for i in range(32)]
    sampling = StepSampling.of(range(32), params)
    try:
        for r in requests:  # as if the prompts had been computed: the contexts' pages, the state slot
            r.chunk(context - 1)
        steps = []
        for _ in range(20):  # the first step is the requests' admission: their whole page tables
            batch = Batch(tuple(r.chunk(1) for r in requests))
            sent, received = runner.traffic
            out = runner.execute(batch, sampling)
            now_sent, now_received = runner.traffic
            steps.append((now_sent - sent, now_received - received))
            for r, token in zip(requests, out.token_ids, strict=True):
                r.token_ids.append(token)
        print("bytes (sent, received) per step:", steps)
        for sent, received in steps[1:]:
            assert 0 < sent <= MOST_BYTES_PER_STEP and 0 < received <= MOST_BYTES_PER_STEP, steps
        assert max(received for _, received in steps) < 4 * VOCAB  # not even one row's logits
        # the page tables travel as diffs: a step sends less than the batch's page tables would pickle to
        assert max(sent for sent, _ in steps[1:]) < len(pickle.dumps(batch, protocol=pickle.HIGHEST_PROTOCOL)) / 2
    finally:
        for r in requests:
            r.release()


CONTROLLED = {  # sampled, seeded rows with every control, and a greedy one with penalties
    "penalised": SamplingParams(
        temperature=1.0,
        seed=11,
        presence_penalty=1.5,
        frequency_penalty=0.5,
        repetition_penalty=1.3,
        logit_bias=((5, 8.0), (9, -100.0)),
        min_p=0.01,
    ),  # fmt: skip
    "min-tokens": SamplingParams(temperature=0.8, seed=12, top_k=40, min_tokens=4, held_token_ids=(5, 6)),
    "greedy-penalised": SamplingParams(repetition_penalty=2.0, frequency_penalty=1.0, logit_bias=((7, 3.0),)),
    "plain": SamplingParams(),
}


def generate_controlled(runner: Runner, names: list[str], steps: int = 6, masked: bool = False) -> dict[str, list[int]]:
    """`generate` for CONTROLLED, each row's history (prompt, generated) handed to the runner as the engine
    hands it: the lists themselves, grown each step; `masked`: every row constrained by FixedMasks too
    (asserts each chosen token was allowed)."""
    assert isinstance(runner, ModelRunner | ProcessRunner)
    prompts = {n: [(13 * i + 7 * len(n)) % VOCAB for i in range(18 + 7 * len(n))] for n in names}
    requests = {n: Request(runner, prompts[n]) for n in names}
    outputs: dict[str, list[int]] = {n: [] for n in names}
    try:
        for step in range(steps + 1):
            chunks = [r.chunk(len(r.token_ids) if step == 0 else 1) for r in requests.values()]
            sampling = StepSampling.of(
                range(len(names)), [CONTROLLED[n] for n in names], [(prompts[n], outputs[n]) for n in names]
            )
            masks = FixedMasks(names, step) if masked else None
            if masks is not None:
                sampling = replace(sampling, masked=tuple(range(len(names))), masks=masks)
            sampled = runner.execute(Batch(tuple(chunks)), sampling)
            for j, (n, token) in enumerate(zip(names, sampled.token_ids, strict=True)):
                assert masks is None or masks.bits[j][token], (n, step, token)
                requests[n].token_ids.append(token)
                outputs[n].append(token)
    finally:
        for r in requests.values():
            r.release()
    return outputs


def test_rows_with_controls_sample_the_same_in_every_runner(runners: dict[str, Runner]) -> None:
    names = list(CONTROLLED)
    expected = generate_controlled(runners["here"], names)
    assert 5 in expected["penalised"] and 9 not in expected["penalised"]  # the +8 bias shows, the -100 one bans
    assert not {5, 6} & set(expected["min-tokens"][:4])
    for label, runner in runners.items():
        for together in (names, names[::-1], ["min-tokens", "plain"]):
            got = generate_controlled(runner, together)
            assert got == {n: expected[n] for n in together}, (label, together)


def test_masked_rows_with_controls_sample_the_same_in_every_runner(runners: dict[str, Runner]) -> None:
    """The grammar mask first, then the controls: every row both constrained and controlled (penalties'
    history in the tables, logit_bias, min_tokens) takes only allowed tokens, the same in every runner."""
    names = list(CONTROLLED)
    expected = generate_controlled(runners["here"], names, steps=4, masked=True)
    assert expected["greedy-penalised"] != generate_controlled(runners["here"], names, steps=4)["greedy-penalised"]
    assert 9 not in expected["penalised"] and not {5, 6} & set(expected["min-tokens"][:4])
    for label, runner in runners.items():
        for together in (names, names[::-1]):
            got = generate_controlled(runner, together, steps=4, masked=True)
            assert got == {n: expected[n] for n in together}, (label, together)


def test_prompt_scores_are_the_same_in_every_runner(runners: dict[str, Runner]) -> None:
    """A row that scores its prompt over two chunks, beside a plain row: the scores of each chunk (the
    tokens after its first, then the next chunk's first token) come back from whichever process ran it."""
    prompt = [(29 * i + 5) % VOCAB for i in range(40)]
    got = {}
    for label, runner in runners.items():
        assert isinstance(runner, ModelRunner | ProcessRunner)
        scored, other = Request(runner, prompt), Request(runner, prompt[:31])
        try:
            first = scored.chunk(24)._replace(score=True, next_token=prompt[24])
            out1 = runner.execute(Batch((other.chunk(30), first)), StepSampling.of([0], [SamplingParams()]))
            last = scored.chunk(16)._replace(score=True)
            out2 = runner.execute(Batch((other.chunk(1), last)), StepSampling.of([0, 1], [SamplingParams()] * 2))
        finally:
            scored.release()
            other.release()
        assert [row for row, _ in out1.prompt_scores] == [1] and [row for row, _ in out2.prompt_scores] == [1]
        got[label] = out1.prompt_scores[0][1] + out2.prompt_scores[0][1]
        assert len(got[label]) == len(prompt) - 1
    for label, scores in got.items():
        assert scores == pytest.approx(got["here"], abs=1e-4), label


class FixedMasks:
    """Token masks as the engine's matchers would give them (gpu_worker.runner.protocol.TokenMasks): here a
    few hundred allowed tokens per (request, step), fixed by a seed, and recorded so that the test can check
    each chosen token against its mask."""

    words = mask_words(VOCAB)

    def __init__(self, names: list[str], step: int) -> None:
        self.bits: list[np.ndarray] = []
        for n in names:
            rng = np.random.default_rng([step, *n.encode()])
            allowed = np.zeros(self.words * 32, dtype=bool)
            allowed[rng.choice(VOCAB, size=300, replace=False)] = True
            self.bits.append(allowed)

    def fill(self, bitmask: np.ndarray, indices, before=()) -> None:
        for allowed, index in zip(self.bits, indices, strict=True):
            bitmask[index] = np.packbits(allowed, bitorder="little").view(np.int32)


def generate_masked(runner: Runner, names: list[str], steps: int = 4) -> dict[str, list[int]]:
    """As `generate`, with every row constrained by FixedMasks; asserts each chosen token was allowed."""
    assert isinstance(runner, ModelRunner | ProcessRunner)
    requests = {n: Request(runner, [(17 * i + 31 * len(n)) % VOCAB for i in range(20 + 9 * len(n))]) for n in names}
    out: dict[str, list[int]] = {n: [] for n in names}
    try:
        for step in range(steps + 1):
            chunks = [r.chunk(len(r.token_ids) - r.num_computed) for r in requests.values()]
            masks = FixedMasks(names, step)
            plain = StepSampling.of(range(len(names)), [PARAMS[n] for n in names])
            sampling = StepSampling(plain.rows, plain.special, plain.params, tuple(range(len(names))), masks)
            sampled = runner.execute(Batch(tuple(chunks)), sampling)
            for n, token, allowed in zip(names, sampled.token_ids, masks.bits, strict=True):
                assert allowed[token], (n, step, token)
                requests[n].token_ids.append(token)
                out[n].append(token)
    finally:
        for r in requests.values():
            r.release()
    return out


def test_constrained_rows_take_only_allowed_tokens_and_agree_across_runners(runners: dict[str, Runner]) -> None:
    names = ["greedy", "seeded", "seeded-top-k"]
    expected = generate_masked(runners["here"], names)
    unmasked = generate(runners["here"], ["greedy"], steps=4)["greedy"][0]
    assert expected["greedy"] != unmasked, "the masks were meant to change the greedy choice"
    for label, runner in runners.items():
        for together in (names, names[::-1]):
            got = generate_masked(runner, together)
            assert got == {n: expected[n] for n in together}, label


def test_the_mask_step_keeps_every_chosen_token_inside_its_mask() -> None:
    """apply_token_masks through sample_rows: greedy rows take the best allowed token; sampled rows (any
    temperature, top-k, top-p) only allowed ones; unconstrained rows and the log-probabilities are as
    without masks."""
    torch.manual_seed(0)
    vocab, rows = 1000, 6
    logits = torch.randn(rows, vocab) * 3
    allowed = torch.rand(rows, mask_words(vocab) * 32) < 0.05
    bitmask = torch.from_numpy(np.packbits(allowed.numpy(), axis=1, bitorder="little").view(np.int32).copy())
    masked_rows = [0, 1, 3, 4]
    params = [SamplingParams(), SamplingParams(temperature=1.5, seed=1), SamplingParams(temperature=0.7, top_k=5,
              seed=2), SamplingParams(temperature=1.0, top_p=0.5, seed=3)]  # fmt: skip
    special = [1, 3, 4, 5]
    free = sample_rows(logits.clone(), special, params, [10] * 4)  # sample_rows writes into the rows it masks
    for trial in range(20):
        positions = [trial] * 4
        got = sample_rows(logits.clone(), special, params, positions, masked_rows, bitmask[masked_rows])
        for row in masked_rows:
            assert allowed[row, got.token_ids[row]], (trial, row)
        best = logits[0].masked_fill(~allowed[0, :vocab], float("-inf")).argmax().item()
        assert got.token_ids[0] == best
        assert got.token_ids[2] == free.token_ids[2]  # plain and unconstrained
        assert got.logprobs[0] == pytest.approx(torch.log_softmax(logits[0], -1)[best].item(), abs=1e-5)


@pytest.mark.parametrize("share", [0.05, 0.95])  # mostly refused (masked, chosen again); mostly allowed (kept)
def test_choosing_before_the_mask_gives_the_tokens_of_masking_first(share: float) -> None:
    """sample_rows masks a row without filters only when its choice falls outside its mask: the tokens are
    those of masking every constrained row first (apply_token_masks, then sampling unconstrained), for
    greedy, seeded and filtered rows, with a logit_bias that pushes a token the mask refuses."""
    torch.manual_seed(1)
    vocab, rows = 1000, 8
    params = [SamplingParams(), SamplingParams(temperature=1.5, seed=1), SamplingParams(temperature=0.7, top_k=5,
              seed=2), SamplingParams(temperature=1.0, top_p=0.5, seed=3), SamplingParams(logit_bias=((7, 50.0),)),
              SamplingParams(temperature=0.9, seed=4, min_p=0.1), SamplingParams(temperature=2.0, seed=5)]  # fmt: skip
    special = [1, 2, 3, 4, 5, 6, 7]
    masked_rows = [0, 1, 2, 3, 5, 6, 7]
    outcomes = set()
    for trial in range(30):
        logits = torch.randn(rows, vocab) * 3
        allowed = torch.rand(rows, mask_words(vocab) * 32) < share
        allowed[5, 7] = False  # the biased token is refused
        words = np.packbits(allowed.numpy(), axis=1, bitorder="little").view(np.int32)
        bitmask = torch.from_numpy(words[masked_rows].copy())
        positions = [trial] * len(special)
        first = sample_rows(apply_token_masks(logits, masked_rows, bitmask), special, params, positions)
        got = sample_rows(logits.clone(), special, params, positions, masked_rows, bitmask)
        assert got.token_ids == first.token_ids, trial
        raw = torch.log_softmax(logits, -1).gather(1, torch.tensor(got.token_ids)[:, None]).view(-1)
        assert got.logprobs == pytest.approx(raw.tolist(), abs=1e-5)  # of the raw distribution
        unmasked = sample_rows(logits.clone(), special, params, positions).token_ids
        outcomes |= {got.token_ids[r] == unmasked[r] for r in masked_rows}
    assert outcomes == {True, False}  # both paths taken: choices kept and choices made again
