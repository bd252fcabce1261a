"""The model's tokenizer at the gateway (optional): text prompts become token ids before routing, so
prefix blocks hash on the workers' own grid, and log-probabilities name their tokens."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer


class GatewayTokenizer:
    def __init__(self, tokenizer: HFTokenizer) -> None:
        self._tok = tokenizer
        self.token_text = lru_cache(maxsize=65536)(self._token_text)

    @staticmethod
    def from_model_dir(model_dir: Path | None) -> GatewayTokenizer | None:
        """The tokenizer of model_dir/tokenizer.json; None without one."""
        if model_dir is None or not (model_dir / "tokenizer.json").is_file():
            return None
        return GatewayTokenizer(HFTokenizer.from_file(str(model_dir / "tokenizer.json")))

    def encode(self, text: str) -> list[int]:
        """As the worker encodes: no special tokens added."""
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def _token_text(self, token_id: int) -> str:
        return str(self._tok.decode([token_id], skip_special_tokens=False))


def token_id_text(token_id: int) -> str:
    """A token's name when the gateway has no tokenizer."""
    return f"token_id:{token_id}"
