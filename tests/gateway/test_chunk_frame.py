"""A stream chunk built from its stream's ChunkFrame is byte for byte the compact JSON of the whole
chunk (envelope, choices, usage placeholder) as each chunk was serialised before."""

from __future__ import annotations

import json
from typing import Any

import pytest

from gateway.openai_response import ChunkFrame, envelope


def whole_chunk(kind: str, model: str, include_usage: bool, entry: dict[str, Any]) -> bytes:
    chunk = envelope(kind, "cmpl-1f", model, 1700000000, chunk=True)
    chunk["choices"] = [entry]
    if include_usage:
        chunk["usage"] = None
    return b"data: " + json.dumps(chunk, separators=(",", ":")).encode() + b"\n\n"


@pytest.mark.parametrize("kind", ["completion", "chat"])
@pytest.mark.parametrize("include_usage", [False, True])
@pytest.mark.parametrize("model", ["bench", 'odd "name", with ]} and \u00e9'])
def test_frame_bytes_equal_the_whole_chunk(kind: str, include_usage: bool, model: str) -> None:
    frame = ChunkFrame.of(kind, "cmpl-1f", model, 1700000000, include_usage)
    entries: list[dict[str, Any]] = [
        {"index": 0, "text": 'hi "there"\n', "logprobs": None, "finish_reason": None},
        {"index": 1, "delta": {"content": "\u00e9\u2713"}, "logprobs": {"content": []}, "finish_reason": "stop"},
    ]
    for entry in entries:
        data = frame.sse(entry)
        assert data == whole_chunk(kind, model, include_usage, entry)
        parsed = json.loads(data.removeprefix(b"data: "))
        assert parsed["choices"] == [entry] and parsed["model"] == model


def test_frame_with_usage_carries_the_choice_usage_so_far() -> None:
    frame = ChunkFrame.of("completion", "cmpl-1f", "m", 1700000000, True)
    entry = {"index": 0, "text": "ab", "logprobs": None, "finish_reason": None}
    chunk = envelope("completion", "cmpl-1f", "m", 1700000000, chunk=True)
    chunk["choices"] = [entry]
    chunk["usage"] = {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7}
    assert frame.sse_with_usage(entry, 5, 2) == b"data: " + json.dumps(chunk, separators=(",", ":")).encode() + b"\n\n"
