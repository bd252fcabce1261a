"""The model in its own process (gpu_worker.runner.model_process): the same logits and pool contents as the
in-process runner, the pools shared both ways, bad batches refused without losing the process, and a
dead model process replaced over the same weights and pools."""

from __future__ import annotations

import os
import re
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2

from gpu_worker.runner.batch import Batch
from gpu_worker.runner.model_process import (
    ModelProcessError,
    ProcessRunner,
    build_runner,
    resolve_processes,
    wants_model_process,
)
from gpu_worker.runner.runner import ModelRunner
from gpu_worker.runner.settings import RunnerConfig
from gpu_worker.runner.tuning import usable_cores
from hybridserve.errors import InvalidArgumentError
from hybridserve.v1 import generation_pb2 as pb
from hybridserve.v1 import generation_pb2_grpc as pb_grpc
from tests.faults.stack import health_check_s, serves, write_model
from tests.model.model_helpers import Request
from tests.procs import ServerProcess

CONFIG = RunnerConfig(
    memory_budget_bytes=16 << 20, kv_page_size_tokens=4, max_num_seqs=8, num_checkpoint_slots=4, device="cpu",
    dtype="float32", cpu_threads=1, model_processes=1,
)  # fmt: skip


@pytest.fixture(scope="module")
def runners(checkpoint: Path) -> Iterator[tuple[ModelRunner, ProcessRunner]]:
    here = build_runner(checkpoint, CONFIG)
    apart = build_runner(checkpoint, replace(CONFIG, model_process="on", model_process_min_rows=0))
    assert isinstance(here, ModelRunner) and isinstance(apart, ProcessRunner)
    yield here, apart
    apart.close()


def run_steps(runner: ModelRunner | ProcessRunner) -> tuple[list[torch.Tensor], Request, Request]:
    """Two requests: prefill chunks (one with every position's logits), then decode steps together."""
    g = torch.Generator().manual_seed(3)
    a = Request(runner, torch.randint(3, 120, (23,), generator=g).tolist())
    b = Request(runner, torch.randint(3, 120, (9,), generator=g).tolist())
    out = runner.forward(Batch((a.chunk(12), b.chunk(9)), return_all_logits=True))
    assert out.all_logits is not None
    logits = [out.logits, *out.all_logits]
    logits.append(runner.forward(Batch((a.chunk(11, save_checkpoint_id=0),))).logits)
    for step in range(4):
        a.token_ids.append(5 + step)
        b.token_ids.append(7 + step)
        logits.append(runner.forward(Batch((a.chunk(1), b.chunk(1)))).logits)
    return logits, a, b


def test_same_logits_and_pool_contents_as_in_process(runners: tuple[ModelRunner, ProcessRunner]) -> None:
    here, apart = runners
    ours, a1, b1 = run_steps(here)
    theirs, a2, b2 = run_steps(apart)
    assert len(ours) == len(theirs)
    for x, y in zip(ours, theirs, strict=True):
        torch.testing.assert_close(y, x, rtol=0, atol=1e-6)
    # what the child wrote is what the worker reads: the live slots, the checkpoint, the KV pages
    for (conv1, ssm1), (conv2, ssm2) in zip(
        here.state_pool.layer_states(), apart.state_pool.layer_states(), strict=True
    ):
        for s1, s2 in ((a1.slot, a2.slot), (b1.slot, b2.slot)):
            torch.testing.assert_close(conv2[s2], conv1[s1], rtol=0, atol=1e-6)
            torch.testing.assert_close(ssm2[s2], ssm1[s1], rtol=0, atol=1e-6)
        row = apart.state_pool.num_slots  # checkpoint 0
        assert ssm2[row].abs().sum() > 0
        torch.testing.assert_close(ssm2[row], ssm1[here.state_pool.num_slots], rtol=0, atol=1e-6)
    for (k1, v1), (k2, v2) in zip(here.kv_pool.layer_caches(), apart.kv_pool.layer_caches(), strict=True):
        for s1, s2 in ((a1, a2), (b1, b2)):
            rows1 = torch.cat([torch.arange(p * 4, p * 4 + 4) for p in s1.page_ids])[: s1.num_computed]
            rows2 = torch.cat([torch.arange(p * 4, p * 4 + 4) for p in s2.page_ids])[: s2.num_computed]
            torch.testing.assert_close(k2[rows2], k1[rows1], rtol=0, atol=1e-6)
            torch.testing.assert_close(v2[rows2], v1[rows1], rtol=0, atol=1e-6)
    for s in (a1, b1, a2, b2):
        s.release()


