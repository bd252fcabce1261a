"""A worker process's health, scheduler outages and drain (findings 5 and 8).

- readiness follows the scheduler: NOT_SERVING while none answers, SERVING again after; liveness
  stays SERVING (an outage makes the worker unready, never dead);
- a request waiting through an outage is served within about a second of the scheduler's return
  (bounded reconnect backoff);
- the give-up time counts once per outage: a request that arrives during it fails with the others;
- SIGTERM drains: readiness NOT_SERVING and new requests UNAVAILABLE at once, requests in flight
  finish (longer than the old fixed 5 s grace), then the process exits 0; past --drain-timeout-s
  the rest end with UNAVAILABLE.
"""

from __future__ import annotations

import signal
import threading
import time

import grpc
import pytest

from hybridserve.children import free_port
from hybridserve.v1 import generation_pb2 as pb
from tests.procs import ServerProcess
from tests.robustness.procs import NOT_SERVING, SERVING, WorkerClient, pools_free, text_request, wait_until, worker

pytestmark = pytest.mark.slow


class Call:
    """One Generate on its own thread: its messages, or its error, and when it ended."""

    def __init__(self, client: WorkerClient, request: pb.GenerateRequest, timeout_s: float = 120.0) -> None:
        self.messages: list[pb.GenerateResponse] = []
        self.error: grpc.RpcError | None = None
        self.started = time.monotonic()
        self.ended = 0.0
        self.first = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(client, request, timeout_s))
        self._thread.start()

    def _run(self, client: WorkerClient, request: pb.GenerateRequest, timeout_s: float) -> None:
        try:
            for message in client.stub.Generate(request, timeout=timeout_s):
                self.messages.append(message)
                self.first.set()
        except grpc.RpcError as exc:
            self.error = exc
        finally:
            self.ended = time.monotonic()
            self.first.set()

    def join(self, timeout_s: float = 120.0) -> Call:
        self._thread.join(timeout_s)
        assert not self._thread.is_alive(), "the call hung"
        return self

    @property
    def num_tokens(self) -> int:
        return sum(len(m.token_ids) for m in self.messages)


def test_an_outage_makes_the_worker_unready_not_dead_and_requests_resume_soon_after(model_dir):
    port = free_port()
    scheduler = ServerProcess(["scheduler", "--port", str(port)])
    client = worker(model_dir, f"127.0.0.1:{port}", "--scheduler-give-up-s", "120")
    try:
        wait_until(lambda: client.status() == SERVING, 10, "ready")
        scheduler.stop(signal.SIGKILL)
        wait_until(lambda: client.status() == NOT_SERVING, 10, "unready without a scheduler")
        assert client.status("liveness") == SERVING
        waiting = Call(client, text_request("def g():", 4))
        time.sleep(4.0)  # gRPC's default reconnect backoff would have grown to seconds by now
        assert waiting.ended == 0.0, "the request waits for the scheduler"
        scheduler = ServerProcess(["scheduler", "--port", str(port)])
        back = time.monotonic()
        waiting.join()
        assert waiting.error is None, waiting.error
        assert waiting.num_tokens == 4
        assert waiting.ended - back < 4.0, f"served {waiting.ended - back:.1f} s after the scheduler came back"
        wait_until(lambda: client.status() == SERVING, 10, "ready again")
    finally:
        client.close()
        scheduler.stop()


def test_the_give_up_time_counts_once_per_outage(model_dir):
    give_up_s = 4.0
    port = free_port()
    scheduler = ServerProcess(["scheduler", "--port", str(port)])
    client = worker(model_dir, f"127.0.0.1:{port}", "--scheduler-give-up-s", str(give_up_s))
    try:
        wait_until(lambda: client.status() == SERVING, 10, "ready")
        scheduler.stop(signal.SIGKILL)
        first = Call(client, text_request("a", 4))
        time.sleep(give_up_s * 0.6)
        second = Call(client, text_request("b", 4))  # arrives while the worker waits for a scheduler
        first.join(), second.join()
        assert first.error is not None and first.error.code() == grpc.StatusCode.UNAVAILABLE
        assert second.error is not None and second.error.code() == grpc.StatusCode.UNAVAILABLE
        assert "no scheduler answered" in second.error.details()
        assert second.ended - second.started < give_up_s, "the second request did not wait a give-up of its own"
        late = Call(client, text_request("c", 4)).join()  # after the give-up: refused at once
        assert late.error is not None and late.error.code() == grpc.StatusCode.UNAVAILABLE
        assert late.ended - late.started < 2.0
        assert client.status() == NOT_SERVING and client.status("liveness") == SERVING
        assert pools_free(client.info())
    finally:
        client.close()
        scheduler.stop()


def test_sigterm_drains_requests_in_flight_longer_than_the_old_grace(model_dir, scheduler_process):
    client = worker(model_dir, scheduler_process.address, "--drain-timeout-s", "90")
    try:
        timed = Call(client, text_request("def timed():", 500)).join()
        per_token_s = (timed.ended - timed.started) / 500
        max_tokens = min(int(15.0 / per_token_s), client.info().max_model_len - 32)  # about 15 s here
        long = Call(client, text_request("def long():", max_tokens))
        assert long.first.wait(30) and long.error is None
        client.process.proc.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        wait_until(lambda: client.status() == NOT_SERVING, 5, "unready once draining")
        assert client.status("liveness") == SERVING
        refused = Call(client, text_request("new", 4)).join()
        assert refused.error is not None and refused.error.code() == grpc.StatusCode.UNAVAILABLE
        assert "shutting down" in refused.error.details()
        long.join()
        assert long.error is None, long.error
        assert long.num_tokens == max_tokens and long.messages[-1].finish_reason == pb.FINISH_REASON_LENGTH
        assert long.ended - signalled > 5.0, "the generation outlasted the old fixed 5 s grace"
        assert client.process.stop(timeout_s=30) == 0
    finally:
        client.close()


def test_past_the_drain_timeout_the_rest_end_with_unavailable(model_dir, scheduler_process):
    client = worker(model_dir, scheduler_process.address, "--drain-timeout-s", "1")
    try:
        limit = client.info().max_model_len
        endless = Call(client, text_request("x", limit - 1))
        assert endless.first.wait(30) and endless.error is None
        client.process.proc.send_signal(signal.SIGTERM)
        endless.join(30)
        assert endless.error is not None and endless.error.code() == grpc.StatusCode.UNAVAILABLE
        assert "shutting down" in endless.error.details()
        assert client.process.stop(timeout_s=30) == 0
    finally:
        client.close()
