"""Hostile inputs against the gateway (HTTP and gRPC) and the lifetimes of calls, real processes: the
fault stack's worker with a gateway in front. A 16 MiB body is refused by size before it is tokenized
while /health keeps answering; calls cancelled at once leave nothing running; a reused request id is
never cut short; edge inputs are clear 400s; one credentials rule and the `liveness` health name on
every server."""

from __future__ import annotations

import gzip
import json
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from hybridserve.grpc_auth import with_bearer
from hybridserve.v1 import generation_pb2 as pb
from hybridserve.v1 import generation_pb2_grpc as pb_grpc
from hybridserve.v1 import scheduler_pb2, scheduler_pb2_grpc
from scheduler_svc.client import SchedulerClient
from scheduler_svc.core import SchedulerConfig
from tests.faults.stack import GATEWAY_KEYS, Stack, greedy, http_health_s, prompts, start_gateway

pytestmark = pytest.mark.slow

KEY, OTHER_KEY = GATEWAY_KEYS
HEALTH_BOUND_S = 1.0  # generous: the target (100 ms p99) is measured by bench/bench_faults.py


@pytest.fixture(scope="module")
def gateway(stack: Stack) -> Iterator[tuple[str, str]]:
    addresses = start_gateway(stack)
    yield addresses
    assert stack.launcher.terminate("gateway") == 0


def post(address: str, path: str, body: bytes | dict[str, Any], headers: dict[str, str] | None = None,
         key: str | None = KEY) -> tuple[int, dict[str, Any]]:  # fmt: skip
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(f"http://{address}{path}", data=data, method="POST")
    request.add_header("Content-Type", "application/json")
    if key is not None:
        request.add_header("Authorization", f"Bearer {key}")
    for name, value in (headers or {}).items():
        request.add_header(name, value)
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read() or b"{}")


def gateway_stub(address: str, key: str | None = KEY) -> tuple[grpc.Channel, pb_grpc.GenerationStub]:
    channel = grpc.insecure_channel(address, options=[("grpc.max_send_message_length", 32 << 20)])
    return channel, pb_grpc.GenerationStub(with_bearer(channel, key))


def health_while(work: list[threading.Thread], address: str) -> list[float]:
    """Starts `work`, then times /health every 20 ms until every thread ended."""
    for t in work:
        t.start()
    times = []
    while any(t.is_alive() for t in work) or not times:
        times.append(http_health_s(address))
        time.sleep(0.02)
    for t in work:
        t.join()
    return times


# ---- 1. a 16 MiB body ----------------------------------------------------------------------------------


BIG_BODIES = {
    "16 MiB text prompt": json.dumps({"model": "tiny", "prompt": "p" * (16 << 20)}).encode(),
    "16 MiB of token ids": ('{"model": "tiny", "prompt": [' + "7," * (8 << 20) + "7]}").encode(),
    "16 MiB of nested lists": ('{"model": "tiny", "prompt": [' + "[]," * (5 << 20) + "[]]}").encode(),
    "16 MiB chat message": json.dumps(
        {"model": "tiny", "messages": [{"role": "user", "content": "c" * (16 << 20)}]}
    ).encode(),  # fmt: skip
}


@pytest.mark.parametrize("name", sorted(BIG_BODIES))
def test_a_16_mib_body_is_refused_while_health_answers(gateway, name):
    http, _ = gateway
    path = "/v1/chat/completions" if "chat" in name else "/v1/completions"
    answers: list[tuple[int, dict[str, Any]]] = []
    senders = [threading.Thread(target=lambda: answers.append(post(http, path, BIG_BODIES[name]))) for _ in range(2)]
    times = health_while(senders, http)
    assert max(times) < HEALTH_BOUND_S, times
    assert len(answers) == 2
    for status, body in answers:
        assert status == 400, body
        if "text" in name or "chat" in name:
            assert "at most" in body["error"]["message"] and "tokens" in body["error"]["message"], body


def test_a_16_mib_tokenize_body_is_refused_while_health_answers(gateway):
    """/tokenize reads its body and sizes its text as the generation routes do."""
    http, _ = gateway
    body = json.dumps({"prompt": "t" * (16 << 20)}).encode()
    answers: list[tuple[int, dict[str, Any]]] = []
    times = health_while([threading.Thread(target=lambda: answers.append(post(http, "/tokenize", body)))], http)
    assert max(times) < HEALTH_BOUND_S, times
    assert [status for status, _ in answers] == [400], answers
    assert "at most" in answers[0][1]["error"]["message"], answers