def test_state_written_by_the_worker_is_what_the_child_continues_from(
    runners: tuple[ModelRunner, ProcessRunner],
) -> None:
    """The prefix cache restores a checkpoint into a live slot on the worker's side; the child's next
    step must continue from it (and a wrong state would change the logits)."""
    here, apart = runners
    logits = []
    for runner in (here, apart):
        first = Request(runner, list(range(3, 19)))
        runner.forward(Batch((first.chunk(16, save_checkpoint_id=1),)))
        second = Request(runner, list(range(3, 19)) + [40])
        second.page_ids = list(first.page_ids)  # the prefix's pages, as the prefix cache shares them
        runner.kv_pool.share(second.page_ids)
        runner.state_pool.restore_checkpoint(1, second.slot)  # on this (the worker's) side
        second.num_computed = 16
        logits.append(runner.forward(Batch((second.chunk(1),))).logits)
        runner.state_pool.zero_slots(torch.tensor([second.slot]))  # a wrong state: different logits
        second.num_computed = 16
        wrong = runner.forward(Batch((second.chunk(1),))).logits
        assert not torch.allclose(wrong, logits[-1], atol=1e-4)
        first.release()
        second.release()
    torch.testing.assert_close(logits[1], logits[0], rtol=0, atol=1e-6)


def test_bad_batch_is_refused_and_the_process_stays(runners: tuple[ModelRunner, ProcessRunner]) -> None:
    _, apart = runners
    seq = Request(apart, [5, 6, 7])
    chunk = seq.chunk(3)
    with pytest.raises(InvalidArgumentError, match="slot"):
        apart.forward(Batch((chunk, chunk._replace(page_ids=chunk.page_ids))))  # one slot twice
    assert apart.alive
    assert apart.forward(Batch((chunk,))).logits.shape == (1, apart.config.vocab_size)
    seq.release()


def test_describe_names_the_process(runners: tuple[ModelRunner, ProcessRunner]) -> None:
    _, apart = runners
    described = apart.describe()
    assert described["model_process"] == apart.pid and apart.pid != os.getpid()
    assert described["num_kv_pages"] == apart.kv_pool.num_pages
    assert described["decode_compile"] == "off"


def test_a_dead_model_process_is_replaced_and_requests_keep_their_state(
    runners: tuple[ModelRunner, ProcessRunner], checkpoint: Path
) -> None:
    """kill -9 of the model process between steps: liveness turns false, a new process starts over the same
    weights and pools, and a request computed before the death continues from its state; a step in flight
    when the process dies fails with an error that says so, and the next one is served."""
    here, _ = runners
    runner = build_runner(checkpoint, replace(CONFIG, model_process="on"))  # small steps would run here: not now
    assert isinstance(runner, ProcessRunner) and runner.pid is not None
    try:
        expected, ours = [], []
        for r, out in ((here, expected), (runner, ours)):
            seq = Request(r, [5, 6, 7, 8, 9])
            out.append(r.forward(Batch((seq.chunk(5),))).logits)
            if r is runner:
                first = runner.pid
                os.kill(first, signal.SIGKILL)
                deadline = time.monotonic() + 10
                while runner.alive:  # what the worker's liveness probe reads
                    assert time.monotonic() < deadline, "the dead model process still counts as alive"
                    time.sleep(0.005)
            seq.token_ids.append(11)
            out.append(r.forward(Batch((seq.chunk(1),))).logits)  # waits for the replacement if need be
            seq.release()
        assert runner.alive and runner.pid != first and runner.replaced == 1
        for x, y in zip(expected, ours, strict=True):
            torch.testing.assert_close(y, x, rtol=0, atol=1e-6)
        # death during a step: the step fails, and says so; the next step is served
        seq = Request(runner, [3 + i % (runner.config.vocab_size - 3) for i in range(600)])
        killer = threading.Timer(0.05, os.kill, (runner.pid, signal.SIGKILL))
        killer.start()
        with pytest.raises(ModelProcessError, match="model process is gone"):
            for _ in range(200):  # long enough that the kill lands inside a step
                seq.num_computed = 0
                runner.forward(Batch((seq.chunk(597),)))
        killer.join()
        seq.num_computed = 0
        assert runner.forward(Batch((seq.chunk(597),))).logits.shape == (1, runner.config.vocab_size)
        assert runner.replaced == 2
        seq.release()
    finally:
        runner.close()


