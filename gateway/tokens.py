"""The model's tokenizer at the gateway (optional): text prompts become token ids before routing, so
prefix blocks hash on the workers' own grid, and log-probabilities name their tokens. Read as the
worker reads it (hybridserve.tokenizer_files), so both give transformers' ids for a text."""

from __future__ import annotations

from functools import cached_property, lru_cache
from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer

from hybridserve.tokenizer_files import load_tokenizer_json

UTF8_MAX_BYTES_PER_CHAR = 4  # a vocabulary entry's character stands for at most 4 bytes of UTF-8 text
RELEASE_GIL_CHARS = 4096  # texts longer than this are encoded through the batch call, which releases the GIL


class GatewayTokenizer:
    def __init__(self, tokenizer: HFTokenizer) -> None:
        self._tok = tokenizer
        self.token_text = lru_cache(maxsize=65536)(self._token_text)

    @staticmethod
    def from_model_dir(model_dir: Path | None) -> GatewayTokenizer | None:
        """The tokenizer of model_dir/tokenizer.json (with its tokenizer_config.json); None without one."""
        tokenizer = None if model_dir is None else load_tokenizer_json(model_dir)
        return None if tokenizer is None else GatewayTokenizer(tokenizer)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """As the worker encodes: with the checkpoint's special tokens unless the text holds them already
        (a rendered chat template: `add_special_tokens=False`). A long text goes through the batch call,
        which releases the GIL while it runs (the single call holds it)."""
        if len(text) > RELEASE_GIL_CHARS:
            return list(self._tok.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids)
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, token_ids: list[int]) -> str:
        """The text of token_ids, special tokens dropped (as /detokenize and vLLM's decode)."""
        return str(self._tok.decode(token_ids, skip_special_tokens=True))

    @cached_property
    def vocab_size(self) -> int:
        """Ids below this name a token of the tokenizer (added tokens included)."""
        return int(self._tok.get_vocab_size(with_added_tokens=True))

    @cached_property
    def max_bytes_per_token(self) -> int:
        """An upper bound on the UTF-8 bytes of text one token stands for, as the worker bounds it: the
        longest vocabulary entry in characters, times UTF8_MAX_BYTES_PER_CHAR (an entry's characters are
        the text's, or stand for fewer bytes, as a byte-level symbol or a byte-fallback `<0xAB>` does)."""
        vocab = self._tok.get_vocab(with_added_tokens=True)
        return UTF8_MAX_BYTES_PER_CHAR * max((len(token) for token in vocab), default=1)

    def _token_text(self, token_id: int) -> str:
        return str(self._tok.decode([token_id], skip_special_tokens=False))


def token_id_text(token_id: int) -> str:
    """A token's name when the gateway has no tokenizer."""
    return f"token_id:{token_id}"
