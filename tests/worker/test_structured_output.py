"""Structured outputs over the worker's gRPC API: a constrained request's output matches its grammar (JSON
schema, choice, regex) greedy and sampled, ends FINISH_REASON_STOP once the grammar is complete, survives a
preemption; a spec the engine cannot compile is INVALID_ARGUMENT at once, naming the problem."""

from __future__ import annotations

import json
import re
import threading
import time
from pathlib import Path

import grpc
import jsonschema
import pytest

from hybridserve.v1 import generation_pb2 as pb
from hybridserve_cli.init_model import ModelSpec, write_random_checkpoint

# A model with a tokenizer (the byte tokenizer: a token per byte), so that text prompts and grammars work.
SPEC = ModelSpec(
    hidden_size=64, intermediate_size=128, num_hidden_layers=4, attn_layer_indices=(1, 3), mamba_n_heads=4,
    mamba_d_state=16,
)  # fmt: skip
SCHEMA = {  # bounded: no output can run out of tokens inside a string
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 10},
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
        "count": {"type": "integer", "minimum": 0, "maximum": 99},
    },
    "required": ["name", "tags", "count"],
    "additionalProperties": False,
}
MAX_TOKENS = 160  # a compact output of SCHEMA is at most ~120 bytes (a 10-character name of \u escapes)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:  # overrides tests/worker/conftest.py's (which has no tokenizer)
    return write_random_checkpoint(tmp_path_factory.mktemp("structured") / "tiny", SPEC, seed=3)


def constrained(structured: pb.StructuredOutput, prompt: str = "Answer:", **sampling) -> pb.GenerateRequest:
    sampling.setdefault("max_tokens", MAX_TOKENS)
    return pb.GenerateRequest(prompt=prompt, sampling=pb.SamplingParams(structured_output=structured, **sampling))


def run(worker, request: pb.GenerateRequest) -> tuple[str, pb.FinishReason]:
    messages = list(worker.stub.Generate(request, timeout=120))
    return "".join(m.text for m in messages), messages[-1].finish_reason


@pytest.fixture
def worker(start_worker):
    return start_worker()


def test_json_schema_outputs_validate_greedy_and_sampled(worker) -> None:
    schema = pb.StructuredOutput(json_schema=json.dumps(SCHEMA))
    for sampling in [{}, *({"temperature": 0.9, "seed": s} for s in range(4))]:
        text, reason = run(worker, constrained(schema, **sampling))
        jsonschema.validate(json.loads(text), SCHEMA)
        assert reason == pb.FINISH_REASON_STOP, (sampling, text)
    text, reason = run(worker, constrained(pb.StructuredOutput(json_object=True)))  # unbounded: greedy ends
    assert isinstance(json.loads(text), dict) and reason == pb.FINISH_REASON_STOP


def test_choice_and_regex_outputs_match(worker) -> None:
    choices = ["positive", "negative", "neutral"]
    for seed in range(3):
        text, reason = run(
            worker, constrained(pb.StructuredOutput(choice=pb.Choices(values=choices)), temperature=1.0, seed=seed)
        )
        assert text in choices and reason == pb.FINISH_REASON_STOP
    pattern = r"[0-9]{3}-[a-z]{2,4}"
    text, reason = run(worker, constrained(pb.StructuredOutput(regex=pattern), temperature=1.0, seed=1))
    assert re.fullmatch(pattern, text) and reason == pb.FINISH_REASON_STOP, text
    grammar = 'start: "yes" | "no" " because " /[a-z]{1,5}/'
    text, _ = run(worker, constrained(pb.StructuredOutput(grammar=grammar), temperature=1.0, seed=2))
    assert re.fullmatch(r"yes|no because [a-z]{1,5}", text), text


BAD_SPECS = [  # (spec, what the error names)
    (pb.StructuredOutput(json_schema='{"type": "object", "properties": {"a": {"$ref": "#/$defs/nope"}}}'), "nope"),
    (pb.StructuredOutput(json_schema="{not json"), "not valid JSON"),
    (pb.StructuredOutput(regex="a(b"), "unclosed group"),
    (pb.StructuredOutput(grammar="start: undefined_rule"), "undefined_rule"),
    (pb.StructuredOutput(choice=pb.Choices()), "choice is empty"),
    (pb.StructuredOutput(), "sets no kind"),
]


def test_a_spec_that_cannot_compile_is_invalid_argument_at_once(worker) -> None:
    for structured, names in BAD_SPECS:
        started = time.monotonic()
        with pytest.raises(grpc.RpcError) as caught:
            run(worker, constrained(structured))
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT, structured
        assert names in caught.value.details() and "structured_output" in caught.value.details(), caught.value
        assert time.monotonic() - started < 5
    text, _ = run(worker, constrained(pb.StructuredOutput(regex="ok|fine")))  # the worker serves on
    assert text in ("ok", "fine")


def test_constrained_requests_stay_valid_through_preemption(start_worker) -> None:
    worker = start_worker(num_kv_pages=48)  # 192 tokens of KV for 6 requests of up to ~170 tokens
    results: dict[int, str] = {}
    schema = pb.StructuredOutput(json_schema=json.dumps(SCHEMA))

    def client(i: int) -> None:
        results[i], _ = run(worker, constrained(schema, prompt="x" * (10 + 3 * i), temperature=0.8, seed=i))

    threads = [threading.Thread(target=client, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    assert len(results) == 6
    for text in results.values():
        jsonschema.validate(json.loads(text), SCHEMA)
    assert worker.info().num_preemptions > 0, "the budget was meant to force preemption"


SPECULATING = {"num_speculative_tokens": 4, "speculative_payoff": False}  # drafts whenever it has some


@pytest.mark.slow
@pytest.mark.parametrize("processes", [False, True], ids=["in_process", "model_processes"])
def test_constrained_requests_draft_and_give_the_output_of_plain_decoding(start_worker, processes) -> None:
    """Speculation on constrained requests: prompt lookup's drafts are cut to the prefix the grammar accepts,
    and each verified position is sampled under the grammar's mask after the drafts before it. The
    alternation `(ab){12}` allows one token at each position, so a draft is accepted only where its
    position's mask is that position's own (a row's last mask at every position would refuse every other
    draft): the same text as without drafts, greedy and seeded, JSON-schema outputs valid, drafts
    accepted; in process and across two model processes (the masks of the draft positions in the tables)."""
    runner = {"num_draft_rows": 4 * 4}
    if processes:
        runner |= {"model_process": "on", "model_processes": 2, "model_process_min_rows": 0, "cpu_threads": 1}
    plain, spec = start_worker(), start_worker(runner=runner, **SPECULATING)
    cases = [
        constrained(pb.StructuredOutput(regex="(ab){12}"), prompt="abababab ab"),
        constrained(pb.StructuredOutput(regex="[0-9]{30}"), prompt="0123012301230123"),
        *(constrained(pb.StructuredOutput(json_schema=json.dumps(SCHEMA)), temperature=0.9, seed=s) for s in range(3)),
    ]
    for request in cases:
        expect = run(plain, request)
        assert run(spec, request) == expect, request.sampling.structured_output
    assert expect[0] and json.loads(expect[0])
    info = spec.info()
    assert info.spec_decode_num_draft_tokens > 0 and info.spec_decode_num_accepted_tokens > 0, info
