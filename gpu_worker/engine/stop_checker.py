"""Streaming text with stop strings, one instance per request."""

from __future__ import annotations

from collections.abc import Callable

from gpu_worker.tokenizer import IncrementalDetokenizer, Tokenizer

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
