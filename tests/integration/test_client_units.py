"""Unit tests of the client commands: `generate` flag handling and output, `bench` statistics and its
closed loop, against a stand-in Generation server (tests/integration/fake_worker.py)."""

from __future__ import annotations

import argparse
import json
import statistics

import pytest

from gpu_worker.api.client import Completion
from hybridserve.children import free_port
from hybridserve_cli import build_parser, generate, loadgen
from hybridserve_cli.bench import command as bench_command
from hybridserve_cli.loadgen import RequestResult
from tests.integration.fake_worker import start_fake_worker


@pytest.fixture(scope="module")
def fake_worker():
    server, address, servicer = start_fake_worker()
    yield address, servicer
    server.stop(0)


def parse(*argv: str) -> argparse.Namespace:
    return build_parser(only=argv[0]).parse_args(list(argv))


# generate: flags -----------------------------------------------------------------------------------


def test_token_ids_flag_parses_lists_and_rejects_junk():
    assert generate.parse_token_ids("1,2, 3") == [1, 2, 3]
    for bad in ("1,x", ",", ""):
        with pytest.raises(argparse.ArgumentTypeError):
            generate.parse_token_ids(bad)


def test_flags_become_the_request():
    args = parse("generate", "Hi", "--max-tokens", "8", "--temperature", "0.7", "--top-p", "0.9", "--top-k", "5",
                 "--seed", "11", "--stop", "a", "b", "--ignore-eos", "--logprobs", "2")  # fmt: skip
    request = generate.request_from_args(args)
    assert request.prompt == "Hi" and request.WhichOneof("input") == "prompt"
    s = request.sampling
    assert (s.max_tokens, s.top_k, s.seed, list(s.stop), s.ignore_eos, s.logprobs) == (8, 5, 11, ["a", "b"], True, 2)
    assert s.temperature == pytest.approx(0.7) and s.top_p == pytest.approx(0.9)
    request = generate.request_from_args(parse("generate", "--token-ids", "5,6"))
    assert list(request.prompt_token_ids.ids) == [5, 6] and not request.sampling.HasField("seed")


@pytest.mark.parametrize("argv", [("generate",), ("generate", "Hi", "--token-ids", "1")])
def test_prompt_must_be_given_exactly_once(argv):
    with pytest.raises(ValueError, match="prompt|token-ids"):
        generate.request_from_args(parse(*argv))


def test_worker_address_defaults_to_env(monkeypatch):
    monkeypatch.setenv("HYBRIDSERVE_GENERATE_WORKER", "10.0.0.1:7000")
    assert parse("generate", "x").worker == "10.0.0.1:7000"
    monkeypatch.delenv("HYBRIDSERVE_GENERATE_WORKER")
    assert parse("generate", "x").worker == "127.0.0.1:50052"


def test_summary_line_has_counts_and_timings():
    done = Completion(finish_reason="length", prompt_tokens=5, completion_tokens=8, token_ids=list(range(8)),
                      start_s=10.0, first_token_s=10.1, last_token_s=10.8, end_s=10.9,
                      first_message_tokens=1)  # fmt: skip
    line = generate.format_summary(done)
    assert "finish_reason=length" in line and "prompt_tokens=5" in line and "completion_tokens=8" in line
    assert "ttft=100.0ms" in line and "decode=10.0tok/s" in line


# generate: against the stand-in worker ----------------------------------------------------------


def test_generate_streams_text_then_summary(fake_worker, capsys):
    address, _ = fake_worker
    assert generate.run(parse("generate", "Hello", "--worker", address, "--max-tokens", "8")) == 0
    out, err = capsys.readouterr()
    assert out == "abcdefgh\n"
    assert "completion_tokens=8" in err and "finish_reason=length" in err


def test_generate_json(fake_worker, capsys):
    address, _ = fake_worker
    assert generate.run(parse("generate", "--token-ids", "4,5", "--worker", address, "--max-tokens", "3",
                              "--json", "--logprobs", "1")) == 0  # fmt: skip
    body = json.loads(capsys.readouterr().out)
    assert body["token_ids"] == [3, 4, 5] and body["usage"]["prompt_tokens"] == 2
    assert body["top_logprobs"][0] == {"3": -0.5, "4": -1.5} and body["finish_reason"] == "length"


def test_generate_shows_the_servers_invalid_argument(fake_worker, capsys):
    address, _ = fake_worker
    assert generate.run(parse("generate", "", "--worker", address)) == generate.EXIT_USAGE
    assert "the worker rejected the request: prompt is empty" in capsys.readouterr().err


def test_generate_says_when_no_worker_listens(capsys):
    address = f"127.0.0.1:{free_port()}"
    assert generate.run(parse("generate", "Hi", "--worker", address, "--timeout", "10")) == generate.EXIT_RPC_ERROR
    assert f"no worker at {address}: is `hybridserve up` running?" in capsys.readouterr().err


