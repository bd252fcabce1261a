"""The bench driver's pure parts: arrivals, goodput on a recorded run, result keys, datasets."""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

import pytest

from hybridserve_cli.bench import datasets
from hybridserve_cli.bench.driver import LoadSpec, RequestOutcome, arrival_offsets
from hybridserve_cli.bench.results import format_table, is_good, parse_goodput, summarize

RECORDED = Path(__file__).parent / "data" / "recorded_run.json"
VLLM_KEYS = ["completed", "request_throughput", "output_throughput", "total_token_throughput", "request_goodput"]
VLLM_KEYS += [f"{s}_{m}_ms" for m in ("ttft", "tpot", "itl", "e2el") for s in ("mean", "median", "p99")]


class ByteTokenizer:
    """One token per byte (the test models' tokenizer), offset past the special ids."""

    def encode(self, text: str) -> list[int]:
        return [b + 3 for b in text.encode()]

    def count_chat(self, messages) -> int:
        return sum(len(self.encode(m["content"])) + 4 for m in messages)


def recorded_outcomes() -> tuple[list[RequestOutcome], float]:
    """A 12-request run against the gateway at 20 req/s, as --save-result wrote it."""
    run = json.loads(RECORDED.read_text())
    outcomes = []
    for start, ttft, gaps, e2el, n_in, n_out in zip(run["start_times"], run["ttfts"], run["itls"], run["e2els"],
                                                   run["input_lens"], run["output_lens"], strict=True):  # fmt: skip
        times = [start + ttft]
        for gap in gaps:
            times.append(times[-1] + gap)
        outcomes.append(RequestOutcome(True, n_in, n_out, 0, start, tuple(times), (1,) * len(times), start + e2el))
    return outcomes, run["duration"]


def test_goodput_equals_a_hand_count_of_the_recorded_run():
    outcomes, duration = recorded_outcomes()
    # Counted by hand from the recording: TTFT <= 400 ms and TPOT <= 20 ms holds for requests 2, 3, 4
    # and 5 (0 and 1 decode slower than 20 ms a token; 6 to 11 wait longer than 400 ms for a token).
    slos = parse_goodput(["ttft:400", "tpot:20"])
    assert [i for i, o in enumerate(outcomes) if is_good(o, slos)] == [2, 3, 4, 5]
    assert summarize(outcomes, duration, slos)["request_goodput"] == pytest.approx(4 / duration)
    # E2EL <= 500 ms: requests 0 to 5.
    assert summarize(outcomes, duration, parse_goodput(["e2el:500"]))["request_goodput"] == pytest.approx(6 / duration)


def test_result_has_vllm_keys_and_cached_share():
    outcomes, duration = recorded_outcomes()
    result = summarize(outcomes, duration, {"ttft": 400.0})
    assert all(key in result for key in VLLM_KEYS), [k for k in VLLM_KEYS if k not in result]
    assert result["completed"] == 12 and result["total_cached_prompt_tokens"] == 0
    assert result["cached_prompt_token_share"] == 0.0
    ttfts_ms = [o.ttft_s * 1000 for o in outcomes]
    assert result["mean_ttft_ms"] == pytest.approx(statistics.fmean(ttfts_ms))
    assert result["median_ttft_ms"] == pytest.approx(statistics.median(ttfts_ms))
    assert result["output_throughput"] == pytest.approx(sum(o.output_len for o in outcomes) / duration)
    assert "Median TTFT (ms)" in format_table(result) and "Request goodput" in format_table(result)


def test_goodput_rejects_unknown_metrics():
    with pytest.raises(ValueError, match="NAME:MS"):
        parse_goodput(["itl:5"])
    with pytest.raises(ValueError, match="milliseconds"):
        parse_goodput(["ttft:fast"])


def test_poisson_and_gamma_arrivals_keep_the_mean_rate():
    poisson = arrival_offsets(4000, 50.0, 1.0, seed=1)
    bursty = arrival_offsets(4000, 50.0, 0.25, seed=1)
    for offsets in (poisson, bursty):
        assert offsets[0] == 0.0 and offsets == sorted(offsets)
        assert 3999 / offsets[-1] == pytest.approx(50.0, rel=0.1)
    gaps = [b - a for a, b in zip(bursty, bursty[1:], strict=False)]
    cv = statistics.pstdev(gaps) / statistics.fmean(gaps)
    assert cv == pytest.approx(2.0, rel=0.15)  # gamma shape k: coefficient of variation 1/sqrt(k)
    assert arrival_offsets(3, math.inf, 1.0, seed=0) == [0.0, 0.0, 0.0]
    with pytest.raises(ValueError):
        LoadSpec(request_rate=0.0)


def test_trace_blocks_follow_hash_ids(tmp_path):
    trace = tmp_path / "trace.jsonl"
    rows = [{"timestamp": 1000, "input_length": 40, "output_length": 3, "hash_ids": [7, 8, 9]},
            {"timestamp": 1250, "input_length": 36, "output_length": 5, "hash_ids": [7, 8, 4]},
            {"timestamp": 1500, "input_length": 16, "output_length": 2, "hash_ids": [5, 6]}]  # fmt: skip
    trace.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    pool = datasets.token_pool(ByteTokenizer(), seed=0)
    a, b, c = datasets.trace_requests(trace, pool, block_size=16)
    assert [r.prompt_len for r in (a, b, c)] == [40, 36, 16] and [len(r.prompt_ids) for r in (a, b, c)] == [40, 36, 16]
    assert a.prompt_ids[:32] == b.prompt_ids[:32] and a.prompt_ids[32:36] != b.prompt_ids[32:36]
    assert a.prompt_ids[:16] != c.prompt_ids[:16]
    assert [r.arrival_s for r in (a, b, c)] == [0.0, 0.25, 0.5] and b.output_len == 5
    trace.write_text('{"timestamp": 1}\n')
    with pytest.raises(ValueError, match="trace.jsonl:1"):
        datasets.trace_requests(trace, pool)


def test_random_and_multiturn_and_sharegpt(tmp_path):
    tok = ByteTokenizer()
    spec = datasets.RandomSpec(input_len=20, output_len=8, range_ratio=0.5)
    reqs = datasets.random_requests(50, spec, datasets.token_pool(tok, 0), seed=3)
    assert all(10 <= r.prompt_len == len(r.prompt_ids) <= 30 and 4 <= r.output_len <= 12 for r in reqs)
    assert len({r.prompt_len for r in reqs}) > 1
    turns = datasets.multiturn_requests(8, datasets.MultiturnSpec(turns=4, system_prompts=1, output_len=4), tok)
    first, second = turns[0].messages, turns[2].messages  # conversation 0, turns 1 and 2 (interleaved)
    assert second[: len(first)] == first and len(second) == len(first) + 2
    assert turns[0].messages[0] == turns[1].messages[0]  # one shared system prompt
    assert all(r.prompt_len == tok.count_chat(r.messages) for r in turns)
    data = [{"conversations": [{"from": "human", "value": "tell me a story " * 3},
                               {"from": "gpt", "value": "once upon a time"}]}] * 3  # fmt: skip
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(data))
    (req,) = datasets.sharegpt_requests(path, 1, tok)
    assert req.prompt_len == len("tell me a story " * 3) and req.output_len == len("once upon a time")
    with pytest.raises(ValueError, match="usable conversations"):
        datasets.sharegpt_requests(path, 5, tok)
