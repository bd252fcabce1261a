"""Why a prefix-cache lookup stopped short, and the fetch-or-recompute rule.

A lookup of a request's usable blocks (full blocks, leaving >= 1 token to compute) hits the longest
run whose KV and Mamba state are both available; when that run is shorter than the usable blocks,
the first block past it is a miss for one reason (`MissReason`). The reason is reported on the
request's span, as a metric label and as a count in GetInfo.

Fetch or recompute: blocks found only in the shared tier are fetched when moving their bytes is
expected to be faster than computing their tokens, from the measured fetch bandwidth and prefill
speed (moving averages); until both are measured the worker fetches (and so measures)."""

from __future__ import annotations

import enum
import threading
from dataclasses import dataclass


class MissReason(enum.Enum):
    NO_ENTRY = "no_entry"  # no tier holds the block
    KV_WITHOUT_STATE = "kv_without_state"  # the blocks' KV is cached but no state at a boundary after the hit
    EVICTED = "evicted"  # the block (or its state) was cached here and evicted
    FAILED_VERIFICATION = "failed_verification"  # a shared-tier checkpoint failed its checksum or checks
    FOREIGN_FINGERPRINT = "foreign_fingerprint"  # a shared-tier checkpoint of another model, grid or version
    SHARED_TIER_DOWN = "shared_tier_down"  # cache_svc or Redis did not answer
    FETCH_SLOWER = "fetch_slower_than_recompute"  # declined: computing the tokens is expected to be faster


def reason_for_rejection(rejection_reason: str) -> MissReason:
    """A checkpoint refused by checkpoint_io.verify: of another block, model or shapes ("identity",
    "layout") is foreign; a bad MAC, format or checksum failed verification."""
    if rejection_reason in ("identity", "layout"):
        return MissReason.FOREIGN_FINGERPRINT
    return MissReason.FAILED_VERIFICATION


@dataclass(frozen=True, slots=True)
class FetchDecision:
    fetch: bool
    expected_fetch_s: float  # 0 when not measured yet
    expected_recompute_s: float  # 0 when not measured yet

    @property
    def name(self) -> str:
        return "fetch" if self.fetch else "recompute"


class FetchOrRecompute:
    """Moving averages of fetch bandwidth (bytes/s) and prefill speed (tokens/s); thread-safe."""

    def __init__(self, bytes_per_block: int, tokens_per_block: int, weight: float = 0.3) -> None:
        self.bytes_per_block = bytes_per_block
        self.tokens_per_block = tokens_per_block
        self.weight = weight  # of the newest sample
        self.fetch_bytes_per_s: float | None = None
        self.prefill_tokens_per_s: float | None = None
        self._lock = threading.Lock()

    def record_fetch(self, num_bytes: int, seconds: float) -> None:
        if num_bytes > 0 and seconds > 0:
            with self._lock:
                self.fetch_bytes_per_s = self._mix(self.fetch_bytes_per_s, num_bytes / seconds)

    def record_prefill(self, num_tokens: int, seconds: float) -> None:
        if num_tokens > 0 and seconds > 0:
            with self._lock:
                self.prefill_tokens_per_s = self._mix(self.prefill_tokens_per_s, num_tokens / seconds)

    def decide(self, num_blocks: int) -> FetchDecision:
        """Fetch `num_blocks` blocks or compute their tokens, whichever is expected to be faster."""
        fetch_bw, prefill = self.fetch_bytes_per_s, self.prefill_tokens_per_s
        if fetch_bw is None or prefill is None:
            return FetchDecision(True, 0.0, 0.0)
        fetch_s = num_blocks * self.bytes_per_block / fetch_bw
        recompute_s = num_blocks * self.tokens_per_block / prefill
        return FetchDecision(fetch_s <= recompute_s, fetch_s, recompute_s)

    def _mix(self, old: float | None, new: float) -> float:
        return new if old is None else (1 - self.weight) * old + self.weight * new