# loadgen: statistics ---------------------------------------------------------------------------


def test_percentile_interpolates_linearly():
    values = [4.0, 1.0, 3.0, 2.0]
    assert loadgen.percentile(values, 50) == pytest.approx(2.5)
    assert loadgen.percentile(values, 0) == 1.0 and loadgen.percentile(values, 100) == 4.0
    assert loadgen.percentile(values, 95) == pytest.approx(3.85)
    assert loadgen.percentile([7.0], 95) == 7.0 and loadgen.percentile([], 50) is None


def test_summarize_synthetic_timings():
    results = [RequestResult(ok=True, completion_tokens=10, ttft_s=0.01 * i, e2e_s=0.1 * i,
                             decode_tokens_per_s=100.0 + i) for i in range(1, 21)]  # fmt: skip
    results += [RequestResult(ok=False, error="boom"), RequestResult(ok=False, error="boom")]
    summary = loadgen.summarize(results, clients=4, wall_s=2.0)
    assert (summary.requests_ok, summary.requests_failed, summary.output_tokens) == (20, 2, 200)
    assert summary.output_tokens_per_s == pytest.approx(100.0)
    assert summary.median_decode_tokens_per_s == pytest.approx(statistics.median(100.0 + i for i in range(1, 21)))
    assert summary.ttft_p50_s == pytest.approx(0.105) and summary.ttft_p95_s == pytest.approx(0.1905)
    assert summary.e2e_p50_s == pytest.approx(1.05) and summary.e2e_p95_s == pytest.approx(1.905)
    assert summary.errors == ("boom",)
    table = loadgen.format_table(summary)
    assert "20 / 2" in table and "100.0" in table and "error: boom" in table


def test_summarize_with_no_successes_has_no_percentiles():
    summary = loadgen.summarize([RequestResult(ok=False, error="x")], clients=1, wall_s=0.0)
    assert summary.requests_ok == 0 and summary.output_tokens_per_s == 0.0 and summary.ttft_p95_s is None
    assert "-" in loadgen.format_table(summary)


def test_decode_rate_excludes_the_first_message():
    done = Completion(token_ids=[1, 2, 3, 4, 5], first_message_tokens=1, start_s=0.0, first_token_s=1.0,
                      last_token_s=3.0, end_s=3.5)  # fmt: skip
    assert done.ttft_s == 1.0 and done.e2e_s == 3.5 and done.decode_tokens_per_s == pytest.approx(2.0)
    assert (
        Completion(token_ids=[1], first_message_tokens=1, first_token_s=1.0, last_token_s=1.0).decode_tokens_per_s
        is None
    )


def test_prompts_are_seeded_mixed_and_avoid_special_ids():
    prompts = loadgen.make_prompts(50, 4, 9, vocab_size=100, seed=3)
    assert prompts == loadgen.make_prompts(50, 4, 9, vocab_size=100, seed=3)
    assert all(4 <= len(p) <= 9 for p in prompts) and len({len(p) for p in prompts}) > 1
    assert all(3 <= t < 100 for p in prompts for t in p)
    with pytest.raises(ValueError):
        loadgen.make_prompts(1, 5, 4, vocab_size=100)


# loadgen: the closed loop against the stand-in worker -------------------------------------------


def test_run_load_keeps_n_requests_in_flight(fake_worker):
    address, servicer = fake_worker
    servicer.max_concurrent = 0
    prompts = loadgen.make_prompts(24, 2, 6, vocab_size=259, seed=0)
    summary = loadgen.run_load(address, prompts, clients=4, max_tokens=5)
    assert (summary.requests_ok, summary.requests_failed, summary.output_tokens) == (24, 0, 120)
    assert 1 < servicer.max_concurrent <= 4
    assert summary.ttft_p50_s is not None and summary.median_decode_tokens_per_s is not None
    sent = servicer.requests[-24:]
    assert all(r.sampling.ignore_eos and r.sampling.max_tokens == 5 for r in sent)


def test_bench_command_json_and_failures(fake_worker, capsys):
    address, _ = fake_worker
    assert bench_command.run(parse("bench", "--worker", address, "--clients", "2", "--requests", "6",
                                   "--random-input-len", "8", "--max-tokens", "2", "--json")) == 0  # fmt: skip
    body = json.loads(capsys.readouterr().out)
    assert body["completed"] == 6 and body["clients"] == 2 and body["total_output_tokens"] == 12
    assert body["total_input_tokens"] == 6 * 8 and body["backend"] == "grpc"
    missing = f"127.0.0.1:{free_port()}"
    assert bench_command.run(parse("bench", "--worker", missing, "--requests", "2")) == 1
    assert f"no worker at {missing}" in capsys.readouterr().err
