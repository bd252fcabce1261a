"""Ready means warm (gpu_worker.runner.warmup, gpu_worker.api.lifecycle). Real processes: a worker with the
decode compile on reports readiness NOT_SERVING and liveness SERVING while it warms up, and SERVING after;
every warm-up part ended before readiness turned SERVING and nothing compiles afterwards; a request sent
while it warms waits and is served; --serve-while-warming is ready at once. In process: the warm-up steps
give the pools back as they found them."""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gpu_worker.runner.runner import ModelRunner
from gpu_worker.runner.settings import RunnerConfig
from gpu_worker.runner.warmup import DECODE_BATCH_SIZES, PREFILL_TOKENS, scratch_steps
from hybridserve.v1 import generation_pb2 as pb
from hybridserve.v1 import generation_pb2_grpc as pb_grpc
from hybridserve_cli import health
from tests.procs import ServerProcess

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
# The compile on, in one model process (the served default's path; its status comes back in replies), a
# small kernel warm-up: every part runs, in as little time as it can. The checkpoint's Mamba shapes are
# tests/model's, whose compile test fills the inductor cache this worker then reads.
WARM_FLAGS = (
    "--device", "cpu", "--decode-compile", "on", "--model-process", "on", "--model-processes", "1",
    "--cpu-warm-rows", "64", "--memory-budget-mb", "16", "--max-num-seqs", "4", "--no-prefix-caching",
)  # fmt: skip
PROMPT = list(range(5, 40))
WARM_UP_TIMEOUT_S = 300.0  # a cold inductor cache on a busy 2-core machine


@pytest.fixture(scope="module")
def scheduler() -> Iterator[ServerProcess]:
    with ServerProcess(["scheduler", "--port", "0"]) as proc:
        yield proc


def worker_command(checkpoint: Path, scheduler: ServerProcess, *extra: str) -> list[str]:
    return ["worker", "--model", str(checkpoint), "--scheduler", scheduler.address, "--port", "0", *WARM_FLAGS, *extra]


def probe(channel: grpc.Channel) -> tuple[int, int, pb.GetInfoResponse]:
    """(readiness, liveness, GetInfo) of a worker, now."""
    health = health_pb2_grpc.HealthStub(channel)
    readiness = health.Check(health_pb2.HealthCheckRequest(service="readiness"), timeout=5).status
    liveness = health.Check(health_pb2.HealthCheckRequest(service="liveness"), timeout=5).status
    return readiness, liveness, pb_grpc.GenerationStub(channel).GetInfo(pb.GetInfoRequest(), timeout=5)


def generate_s(channel: grpc.Channel, max_tokens: int = 4) -> tuple[float, list[int]]:
    """(seconds, tokens) of one greedy request."""
    request = pb.GenerateRequest(
        prompt_token_ids=pb.TokenIds(ids=PROMPT), sampling=pb.SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    )
    started = time.monotonic()
    stream = pb_grpc.GenerationStub(channel).Generate(request, timeout=WARM_UP_TIMEOUT_S)
    tokens = [t for m in stream for t in m.token_ids]
    return time.monotonic() - started, tokens


def line_index(lines: list[str], text: str) -> int:
    found = [i for i, line in enumerate(lines) if text in line]
    assert found, f"no {text!r} line in the worker's log:\n" + "\n".join(lines)
    return found[-1]


def test_ready_means_warm(checkpoint: Path, scheduler: ServerProcess) -> None:
    with ServerProcess(worker_command(checkpoint, scheduler), timeout_s=120) as worker:
        channel = grpc.insecure_channel(worker.address)
        early: list[tuple[float, list[int]]] = []
        sent = threading.Thread(target=lambda: early.append(generate_s(channel)))
        sent.start()  # a request while the worker warms up waits for it
        warming = []
        deadline = time.monotonic() + WARM_UP_TIMEOUT_S
        while (seen := probe(channel))[0] != SERVING:
            if not warming:  # `hybridserve health`, the containers' probe, says the same
                assert health.check(worker.address, "liveness", 5)[0]
                serving, said = health.check(worker.address, "readiness", 5)
                assert not serving and "NOT_SERVING" in said, said
            warming.append((seen[0], seen[1], seen[2].warmup_state))
            assert time.monotonic() < deadline, "readiness did not turn SERVING"
            time.sleep(0.05)
        ready_unix_s = time.time()
        info = seen[2]
        assert health.check(worker.address, "readiness", 5)[0]
        assert warming, "readiness was SERVING at once, before the decode compile could have ended"
        assert warming[0][2] == "warming" and all(r == NOT_SERVING and live == SERVING for r, live, _ in warming)
        assert {state for _, _, state in warming} <= {"warming", "warm"}, warming  # warm, then ready

        # every part ran and ended before readiness turned SERVING; the compiled decode is attached
        assert info.warmup_state == "warm" and info.decode_compile == "attached", info
        assert info.warmup_compile_seconds > 0 and info.warmup_kernels_seconds > 0 and info.warmup_steps_seconds > 0
        assert 0 < info.warmup_done_unix_seconds <= ready_unix_s and info.warmup_seconds > 0, info
        lines = list(worker.lines)
        ready_line = line_index(lines, "readiness SERVING")
        for part in ("compiled the Mamba decode step in", "built oneDNN projection kernels", "warm in"):
            assert line_index(lines, part) < ready_line, part

        sent.join(WARM_UP_TIMEOUT_S)
        assert early and len(early[0][1]) == 4, "the request sent while warming was not served"
        # the first request after readiness costs about what the later ones do: nothing left to build
        first_s, tokens = generate_s(channel)
        later_s = [generate_s(channel)[0] for _ in range(4)]
        assert len(tokens) == 4 and first_s <= max(1.0, 3 * statistics.median(later_s)), (first_s, later_s)
        after = probe(channel)[2]
        assert after.decode_compile == "attached" and after.warmup_done_unix_seconds == info.warmup_done_unix_seconds
        lines = list(worker.lines)
        assert sum("compiled the Mamba decode step" in line for line in lines) == 1, "one model process compiles once"
        assert not any("compil" in line for line in lines[ready_line:]), lines[ready_line:]
        channel.close()
        assert worker.stop() == 0


