"""Scheduler processes that die mid-run: a restarted or surviving replica loses no request."""

from __future__ import annotations

import signal
import threading
import time

import pytest

from hybridserve.children import free_port
from tests.procs import ServerProcess
from tests.worker.conftest import collect, greedy_request, hf_greedy, prompt_of

pytestmark = pytest.mark.slow

JOBS = [(10 + 3 * i, 300 + i, 60) for i in range(8)]


def run_clients(worker) -> tuple[dict[int, list[int]], list[BaseException], list[threading.Thread]]:
    results: dict[int, list[int]] = {}
    errors: list[BaseException] = []

    def client(i: int) -> None:
        length, seed, max_tokens = JOBS[i]
        try:
            results[i], _ = collect(
                worker.stub.Generate(greedy_request(prompt_of(length, seed), max_tokens), timeout=120)
            )
        except BaseException as exc:  # collected and asserted by the caller
            errors.append(exc)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(JOBS))]
    for t in threads:
        t.start()
    return results, errors, threads


def wait_for_progress(worker, tokens: int) -> None:
    deadline = time.monotonic() + 30
    while worker.info().num_generated_tokens < tokens:
        assert time.monotonic() < deadline
        time.sleep(0.01)


def test_scheduler_killed_and_restarted_mid_run_loses_no_stream(start_worker, hf_model):
    port = free_port()
    scheduler = ServerProcess(["scheduler", "--port", str(port)])
    worker = start_worker(scheduler_addresses=(f"127.0.0.1:{port}",), scheduler_give_up_s=60.0)
    results, errors, threads = run_clients(worker)
    try:
        wait_for_progress(worker, 40)
        scheduler.stop(signal.SIGKILL)
        time.sleep(1.0)  # the worker retries meanwhile
        before = worker.info().num_generated_tokens
        scheduler = ServerProcess(["scheduler", "--port", str(port)])
        for t in threads:
            t.join(120)
    finally:
        scheduler.stop()
    assert not errors, errors[:3]
    assert before < sum(j[2] for j in JOBS), "the kill happened mid-run"
    assert results == {i: hf_greedy(hf_model, prompt_of(length, seed), n) for i, (length, seed, n) in enumerate(JOBS)}


def test_a_dead_replica_fails_over_to_the_other(start_worker, hf_model):
    first = ServerProcess(["scheduler", "--port", "0"])
    second = ServerProcess(["scheduler", "--port", "0"])
    worker = start_worker(scheduler_addresses=(first.address, second.address), scheduler_deadline_s=0.5)
    results, errors, threads = run_clients(worker)
    try:
        wait_for_progress(worker, 40)
        first.stop(signal.SIGKILL)
        for t in threads:
            t.join(120)
    finally:
        first.stop()
        second.stop()
    assert not errors, errors[:3]
    assert len(results) == len(JOBS)
    assert results[0] == hf_greedy(hf_model, prompt_of(*JOBS[0][:2]), JOBS[0][2])
