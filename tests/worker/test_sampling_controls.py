"""The sampling controls through a real worker (gRPC, engine, scheduler, the in-process runner) against
transformers on the same seeded tiny checkpoint, greedy, token for token: repetition_penalty (transformers'
RepetitionPenaltyLogitsProcessor), presence and frequency penalties (OpenAI's formula, written below as a
logits processor), logit_bias (transformers' sequence_bias), min_tokens with EOS (min_new_tokens),
stop_token_ids, zero new tokens, and prompt log-probabilities (log_softmax over the prompt, within 1e-4)
across a chunked prefill. Bad values are INVALID_ARGUMENT naming the field, and the worker keeps serving."""

from __future__ import annotations

import grpc
import pytest
import torch
from transformers import LogitsProcessor, LogitsProcessorList

from hybridserve.v1 import generation_pb2 as pb
from tests.worker.conftest import collect, prompt_of

NEW = 12


@pytest.fixture(scope="module")
def worker(start_module_worker):
    return start_module_worker()


@pytest.fixture(autouse=True)
def _hf_defaults(hf_model):
    hf_model.generation_config.eos_token_id = None
    hf_model.generation_config.pad_token_id = 0


class OpenAIPenalties(LogitsProcessor):
    """OpenAI's presence and frequency penalties over the generated tokens only."""

    def __init__(self, prompt_len: int, presence: float, frequency: float) -> None:
        self.prompt_len, self.presence, self.frequency = prompt_len, presence, frequency

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        counts = torch.zeros_like(scores)
        generated = input_ids[:, self.prompt_len :]
        counts.scatter_add_(1, generated, torch.ones_like(generated, dtype=scores.dtype))
        return scores - self.frequency * counts - self.presence * (counts > 0).to(scores.dtype)


def hf_generate(hf_model, prompt: list[int], new: int = NEW, **kwargs) -> list[int]:
    with torch.no_grad():
        out = hf_model.generate(torch.tensor([prompt]), max_new_tokens=new, do_sample=False, **kwargs)
    return out[0, len(prompt) :].tolist()


def ours(worker, prompt: list[int], new: int = NEW, ignore_eos: bool = True, **sampling) -> list[pb.GenerateResponse]:
    request = pb.GenerateRequest(
        prompt_token_ids=pb.TokenIds(ids=prompt),
        sampling=pb.SamplingParams(max_tokens=new, ignore_eos=ignore_eos, **sampling),
    )
    return collect(worker.stub.Generate(request, timeout=60))[1]


def tokens(messages: list[pb.GenerateResponse]) -> list[int]:
    return [t for m in messages for t in m.token_ids]


# a prompt longer than a step's prefill budget (32): two chunks
PROMPT = prompt_of(40, seed=3)


def test_repetition_penalty_matches_transformers(worker, hf_model) -> None:
    expected = hf_generate(hf_model, PROMPT, repetition_penalty=1.8, eos_token_id=None)
    assert expected != hf_generate(hf_model, PROMPT, eos_token_id=None)  # the penalty changes the output
    assert tokens(ours(worker, PROMPT, repetition_penalty=1.8)) == expected


def test_presence_and_frequency_penalties_match_openais_formula(worker, hf_model) -> None:
    processor = LogitsProcessorList([OpenAIPenalties(len(PROMPT), 1.2, 0.7)])
    expected = hf_generate(hf_model, PROMPT, 20, logits_processor=processor, eos_token_id=None)
    assert expected != hf_generate(hf_model, PROMPT, 20, eos_token_id=None)
    assert tokens(ours(worker, PROMPT, 20, presence_penalty=1.2, frequency_penalty=0.7)) == expected


def test_logit_bias_matches_sequence_bias(worker, hf_model) -> None:
    plain = hf_generate(hf_model, PROMPT, eos_token_id=None)
    bias = {plain[0]: -100.0, 17: 4.0, 33: 2.5}
    expected = hf_generate(hf_model, PROMPT, sequence_bias={(t,): b for t, b in bias.items()}, eos_token_id=None)
    assert expected != plain and plain[0] not in expected
    assert tokens(ours(worker, PROMPT, logit_bias=bias)) == expected


