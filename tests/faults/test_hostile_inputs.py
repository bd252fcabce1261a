"""About a hundred hostile inputs against the three services' gRPC APIs (Generation on the worker,
Scheduler.PlanStep, BlockCache), real processes: random bytes as messages (raw, through a generic
call), bad UTF-8, huge and odd fields, non-finite numbers, duplicate request ids at once. None may get
INTERNAL or UNKNOWN, hang past its deadline or end a process; a normal request is served after each."""

from __future__ import annotations

import hashlib
import math
import threading
from collections.abc import Callable

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hybridserve.v1 import cache_pb2, cache_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc
from hybridserve.v1 import generation_pb2 as gen_pb
from hybridserve.v1 import generation_pb2_grpc as gen_grpc
from tests.faults.stack import Stack, greedy, prompts, serves

pytestmark = pytest.mark.slow

TIMEOUT_S = 30.0
NEVER = {grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN, grpc.StatusCode.DEADLINE_EXCEEDED}
INT64_MAX, INT64_MIN = 2**63 - 1, -(2**63)
FP = "c" * 64
METHODS = {
    "generate": ("/hybridserve.v1.Generation/Generate", True),
    "abort": ("/hybridserve.v1.Generation/Abort", False),
    "get_info": ("/hybridserve.v1.Generation/GetInfo", False),
    "plan_step": ("/hybridserve.v1.Scheduler/PlanStep", False),
    "validate_config": ("/hybridserve.v1.Scheduler/ValidateConfig", False),
    "lookup": ("/hybridserve.v1.BlockCache/Lookup", False),
    "publish": ("/hybridserve.v1.BlockCache/Publish", False),
    "fetch": ("/hybridserve.v1.BlockCache/Fetch", True),
}
SERVICE_OF = {
    "generate": "worker", "abort": "worker", "get_info": "worker", "plan_step": "scheduler",
    "validate_config": "scheduler", "lookup": "cache", "publish": "cache", "fetch": "cache",
}  # fmt: skip


def address(stack: Stack, service: str) -> str:
    return f"127.0.0.1:{stack.ports[service]}"


def raw_call(stack: Stack, method: str, payload: bytes) -> grpc.StatusCode:
    """The status of one call with `payload` as the request's bytes (a stream is read to its end)."""
    path, streaming = METHODS[method]
    service = SERVICE_OF[method]
    opened = stack.cache_channel() if service == "cache" else grpc.insecure_channel(address(stack, service))
    with opened as channel:
        try:
            if streaming:
                for _ in channel.unary_stream(path)(payload, timeout=TIMEOUT_S):
                    pass
            else:
                channel.unary_unary(path)(payload, timeout=TIMEOUT_S)
        except grpc.RpcError as err:
            return err.code()
    return grpc.StatusCode.OK


def status_of(call: Callable[[], object]) -> tuple[grpc.StatusCode, str]:
    try:
        result = call()
        if hasattr(result, "__iter__") and not isinstance(result, bytes | str):
            for _ in result:  # type: ignore[union-attr]
                pass
    except grpc.RpcError as err:
        return err.code(), err.details() or ""
    return grpc.StatusCode.OK, ""


def assert_all_serve(stack: Stack) -> None:
    """No process ended, and each service answers a normal request."""
    for name, proc in stack.procs.items():
        assert proc.is_running(), f"{name} ended: {proc.output[-2000:]}"
    assert serves(stack.worker_address, prompts(1, length=20, seed=3)[0], 4, timeout_s=30) is not None
    with grpc.insecure_channel(address(stack, "scheduler")) as channel:
        scheduler_pb2_grpc.SchedulerStub(channel).ValidateConfig(
            scheduler_pb2.SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=4, block_size=16,
                                          mamba_block_size=8, kv_page_size=4, mamba_cache_mode=1),
            timeout=10,
        )  # fmt: skip
    with stack.cache_channel() as channel:
        cache_pb2_grpc.BlockCacheStub(channel).Lookup(
            cache_pb2.LookupRequest(model_fingerprint=FP, block_hashes=[b"x" * 32]), timeout=10
        )


