"""Structured outputs on the worker: the grammar a request's output must match, compiled at admission, and
one matcher per request that says which tokens may come next.

- `GrammarCompiler` (one per engine) turns a `StructuredSpec` into a `Constraint` against the model's
  vocabulary: it builds the llguidance tokenizer once (lazily, at the first constrained request), keeps the
  last MAX_CACHED compiled grammars (a matcher in its start state, copied per request), and raises
  InvalidArgumentError naming the problem for a spec the engine cannot compile. Compiling runs on the
  RPC's thread, with llguidance's fuel limits (hybridserve.structured_output.parser_limits).
- `Constraint` (one per request, owned by the engine thread): `fill(bitmask, index)` writes the allowed
  next tokens (one bit per token id, vocab/32 int32 words) into row `index` of a bitmask; `advance(token)`
  consumes the sampled token and says whether the grammar is complete (the request then ends,
  FINISH_REASON_STOP). The matcher covers the output tokens only (a prefix-cache hit changes nothing), and
  stays with its request across a preemption (the request keeps its generated tokens, and so does the
  matcher); should its count of consumed tokens ever differ from the request's, `sync` replays them into a
  fresh matcher.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import llguidance
import numpy as np
from llguidance.numpy import fill_next_token_bitmask

from gpu_worker.model.tokenizer import Tokenizer
from gpu_worker.runner.protocol import mask_vocab_size, mask_words
from hybridserve.errors import InvalidArgumentError
from hybridserve.structured_output import StructuredSpec, check_grammar, parser_limits, to_grammar

MAX_CACHED = 64  # compiled grammars kept (keyed by spec)
log = logging.getLogger("hybridserve.engine")


class Constraint:
    """One request's matcher (see the module docstring). Not thread-safe: the engine thread uses it, or the
    runner's mask thread while the engine waits for the step."""

    __slots__ = ("_matcher", "_start", "_eos", "consumed")

    def __init__(self, start: llguidance.LLMatcher, eos_token_ids: frozenset[int]) -> None:
        self._start = start  # the compiled grammar's start state (shared, never advanced)
        self._matcher = start.deep_copy()
        self._eos = eos_token_ids
        self.consumed = 0  # output tokens the matcher has consumed

    def fill(self, bitmask: np.ndarray[Any, Any], index: int) -> None:
        """The tokens allowed next, into row `index` of `bitmask` (int32, C-contiguous rows)."""
        fill_next_token_bitmask(self._matcher, bitmask, index)

    def fill_drafted(self, bitmask: np.ndarray[Any, Any], index: int, drafts: Sequence[int], before: int) -> None:
        """A verify row's masks (speculation): the tokens allowed after each prefix of `drafts`, the empty
        one into row `before`, the one of i drafts into row `before` + i, all of them into row `index`; the
        matcher is put back where it stood. A draft the grammar refuses ends the walk: the rows after it
        allow every token (verification stops before them: the masked sample there cannot be the refused
        draft)."""
        taken = 0
        for i in range(len(drafts) + 1):
            row = index if i == len(drafts) else before + i
            if i > taken:  # a refused draft before this position
                bitmask[row] = -1
                continue
            fill_next_token_bitmask(self._matcher, bitmask, row)
            if (
                i < len(drafts)
                and self._matcher.validate_tokens([drafts[i]]) == 1
                and self._matcher.consume_token(drafts[i])
            ):
                taken += 1
        if taken:
            self._matcher.rollback(taken)

    def valid_prefix(self, tokens: Sequence[int]) -> int:
        """How many of `tokens`, in order, the grammar accepts after the consumed ones (nothing consumed)."""
        if self._matcher.is_stopped():
            return 0
        return int(self._matcher.validate_tokens(list(tokens)))

    def advance(self, token_id: int) -> bool:
        """Consumes the sampled token; True when the grammar is complete: nothing may follow (the matcher
        stopped), or the token is an end-of-sequence token the grammar allowed. A token the grammar refuses
        (which the mask makes impossible) ends the request too, logged: nothing valid can follow it."""
        self.consumed += 1
        if not self._matcher.consume_token(token_id):
            log.error("the grammar refused token %d: %s; ending the request", token_id, self._matcher.get_error())
            return True
        return token_id in self._eos or self._matcher.is_stopped()

    def sync(self, output_token_ids: Sequence[int]) -> None:
        """Makes the matcher stand after exactly `output_token_ids` (a fresh matcher replays them when its
        count differs)."""
        if self.consumed == len(output_token_ids):
            return
        self._matcher = self._start.deep_copy()
        self.consumed = 0
        for token_id in output_token_ids:
            self.advance(token_id)

    @property
    def is_accepting(self) -> bool:
        return bool(self._matcher.is_accepting())


