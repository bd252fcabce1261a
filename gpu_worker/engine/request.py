"""One generation request as the engine owns it: its state, why it ended (`FinishReason`), its text
with stop strings (`StopChecker`), and the events it streams out.

Token regions of a request (positions):

    [0, num_prompt)  prompt   [num_prompt, len(all_token_ids))  generated
    [0, num_computed_tokens)  KV in page_ids, Mamba state in state_slot

The scheduler sees a projection (`sched_state`): after a preemption the generated tokens are folded
into the "prompt" it recomputes (`sched_prompt_len`), as the scheduler contract says.
"""

from __future__ import annotations

import queue
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING, NamedTuple

from gpu_worker.model.tokenizer import IncrementalDetokenizer, Tokenizer
from gpu_worker.runner.protocol import SamplingParams
from hybridserve.errors import HybridServeError
from scheduler_svc.core import RequestState

if TYPE_CHECKING:
    from gpu_worker.engine.grammar import Constraint


class FinishReason(StrEnum):
    """The value is the name metrics labels and span attributes carry."""

    LENGTH = "length"  # max_tokens generated
    STOP = "stop"  # a stop string appeared in the text, or the output's grammar is complete
    EOS = "eos"  # the model emitted an end-of-sequence token (and ignore_eos was off)
    ABORT = "abort"  # the client aborted or cancelled
    ERROR = "error"  # the request failed; its stream raises the error


TRIM_CHARS = 1024  # emitted text kept before the window is cut (cutting is a copy too)


class StopChecker:
    """Incremental text with stop strings: holds back the tail that could still become a stop
    string, and cuts the text where one appears."""

    def __init__(self, tokenizer: Tokenizer | None, stop: tuple[str, ...]) -> None:
        self._detok = IncrementalDetokenizer(tokenizer) if tokenizer is not None else None
        self._stop = stop
        self._hold = max((len(s) for s in stop), default=1) - 1
        self._text = ""  # the text, less a head that no stop string can reach any more (see push)
        self._emitted = 0  # text before this index in `_text` was emitted
        self.stopped = False  # a stop string was reached
        # push_one(token_id) -> the text to emit now (a stop string reached sets `stopped`); once per
        # token of every request: without stop strings, the detokenizer's own method, no layer between.
        self.push_one: Callable[[int], str] = (
            _no_text if self._detok is None else self._detok.push_one if not stop else self._push_one_held
        )

    def push(self, token_ids: list[int]) -> tuple[str, bool]:
        """Returns (text to emit now, whether a stop string was reached)."""
        if self._detok is None:
            return "", False
        if not self._stop:  # nothing held back: the new text goes out as it comes
            return self._detok.push(token_ids), False
        return self._take(self._detok.push(token_ids))

    def _push_one_held(self, token_id: int) -> str:
        assert self._detok is not None
        return self._take(self._detok.push_one(token_id))[0]

    def _take(self, new_text: str) -> tuple[str, bool]:
        """The text to emit now, of the text so far and `new_text`, and whether a stop string was reached."""
        drop = self._emitted - self._hold - 1  # no stop string can begin before this index
        if drop > TRIM_CHARS:  # appending to an ever-growing string copies it: keep a bounded window
            self._text, self._emitted = self._text[drop:], self._emitted - drop
        self._text += new_text
        for s in self._stop:
            index = self._text.find(s, max(self._emitted - len(s), 0))
            if index >= 0:
                delta = self._text[self._emitted : max(index, self._emitted)]
                self._emitted = len(self._text)
                self.stopped = True
                return delta, True
        end = max(len(self._text) - self._hold, self._emitted)
        delta, self._emitted = self._text[self._emitted : end], end
        return delta, False

    def flush(self) -> str:
        """The held-back tail (the request ended without a stop string)."""
        delta, self._emitted = self._text[self._emitted :], len(self._text)
        return delta


def _no_text(token_id: int) -> str:
    return ""


@dataclass(frozen=True, slots=True)
class GenerationParams:
    """What the client asked for, validated at admission."""

    sampling: SamplingParams
    max_tokens: int  # generated tokens at most; 0: none (the prompt is read, and scored if asked)
    stop: tuple[str, ...] = ()  # generation ends before any of these strings
    ignore_eos: bool = False
    priority: int = 0  # smaller is served first
    stop_token_ids: frozenset[int] = frozenset()  # generation ends after any of these (FinishReason.STOP)
    prompt_logprobs: bool = False  # the first event carries the prompt tokens' log-probabilities
    # what the scheduler is told: a request of no new tokens still runs its prompt, whose last chunk samples
    # one token (dropped)
    sched_max_tokens: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "sched_max_tokens", max(self.max_tokens, 1))


class RequestOutput(NamedTuple):
    """One streamed event: new tokens, and on the last event the finish reason and usage.

    A NamedTuple, immutable like a frozen dataclass: one is built per token every step, and a
    frozen dataclass costs two to four times as much to construct.
    """

    token_ids: tuple[int, ...] = ()
    logprobs: tuple[float, ...] = ()
    top_logprobs: tuple[tuple[tuple[int, float], ...], ...] = ()
    text: str = ""
    finish_reason: FinishReason | None = None  # set on the last event only; None = more follows
    prompt_tokens: int = 0  # usage, on the last event
    cached_tokens: int = 0
    completion_tokens: int = 0
    error: HybridServeError | None = None  # the request failed; no event follows
    prompt_logprobs: tuple[float, ...] = ()  # on the first event, when asked: each prompt token's after the first