# ---- random bytes as messages -----------------------------------------------------------------------


@settings(max_examples=24, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(method=st.sampled_from(sorted(METHODS)), payload=st.binary(max_size=256))
def test_random_bytes_as_any_message(stack, method, payload):
    assert raw_call(stack, method, payload) not in NEVER


def test_random_bytes_then_every_service_serves(stack):
    assert_all_serve(stack)


def _field(number: int, wire_type: int, body: bytes) -> bytes:
    """One protobuf field, hand-encoded (so strings can carry bytes that are not UTF-8)."""
    tag = _varint(number << 3 | wire_type)
    return tag + (_varint(len(body)) + body if wire_type == 2 else body)


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


BAD_UTF8 = b"\xff\xfe\xc3\x28 not utf-8 \xed\xa0\x80"
BAD_UTF8_CASES = {
    "generate request_id": ("generate", _field(1, 2, BAD_UTF8) + _field(2, 2, b"hello")),
    "generate prompt": ("generate", _field(2, 2, BAD_UTF8)),
    "generate stop": ("generate", _field(2, 2, b"hi") + _field(4, 2, _field(6, 2, BAD_UTF8))),
    "abort request_id": ("abort", _field(1, 2, BAD_UTF8)),
    "plan_step request_id": (
        "plan_step",
        _field(
            1,
            2,
            _field(1, 0, _varint(64)) + _field(2, 0, _varint(4)) + _field(5, 0, _varint(16)) + _field(8, 0, _varint(4)),
        )
        + _field(3, 2, _field(1, 2, BAD_UTF8) + _field(2, 0, _varint(10)) + _field(5, 0, _varint(4))),
    ),  # fmt: skip
    "lookup fingerprint": ("lookup", _field(1, 2, BAD_UTF8) + _field(2, 2, b"h" * 32)),
    "publish fingerprint": ("publish", _field(1, 2, BAD_UTF8) + _field(2, 2, b"h" * 32) + _field(5, 2, b"data")),
    "fetch fingerprint": ("fetch", _field(1, 2, BAD_UTF8) + _field(2, 2, b"h" * 32)),
    "truncated length": ("generate", b"\x12\xff\xff\xff\x0f" + b"x" * 8),
    "unknown fields only": ("plan_step", _field(99, 2, b"?" * 100) + _field(100, 0, _varint(7))),
}


@pytest.mark.parametrize("name", sorted(BAD_UTF8_CASES))
def test_bad_utf8_and_malformed_wire_is_invalid_argument(stack, name):
    method, payload = BAD_UTF8_CASES[name]
    code = raw_call(stack, method, payload)
    assert code not in NEVER
    if name != "unknown fields only":
        assert code == grpc.StatusCode.INVALID_ARGUMENT, code


def test_bad_bytes_then_every_service_serves(stack):
    assert_all_serve(stack)


# ---- Generation: odd and huge fields, non-finite numbers ----------------------------------------------


def sampling(**fields: object) -> gen_pb.GenerateRequest:
    params = gen_pb.SamplingParams(max_tokens=4, ignore_eos=True)
    for name, value in fields.items():
        if name == "stop":
            params.stop.extend(value)  # type: ignore[arg-type]
        else:
            setattr(params, name, value)
    return gen_pb.GenerateRequest(prompt="hostile", sampling=params)


SHORT = gen_pb.SamplingParams(max_tokens=2)
NON_FINITE_SAMPLING = {
    "temperature nan": sampling(temperature=math.nan),
    "temperature +inf": sampling(temperature=math.inf),
    "temperature -inf": sampling(temperature=-math.inf),
    "top_p nan": sampling(top_p=math.nan),
    "top_p +inf": sampling(top_p=math.inf),
    "top_p -inf": sampling(top_p=-math.inf),
}
ODD_GENERATION = {
    "temperature negative": sampling(temperature=-1.0),
    "temperature huge": sampling(temperature=3.0e38),
    "top_p zero": sampling(top_p=0.0),
    "top_p above one": sampling(top_p=1.5),
    "top_k negative": sampling(top_k=-1),
    "top_k int64 max": sampling(top_k=INT64_MAX),
    "max_tokens negative": sampling(max_tokens=-1),
    "max_tokens int64 min": sampling(max_tokens=INT64_MIN),
    "max_tokens int64 max": sampling(max_tokens=INT64_MAX),
    "logprobs negative": sampling(logprobs=-1),
    "logprobs huge": sampling(logprobs=INT64_MAX),
    "seed int64 min": sampling(seed=INT64_MIN),
    "seed int64 max": sampling(seed=INT64_MAX),
    "empty stop string": sampling(stop=[""]),
    "a 1 MB stop string": sampling(stop=["s" * (1 << 20)]),
    "20000 stop strings": sampling(stop=[f"stop-{i}" for i in range(20000)]),
    "no sampling at all": gen_pb.GenerateRequest(prompt="hostile"),
    "no prompt": gen_pb.GenerateRequest(sampling=gen_pb.SamplingParams(max_tokens=4)),
    "empty text prompt": gen_pb.GenerateRequest(prompt="", sampling=gen_pb.SamplingParams(max_tokens=4)),
    "a 2 MB text prompt": gen_pb.GenerateRequest(prompt="p" * (2 << 20), sampling=gen_pb.SamplingParams(max_tokens=4)),
    "odd unicode prompt": gen_pb.GenerateRequest(
        prompt="\x00\u202e\ufeff\U0010ffff\u0301" * 8, sampling=gen_pb.SamplingParams(max_tokens=4, ignore_eos=True)
    ),
    "empty token ids": gen_pb.GenerateRequest(prompt_token_ids=gen_pb.TokenIds(ids=[])),
    "negative token id": gen_pb.GenerateRequest(prompt_token_ids=gen_pb.TokenIds(ids=[5, -1])),
    "token id beyond the vocabulary": gen_pb.GenerateRequest(prompt_token_ids=gen_pb.TokenIds(ids=[5, 2**31 - 1])),
    "200000 token ids": gen_pb.GenerateRequest(prompt_token_ids=gen_pb.TokenIds(ids=[7] * 200_000)),
    "a 1 MB request id": gen_pb.GenerateRequest(request_id="r" * (1 << 20), prompt="hostile"),
    "priority int64 min": gen_pb.GenerateRequest(prompt="hostile", priority=INT64_MIN, sampling=SHORT),
    "priority int64 max": gen_pb.GenerateRequest(prompt="hostile", priority=INT64_MAX, sampling=SHORT),
}  # fmt: skip


def generate_status(stack: Stack, request: gen_pb.GenerateRequest) -> tuple[grpc.StatusCode, str]:
    with grpc.insecure_channel(stack.worker_address) as channel:
        stub = gen_grpc.GenerationStub(channel)
        return status_of(lambda: stub.Generate(request, timeout=TIMEOUT_S))


@pytest.mark.parametrize("name", sorted(NON_FINITE_SAMPLING))
def test_non_finite_sampling_values_are_invalid_argument(stack, name):
    code, details = generate_status(stack, NON_FINITE_SAMPLING[name])
    assert code == grpc.StatusCode.INVALID_ARGUMENT, (code, details)
    assert "temperature" in details or "top_p" in details, details


@pytest.mark.parametrize("name", sorted(ODD_GENERATION))
def test_odd_generation_fields_get_a_clear_answer(stack, name):
    code, details = generate_status(stack, ODD_GENERATION[name])
    assert code not in NEVER, (code, details)
    assert code == grpc.StatusCode.OK or details, "a refusal says what to change"


def test_abort_of_odd_ids_is_not_found(stack):
    with grpc.insecure_channel(stack.worker_address) as channel:
        stub = gen_grpc.GenerationStub(channel)
        for request_id in ("", "nobody", "r" * (1 << 20), "\u202e\x00"):
            code, _ = status_of(lambda rid=request_id: stub.Abort(gen_pb.AbortRequest(request_id=rid), timeout=10))
            assert code in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.INVALID_ARGUMENT), code


