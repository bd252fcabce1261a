"""Text <-> token ids for the worker, on the `tokenizers` library.

`load_tokenizer(dir)` reads a checkpoint's `tokenizer.json` when present, with its `tokenizer_config.json` applied
as transformers applies it (hybridserve.tokenizer_files; None without one: the checkpoint then serves token-id
prompts only). `build_byte_tokenizer()` makes the default model's tokenizer: three special
tokens (ids 0-2: pad, bos, eos, the Bamba config defaults) then one token per byte (ids 3-258), so any
text round-trips and no merges are needed."""

from __future__ import annotations

from functools import cached_property
from pathlib import Path

from tokenizers import AddedToken, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer
from tokenizers.decoders import DecodeStream

from hybridserve.tokenizer_files import load_tokenizer_json

SPECIAL_TOKENS = ("<|pad|>", "<|bos|>", "<|eos|>")
BYTE_VOCAB_SIZE = len(SPECIAL_TOKENS) + 256
UTF8_MAX_BYTES_PER_CHAR = 4
RELEASE_GIL_CHARS = 4096  # texts longer than this are encoded with the GIL released


def build_byte_tokenizer() -> HFTokenizer:
    """A byte-level tokenizer: vocab = specials + the 256 byte symbols of the ByteLevel alphabet."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    vocab.update({sym: len(SPECIAL_TOKENS) + i for i, sym in enumerate(alphabet)})
    tok = HFTokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    return tok


class Tokenizer:
    """Encode/decode; thread-safe for reads (the underlying Rust tokenizer is immutable once loaded)."""

    def __init__(self, tokenizer: HFTokenizer) -> None:
        self._tok = tokenizer

    @property
    def vocab_size(self) -> int:
        return int(self._tok.get_vocab_size(with_added_tokens=True))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`, as transformers' `encode` gives them: with the special tokens the checkpoint
        adds (a BOS, for most) unless `add_special_tokens` is false (a rendered chat template holds its own).
        A long text is encoded through the batch call, which releases the GIL (the single call holds it
        throughout), so the engine and the other RPCs run meanwhile."""
        if len(text) > RELEASE_GIL_CHARS:
            return list(self._tok.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids)
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens).ids)

    @cached_property
    def max_bytes_per_token(self) -> int:
        """An upper bound on the UTF-8 bytes of text one token stands for: the longest vocabulary
        entry in characters, each at most 4 bytes (an entry's characters are the text's, or stand
        for fewer bytes, as a byte-level symbol or a byte-fallback `<0xAB>` does)."""
        vocab = self._tok.get_vocab(with_added_tokens=True)
        return UTF8_MAX_BYTES_PER_CHAR * max((len(token) for token in vocab), default=1)

    @property
    def rust(self) -> HFTokenizer:
        """The underlying `tokenizers` object (for DecodeStream)."""
        return self._tok

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return str(self._tok.decode(token_ids, skip_special_tokens=skip_special_tokens))

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def save(self, path: Path) -> None:
        self._tok.save(str(path))


class WindowDetokenizer:
    """Turns a growing list of generated ids into text deltas for streaming, in Python.

    Decodes only a window: the ids since the last emitted text plus the chunk before it as context
    (so tokenizers that depend on a neighbour, such as a leading space, decode as in the full text).
    Each push costs O(window), not O(output). Holds back output while the window ends in an
    incomplete UTF-8 sequence (U+FFFD), so a multi-byte character split across tokens is emitted
    once, whole. The reference for IncrementalDetokenizer, and its fallback."""

    def __init__(self, tokenizer: Tokenizer, ids: list[int] | None = None, offsets: tuple[int, int] = (0, 0)) -> None:
        self._decode = tokenizer.decode
        self._ids: list[int] = ids if ids is not None else []
        self._prefix_offset, self._read_offset = offsets  # start of the context window; ids before
        # the read offset were emitted as text

    def push(self, token_ids: list[int]) -> str:
        """Append new ids; return the newly completed text (possibly empty)."""
        ids, decode = self._ids, self._decode
        ids.extend(token_ids)
        prefix_text = decode(ids[self._prefix_offset : self._read_offset])
        new_text = decode(ids[self._prefix_offset :])
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            return ""
        self._prefix_offset, self._read_offset = self._read_offset, len(ids)
        return new_text[len(prefix_text) :]


class IncrementalDetokenizer:
    """WindowDetokenizer's text, from the tokenizers library's DecodeStream: the same window and
    the same rule (emit the window's text past its context's once it grew and does not end in
    U+FFFD), in one call into Rust per token instead of two decodes and two slices in Python.

    DecodeStream refuses a window whose text does not begin with its context's text (a decoder
    that rewrites across tokens); WindowDetokenizer emits the text past the context's length
    there, so such a request continues on WindowDetokenizer from the same window. Pushing no ids
    emits nothing in both (the window is unchanged). One instance per request."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self._rust = tokenizer.rust
        self._stream = DecodeStream(skip_special_tokens=True)
        self._ids: list[int] = []  # every id pushed, for the fallback
        self._prefix_offset = 0  # the window as WindowDetokenizer keeps it
        self._read_offset = 0
        self._fallback: WindowDetokenizer | None = None

    def push(self, token_ids: list[int]) -> str:
        """Append new ids; return the newly completed text (possibly empty)."""
        if not token_ids:
            return ""
        if len(token_ids) == 1:
            return self.push_one(token_ids[0])
        if self._fallback is not None:
            return self._fallback.push(token_ids)
        ids = self._ids
        ids.extend(token_ids)
        try:
            text = self._stream.step(self._rust, token_ids)
        except Exception:  # the Rust side raises a plain Exception: the window's text changed its start
            return self._fall_back(token_ids)
        if text is None:
            return ""
        self._prefix_offset, self._read_offset = self._read_offset, len(ids)
        return str(text)

    def push_one(self, token_id: int) -> str:
        """push([token_id]), without the list: the engine pushes one token per request per step."""
        if self._fallback is not None:
            return self._fallback.push([token_id])
        self._ids.append(token_id)
        try:
            text = self._stream.step(self._rust, token_id)
        except Exception:  # as in push
            return self._fall_back([token_id])
        if text is None:
            return ""
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        return str(text)

    def _fall_back(self, token_ids: list[int]) -> str:
        """Continues on WindowDetokenizer from the window before `token_ids` (already appended)."""
        self._fallback = WindowDetokenizer(self._tokenizer, self._ids[: -len(token_ids)],
                                           (self._prefix_offset, self._read_offset))  # fmt: skip
        return self._fallback.push(token_ids)


def load_tokenizer(model_dir: Path) -> Tokenizer | None:
    """The checkpoint's tokenizer, or None when it has no `tokenizer.json`."""
    tokenizer = load_tokenizer_json(model_dir)
    return None if tokenizer is None else Tokenizer(tokenizer)
