"""Why a request ended: the engine's own vocabulary, mapped to the wire by the servicer."""

from __future__ import annotations

from enum import StrEnum


class FinishReason(StrEnum):
    """The value is the name metrics labels and span attributes carry."""

    LENGTH = "length"  # max_tokens generated
    STOP = "stop"  # a stop string appeared in the text
    EOS = "eos"  # the model emitted an end-of-sequence token (and ignore_eos was off)
    ABORT = "abort"  # the client aborted or cancelled
    ERROR = "error"  # the request failed; its stream raises the error