def test_small_steps_run_here_over_the_same_pools(checkpoint: Path) -> None:
    """Below min_rows rows a step runs in the worker's own process; either way the pools hold the same
    states, so a request moves between the two with each step's size."""
    mixed = build_runner(checkpoint, replace(CONFIG, model_process="on", model_process_min_rows=2))
    here = build_runner(checkpoint, CONFIG)
    assert isinstance(mixed, ProcessRunner) and isinstance(here, ModelRunner)
    try:
        logits = []
        for runner in (here, mixed):
            a, b = Request(runner, list(range(3, 20))), Request(runner, list(range(30, 41)))
            out = [runner.forward(Batch((a.chunk(17), b.chunk(11)))).logits]  # 2 rows: the model process
            for step in range(3):
                a.token_ids.append(5 + step)
                out.append(runner.forward(Batch((a.chunk(1),))).logits)  # 1 row: here
                b.token_ids.append(9 + step)
                out.append(runner.forward(Batch((b.chunk(1),))).logits)  # 1 row: here
                a.token_ids.append(6 + step)
                b.token_ids.append(7 + step)
                out.append(runner.forward(Batch((a.chunk(1), b.chunk(1)))).logits)  # 2 rows: there
            logits.append(out)
            a.release()
            b.release()
        for x, y in zip(logits[0], logits[1], strict=True):
            torch.testing.assert_close(y, x, rtol=0, atol=1e-5)
        assert (mixed.steps_here, mixed.steps_there) == (6, 4)
        assert mixed.runs_elsewhere(Batch((Request(mixed, [1, 2]).chunk(2),) * 2))
    finally:
        mixed.close()


def test_steps_shared_among_model_processes_give_the_same_logits(checkpoint: Path) -> None:
    """Two model processes: prefill chunks are dealt between them, the decode rows stay together; the
    logits come back in the batch's order and equal the in-process runner's, and the states each one
    wrote are in the pools."""
    shared = build_runner(checkpoint, replace(CONFIG, model_process="on", model_process_min_rows=0,
                                              model_processes=2, model_process_split_min_tokens=2))  # fmt: skip
    here = build_runner(checkpoint, CONFIG)
    assert isinstance(shared, ProcessRunner) and isinstance(here, ModelRunner)
    try:
        assert len({*shared.pids, os.getpid()}) == 3 and shared.describe()["model_processes"] == 2
        for pid in shared.pids:  # one copy of the weights, mapped by both (each built and freed its own)
            assert "/memfd:hybridserve-weights" in Path(f"/proc/{pid}/maps").read_text()
        results = []
        for runner in (here, shared):
            g = torch.Generator().manual_seed(5)
            reqs = [Request(runner, torch.randint(3, 120, (n + 12,), generator=g).tolist()) for n in (13, 2, 7, 9)]
            a, b, c, d = reqs
            # prefills only (dealt: two processes); then a and b decode while c and d prefill their next
            # chunks (a mixed step: decode rows in one process, chunks in the other, logits interleaved);
            # then all four decode (one process: a decode group is never cut)
            out = []
            for chunks in ((a.chunk(13), b.chunk(2)), (c.chunk(7), a.chunk(1), d.chunk(9), b.chunk(1)),
                           (a.chunk(1), c.chunk(5), b.chunk(1), d.chunk(3))):  # fmt: skip
                if isinstance(runner, ProcessRunner):  # even shares, whatever the last step's timing taught
                    runner._split.shares = [0.5, 0.5]
                out.append(runner.forward(Batch(chunks)).logits)
            for _ in range(4):
                out.append(runner.forward(Batch(tuple(r.chunk(1) for r in reqs))).logits)
            # prefill-sized chunks: alone in a step (>= 64 tokens), the first process takes the second's
            # core from its first block; beside decode rows (>= 512 tokens), the chunk's process takes the
            # other's core once that one has finished its rows (if it finishes first)
            e = Request(runner, torch.randint(3, 120, (680,), generator=g).tolist())
            out.append(runner.forward(Batch((e.chunk(80),))).logits)
            if isinstance(runner, ProcessRunner):
                runner._split.shares = [0.5, 0.5]
            out.append(runner.forward(Batch((a.chunk(1), e.chunk(600), b.chunk(1)))).logits)
            reqs.append(e)
            ssm = [layer[1][[r.slot for r in reqs]].clone() for layer in runner.state_pool.layer_states()]
            results.append((out, ssm))
            for r in reqs:
                r.release()
        for x, y in zip(results[0][0], results[1][0], strict=True):
            assert y.shape == x.shape
            torch.testing.assert_close(y, x, rtol=0, atol=1e-5)
        for x, y in zip(results[0][1], results[1][1], strict=True):
            torch.testing.assert_close(y, x, rtol=0, atol=1e-5)
        assert (shared.steps_shared, shared.steps_there) == (4, 9)
        assert shared.lone_parts >= 1  # at least the lone 80-token step
    finally:
        shared.close()


