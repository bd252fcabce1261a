"""Units of the completions batch (several prompts in one request), its choices' order and usage, and
the cache_salt field."""

from __future__ import annotations

import pytest

from gateway.api_errors import ApiError
from gateway.openai_request import MAX_BATCH_CHOICES, TextLimits, check_prompt_size, parse_completion
from gateway.openai_response import ChoiceState, UsageCount, final_body, request_usage


def test_the_four_prompt_shapes():
    assert parse_completion({"model": "m", "prompt": "a"}).all_prompts == ("a",)
    assert parse_completion({"model": "m", "prompt": [5, 6]}).all_prompts == ((5, 6),)
    assert parse_completion({"model": "m", "prompt": ["a", "bc"]}).all_prompts == ("a", "bc")
    batch = parse_completion({"model": "m", "prompt": [[1, 2], [3]], "n": 2})
    assert batch.all_prompts == ((1, 2), (3,)) and batch.prompt == (1, 2) and batch.n == 2
    assert parse_completion({"model": "m", "prompt": ["a"]}).prompts == ()  # a batch of one is one prompt
    n = MAX_BATCH_CHOICES // 4
    assert len(parse_completion({"model": "m", "prompt": ["x"] * n, "n": 4}).all_prompts) == n


def test_each_prompt_of_a_batch_is_sized_on_its_own():
    limits = TextLimits(max_model_len=8, max_bytes_per_token=1)
    check_prompt_size(parse_completion({"model": "m", "prompt": ["a" * 8, "b" * 8]}), limits)
    with pytest.raises(ApiError) as too_long:
        check_prompt_size(parse_completion({"model": "m", "prompt": [[1] * 8, [1] * 9]}), limits)
    assert too_long.value.param == "prompt" and too_long.value.code == "context_length_exceeded"


def test_choices_of_prompt_i_are_i_n_to_i_n_plus_n_and_usage_sums_the_prompts():
    def choice(index: int, prompt_tokens: int, completion_tokens: int) -> ChoiceState:
        state = ChoiceState(index, "completion", False, False, str)
        state.usage = UsageCount(prompt_tokens, 2, completion_tokens)
        state.finish_reason = "length"
        return state

    # prompt 0 (10 tokens) has choices 0 and 1, prompt 1 (7 tokens) choices 2 and 3
    choices = [choice(0, 10, 3), choice(1, 10, 4), choice(2, 7, 5), choice(3, 7, 6)]
    assert request_usage(choices, n=2) == UsageCount(17, 4, 18)
    body = final_body("completion", "cmpl-1", "m", choices, n=2)
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    assert body["usage"]["prompt_tokens"] == 17 and body["usage"]["total_tokens"] == 35
    assert request_usage(choices[:2], n=2) == UsageCount(10, 2, 7)  # one prompt: counted once, as before


@pytest.mark.parametrize("salt", ["", 5, "s" * 257, "\ud800"])
def test_a_bad_cache_salt_is_named(salt):
    with pytest.raises(ApiError) as failed:
        parse_completion({"model": "m", "prompt": "x", "cache_salt": salt})
    assert failed.value.param == "cache_salt"


def test_the_salt_goes_to_every_choice_and_roots_the_routing_hashes():
    from gateway.convert import generate_requests
    from gateway.routing import prefix_block_hashes

    api = parse_completion({"model": "m", "prompt": "x", "n": 2, "cache_salt": "tenant"})
    assert [r.cache_salt for r in generate_requests(api, [1, 2])] == ["tenant", "tenant"]
    tokens = list(range(32))
    salted, other, bare = (prefix_block_hashes(tokens, 16, salt=s) for s in ("tenant", "other", ""))
    assert not set(salted) & set(other) and not set(salted) & set(bare)
