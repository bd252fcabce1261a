"""The model's tokenizer at the gateway (optional): text prompts become token ids before routing, so
prefix blocks hash on the workers' own grid, and log-probabilities name their tokens. Read as the
worker reads it (hybridserve.tokenizer_files), so both give transformers' ids for a text."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer

from hybridserve.tokenizer_files import load_tokenizer_json


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
        (a rendered chat template: `add_special_tokens=False`)."""
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, token_ids: list[int]) -> str:
        """The text of token_ids, special tokens dropped (as /detokenize and vLLM's decode)."""
        return str(self._tok.decode(token_ids, skip_special_tokens=True))

    def _token_text(self, token_id: int) -> str:
        return str(self._tok.decode([token_id], skip_special_tokens=False))


def token_id_text(token_id: int) -> str:
    """A token's name when the gateway has no tokenizer."""
    return f"token_id:{token_id}"