def test_serve_while_warming_is_ready_at_once(checkpoint: Path, scheduler: ServerProcess) -> None:
    command = worker_command(checkpoint, scheduler, "--serve-while-warming", "--model-process", "off")  # a faster start
    with ServerProcess(command, timeout_s=120) as worker:
        with grpc.insecure_channel(worker.address) as channel:
            readiness, liveness, info = probe(channel)
            assert (readiness, liveness) == (SERVING, SERVING)
            assert info.warmup_state == "serving while warming" and info.warmup_seconds == 0, info
            assert len(generate_s(channel)[1]) == 4  # served, eagerly until the compile is attached
        assert "warming up" not in worker.output
        assert worker.stop() == 0


def test_warm_up_steps_give_the_pools_back(checkpoint: Path) -> None:
    config = RunnerConfig(
        memory_budget_bytes=8 << 20, kv_page_size_tokens=4, max_num_seqs=3, num_checkpoint_slots=2, device="cpu",
        dtype="float32",
    )  # fmt: skip
    runner = ModelRunner.from_model_dir(checkpoint, config)
    kv, state = runner.kv_pool, runner.state_pool
    first_pages, first_slot = kv.allocate(2), state.allocate_slot()  # what the next request would get
    kv.free(first_pages)
    state.free_slot(first_slot)
    with scratch_steps(kv, state, runner.config.vocab_size) as steps:
        prefill, *decodes = steps
        assert [len(s.token_ids) for s in prefill.sequences] == [PREFILL_TOKENS]
        assert [len(b.sequences) for b in decodes] == [b for b in DECODE_BATCH_SIZES if b <= 3]
        assert all(len(s.token_ids) == 1 for b in decodes for s in b.sequences)
        assert state.num_free_slots == 1
    assert (kv.num_free_pages, state.num_free_slots) == (kv.num_pages, state.num_slots)
    assert kv.allocate(2) == first_pages and state.allocate_slot() == first_slot
    times = runner.warm_up()
    assert times.steps_s > 0 and times.compile_status == "off" and times.compile_s == 0
    three_pages = runner.state_bytes_per_request * 5 + 3 * 4 * runner.kv_bytes_per_token
    tiny = ModelRunner.from_model_dir(checkpoint, replace(config, memory_budget_bytes=three_pages))
    assert tiny.kv_pool.num_pages == 3
    with scratch_steps(tiny.kv_pool, tiny.state_pool, 10) as steps:  # a small pool: a shorter prefill
        assert [s.token_ids for s in steps[0].sequences] == [tuple(range(7))]  # then decodes at 7 (2 pages) and 0
        assert all(len(s.page_ids) * 4 >= s.start_pos + len(s.token_ids) for b in steps for s in b.sequences)
        assert tiny.kv_pool.num_free_pages == 0
    runner.close()
    tiny.close()


def test_a_stop_while_warming_up_is_prompt(checkpoint: Path, scheduler: ServerProcess, tmp_path: Path) -> None:
    """SIGTERM during the warm-up (a cold inductor cache: the compile has seconds to go) ends the worker
    and its model process at once, without waiting for the compile or calling it a failure."""
    env = {"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}
    with ServerProcess(worker_command(checkpoint, scheduler), timeout_s=120, env=env) as worker:
        with grpc.insecure_channel(worker.address) as channel:
            readiness, liveness, info = probe(channel)
        assert (readiness, liveness, info.warmup_state) == (NOT_SERVING, SERVING, "warming")
        started = time.monotonic()
        assert worker.stop() == 0
        assert time.monotonic() - started < 10, worker.output
    assert "warm-up ended by the stop" in worker.output and "Traceback" not in worker.output, worker.output
