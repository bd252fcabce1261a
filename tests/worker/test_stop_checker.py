"""The stop checker on long outputs: the text it streams is the generated text cut before the first
stop string, however far into the output that string comes (its window of text is cut as it goes)."""

from __future__ import annotations

import random

import pytest

from gpu_worker.engine.request import TRIM_CHARS, StopChecker
from gpu_worker.model.tokenizer import Tokenizer, build_byte_tokenizer

TOKENIZER = Tokenizer(build_byte_tokenizer())


@pytest.fixture(params=["push", "push_one"])
def one(request: pytest.FixtureRequest) -> bool:
    """Whether tokens go in through push_one (the engine's) rather than push([token])."""
    return bool(request.param == "push_one")


def run(text: str, stop: tuple[str, ...], one: bool) -> tuple[str, bool]:
    """Pushes `text` one token at a time; returns what was streamed (with the flush) and whether a
    stop string ended it."""
    checker = StopChecker(TOKENIZER, stop)
    out = []
    for token in TOKENIZER.encode(text):
        if one:
            delta, hit = checker.push_one(token), checker.stopped
        else:
            delta, hit = checker.push([token])
            assert checker.stopped == hit
        out.append(delta)
        if hit:
            return "".join(out), True
    return "".join(out) + checker.flush(), False


def expected(text: str, stop: tuple[str, ...]) -> tuple[str, bool]:
    cuts = [i for s in stop if (i := text.find(s)) >= 0]
    return (text[: min(cuts)], True) if cuts else (text, False)


@pytest.mark.parametrize("seed", range(6))
def test_long_output_is_cut_at_the_first_stop_string(seed, one):
    rng = random.Random(seed)
    body = "".join(rng.choice("abcxyz ") for _ in range(3 * TRIM_CHARS + rng.randrange(500)))
    stop = ("STOP", "xyzzy!", "q")
    at = rng.randrange(TRIM_CHARS, len(body))  # past the first cut of the window
    text = body[:at] + "xyzzy!" + body[at:] + "STOP tail"
    assert run(text, stop, one) == expected(text, stop) == (body[:at], True)


def test_stop_string_after_a_near_miss_across_the_cut(one):
    text = "a" * (TRIM_CHARS + 3) + "STO" + "b" * (TRIM_CHARS * 2) + "STOP" + "c" * 10
    assert run(text, ("STOP",), one) == (text[: text.index("STOP")], True)


@pytest.mark.parametrize("stop", [(), ("never",)])
def test_without_a_stop_string_the_whole_text_streams(stop, one):
    text = "".join(chr(ord("a") + i % 26) for i in range(3 * TRIM_CHARS)) + " é€ end"  # multi-byte too
    assert run(text, stop, one) == (text, False)