def test_min_tokens_holds_off_eos_as_min_new_tokens(worker, hf_model) -> None:
    eos = worker.engine.runner.eos_token_ids[0]
    expected = hf_generate(hf_model, PROMPT, sequence_bias={(eos,): 30.0}, min_new_tokens=5, eos_token_id=eos)
    assert expected[-1] == eos and len(expected) == 6  # EOS the moment it may come
    messages = ours(worker, PROMPT, ignore_eos=False, logit_bias={eos: 30.0}, min_tokens=5)
    assert tokens(messages) == expected
    assert messages[-1].finish_reason == pb.FINISH_REASON_EOS
    assert tokens(ours(worker, PROMPT, ignore_eos=False, logit_bias={eos: 30.0}))[-1:] == [eos]  # at once without


def test_stop_token_ids_end_the_request_with_the_token(worker, hf_model) -> None:
    plain = hf_generate(hf_model, PROMPT, eos_token_id=None)
    stop = plain[3]
    cut = plain[: plain.index(stop) + 1]
    messages = ours(worker, PROMPT, stop_token_ids=[stop])
    assert tokens(messages) == cut and messages[-1].finish_reason == pb.FINISH_REASON_STOP
    held = ours(worker, PROMPT, stop_token_ids=[stop], min_tokens=NEW)  # min_tokens holds a stop id off too
    assert stop not in tokens(held) and len(tokens(held)) == NEW


def test_prompt_logprobs_match_log_softmax_over_a_chunked_prompt(worker, hf_model) -> None:
    with torch.no_grad():
        logp = hf_model(torch.tensor([PROMPT])).logits[0].float().log_softmax(dim=-1)
    expected = logp[:-1].gather(1, torch.tensor(PROMPT[1:])[:, None]).view(-1).tolist()
    scored = ours(worker, PROMPT, 0, prompt_logprobs=0)  # zero new tokens: a prompt's score
    assert len(scored) == 1 and not scored[0].token_ids
    assert scored[0].finish_reason == pb.FINISH_REASON_LENGTH and scored[0].usage.completion_tokens == 0
    assert list(scored[0].prompt_logprobs) == pytest.approx(expected, abs=1e-4)
    with_tokens = ours(worker, PROMPT, 4, prompt_logprobs=0)
    assert list(with_tokens[0].prompt_logprobs) == pytest.approx(expected, abs=1e-4)
    assert all(not m.prompt_logprobs for m in with_tokens[1:])
    assert tokens(with_tokens) == hf_generate(hf_model, PROMPT, 4, eos_token_id=None)
    without = ours(worker, PROMPT, 0)  # zero tokens, nothing asked: just the end
    assert not tokens(without) and without[-1].finish_reason == pb.FINISH_REASON_LENGTH


BAD = {
    "presence_penalty": {"presence_penalty": 2.5},
    "frequency_penalty": {"frequency_penalty": -3.0},
    "repetition_penalty": {"repetition_penalty": 0.0},
    "min_p": {"min_p": 1.5},
    "logit_bias": {"logit_bias": {100000: 1.0}},
    "logit_bias of token": {"logit_bias": {3: 101.0}},
    "min_tokens": {"min_tokens": 13},
    "stop_token_ids": {"stop_token_ids": [-1]},
    "prompt_logprobs": {"prompt_logprobs": 2},
}


@pytest.mark.parametrize("field", list(BAD))
def test_bad_controls_are_invalid_argument_naming_the_field(worker, field: str) -> None:
    with pytest.raises(grpc.RpcError) as err:
        ours(worker, PROMPT[:5], **BAD[field])
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"sampling.{field}" in err.value.details()
    if field == "prompt_logprobs":
        assert "not supported yet" in err.value.details()
    assert len(tokens(ours(worker, PROMPT[:5], 2))) == 2  # still serving
