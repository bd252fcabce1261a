"""Speculative decoding (n-gram drafts) served end to end, for every family: a real Scheduler and worker
over gRPC, the greedy tokens with drafts equal to transformers' generate() alone, under 24 concurrent
streams whose prompts repeat (prefix-cache hits taken while others draft), across two model processes
sharing the steps, and with preemption forced by a small KV pool (scheduled synchronously there).

The prompts repeat themselves, so prompt lookup drafts from the first token on, and the tiny random
models' greedy outputs fall into loops, where the drafts are accepted: each run asserts drafts were
verified and some accepted, so none of these passes by drafting nothing. A verify forward scores its
positions in one chunk, so float32 sums may differ from one-token steps in the last bits (~1e-6): the
tokens are those of transformers wherever the top-2 logit margin is above that, as on these prompts."""

from __future__ import annotations

import random
import threading
from typing import Any

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client import CollectorRegistry

from gpu_worker.engine.observer import FanOut
from gpu_worker.model.backends.cpu.compiled_step import CompiledDecodeSteps
from gpu_worker.observers.metrics import MetricsObserver
from gpu_worker.observers.tracing import TracingObserver
from hybridserve.metrics import WorkerMetrics
from hybridserve.v1 import generation_pb2 as pb
from tests.model.model_helpers import FAMILY_SPECS, MTP_SPECS
from tests.model.test_families_serving import Served
from tests.worker.conftest import SCHEDULER, collect, greedy_request, hf_greedy

K = 4  # --num-speculative-tokens
SPLIT = {"model_process": "on", "model_processes": 2, "model_process_min_rows": 0,
         "model_process_split_min_tokens": 8, "cpu_threads": 1}  # fmt: skip