def test_a_dead_second_model_process_replaces_both(checkpoint: Path) -> None:
    """Either process dying takes both down and up again (the survivor may hold a reply nobody reads)."""
    runner = build_runner(checkpoint, replace(CONFIG, model_process="on", model_processes=2))
    assert isinstance(runner, ProcessRunner)
    try:
        before = list(runner.pids)
        assert before[1] is not None
        os.kill(before[1], signal.SIGKILL)
        deadline = time.monotonic() + 10
        while runner.alive:
            assert time.monotonic() < deadline, "a dead second model process still counts as alive"
            time.sleep(0.01)
        seq = Request(runner, list(range(3, 40)))
        assert runner.forward(Batch((seq.chunk(37),))).logits.shape == (1, runner.config.vocab_size)
        assert runner.replaced == 2 and not set(runner.pids) & set(before)
    finally:
        runner.close()
    for pid in runner.pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid or 0, 0)


def test_close_stops_the_child(checkpoint: Path) -> None:
    runner = build_runner(checkpoint, replace(CONFIG, model_process="on"))
    assert isinstance(runner, ProcessRunner) and runner.pid is not None
    pid = runner.pid
    runner.close()
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


def test_where_the_model_runs() -> None:
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert wants_model_process(replace(CONFIG, model_process="on"), cpu)
    assert not wants_model_process(replace(CONFIG, model_process="off"), cpu)
    assert not wants_model_process(replace(CONFIG, model_process="auto"), cuda)  # CUDA keeps it in process
    with pytest.raises(InvalidArgumentError, match="CPU only"):
        wants_model_process(replace(CONFIG, model_process="on"), cuda)
    with pytest.raises(InvalidArgumentError, match="model_process"):
        RunnerConfig(model_process="sometimes")
    with pytest.raises(InvalidArgumentError, match="model_processes must be >= 0"):
        RunnerConfig(model_processes=-1)
    # auto: two processes where two cores are usable, each with its share of the torch threads
    count, child = resolve_processes(RunnerConfig(model_processes=0))
    assert count == (2 if usable_cores() >= 2 else 1)
    assert child.cpu_threads == (max(1, (usable_cores() - 1) // 2) if count == 2 else 0)
    explicit = RunnerConfig(model_processes=3, cpu_threads=4)  # threads as given; a lone step takes them all
    lone = max(12, usable_cores() - 1)
    # threads set by hand also hold decode steps (tuning.decode_threads)
    assert resolve_processes(explicit) == (3, replace(explicit, model_process_lone_threads=lone, cpu_decode_threads=4))


def test_a_served_worker_replaces_its_dead_model_process(tmp_path: Path) -> None:
    """Real processes: `hybridserve worker --model-process on` serves the same greedy tokens as with the
    model in process; once its model process is killed, the worker's liveness turns NOT_SERVING while a
    new one starts, then SERVING, and it serves the same tokens again; a request streaming when the
    process dies ends with an error that says so; SIGTERM still stops it."""
    model = write_model(tmp_path)
    prompt = list(range(5, 40))
    long_prompt = [3 + (i * 7) % 250 for i in range(1300)]  # over the two processes' chunk cap (1,024)
    with ServerProcess(["scheduler", "--port", "0"]) as scheduler:
        common = ["worker", "--model", str(model), "--scheduler", scheduler.address, "--port", "0"]
        with ServerProcess([*common, "--model-process", "off"]) as here:
            expected = serves(here.address, prompt, 8, timeout_s=30)
            expected_long = serves(here.address, long_prompt, 4, timeout_s=60)
            assert "prefill chunks capped" not in here.output  # one process: nothing to share
        split = ["--model-process", "on", "--model-processes", "2", "--model-process-split-min-tokens", "1"]
        with ServerProcess([*common, *split, "--model-process-min-rows", "0"]) as two:
            assert expected is not None and serves(two.address, prompt, 8, timeout_s=30) == expected
            assert re.search(r"model processes \d+, \d+ ready", two.output), two.output
            # the chunk cap on auto: half the step's 2,048 tokens, so a long prompt's chunks leave room
            # for another prompt's in the other process; the same tokens as one uncapped chunk
            assert "prefill chunks capped at 1024 tokens" in two.output, two.output
            assert expected_long is not None and serves(two.address, long_prompt, 4, timeout_s=60) == expected_long
        with ServerProcess([*common, "--model-process", "on", "--model-processes", "1"]) as worker:
            assert expected is not None and serves(worker.address, prompt, 8, timeout_s=30) == expected
            found = re.search(r"model process (\d+) ready", worker.output)
            assert found, worker.output
            os.kill(int(found.group(1)), signal.SIGKILL)
            deadline = time.monotonic() + 10
            while health_check_s(worker.address, "liveness")[1] != health_pb2.HealthCheckResponse.NOT_SERVING:
                assert time.monotonic() < deadline, "liveness did not turn NOT_SERVING"
                time.sleep(0.02)
            deadline = time.monotonic() + 120
            while health_check_s(worker.address, "liveness")[1] != health_pb2.HealthCheckResponse.SERVING:
                assert time.monotonic() < deadline, "the model process was not replaced"
                time.sleep(0.1)
            assert "replaced in" in worker.output, worker.output
            assert serves(worker.address, prompt, 8, timeout_s=60) == expected
            # killed while a request streams: that request fails and says why; the next is served
            with grpc.insecure_channel(worker.address) as channel:
                request = pb.GenerateRequest(
                    prompt_token_ids=pb.TokenIds(ids=prompt),
                    sampling=pb.SamplingParams(max_tokens=1000, ignore_eos=True),
                )
                stream = pb_grpc.GenerationStub(channel).Generate(request, timeout=120)
                next(stream)
                pid = int(re.findall(r"model processes? (\d+)[ ,]", worker.output)[-1])
                os.kill(pid, signal.SIGKILL)
                with pytest.raises(grpc.RpcError) as failed:
                    list(stream)
            assert "model process is gone" in (failed.value.details() or ""), failed.value
            assert serves(worker.address, prompt, 8, timeout_s=120) == expected
            assert worker.stop() == 0


def test_closing_ends_the_kernel_warm_up(checkpoint: Path) -> None:
    """The warm-up thread is no daemon (the interpreter must not end under a oneDNN call), so close()
    must end it promptly, here and in the model process."""
    runner = ModelRunner.from_model_dir(checkpoint, replace(CONFIG, cpu_warm_rows=4096))
    warming = runner._warming
    assert warming is not None and warming.is_alive()
    started = time.monotonic()
    runner.close()
    assert not warming.is_alive() and time.monotonic() - started < 5
    apart = build_runner(checkpoint, replace(CONFIG, model_process="on", cpu_warm_rows=4096))
    assert isinstance(apart, ProcessRunner) and apart.pid is not None
    pid = apart.pid
    apart.close()  # the worker's copy and the child's stop their warm-up and end
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
