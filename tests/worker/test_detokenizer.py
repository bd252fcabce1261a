"""The streaming detokenizer on DecodeStream emits exactly the text of the Python window detokenizer it
replaced: for any ids (special ones and bytes that split a character included), pushed in any groups,
and on a decoder that rewrites earlier text, where DecodeStream refuses and the window takes over."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models

from gpu_worker.model.tokenizer import (
    BYTE_VOCAB_SIZE,
    IncrementalDetokenizer,
    Tokenizer,
    WindowDetokenizer,
    build_byte_tokenizer,
)

BYTES = Tokenizer(build_byte_tokenizer())


def pushes(tok: Tokenizer, ids: list[int], sizes: list[int]) -> tuple[list[str], list[str], IncrementalDetokenizer]:
    """Both detokenizers fed the same groups of `ids` (sizes taken in turn; 0 pushes nothing)."""
    window, stream = WindowDetokenizer(tok), IncrementalDetokenizer(tok)
    a, b, index, turn = [], [], 0, 0
    while index < len(ids):
        group = ids[index : index + sizes[turn % len(sizes)]]
        a.append(window.push(group))
        b.append(stream.push(group))
        index, turn = index + len(group), turn + 1
        if not group and turn > 4 * len(ids) + 8:  # only empty groups: push the rest at once
            a.append(window.push(ids[index:]))
            b.append(stream.push(ids[index:]))
            break
    return a, b, stream


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.integers(0, BYTE_VOCAB_SIZE - 1), max_size=120), st.lists(st.integers(0, 4), min_size=1, max_size=20)
)
def test_same_deltas_as_the_window_detokenizer(ids: list[int], sizes: list[int]) -> None:
    """Random ids: special tokens (skipped), lone continuation bytes, characters split across pushes."""
    a, b, stream = pushes(BYTES, ids, sizes)
    assert a == b
    assert stream._fallback is None  # the byte-level decoder never rewrites earlier text


@settings(max_examples=50, deadline=None)
@given(st.text(max_size=200))
def test_any_text_streams_whole(text: str) -> None:
    ids = BYTES.encode(text)
    a, b, _ = pushes(BYTES, ids, [1])
    assert "".join(b) == "".join(a) == text


class _Reversing:
    """A decoder whose text for more ids does not begin with its text for fewer."""

    def decode_chain(self, tokens: list[str]) -> list[str]:
        return ["".join(tokens)[::-1]]


def test_a_decoder_that_rewrites_earlier_text_falls_back_to_the_window() -> None:
    model = HFTokenizer(models.WordLevel(vocab={c: i for i, c in enumerate("abcdef")}, unk_token="a"))
    model.decoder = decoders.Decoder.custom(_Reversing())
    tok = Tokenizer(model)
    ids = [0, 1, 2, 3, 4, 5, 1, 0]
    for sizes in ([1], [2], [1, 2]):  # the fallback taken on a single id (push_one) and on a group
        a, b, stream = pushes(tok, ids, sizes)
        assert a == b
        assert stream._fallback is not None
