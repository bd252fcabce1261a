"""Speculative steps in the runner (gpu_worker.runner.speculation), for every family: a row's drafts
are verified against the model's own tokens, and the state and KV it keeps are those a plain decode of
the accepted tokens leaves, whether every draft, none or some are accepted.

Two runners over one checkpoint run the same request side by side: one decodes a token a step (the
reference), the other carries drafts. A verify forward scores its positions in one chunk, so float32
sums may differ from one-token steps in the last bits: states, KV and logits are compared within 1e-5."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from gpu_worker.runner.batch import Batch, SequenceChunk
from gpu_worker.runner.runner import ModelRunner
from gpu_worker.runner.sampling import SamplingParams, StepSampling, sample_step
from gpu_worker.runner.settings import RunnerConfig
from gpu_worker.runner.speculation import verify_drafts
from hybridserve.errors import InvalidArgumentError
from tests.model.model_helpers import FAMILY_SPECS, Request

TOL = 1e-5


def _runner(path: Path, draft_rows: int) -> ModelRunner:
    cfg = RunnerConfig(
        memory_budget_bytes=8 << 20, kv_page_size_tokens=4, max_num_seqs=4, num_checkpoint_slots=2, device="cpu",
        dtype="float32", num_draft_rows=draft_rows,
    )  # fmt: skip
    return ModelRunner.from_model_dir(path, cfg)


def _drafted(req: Request, drafts: list[int]) -> SequenceChunk:
    """The request's newest token with `drafts` after it, pages grown to cover them; computed += 1."""
    req.token_ids[req.num_computed + 1 :] = drafts
    chunk = req.chunk(1 + len(drafts))._replace(num_draft_tokens=len(drafts))
    req.num_computed -= len(drafts)
    return chunk


def _state(runner: ModelRunner, slot: int) -> list[torch.Tensor]:
    return [t[slot].clone() for pair in runner._states for t in pair]


