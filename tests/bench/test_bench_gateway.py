"""`hybridserve bench` against a real gateway over a real worker (tiny model, one worker, prefix
caching on, both with --metrics-compat vllm): the open loop keeps its rate, the result JSON has
vLLM's keys, a trace's shared hash ids become cached tokens, and every serving series is on
/metrics afterwards under our names and vLLM's."""

from __future__ import annotations

import argparse
import json
import re
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from gateway.metrics import GATEWAY_VLLM_SERIES
from hybridserve.children import free_ports
from hybridserve.metrics import VLLM_SERIES
from hybridserve_cli import build_parser
from hybridserve_cli.bench import command
from hybridserve_cli.bench.driver import arrival_offsets
from tests.bench.test_bench_units import VLLM_KEYS
from tests.gateway.conftest import model_dir, scheduler, start_gateway, start_worker, wait_ready  # noqa: F401
from tests.procs import ServerProcess

COUNTERS = {"prompt_tokens", "generation_tokens", "request_success", "num_preemptions", "prefix_cache_queries",
            "prefix_cache_hits", "spec_decode_num_drafts", "spec_decode_num_draft_tokens",
            "spec_decode_num_accepted_tokens", "spec_decode_num_accepted_tokens_per_pos"}  # fmt: skip
# labelled by draft position as well: no sample until a draft is accepted (this worker does not speculate)
PER_POSITION = {"spec_decode_num_accepted_tokens_per_pos"}
RATE, NUM = 12.0, 60


@pytest.fixture(scope="module")
def served(model_dir, scheduler) -> Iterator[tuple[ServerProcess, ServerProcess]]:  # noqa: F811
    (port,) = free_ports(1)
    worker = start_worker(model_dir, scheduler.address, port, "--max-num-seqs", "8", "--metrics-port", "0",
                          "--metrics-compat", "vllm")  # fmt: skip
    try:
        gateway = start_gateway([f"127.0.0.1:{port}"], model_dir, "--metrics-compat", "vllm")
        try:
            wait_ready(gateway, 1)
            yield worker, gateway
        finally:
            gateway.stop()
    finally:
        worker.stop()


def bench(gateway: ServerProcess, tmp_path, *flags: str) -> dict:
    out = tmp_path / "result.json"
    args: argparse.Namespace = build_parser(only="bench").parse_args(
        ["bench", "--base-url", f"http://{gateway.address}", "--save-result", str(out), "--json", *flags]
    )
    assert command.run(args) == 0
    return json.loads(out.read_text())


def test_open_loop_keeps_the_asked_rate(served, tmp_path):
    _, gateway = served
    result = bench(gateway, tmp_path, "--request-rate", str(RATE), "--num-prompts", str(NUM), "--seed", "5",
                   "--random-input-len", "16", "--random-output-len", "2", "--goodput", "ttft:2000")  # fmt: skip
    assert result["completed"] == NUM and result["failed"] == 0
    assert result["request_throughput"] == pytest.approx(RATE, rel=0.25)
    offsets = arrival_offsets(NUM, RATE, 1.0, seed=5)
    assert (NUM - 1) / offsets[-1] == pytest.approx(RATE, rel=0.25)  # the seeded stream itself
    late = [s - o for s, o in zip(result["start_times"], offsets, strict=True)]
    assert max(late) < 0.25, "requests were sent late: the driver did not keep the schedule"
    assert all(key in result for key in VLLM_KEYS) and result["request_goodput"] > 0
    assert "total_cached_prompt_tokens" in result and "cached_prompt_token_share" in result
    assert all(n == 16 for n in result["input_lens"]) and all(n == 2 for n in result["output_lens"])


def write_trace(path, hash_ids: list[list[int]]) -> None:
    rows = [{"timestamp": 400 * i, "input_length": 16 * len(ids), "output_length": 2, "hash_ids": ids}
            for i, ids in enumerate(hash_ids)]  # fmt: skip
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_trace_shared_hash_ids_are_cached(served, tmp_path):
    _, gateway = served
    shared, unshared = tmp_path / "shared.jsonl", tmp_path / "unshared.jsonl"
    write_trace(shared, [[101, 102, 103, 104], [101, 102, 103, 105]])
    write_trace(unshared, [[201, 202, 203, 204], [301, 302, 303, 304]])
    flags = ("--dataset", "trace", "--trace-block-size", "16", "--seed", "9")
    result = bench(gateway, tmp_path, *flags, "--dataset-path", str(shared))
    assert result["completed"] == 2 and result["cached_tokens"][0] == 0
    assert 16 <= result["cached_tokens"][1] <= 48  # the three shared blocks, at most
    assert result["total_cached_prompt_tokens"] == result["cached_tokens"][1] > 0
    result = bench(gateway, tmp_path, *flags, "--dataset-path", str(unshared))
    assert result["completed"] == 2 and result["cached_tokens"] == [0, 0]


