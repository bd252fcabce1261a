"""The model's tokenizer at the gateway (optional): text prompts become token ids before routing, so
prefix blocks hash on the workers' own grid, and log-probabilities name their tokens. Read as the
worker reads it (hybridserve.tokenizer_files), so both give transformers' ids for a text.

A chat prompt's spans that message content wrote (`ChatPrompt.literal_spans`) are encoded with special-token
parsing off (tokenizers' `encode_special_tokens`, on a second copy of the tokenizer, since the flag is the
tokenizer's and threads share it): `<|eos|>` typed by a user is seven characters, not EOS."""

from __future__ import annotations

from functools import cached_property, lru_cache
from pathlib import Path

from tokenizers import Encoding
from tokenizers import Tokenizer as HFTokenizer

from gateway.chat_template import ChatPrompt
from hybridserve.tokenizer_files import load_tokenizer_json

UTF8_MAX_BYTES_PER_CHAR = 4  # a vocabulary entry's character stands for at most 4 bytes of UTF-8 text
RELEASE_GIL_CHARS = 4096  # texts longer than this are encoded through the batch call, which releases the GIL


class GatewayTokenizer:
    def __init__(self, tokenizer: HFTokenizer) -> None:
        self._tok = tokenizer
        self._literal = HFTokenizer.from_str(tokenizer.to_str())  # encodes special tokens' text as text
        self._literal.encode_special_tokens = True
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

    @cached_property
    def special_token_texts(self) -> tuple[str, ...]:
        """The texts the tokenizer reads as special tokens (which content must not smuggle in)."""
        added = self._tok.get_added_tokens_decoder().values()
        return tuple(sorted({t.content for t in added if t.special and t.content}))

    def encode_chat(self, prompt: ChatPrompt, add_special_tokens: bool = False) -> list[int]:
        """A rendered chat prompt's ids (it holds its special tokens; none are added unless
        `add_special_tokens`, as /tokenize may ask): its literal spans encoded as text, the rest as the
        template wrote it. The text between spans is cut where the tokenizer cuts anyway (a special
        token's text ends a segment), so only the spans themselves tokenize differently from the whole
        text; the checkpoint's special tokens go around the whole, as its post-processor places them."""
        if not prompt.literal_spans:
            return self.encode(prompt.text, add_special_tokens=add_special_tokens)
        parts: list[Encoding] = []
        start = 0
        for begin, end in prompt.literal_spans:
            if begin > start:
                parts.append(self._encoding(prompt.text[start:begin]))
            parts.append(self._literal.encode(prompt.text[begin:end], add_special_tokens=False))
            start = end
        if start < len(prompt.text):
            parts.append(self._encoding(prompt.text[start:]))
        if add_special_tokens:
            return list(self._tok.post_process(Encoding.merge(parts), None, True).ids)
        return [token_id for part in parts for token_id in part.ids]

    def _encoding(self, text: str) -> Encoding:
        """`text` encoded without special tokens added (through the batch call when long: see `encode`)."""
        if len(text) > RELEASE_GIL_CHARS:
            return self._tok.encode_batch([text], add_special_tokens=False)[0]
        return self._tok.encode(text, add_special_tokens=False)

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