@dataclass(eq=False)
class Request:
    """Mutable engine-side request. Only the engine thread changes it after admission."""

    request_id: str
    prompt_token_ids: list[int]
    params: GenerationParams
    arrival_time: float  # monotonic seconds; kept across preemptions (queue place)
    deadline: float | None  # monotonic seconds, or None
    stop_checker: StopChecker
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    page_ids: list[int] = field(default_factory=list)
    state_slot: int | None = None
    sched_prompt_len: int = 0  # the prompt as the scheduler sees it (grows on preemption)
    sched_output_base: int = 0  # outputs folded into sched_prompt_len
    block_hashes: list[bytes] = field(default_factory=list)  # chained hashes of full blocks, grown lazily
    cache_salt: str = ""  # roots block_hashes' chain (gpu_worker/cache/blocks.py); "" = unsalted
    first_token_time: float | None = None
    trace_context: object | None = None  # the request span's tracing context, from the observer
    # prompt log-probabilities (GenerationParams.prompt_logprobs): scored until the first token, index k
    # holding the prompt token at position k + 1's
    scoring: bool = False
    prompt_logprobs: list[float] = field(default_factory=list)
    grammar: Constraint | None = None  # the structured output's matcher (gpu_worker.engine.grammar), if any
    num_draft_tokens: int = 0  # speculative decoding: drafts verified, and accepted (gpu_worker.engine.speculation)
    num_accepted_tokens: int = 0
    # the MTP head's drafts after the request's first `mtp_drafts_at` tokens (gpu_worker.runner.mtp)
    mtp_drafts: tuple[int, ...] = ()
    mtp_drafts_at: int = -1
    events: queue.SimpleQueue[RequestOutput] = field(default_factory=queue.SimpleQueue)
    # page_ids as a tuple (the batch row's page table), rebuilt only when page_ids grew or was replaced:
    # a long request's table is hundreds of pages, and a decode step rebuilds every row.
    _page_table: tuple[int, ...] = field(default=(), repr=False)
    _page_table_of: list[int] | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        self.sched_prompt_len = self.sched_prompt_len or len(self.prompt_token_ids)
        self.scoring = self.params.prompt_logprobs

    @property
    def history(self) -> tuple[list[int], list[int]]:
        """The prompt and the generated tokens, as held (what the penalties' tables are written from)."""
        return self.prompt_token_ids, self.output_token_ids

    @property
    def num_tokens(self) -> int:
        """Tokens known: prompt plus generated."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def page_table(self) -> tuple[int, ...]:
        """page_ids as a tuple. page_ids only grows in place (allocation) or is replaced (release, a
        prefix-cache hit), so its identity and length tell whether the cached tuple is current."""
        pages = self.page_ids
        if self._page_table_of is not pages or len(self._page_table) != len(pages):
            self._page_table, self._page_table_of = tuple(pages), pages
        return self._page_table

    def tokens(self, start: int, end: int) -> tuple[int, ...]:
        """Token ids of positions [start, end)."""
        n = len(self.prompt_token_ids)
        if end <= n:
            return tuple(self.prompt_token_ids[start:end])
        if start >= n:  # generated tokens only (a decode): one slice
            return tuple(self.output_token_ids[start - n : end - n])
        return tuple(self.prompt_token_ids[start:n] + self.output_token_ids[: end - n])

    def sched_state(self, num_new_outputs: int = 0) -> RequestState:
        """The scheduler's view; `num_new_outputs` tokens the step in flight will add (prediction)."""
        # In RequestState's field order, through tuple.__new__ (its constructor without the Python
        # call): this runs for every request of every step.
        base, params = self.sched_output_base, self.params
        return tuple.__new__(RequestState, (
            self.request_id,
            self.sched_prompt_len,
            self.num_computed_tokens,
            len(self.output_token_ids) + num_new_outputs - base,
            params.sched_max_tokens - base,
            params.priority,
            self.arrival_time,
            0,
        ))  # fmt: skip

    def fold_for_recompute(self) -> None:
        """After a preemption: every known token becomes prompt for the recompute."""
        self.sched_prompt_len = self.num_tokens
        self.sched_output_base = len(self.output_token_ids)
        self.num_computed_tokens = 0

    def last_output(self, reason: FinishReason, event: RequestOutput | None = None) -> RequestOutput:
        """`event` (or an empty one) as the request's last: with the finish reason and usage."""
        event = event or RequestOutput()
        return RequestOutput(
            token_ids=event.token_ids,
            logprobs=event.logprobs,
            top_logprobs=event.top_logprobs,
            text=event.text,
            finish_reason=reason,
            prompt_tokens=len(self.prompt_token_ids),
            cached_tokens=self.num_cached_tokens,
            completion_tokens=len(self.output_token_ids),
            prompt_logprobs=event.prompt_logprobs,
        )
