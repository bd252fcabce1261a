"""Structured outputs through the official OpenAI client, a real gateway (started without --model) and real
workers: `response_format` (json_schema, json_object) and vLLM's `structured_outputs` (choice, regex) on chat
and completions, streamed and not; a schema the engine cannot compile is a quick 400 naming the field, and
the server serves on."""

from __future__ import annotations

import json
import re
import time
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai
import pytest

from tests.gateway.conftest import MODEL_NAME, gateway_stack

pytestmark = pytest.mark.slow

SCHEMA = {  # bounded (maxLength, maxItems, enum, integer range): no output runs out of tokens inside a string
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "tags": {"type": "array", "items": {"enum": ["sunny", "rain", "snow"]}, "maxItems": 3},
        "degrees": {"type": "integer", "minimum": -40, "maximum": 50},
    },
    "required": ["city", "tags", "degrees"],
    "additionalProperties": False,
}
MAX_TOKENS = 200  # a compact output of SCHEMA is at most ~130 bytes (the byte tokenizer: a token per byte)
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "weather", "schema": SCHEMA, "strict": True}}
MESSAGES = [{"role": "user", "content": "Weather as JSON:"}]


@pytest.fixture(scope="module")
def client(model_dir, scheduler):
    with gateway_stack(model_dir, scheduler, gateway_model=False) as stack:
        yield openai.OpenAI(base_url=stack.base_url, api_key="none", max_retries=0, timeout=120)


def chat_text(client: openai.OpenAI, stream: bool, **kwargs) -> tuple[str, str]:
    kwargs = {"model": MODEL_NAME, "messages": MESSAGES, "max_tokens": MAX_TOKENS, **kwargs}
    if not stream:
        choice = client.chat.completions.create(**kwargs).choices[0]
        return choice.message.content or "", choice.finish_reason
    text, reason = "", ""
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            text += choice.delta.content or ""
            reason = choice.finish_reason or reason
    return text, reason


def test_json_schema_outputs_at_temperature_08_validate_for_20_seeds(client) -> None:
    def one(seed: int) -> tuple[str, str]:
        return chat_text(client, stream=seed % 4 == 0, response_format=RESPONSE_FORMAT, temperature=0.8, seed=seed)

    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(one, range(20)))
    for seed, (text, reason) in enumerate(results):
        jsonschema.validate(json.loads(text), SCHEMA)
        assert reason == "stop", (seed, text)
    assert len({text for text, _ in results}) > 10, "20 seeds at temperature 0.8 should mostly differ"
    # the completions endpoint takes the same field, and vLLM's spelling of it
    for stream in (False, True):
        kwargs = {"model": MODEL_NAME, "prompt": "JSON:", "max_tokens": MAX_TOKENS, "temperature": 0.8, "seed": 3}
        body = {"structured_outputs": {"json": SCHEMA}}
        if stream:
            text = "".join(c.choices[0].text for c in client.completions.create(stream=True, extra_body=body, **kwargs))
        else:
            text = client.completions.create(extra_body=body, **kwargs).choices[0].text
        jsonschema.validate(json.loads(text), SCHEMA)


def test_json_object_choice_and_regex(client) -> None:
    for stream in (False, True):
        # Any JSON object is unbounded (a key may run on until max_tokens): those that ended must parse
        ended = 0
        for seed in range(4):
            text, reason = chat_text(
                client, stream, response_format={"type": "json_object"}, temperature=0.9, seed=seed
            )
            if reason == "stop":
                assert isinstance(json.loads(text), dict), text
                ended += 1
        assert ended, "no JSON object ended within max_tokens"
        choices = ["yes", "no", "maybe"]
        for seed in range(3):
            text, reason = chat_text(
                client, stream, temperature=1.0, seed=seed, extra_body={"structured_outputs": {"choice": choices}}
            )
            assert text in choices and reason == "stop", text
        pattern = r"\d{3}-[A-Z]{2}"
        result = client.completions.create(
            model=MODEL_NAME, prompt="Code:", max_tokens=20, temperature=1.0, seed=4,
            extra_body={"structured_outputs": {"regex": pattern}},
        )  # fmt: skip
        assert re.fullmatch(pattern, result.choices[0].text), result.choices[0].text


def test_a_schema_that_cannot_compile_is_a_quick_400_and_the_server_serves_on(client) -> None:
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#/$defs/missing"}}}
    for body in ({"response_format": bad}, {"structured_outputs": {"grammar": "start: nowhere"}}):
        started = time.monotonic()
        with pytest.raises(openai.BadRequestError) as caught:
            client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=5, extra_body=body)
        assert time.monotonic() - started < 5
        error = caught.value.body
        param = "response_format.json_schema.schema" if "response_format" in body else "structured_outputs.grammar"
        assert error["param"] == param and "cannot be compiled" in error["message"], error
    text, _ = chat_text(client, False, response_format=RESPONSE_FORMAT, temperature=0)
    jsonschema.validate(json.loads(text), SCHEMA)