def _repeating(vocab: int, n: int, seed: int) -> list[int]:
    """A prompt of `n` random tokens, then them again: prompt lookup finds its suffix."""
    rng = random.Random(seed)
    head = [rng.randrange(3, vocab) for _ in range(n)]
    return head + head[: n // 2]


def _run_all(served: Served, prompts: list[list[int]], max_tokens: int) -> dict[int, list[int]]:
    results: dict[int, list[int]] = {}
    threads = [threading.Thread(target=lambda i=i: results.__setitem__(i, served.generate(prompts[i], max_tokens)[0]))
               for i in range(len(prompts))]  # fmt: skip
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    return results


def _assert_drafted(served: Served) -> None:
    counters = served.engine.counters
    assert counters.num_draft_tokens > 0, "no drafts were verified: the test checked plain decoding only"
    assert 0 < counters.num_accepted_tokens <= counters.num_draft_tokens


@pytest.mark.slow
@pytest.mark.parametrize("name", FAMILY_SPECS)
def test_greedy_with_drafts_is_transformers_greedy(checkpoints, scheduler_address, name) -> None:
    hf, path = checkpoints[name]
    _greedy_runs(hf, path, scheduler_address, "ngram")


@pytest.mark.slow
@pytest.mark.parametrize("name", MTP_SPECS)
def test_greedy_with_mtp_drafts_is_transformers_greedy(mtp_checkpoints, scheduler_address, name) -> None:
    """The MTP head's drafts (Nemotron-H checkpoints with a head): the same runs as prompt lookup's."""
    hf, path = mtp_checkpoints[name]
    _greedy_runs(hf, path, scheduler_address, "mtp")


def _greedy_runs(hf, path, scheduler_address: str, method: str) -> None:  # type: ignore[no-untyped-def]
    vocab, block = hf.config.vocab_size, SCHEDULER.block_size
    served = Served(path, scheduler_address, prefix_caching=True, speculative_tokens=K, runner=SPLIT,
                    speculative_method=method)  # fmt: skip
    try:
        alone = _repeating(vocab, 12, 1)
        assert served.generate(alone, 64)[0] == hf_greedy(hf, alone, 64), "alone"
        # 24 streams over 8 prompts of two blocks and more: the later copies hit the first's cached blocks
        prompts = [_repeating(vocab, 2 * block + i, 20 + i) for i in range(8)]
        expect = {i: hf_greedy(hf, p, 16) for i, p in enumerate(prompts)}
        streams = prompts * 3
        results = _run_all(served, streams, 16)
        assert results == {i: expect[i % 8] for i in range(len(streams))}, "24 concurrent streams"
        assert served.engine.prefix.stats().prefix_cache_hits > 0, "the repeated prompts were meant to hit"
        assert served.engine.runner.steps_shared > 0, "no step was shared between the two model processes"
        _assert_drafted(served)
    finally:
        served.close()

    tight = Served(path, scheduler_address, num_kv_pages=30, speculative_tokens=K, async_scheduling=False,
                   speculative_method=method)  # fmt: skip
    jobs = [_repeating(vocab, 16 + 2 * i, 10 + i) for i in range(4)]  # 4 requests of ~55 tokens in 120 of KV
    try:
        results = _run_all(tight, jobs, 30)
        assert tight.engine.counters.num_preemptions > 0, "the KV budget was meant to force preemption"
        _assert_drafted(tight)
    finally:
        tight.close()
    assert results == {i: hf_greedy(hf, p, 30) for i, p in enumerate(jobs)}


@pytest.mark.slow
def test_greedy_with_drafts_through_the_compiled_verify_programs(checkpoints, scheduler_address, monkeypatch) -> None:
    """Verify steps through their compiled programs (--compile-step-sizes 2: a bucket of 2 rows, with its
    verify program of 1 + K tokens a row) serve transformers' greedy tokens, alone (padded to the bucket)
    and under 6 concurrent streams (steps of 2 rows or fewer: the program; more: the eager forward),
    prefix hits taken; the program ran verify steps and drafts were accepted."""
    hf, path = checkpoints["granite_moe"]
    vocab, block = hf.config.vocab_size, SCHEDULER.block_size
    ran = []
    run_verify = CompiledDecodeSteps.run_verify

    def counted(self: CompiledDecodeSteps, *columns: Any) -> Any:
        out = run_verify(self, *columns)
        ran.append(out is not None)
        return out

    monkeypatch.setattr(CompiledDecodeSteps, "run_verify", counted)
    served = Served(path, scheduler_address, prefix_caching=True, speculative_tokens=K,
                    runner={"compile_step_sizes": "2", "verify_tokens": 1 + K})  # fmt: skip
    try:
        alone = _repeating(vocab, 12, 1)
        assert served.generate(alone, 48)[0] == hf_greedy(hf, alone, 48), "alone"
        prompts = [_repeating(vocab, 2 * block + i, 40 + i) for i in range(3)]
        expect = {i: hf_greedy(hf, p, 24) for i, p in enumerate(prompts)}
        results = _run_all(served, prompts * 2, 24)
        assert results == {i: expect[i % 3] for i in range(6)}, "6 concurrent streams"
        assert served.engine.prefix.stats().prefix_cache_hits > 0
        _assert_drafted(served)
        assert any(ran), "no verify step ran through a compiled program"
    finally:
        served.close()


@pytest.mark.slow
@pytest.mark.parametrize("method", ["ngram", "mtp"])
def test_a_seeded_sampled_request_gives_the_same_text_with_drafts(
    checkpoints, mtp_checkpoints, scheduler_address, monkeypatch, method
) -> None:
    """The runner draws each position from the random stream of the position it would have in a plain
    decode, so a seeded request's tokens and log-probabilities are the same with speculation on or off,
    whether prompt lookup or the MTP head (its argmax: point-mass drafts) proposes. At temperature 0.1
    these models' samples still differ from their greedy tokens, and fall into loops that the drafts
    follow. The drafts show in the metrics, GetInfo and the spans."""
    hf, path = checkpoints["gqa_groups2"] if method == "ngram" else mtp_checkpoints["nemotron_dense"]
    prompt = _repeating(hf.config.vocab_size, 12, 1)
    request = greedy_request(prompt, 96, temperature=0.1, seed=3, logprobs=2)
    monkeypatch.setenv("OTEL_SDK_DISABLED", "false")
    exporter, provider, registry = InMemorySpanExporter(), TracerProvider(), CollectorRegistry()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    outputs = []
    for k in (0, K):
        served = Served(path, scheduler_address, speculative_tokens=k, speculative_method=method)
        if k:  # before its first request: the engine reads its observer per event
            served.engine.observer = FanOut([TracingObserver(provider), MetricsObserver(WorkerMetrics(registry))])
        try:
            tokens, messages = collect(served.stub.Generate(request, timeout=120))
            logprobs = [lp for m in messages for lp in m.logprobs]
            info = served.stub.GetInfo(pb.GetInfoRequest(), timeout=10)
            counters = served.engine.counters
            outputs.append((tokens, logprobs, counters.num_draft_tokens, counters.num_accepted_tokens, info))
        finally:
            served.close()
    (plain, plain_lp, *_), (drafted, drafted_lp, num_drafted, accepted, info) = outputs
    assert accepted > 0, "no draft was accepted: the seeded run checked plain decoding only"
    assert drafted == plain and plain != hf_greedy(hf, prompt, 96)
    assert drafted_lp == pytest.approx(plain_lp, abs=1e-5)

    assert (info.num_speculative_tokens, info.spec_decode_num_draft_tokens) == (K, num_drafted)
    assert info.spec_decode_num_accepted_tokens == accepted
    sample = registry.get_sample_value
    assert sample("hybridserve_spec_decode_num_draft_tokens_total", {"model_name": ""}) == num_drafted
    assert sample("hybridserve_spec_decode_num_accepted_tokens_total", {"model_name": ""}) == accepted
    per_position = [sample("hybridserve_spec_decode_num_accepted_tokens_per_pos_total",
                           {"model_name": "", "position": str(p)}) or 0 for p in range(K)]  # fmt: skip
    assert sum(per_position) == accepted and per_position == sorted(per_position, reverse=True)
    spans = exporter.get_finished_spans()
    steps = [s.attributes for s in spans if s.name == "hybridserve.step" and "hybridserve.step.num_draft_tokens"
             in (s.attributes or {})]  # fmt: skip
    assert sum(a["hybridserve.step.num_accepted_tokens"] for a in steps) == accepted
    assert all(a["hybridserve.step.num_rejected_tokens"] == a["hybridserve.step.num_draft_tokens"]
               - a["hybridserve.step.num_accepted_tokens"] for a in steps)  # fmt: skip
    (done,) = [s.attributes for s in spans if s.name == "hybridserve.request"]
    assert done["hybridserve.spec_decode.acceptance_rate"] == pytest.approx(accepted / num_drafted)


@pytest.mark.slow
def test_requests_with_penalties_give_the_same_text_with_drafts(checkpoints, scheduler_address) -> None:
    """Presence, frequency and repetition penalties and min_tokens (with EOS held) draft: at each verified
    position the runner counts the drafts before it as generated (in process and across two model
    processes), so the text and log-probabilities are those of speculation off."""
    hf, path = checkpoints["gqa_groups2"]
    prompt = _repeating(hf.config.vocab_size, 12, 1)
    request = greedy_request(prompt, 64, presence_penalty=0.1, frequency_penalty=0.05, repetition_penalty=1.05,
                             min_tokens=8, logprobs=1)  # fmt: skip
    seeded = greedy_request(prompt, 64, temperature=0.1, seed=5, presence_penalty=0.1, repetition_penalty=1.05)
    outputs = []
    for k, runner in ((0, None), (K, None), (K, SPLIT)):
        served = Served(path, scheduler_address, speculative_tokens=k, runner=runner)
        try:
            runs = [collect(served.stub.Generate(r, timeout=120)) for r in (request, seeded)]
            texts = [(tokens, [lp for m in messages for lp in m.logprobs]) for tokens, messages in runs]
            outputs.append((texts, served.engine.counters.num_accepted_tokens))
        finally:
            served.close()
    (plain, _), *drafted = outputs
    for texts, accepted in drafted:
        assert accepted > 0, "no draft was accepted: plain decoding was checked only"
        for (tokens, logprobs), (want, want_lp) in zip(texts, plain, strict=True):
            assert tokens == want
            assert logprobs == pytest.approx(want_lp, abs=1e-5)