def test_a_4_mib_grpc_prompt_is_refused_by_size_while_health_answers(gateway):
    http, address = gateway
    channel, stub = gateway_stub(address)
    codes: list[tuple[grpc.StatusCode, str]] = []

    def send() -> None:
        request = pb.GenerateRequest(prompt="g" * ((39 << 20) // 10), sampling=pb.SamplingParams(max_tokens=2))
        try:
            list(stub.Generate(request, timeout=60))
            codes.append((grpc.StatusCode.OK, ""))
        except grpc.RpcError as err:
            codes.append((err.code(), err.details() or ""))

    with channel:
        times = health_while([threading.Thread(target=send) for _ in range(2)], http)
    assert max(times) < HEALTH_BOUND_S, times
    assert [c for c, _ in codes] == [grpc.StatusCode.INVALID_ARGUMENT] * 2, codes
    assert "at most" in codes[0][1] and "tokens" in codes[0][1], codes


# ---- 2. cancelled calls leave nothing running ----------------------------------------------------------


def cancel_many(stub: pb_grpc.GenerationStub, delays_s: tuple[float, ...], count: int) -> None:
    """`count` long Generate calls, each cancelled `delay` after it starts (the delays in turn)."""
    request = greedy(prompts(1, length=12, seed=5)[0], 1500)
    for i in range(count):
        call = stub.Generate(request, timeout=60)
        delay = delays_s[i % len(delays_s)]
        if delay:
            time.sleep(delay)
        call.cancel()


def nothing_left(stack: Stack, timeout_s: float = 15.0) -> pb.GetInfoResponse:
    info = stack.wait_quiet(timeout_s)
    assert info.num_running == 0 and info.num_waiting == 0, (info.num_running, info.num_waiting)
    return info


@pytest.mark.parametrize("through", ["worker", "gateway"])
def test_calls_cancelled_at_0_10_and_20_ms_leave_no_request_running(stack, gateway, through):
    assert max_model_len(stack) > 1500 + 12
    if through == "worker":
        with grpc.insecure_channel(stack.worker_address) as channel:
            cancel_many(pb_grpc.GenerationStub(channel), (0.0, 0.01, 0.02), 100)
    else:
        channel, stub = gateway_stub(gateway[1])
        with channel:
            cancel_many(stub, (0.0, 0.01, 0.02), 100)
    time.sleep(0.5)  # the last cancels reach the worker
    nothing_left(stack)


def max_model_len(stack: Stack) -> int:
    return int(stack.info().max_model_len)


# ---- 3. request ids ------------------------------------------------------------------------------------


def test_a_request_id_reused_150_times_is_never_cut_short(stack, gateway):
    """Six clients, each reusing its own id 25 times, each request sent right after the last one ended."""
    cut: list[tuple[str, int, str, int]] = []

    def reuse(request_id: str) -> None:
        channel, stub = gateway_stub(gateway[1])
        request = greedy(prompts(1, length=10, seed=6)[0], 2)
        request.request_id = request_id
        with channel:
            for i in range(25):
                messages = list(stub.Generate(request, timeout=30))
                tokens = [t for m in messages for t in m.token_ids]
                if messages[-1].finish_reason != pb.FINISH_REASON_LENGTH or len(tokens) != 2:
                    cut.append((request_id, i, pb.FinishReason.Name(messages[-1].finish_reason), len(tokens)))

    clients = [threading.Thread(target=reuse, args=(f"reused-{k}",)) for k in range(6)]
    for t in clients:
        t.start()
    for t in clients:
        t.join(120)
    assert not cut, cut
    nothing_left(stack)


def test_a_refused_duplicate_leaves_the_original_abortable_by_its_creator_only(stack, gateway):
    channel, stub = gateway_stub(gateway[1])
    other_channel, other = gateway_stub(gateway[1], OTHER_KEY)
    request = greedy(prompts(1, length=10, seed=7)[0], 1500)
    request.request_id = "held-id"
    with channel, other_channel:
        original = stub.Generate(request, timeout=60)
        first = next(original)  # it runs
        assert first.finish_reason == pb.FINISH_REASON_UNSPECIFIED
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Generate(request, timeout=30))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "already in use" in err.value.details()
        with pytest.raises(grpc.RpcError) as err:  # another key: as if it did not exist
            other.Abort(pb.AbortRequest(request_id="held-id"), timeout=10)
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
        stub.Abort(pb.AbortRequest(request_id="held-id"), timeout=10)  # the creator's key: the route is intact
        rest = list(original)
        assert rest and rest[-1].finish_reason == pb.FINISH_REASON_ABORT
    nothing_left(stack)


# ---- 4. edge inputs ------------------------------------------------------------------------------------


def completion(http: str, **fields: Any) -> tuple[int, dict[str, Any]]:
    body = {"model": "tiny", "prompt": "edge inputs", "max_tokens": 6, "ignore_eos": True, **fields}
    return post(http, "/v1/completions", body)


@pytest.mark.parametrize("temperature", [1e-38, 1e-40, 1e-45, 5e-6])
def test_a_temperature_below_1e_5_is_greedy_over_http(gateway, temperature):
    status, greedy_body = completion(gateway[0], temperature=0)
    assert status == 200, greedy_body
    status, body = completion(gateway[0], temperature=temperature)
    assert status == 200, body
    assert body["choices"][0]["text"] == greedy_body["choices"][0]["text"] != ""


@pytest.mark.parametrize("temperature", [1e-38, 1e-45])
def test_a_temperature_below_1e_5_is_greedy_on_the_worker(stack, temperature):
    request = greedy(prompts(1, length=10, seed=8)[0], 8)
    with grpc.insecure_channel(stack.worker_address) as channel:
        stub = pb_grpc.GenerationStub(channel)
        reference = [t for m in stub.Generate(request, timeout=30) for t in m.token_ids]
        request.sampling.temperature = temperature
        tokens = [t for m in stub.Generate(request, timeout=30) for t in m.token_ids]
    assert tokens == reference and set(tokens) != {0}


def test_a_temperature_that_overflows_is_refused(stack, gateway):
    status, body = completion(gateway[0], temperature=1e39)
    assert status == 400 and body["error"]["param"] == "temperature", body
    request = greedy(prompts(1, length=10, seed=8)[0], 2)
    request.sampling.temperature = 1e39  # a float on the wire: +inf
    with grpc.insecure_channel(stack.worker_address) as channel, pytest.raises(grpc.RpcError) as err:
        list(pb_grpc.GenerationStub(channel).Generate(request, timeout=30))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "temperature" in err.value.details()


@pytest.mark.parametrize("depth", [33, 10_000])
def test_json_nested_too_deep_is_a_400(gateway, depth):
    raw = ('{"model": "tiny", "prompt": "x", "user": ' + "[" * depth + "]" * depth + "}").encode()
    status, body = post(gateway[0], "/v1/completions", raw)
    assert status == 400 and "deeper than 32" in body["error"]["message"], body


LONE_SURROGATES = {
    "prompt": ("/v1/completions", '{"model": "tiny", "prompt": "a\\ud800b"}'),
    "stop": ("/v1/completions", '{"model": "tiny", "prompt": "ab", "stop": ["\\udfff"]}'),
    "messages[0].content": ("/v1/chat/completions", '{"model": "tiny", "messages": [{"role": "user", "content": "\\ud83d"}]}'),  # noqa: E501
    "messages[0].content.text": ("/v1/chat/completions", '{"model": "tiny", "messages": [{"role": "user", "content": [{"type": "text", "text": "\\udc00"}]}]}'),  # noqa: E501
}  # fmt: skip


@pytest.mark.parametrize("field", sorted(LONE_SURROGATES))
def test_a_lone_surrogate_is_a_400_naming_the_field(gateway, field):
    path, raw = LONE_SURROGATES[field]
    status, body = post(gateway[0], path, raw.encode())
    assert status == 400 and body["error"]["param"] == field, body
    assert "surrogate" in body["error"]["message"]


def test_a_body_marked_gzip_that_is_not_gzip_is_a_400(gateway):
    status, body = post(gateway[0], "/v1/completions", b'{"model": "tiny"}', {"Content-Encoding": "gzip"})
    assert status == 400 and body["error"]["code"] == "invalid_encoding", body
    real = gzip.compress(json.dumps({"model": "tiny", "prompt": "zipped", "max_tokens": 2}).encode())
    status, body = post(gateway[0], "/v1/completions", real, {"Content-Encoding": "gzip"})
    assert status == 200, body


# ---- 5. credentials and health names -------------------------------------------------------------------


def test_a_wrong_or_missing_key_is_unauthenticated_on_both_gateway_ports(gateway):
    http, address = gateway
    for key in (None, "not-a-key"):
        status, body = post(http, "/v1/completions", {"model": "tiny", "prompt": "x"}, key=key)
        assert status == 401, body
        channel, stub = gateway_stub(address, key)
        with channel, pytest.raises(grpc.RpcError) as err:
            stub.GetInfo(pb.GetInfoRequest(), timeout=10)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_every_server_reports_liveness_and_readiness(stack, gateway):
    addresses = [gateway[1], stack.worker_address, stack.cache_address, f"127.0.0.1:{stack.ports['scheduler']}"]
    for address in addresses:
        with grpc.insecure_channel(address) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            for name in ("liveness", "readiness"):
                status = health.Check(health_pb2.HealthCheckRequest(service=name), timeout=10).status
                assert status == health_pb2.HealthCheckResponse.SERVING, (address, name)


CONFIG = SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=4, block_size=16, mamba_block_size=16,
                         kv_page_size=16)  # fmt: skip


def test_a_scheduler_with_the_cluster_token_refuses_calls_without_it(stack):
    address = stack.launcher.scheduler(0, env={"HYBRIDSERVE_CLUSTER_TOKEN": "sched-token"}, name="guarded-scheduler")
    try:
        config = scheduler_pb2.SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=4, block_size=16,
                                               mamba_block_size=16, kv_page_size=16)  # fmt: skip
        for token in (None, "wrong-token"):
            with grpc.insecure_channel(address) as channel:
                stub = scheduler_pb2_grpc.SchedulerStub(with_bearer(channel, token))
                with pytest.raises(grpc.RpcError) as err:
                    stub.ValidateConfig(config, timeout=10)
                assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        client = SchedulerClient([address], token="sched-token")  # as the worker sends it
        try:
            assert client.validate_config(CONFIG) is not None
        finally:
            client.close()
    finally:
        stack.launcher.terminate("guarded-scheduler")
