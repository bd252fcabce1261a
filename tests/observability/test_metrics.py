"""/metrics scraped over HTTP while requests run: counters only grow, and at the end they agree
with the tokens the clients received."""

from __future__ import annotations

import threading
import urllib.request
from concurrent.futures import ThreadPoolExecutor

from prometheus_client import start_http_server
from prometheus_client.parser import text_string_to_metric_families

from tests.observability.conftest import greedy, prompt_of


def scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_metrics_move_with_generated_tokens(start_stack):
    stack = start_stack(traced=False)
    httpd, _ = start_http_server(0, addr="127.0.0.1", registry=stack.registry)
    port = httpd.server_port
    num_requests, max_tokens = 4, 8
    prompts = [prompt_of(24 + 5 * i, i) for i in range(num_requests)]
    done = threading.Event()
    seen: list[float] = []

    def poll() -> None:
        while not done.is_set():
            seen.append(scrape(port).get(("hybridserve_generation_tokens_total", (("model_name", ""),)), 0.0))
            done.wait(0.01)

    poller = threading.Thread(target=poll)
    poller.start()
    with ThreadPoolExecutor(num_requests) as pool:
        outs = list(pool.map(lambda p: list(stack.stub.Generate(greedy(p, max_tokens), timeout=60)), prompts))
    done.set()
    poller.join()
    received = sum(len(m.token_ids) for out in outs for m in out)
    final = scrape(port)
    httpd.shutdown()

    assert received == num_requests * max_tokens
    assert seen == sorted(seen), "a counter went backwards"
    assert final[("hybridserve_generation_tokens_total", (("model_name", ""),))] == received
    assert (
        final[("hybridserve_request_success_total", (("finished_reason", "length"), ("model_name", "")))]
        == num_requests
    )
    assert final[("hybridserve_time_to_first_token_seconds_count", (("model_name", ""),))] == num_requests
    assert final[("hybridserve_inter_token_latency_seconds_count", (("model_name", ""),))] == received - num_requests
    computed = sum(final[("hybridserve_computed_tokens_total", (("kind", k),))] for k in ("prefill", "decode"))
    assert computed == sum(map(len, prompts)) + received - num_requests  # every token but each last one
    assert final[("hybridserve_computed_tokens_total", (("kind", "prefill"),))] >= sum(map(len, prompts))
    assert final[("hybridserve_steps_total", ())] == stack.engine.counters.num_steps
    assert final[("hybridserve_plan_latency_seconds_count", ())] == stack.engine.counters.num_steps
    assert final[("hybridserve_stalled_steps_total", ())] == 0
    assert (
        final[("hybridserve_num_requests_waiting", (("model_name", ""),))] == 0
        and final[("hybridserve_num_requests_running", (("model_name", ""),))] == 0
    )
    for phase in ("queue", "prefill", "decode"):
        assert final[(f"hybridserve_request_{phase}_time_seconds_count", (("model_name", ""),))] == num_requests
    assert final[("hybridserve_prompt_tokens_total", (("model_name", ""),))] == sum(map(len, prompts))
    assert final[("hybridserve_request_generation_tokens_sum", (("model_name", ""),))] == received
    assert final[("hybridserve_iteration_tokens_total_sum", (("model_name", ""),))] == computed
    assert final[("hybridserve_kv_cache_usage_perc", (("model_name", ""),))] == 0.0
    assert final[("hybridserve_kv_pages_used", ())] == 0 and final[("hybridserve_kv_pages_total", ())] > 0
    assert final[("hybridserve_state_slots_used", ())] == 0