def test_one_request_id_sent_16_times_at_once(stack):
    """One of them runs; the others are refused with a clear status; none is lost or hangs."""
    request = greedy(prompts(1, length=24, seed=9)[0], 24)
    request.request_id = "the-same-id"
    codes: list[grpc.StatusCode] = []
    with grpc.insecure_channel(stack.worker_address) as channel:
        stub = gen_grpc.GenerationStub(channel)

        def call() -> None:
            codes.append(status_of(lambda: stub.Generate(request, timeout=TIMEOUT_S))[0])

        threads = [threading.Thread(target=call) for _ in range(16)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(TIMEOUT_S + 10)
    assert len(codes) == 16
    assert not set(codes) & NEVER, codes
    assert codes.count(grpc.StatusCode.OK) >= 1
    assert set(codes) <= {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.ALREADY_EXISTS}


def test_odd_generation_then_every_service_serves(stack):
    assert_all_serve(stack)


# ---- Scheduler.PlanStep: odd fields --------------------------------------------------------------------


def plan_request(**config_fields: int) -> scheduler_pb2.PlanStepRequest:
    config = dict(max_num_batched_tokens=64, max_num_seqs=4, block_size=16, mamba_block_size=8, kv_page_size=4,
                  mamba_cache_mode=1)  # fmt: skip
    config.update(config_fields)
    return scheduler_pb2.PlanStepRequest(config=scheduler_pb2.SchedulerConfig(**config), num_free_kv_pages=100)


def with_waiting(
    msg: scheduler_pb2.PlanStepRequest, *states: scheduler_pb2.RequestState
) -> scheduler_pb2.PlanStepRequest:
    msg.waiting.extend(states)
    return msg


def waiting(request_id: str = "w", **fields: object) -> scheduler_pb2.RequestState:
    values: dict[str, object] = dict(request_id=request_id, num_prompt_tokens=40, max_tokens=8)
    values.update(fields)
    return scheduler_pb2.RequestState(**values)  # type: ignore[arg-type]


ODD_PLAN_STEPS = {
    "arrival nan": with_waiting(plan_request(), waiting(arrival_time=math.nan)),
    "arrival +inf": with_waiting(plan_request(), waiting(arrival_time=math.inf)),
    "arrival -inf": with_waiting(plan_request(), waiting(arrival_time=-math.inf)),
    "computed beyond the prompt, waiting": with_waiting(plan_request(), waiting(num_computed_tokens=41)),
    "prompt int64 max": with_waiting(plan_request(), waiting(num_prompt_tokens=INT64_MAX)),
    "max_tokens int64 min": with_waiting(plan_request(), waiting(max_tokens=INT64_MIN)),
    "priority extremes": with_waiting(
        plan_request(), waiting("a", priority=INT64_MIN), waiting("b", priority=INT64_MAX)
    ),
    "batched tokens int64 max": plan_request(max_num_batched_tokens=INT64_MAX),
    "max_num_seqs int64 max": with_waiting(plan_request(max_num_seqs=INT64_MAX), waiting()),
    "block size int64 max": plan_request(block_size=INT64_MAX),
    "page size int64 min": plan_request(kv_page_size=INT64_MIN),
    "unknown cache mode": plan_request(mamba_cache_mode=99),
    "micro budget int64 max": plan_request(max_num_prefill_tokens_per_step=INT64_MAX),
    "duplicate ids": with_waiting(plan_request(), waiting("same"), waiting("same")),
    "a 1 MB request id": with_waiting(plan_request(), waiting("i" * (1 << 20))),
    "20000 waiting": with_waiting(plan_request(), *(waiting(f"w{i}", arrival_time=float(i)) for i in range(20000))),
    "no config": scheduler_pb2.PlanStepRequest(),
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(ODD_PLAN_STEPS))
def test_odd_plan_steps_get_a_clear_answer(stack, name):
    msg = ODD_PLAN_STEPS[name]
    if name.startswith("free pages"):
        msg.num_free_kv_pages = INT64_MAX
    with grpc.insecure_channel(address(stack, "scheduler")) as channel:
        stub = scheduler_pb2_grpc.SchedulerStub(channel)
        code, details = status_of(lambda: stub.PlanStep(msg, timeout=TIMEOUT_S))
    assert code not in NEVER, (code, details)
    if name.startswith(("arrival", "computed", "duplicate", "no config", "unknown", "page size", "max_tokens")):
        assert code == grpc.StatusCode.INVALID_ARGUMENT and details, (code, details)


def test_odd_plan_steps_then_every_service_serves(stack):
    assert_all_serve(stack)


# ---- BlockCache: odd fields ----------------------------------------------------------------------------


def publish_request(data: bytes = b"checkpoint", **fields: object) -> cache_pb2.PublishRequest:
    values: dict[str, object] = dict(model_fingerprint=FP, block_hash=b"h" * 32, block_size=16, checkpoint=data,
                                     checksum=hashlib.sha256(data).digest())  # fmt: skip
    values.update(fields)
    return cache_pb2.PublishRequest(**values)  # type: ignore[arg-type]


ODD_CACHE_CALLS: dict[str, tuple[str, object]] = {
    "lookup of 65537 hashes": ("Lookup", cache_pb2.LookupRequest(model_fingerprint=FP, block_hashes=[b"h"] * 65537)),
    "lookup of a 1 MB hash": ("Lookup", cache_pb2.LookupRequest(model_fingerprint=FP, block_hashes=[b"h" * (1 << 20)])),
    "lookup without fingerprint": ("Lookup", cache_pb2.LookupRequest(block_hashes=[b"h" * 32])),
    "lookup of nothing": ("Lookup", cache_pb2.LookupRequest(model_fingerprint=FP)),
    "lookup with a 1 MB fingerprint": ("Lookup", cache_pb2.LookupRequest(model_fingerprint="f" * (1 << 20), block_hashes=[b"h"])),  # noqa: E501
    "lookup with a unicode fingerprint": ("Lookup", cache_pb2.LookupRequest(model_fingerprint="\u202e\x00*?[", block_hashes=[b"*"])),  # noqa: E501
    "publish with a wrong checksum": ("Publish", publish_request(checksum=b"\x00" * 32)),
    "publish of block size -1": ("Publish", publish_request(block_size=-1)),
    "publish of block size int64 max": ("Publish", publish_request(block_size=INT64_MAX)),
    "publish of no bytes": ("Publish", publish_request(b"")),
    "publish without a hash": ("Publish", publish_request(block_hash=b"")),
    "publish with a 1 MB parent hash": ("Publish", publish_request(parent_hash=b"p" * (1 << 20))),
    "publish with a glob fingerprint": ("Publish", publish_request(model_fingerprint="*")),
    "fetch of an absent block": ("Fetch", cache_pb2.FetchRequest(model_fingerprint=FP, block_hash=b"absent")),
    "fetch of an empty hash": ("Fetch", cache_pb2.FetchRequest(model_fingerprint=FP)),
    "fetch of a 1 MB hash": ("Fetch", cache_pb2.FetchRequest(model_fingerprint=FP, block_hash=b"h" * (1 << 20))),
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(ODD_CACHE_CALLS))
def test_odd_cache_calls_get_a_clear_answer(stack, name):
    method, request = ODD_CACHE_CALLS[name]
    with stack.cache_channel() as channel:
        call = getattr(cache_pb2_grpc.BlockCacheStub(channel), method)
        code, details = status_of(lambda: call(request, timeout=TIMEOUT_S))
    assert code not in NEVER, (code, details)
    if name.startswith(("publish with a wrong", "publish of block size -1", "publish of no", "publish without",
                        "lookup without", "lookup of 65537")):  # fmt: skip
        assert code == grpc.StatusCode.INVALID_ARGUMENT and details, (code, details)
    if name == "fetch of an absent block":
        assert code == grpc.StatusCode.NOT_FOUND


def test_odd_cache_calls_then_every_service_serves(stack):
    assert_all_serve(stack)