def _kv(runner: ModelRunner, req: Request, upto: int) -> list[torch.Tensor]:
    page = runner.kv_page_size_tokens
    slots = torch.tensor([req.page_ids[p // page] * page + p % page for p in range(upto)])
    return [c[slots] for pair in runner._kv_caches for c in pair]  # each [pages * page_size, heads, dim]


def _close(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max(((x - y).abs().max().item() for x, y in zip(a, b, strict=True)), default=0.0)


@pytest.mark.parametrize("kept", ["short_spans", "draft_rows"])
@pytest.mark.parametrize("name", FAMILY_SPECS)
def test_drafts_accepted_in_part_leave_what_a_plain_decode_leaves(
    checkpoints, name: str, kept: str, monkeypatch
) -> None:
    """Both ways of restoring a rejected row: rebuilt from the short spans' inputs (CPU) and copied from the
    draft rows (every other device, and steps with long chunks)."""
    if kept == "draft_rows":
        monkeypatch.setattr("gpu_worker.runner.runner.keeps_short_spans", lambda batch, device: False)
    hf, path = checkpoints[name]
    vocab = hf.config.vocab_size
    plain, spec = _runner(path, 0), _runner(path, 4)
    prompt = torch.randint(0, vocab, (7,), generator=torch.Generator().manual_seed(3)).tolist()
    ref = Request(plain, prompt)
    greedy = StepSampling((0,))
    first = plain.execute(Batch((ref.chunk(len(prompt)),)), greedy).token_ids[0]
    tokens = [first]
    for _ in range(9):  # the model's own greedy continuation, a token a step
        ref.token_ids.append(tokens[-1])
        tokens.append(plain.execute(Batch((ref.chunk(1),)), greedy).token_ids[0])
    req = Request(spec, prompt)
    assert spec.execute(Batch((req.chunk(len(prompt)),)), greedy).token_ids[0] == first
    req.token_ids.append(first)
    at = len(prompt)
    # every draft right (3 of 3), then none (the first wrong), then 1 of 2
    for right, wrong in ((3, 0), (0, 2), (1, 1)):
        k = at - len(prompt)  # tokens[k] is the newest token, at position `at`
        drafts = tokens[k + 1 : k + 1 + right] + [(tokens[k + 1 + right] + 1) % vocab] * wrong
        out = spec.execute(Batch((_drafted(req, drafts),)), greedy)
        (verified,) = out.drafts
        assert verified.num_drafted == len(drafts) and list(verified.token_ids) == tokens[k + 1 : k + 1 + right]
        assert out.token_ids[0] == tokens[k + 1 + right], f"{name}: the model's token after the accepted drafts"
        req.num_computed += right  # what the engine does with the accepted drafts
        req.token_ids[at + 1 :] = tokens[k + 1 : k + 2 + right]
        at += 1 + right
        # the reference at the same point: its slot holds the state after position at - 1
        ref_ref = Request(plain, prompt + tokens[: k + 1 + right])
        plain.forward(Batch((ref_ref.chunk(at),)))
        assert _close(_state(plain, ref_ref.slot), _state(spec, req.slot)) <= TOL, f"{name}: state after {right}"
        assert _close(_kv(plain, ref_ref, at), _kv(spec, req, at)) <= TOL, f"{name}: KV after {right} accepted"
        ref_ref.release()
    # and the next plain decode from there agrees with the reference's
    req.token_ids = req.token_ids[: at + 1]
    logits = spec.forward(Batch((req.chunk(1),))).logits[0]
    ref_ref = Request(plain, prompt + tokens[: at - len(prompt) + 1])
    expect = plain.forward(Batch((ref_ref.chunk(at + 1),))).logits[0]
    assert (logits - expect).abs().max().item() <= TOL


def test_seeded_sampled_rows_draw_the_tokens_of_a_plain_decode(checkpoints) -> None:
    hf, path = checkpoints["gqa_groups2"]
    plain, spec = _runner(path, 0), _runner(path, 4)
    params = SamplingParams(temperature=1.0, seed=7, num_logprobs=2)
    sampling = StepSampling.of((0,), [params])
    prompt = [1, 2, 3, 4, 5]
    ref = Request(plain, prompt)
    tokens = [plain.execute(Batch((ref.chunk(5),)), sampling).token_ids[0]]
    logprobs = []
    for _ in range(4):
        ref.token_ids.append(tokens[-1])
        out = plain.execute(Batch((ref.chunk(1),)), sampling)
        tokens.append(out.token_ids[0])
        logprobs.append(out.logprobs[0])
    req = Request(spec, prompt)
    spec.execute(Batch((req.chunk(5),)), sampling)
    req.token_ids.append(tokens[0])
    out = spec.execute(Batch((_drafted(req, tokens[1:4]),)), sampling)  # the drafts a plain decode draws
    (verified,) = out.drafts
    assert list(verified.token_ids) == tokens[1:4] and out.token_ids[0] == tokens[4]
    assert verified.logprobs == pytest.approx(logprobs[:3], abs=1e-5)
    assert all(len(t) == 2 for t in verified.top_logprobs)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_rows_with_penalties_verify_with_the_drafts_before_each_position_counted(checkpoints, temperature) -> None:
    """Presence, frequency and repetition penalties and min_tokens read the tokens generated so far: at
    each drafted position they count the drafts before it, so the drafts a plain decode (greedy, or
    seeded sampled) chose are accepted with its log-probabilities, and its next token follows them."""
    hf, path = checkpoints["gqa_groups2"]
    plain, spec = _runner(path, 0), _runner(path, 4)
    prompt = [5, 6, 7, 8, 5, 6, 7]
    first = plain.execute(Batch((Request(plain, prompt).chunk(7),)), StepSampling((0,))).token_ids[0]
    params = SamplingParams(
        temperature=temperature, seed=3, presence_penalty=0.8, frequency_penalty=0.6, repetition_penalty=1.4,
        min_tokens=5, held_token_ids=(first,),
    )  # fmt: skip

    def decode(runner, steps: int):  # type: ignore[no-untyped-def]
        outputs: list[int] = []
        req = Request(runner, prompt)
        sampling = StepSampling.of((0,), [params], [(prompt, outputs)])
        out = runner.execute(Batch((req.chunk(7),)), sampling)
        outputs.append(out.token_ids[0])
        lps = []
        for _ in range(steps):
            req.token_ids.append(outputs[-1])
            out = runner.execute(Batch((req.chunk(1),)), sampling)
            outputs.append(out.token_ids[0])
            lps.append(out.logprobs[0])
        return req, outputs, lps, sampling

    _, tokens, logprobs, _ = decode(plain, 6)
    assert first not in tokens[:5], "min_tokens held the model's own first choice"
    req, outputs, _, sampling = decode(spec, 0)  # the prompt, then a verify step of the plain decode's drafts
    req.token_ids.append(outputs[-1])
    out = spec.execute(Batch((_drafted(req, tokens[1:5]),)), sampling)
    (verified,) = out.drafts
    assert list(verified.token_ids) == tokens[1:5] and out.token_ids[0] == tokens[5]
    assert verified.logprobs == pytest.approx(logprobs[:4], abs=1e-5)
    assert out.logprobs[0] == pytest.approx(logprobs[4], abs=1e-5)
    # a wrong second draft: the first is kept, and the token after it is the plain decode's
    outputs.extend(tokens[1:6])
    req.num_computed += 4  # what the engine does with the accepted drafts
    req.token_ids.append(tokens[5])
    _, tokens2, _, _ = decode(plain, 8)
    out = spec.execute(Batch((_drafted(req, [tokens2[6], (tokens2[7] + 1) % 97]),)), sampling)
    (verified,) = out.drafts
    assert list(verified.token_ids) == [tokens2[6]] and out.token_ids[0] == tokens2[7]


def test_a_step_drafting_more_than_the_draft_rows_is_refused(checkpoints, monkeypatch) -> None:
    monkeypatch.setattr("gpu_worker.runner.runner.keeps_short_spans", lambda batch, device: False)
    _, path = checkpoints["gqa_groups2"]
    spec = _runner(path, 2)
    req = Request(spec, [1, 2, 3])
    spec.forward(Batch((req.chunk(3),)))
    req.token_ids.append(4)
    with pytest.raises(InvalidArgumentError, match="draft rows"):
        spec.execute(Batch((_drafted(req, [5, 6, 7]),)), StepSampling((0,)))


def _chi_square_p(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's goodness of fit of `counts` to `probs`; cells expecting fewer than 5 are pooled."""
    expected = probs.double() * counts.sum()
    small = expected < 5
    observed = torch.cat([counts[~small].double(), counts[small].double().sum().reshape(1)])
    expected = torch.cat([expected[~small], expected[small].sum().reshape(1)])
    keep = expected > 0
    stat = (((observed - expected) ** 2) / expected)[keep].sum()
    df = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), stat / 2))


def test_sampled_drafts_keep_the_target_distribution(tmp_path: Path) -> None:
    """A 16-token vocabulary, temperature 1, unseeded: over 20,000 verifications of the same drafted row,
    the first token follows the model's distribution after the context, and the token after an accepted
    first draft follows the distribution after the context and that draft: what plain decoding samples
    from, read off a plain runner's logits (chi-square, p > 0.01 each)."""
    from tests.model.model_helpers import SPECS, make_hf_model, save_hf_model

    spec = replace(SPECS["gqa_groups2"], vocab_size=16, seed=11)
    path = save_hf_model(make_hf_model(spec), tmp_path / "v16")
    plain, spec_runner = _runner(path, 0), _runner(path, 4)
    prompt = [1, 5, 9, 2, 7]
    ref = Request(plain, prompt + [3])
    p0 = plain.forward(Batch((ref.chunk(6),))).logits[0].softmax(-1)
    d1 = int(p0.argmax())  # a draft accepted often, so its branch has thousands of samples
    ref.token_ids.append(d1)
    p1 = plain.forward(Batch((ref.chunk(1),))).logits[0].softmax(-1)

    req = Request(spec_runner, prompt)
    spec_runner.forward(Batch((req.chunk(5),)))
    req.token_ids.append(3)
    batch = Batch((_drafted(req, [d1, 0]),))
    out = spec_runner.forward(batch)
    sampling = StepSampling.of((0,), [SamplingParams(temperature=1.0)])
    sampled = sample_step(out.logits, batch, sampling, None, None)
    torch.manual_seed(5)
    first, second = torch.zeros(16, dtype=torch.long), torch.zeros(16, dtype=torch.long)
    for _ in range(20_000):
        v = verify_drafts(out, batch, sampling, sampled)
        accepted = v.drafts[0].token_ids
        first[accepted[0] if accepted else v.token_ids[0]] += 1
        if accepted:
            second[accepted[1] if len(accepted) > 1 else v.token_ids[0]] += 1
    assert second.sum() > 2000
    assert _chi_square_p(first, p0) > 0.01
    assert _chi_square_p(second, p1) > 0.01