def scrape(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as response:
        return response.read().decode()


def series_name(prefix: str, name: str) -> str:
    return prefix + name + ("_total" if name in COUNTERS else "")


def present(text: str, name: str) -> bool:
    return re.search(rf"^{re.escape(name)}(_bucket|_count|_sum)?\{{[^}}]*model_name=", text, re.M) is not None


def test_metrics_expose_vllm_series_after_load(served, tmp_path):
    worker, gateway = served
    bench(gateway, tmp_path, "--num-prompts", "4", "--random-input-len", "40", "--random-output-len", "3",
          "--clients", "2")  # fmt: skip
    (address,) = [line.split()[-1] for line in worker.lines if line.startswith("metrics on ")]
    worker_text = scrape(f"http://{address}/metrics")
    gateway_text = scrape(f"http://{gateway.address}/metrics")
    for prefix in ("hybridserve_", "vllm:"):
        missing = [n for n in VLLM_SERIES if n not in PER_POSITION and not present(worker_text, series_name(prefix, n))]
        assert not missing, f"worker lacks {prefix}{missing}"
    for prefix in ("hybridserve_gateway_", "vllm:"):
        missing = [n for n in GATEWAY_VLLM_SERIES if not present(gateway_text, series_name(prefix, n))]
        assert not missing, f"gateway lacks {prefix}{missing}"
    ok = re.search(r'^vllm:request_success_total\{finished_reason="length",model_name="tiny"\} (\S+)$', gateway_text,
                   re.M)  # fmt: skip
    assert ok and float(ok.group(1)) >= 4
    assert re.search(r'^vllm:e2e_request_latency_seconds_count\{model_name="\S+"\} [1-9]', worker_text, re.M)


def test_tokenize_in_vllm_shape(served):
    _, gateway = served

    def post(path: str, body: dict) -> dict:
        request = urllib.request.Request(f"http://{gateway.address}{path}", json.dumps(body).encode(),
                                         {"Content-Type": "application/json"})  # fmt: skip
        with urllib.request.urlopen(request, timeout=10) as response:
            return json.loads(response.read())

    out = post("/tokenize", {"model": "tiny", "prompt": "hello"})
    assert out["count"] == len(out["tokens"]) == 5 and out["max_model_len"] > 0
    chat = post("/tokenize", {"messages": [{"role": "user", "content": "hello"}]})
    assert chat["count"] > out["count"]  # the template's markers and BOS
    assert post("/detokenize", {"tokens": out["tokens"]})["prompt"] == "hello"
    with pytest.raises(urllib.error.HTTPError) as failed:
        post("/tokenize", {"prompt": "x", "messages": []})
    assert failed.value.code == 400


DASHBOARD = Path(__file__).parents[2] / "deploy" / "grafana" / "hybridserve.json"
SHARED_TIER_ONLY = {"hybridserve_checkpoints_rejected_total"}  # a worker with --cache serves it (cache/remote.py)


def exposed_names(text: str) -> set[str]:
    """Every sample and family name of a /metrics text (a labelled family with no child yet has only
    its HELP and TYPE lines)."""
    return set(re.findall(r"^(?:# (?:HELP|TYPE) )?([a-zA-Z_:][a-zA-Z0-9_:]*)", text, re.M))


def test_dashboard_queries_name_only_exposed_metrics(served, tmp_path):
    worker, gateway = served
    bench(gateway, tmp_path, "--num-prompts", "2", "--random-input-len", "20", "--random-output-len", "2")
    (address,) = [line.split()[-1] for line in worker.lines if line.startswith("metrics on ")]
    names = exposed_names(scrape(f"http://{address}/metrics")) | exposed_names(
        scrape(f"http://{gateway.address}/metrics")
    )
    exprs = [t["expr"] for panel in json.loads(DASHBOARD.read_text())["panels"] for t in panel["targets"]]
    queried = {n for e in exprs for n in re.findall(r"\b(?:hybridserve_|vllm:)[a-z0-9_:]+", e)}
    assert len(queried) > 20

    def known(name: str) -> bool:
        return any(name.removesuffix(s) in names for s in ("", "_total", "_bucket", "_count", "_sum"))

    missing = {n for n in queried if not known(n)}
    assert missing == SHARED_TIER_ONLY, f"the dashboard queries metrics no server exposes: {missing - SHARED_TIER_ONLY}"
    assert "hybridserve_checkpoints_rejected" in (Path(__file__).parents[2] / "gpu_worker/cache/remote.py").read_text()
