"""Completions `echo` (OpenAI's legacy completions, as vLLM serves it): the choice's text starts with the
prompt, and with `logprobs` its `logprobs` lists start with the prompt's tokens, the first one's
log-probability `null` (nothing comes before it) and the others' given the tokens before them, as the
worker computes them (`SamplingParams.prompt_logprobs`, on its first message). With `max_tokens: 0` the
prompt alone is scored: lm-eval's loglikelihood requests. Works streamed (the first chunk carries the
prompt), with `n` > 1 (each choice echoes it) and with several prompts (each choice echoes its own)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from gateway.api_errors import bad_request
from gateway.openai_request import ApiRequest
from gateway.openai_response import CompletionLogprobs, TokenText
from gateway.tokens import GatewayTokenizer
from hybridserve.v1 import generation_pb2 as pb


@dataclass(slots=True)
class Echo:
    """One choice's echoed prompt, sent with its first message."""

    text: str
    token_ids: tuple[int, ...]  # the prompt's tokens (named in logprobs)
    pending: bool = True

    def first(
        self, msg: pb.GenerateResponse, token_text: TokenText, with_top: bool, want_logprobs: bool
    ) -> tuple[str, CompletionLogprobs | None]:
        """(the text to put before the message's, the prompt's logprobs part) on the first message; ("",
        None) after it."""
        if not self.pending:
            return "", None
        self.pending = False
        if not want_logprobs:
            return self.text, None
        part = CompletionLogprobs()
        values: list[float | None] = [None, *msg.prompt_logprobs]
        for token_id, logprob in zip(self.token_ids, values, strict=False):
            text = token_text(token_id)
            part.tokens.append(text)
            part.token_logprobs.append(logprob)
            part.text_offset.append(part.offset)
            part.offset += len(text)
            if with_top:  # the prompt's own token only: top alternatives of prompt tokens are not computed
                part.top_logprobs.append(None if logprob is None else {text: logprob})
        part.offset = len(self.text)  # the completion's offsets go on from the echoed text's end
        return self.text, part


def echo_of(
    api: ApiRequest, raw: str | Sequence[int], prompt: str | Sequence[int], tokenizer: GatewayTokenizer | None
) -> Echo | None:
    """The echo of one prompt of a completions request (None without `echo`): `raw` as the client sent it
    (one of `api.all_prompts`), `prompt` what goes to the workers (token ids when the gateway tokenized it)."""
    if not api.echo:
        return None
    ids = () if isinstance(prompt, str) else tuple(prompt)
    if isinstance(raw, str):
        text = raw
    elif tokenizer is not None:
        text = tokenizer.decode(list(raw))
    else:
        raise bad_request(
            "'echo' of a token-id prompt needs the model's tokenizer at the gateway (start it with --model)", "echo"
        )
    if api.logprobs and not ids:
        raise bad_request(
            "'echo' with 'logprobs' needs the prompt's tokens at the gateway (start it with --model)", "echo"
        )
    return Echo(text, ids)
