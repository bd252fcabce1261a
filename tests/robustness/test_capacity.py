"""256 concurrent streams on one worker process (finding 4): it holds max_num_seqs + max_queue_len
of them (more than the 32 threads its gRPC pool used to have), refuses the rest with
RESOURCE_EXHAUSTED at once, answers health, GetInfo and Abort within a second throughout, and its
pools are free afterwards."""

from __future__ import annotations

import threading
import time

import grpc
import pytest

from hybridserve.v1 import generation_pb2 as pb
from tests.robustness.procs import SERVING, pools_free, text_request, worker

pytestmark = pytest.mark.slow

NUM_STREAMS = 256
MAX_NUM_SEQS, MAX_QUEUE_LEN = 2, 62  # 64 streams held


def test_256_streams_only_resource_exhausted_and_health_answers_throughout(model_dir, scheduler_process):
    client = worker(
        model_dir, scheduler_process.address, "--max-num-seqs", str(MAX_NUM_SEQS), "--max-queue-len", str(MAX_QUEUE_LEN)
    )
    codes: list[grpc.StatusCode] = []
    probe_failures: list[str] = []
    done = threading.Event()
    lock = threading.Lock()

    def stream(i: int) -> None:
        request = text_request(f"{i}:", 6)  # under one 16-token block: nothing stays cached
        request.request_id = f"s{i}"
        try:
            messages = list(client.stub.Generate(request, timeout=120))
            code = grpc.StatusCode.OK if messages[-1].finish_reason == pb.FINISH_REASON_LENGTH else None
        except grpc.RpcError as exc:
            code = exc.code()
        with lock:
            codes.append(code)

    def probe() -> None:  # health, GetInfo and Abort, each within a second, until every stream ended
        while not done.is_set():
            try:
                assert client.status("liveness", timeout_s=1.0) == SERVING
                client.stub.GetInfo(pb.GetInfoRequest(), timeout=1.0)
                try:
                    client.stub.Abort(pb.AbortRequest(request_id="no-such-request"), timeout=1.0)
                except grpc.RpcError as exc:
                    if exc.code() != grpc.StatusCode.NOT_FOUND:
                        raise
            except (grpc.RpcError, AssertionError) as exc:
                probe_failures.append(repr(exc))
            time.sleep(0.05)

    try:
        prober = threading.Thread(target=probe)
        prober.start()
        threads = [threading.Thread(target=stream, args=(i,)) for i in range(NUM_STREAMS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(180)
        done.set()
        prober.join(10)
        assert len(codes) == NUM_STREAMS
        assert set(codes) <= {grpc.StatusCode.OK, grpc.StatusCode.RESOURCE_EXHAUSTED}, set(codes)
        assert codes.count(grpc.StatusCode.OK) >= MAX_NUM_SEQS + MAX_QUEUE_LEN // 2, "held streams were served"
        assert codes.count(grpc.StatusCode.RESOURCE_EXHAUSTED) > 0, "streams beyond the limit were refused"
        assert not probe_failures, probe_failures[:3]
        info = client.info()
        assert pools_free(info), str(info)
    finally:
        done.set()
        client.close()