class GrammarCompiler:
    """Specs -> Constraints for one model's vocabulary (see the module docstring). Thread-safe."""

    def __init__(self, tokenizer: Tokenizer | None, vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        self._tokenizer = tokenizer
        self._eos = tuple(eos_token_ids)
        # The logits' width may exceed the tokenizer's (padded vocabularies); tokens without text are never
        # allowed.
        self.vocab_size = mask_vocab_size(vocab_size, tokenizer.vocab_size if tokenizer is not None else 0)
        self.words = mask_words(self.vocab_size)
        self._lock = threading.Lock()
        self._ll_tokenizer: llguidance.LLTokenizer | None = None
        self._cache: OrderedDict[StructuredSpec, llguidance.LLMatcher] = OrderedDict()

    def _vocabulary(self) -> llguidance.LLTokenizer:
        if self._tokenizer is None:
            raise InvalidArgumentError(
                "structured_output needs the model's tokenizer, and this model has no tokenizer.json"
            )
        with self._lock:
            if self._ll_tokenizer is None:
                self._ll_tokenizer = llguidance.LLTokenizer(
                    self._tokenizer.rust.to_str(), n_vocab=self.vocab_size, eos_token=list(self._eos) or None
                )
            return self._ll_tokenizer

    def compile(self, spec: StructuredSpec) -> Constraint:
        """A fresh Constraint for `spec`; InvalidArgumentError (naming the problem) when it cannot be compiled."""
        vocabulary = self._vocabulary()
        with self._lock:
            start = self._cache.get(spec)
            if start is not None:
                self._cache.move_to_end(spec)
        if start is None:
            grammar = to_grammar(spec)
            check_grammar(grammar, spec)
            start = llguidance.LLMatcher(vocabulary, grammar, log_level=0, limits=parser_limits())  # GIL released
            if start.is_error():
                raise InvalidArgumentError(f"structured_output.{spec.kind} cannot be compiled: {start.get_error()}")
            with self._lock:
                self._cache[spec] = start
                while len(self._cache) > MAX_CACHED:
                    self._cache.popitem(last=False)
        return Constraint(start, frozenset(self._eos))


class StepMasks:
    """The token masks of one step's constrained rows (gpu_worker.runner.protocol.TokenMasks): the runner
    calls `fill` while the forward runs."""

    __slots__ = ("_constraints", "_outputs", "_drafts", "words")

    def __init__(
        self, constraints: list[Constraint], outputs: list[list[int]], words: int,
        drafts: Sequence[tuple[int, ...]] = (),
    ) -> None:  # fmt: skip
        self._constraints = constraints
        self._outputs = outputs  # each row's request's generated tokens (what its matcher must stand after)
        self._drafts = drafts  # each row's drafts (speculation), when some row carries any
        self.words = words

    def fill(self, bitmask: np.ndarray[Any, Any], indices: Sequence[int], before: Sequence[int] = ()) -> None:
        """Row `indices[j]` of `bitmask` gets constrained row j's mask; a row with drafts, its positions'
        masks too (TokenMasks.fill)."""
        for j, (constraint, outputs, index) in enumerate(zip(self._constraints, self._outputs, indices, strict=True)):
            constraint.sync(outputs)
            drafts = self._drafts[j] if self._drafts else ()
            if drafts:
                if len(before) <= j or before[j] < 0:
                    raise ValueError(f"constrained row {j} carries {len(drafts)} drafts and no rows for their masks")
                constraint.fill_drafted(bitmask, index, drafts, before[j])
            else:
                constraint.fill(bitmask, index)
