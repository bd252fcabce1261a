"""The scheduler configuration and its validation.

Derived values (the quantum, whether the sub-block exception holds) are properties, computed from
the fields by the rules in `scheduler_svc.core.rules`; `validate()` raises InvalidArgumentError
naming the field, the value and what would be accepted.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

from hybridserve.errors import InvalidArgumentError
from scheduler_svc.core import rules
from scheduler_svc.core.share import PrefillShareMode


class MambaCacheMode(enum.IntEnum):
    """How recurrent state is checkpointed (values match the wire enum)."""

    NONE = 0  # no recurrent state to checkpoint: chunks may end anywhere
    ALIGN = 1  # state is saved only where a step ends on a multiple of block_size


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    # The defaults are the worker's (its flags are derived from these fields: scheduler_svc/flags.py).
    max_num_batched_tokens: int = 2048  # tokens (prefill + decode) one step may compute
    max_num_seqs: int = 32  # requests one step may run (also the worker's Mamba state slots)
    long_prefill_token_threshold: int = 0  # per-request cap on a prefill chunk, tokens; 0 = none
    max_num_prefill_tokens_per_step: int = 0  # micro-slicing: prefill tokens of a step with decodes, at most; 0 = off
    block_size: int = 256  # checkpoint / prefix-cache grid, tokens
    mamba_block_size: int = 64  # recurrent block, tokens
    mamba_cache_mode: MambaCacheMode = MambaCacheMode.ALIGN
    kv_page_size: int = 16  # KV capacity unit, tokens
    stop_at_last_boundary: bool = False  # ALIGN: the prompt-finishing chunk stops at its last block boundary
    # Micro-slicing caps only the prompts longer than its budget; shorter ones take the rest of the
    # step as plain chunked prefill gives it (off: every prefill token of the step counts)
    micro_slice_long_prompts_only: bool = False
    # The prefill compute share (scheduler_svc/core/share.py): prefill's target share of the service
    # time while both classes are runnable, which sets a mixed step's prefill budget
    prefill_share_mode: PrefillShareMode = PrefillShareMode.OFF
    prefill_share: float = 0.5  # FIXED: the target share (0..1); AUTO: where the target starts
    prefill_share_min: float = 0.2  # AUTO: the lowest target
    prefill_share_max: float = 0.8  # AUTO: the highest target
    prefill_share_deadband: float = 0.1  # AUTO: the target stays while the backlog's share is this close
    prefill_share_half_life_s: float = 2.0  # decay of the service times, seconds
    prefill_share_slew_per_s: float = 0.05  # AUTO: the most the target moves in a second

    @property
    def sliced_prompt_threshold(self) -> int:
        """Prompts longer than this share a mixed step's prefill budget (rules.sliced_prompt_threshold)."""
        return rules.sliced_prompt_threshold(self.max_num_prefill_tokens_per_step, self.micro_slice_long_prompts_only)

    @property
    def has_prefill_share(self) -> bool:
        return self.prefill_share_mode != PrefillShareMode.OFF

    @property
    def is_aligned(self) -> bool:
        """Whether non-final prefill chunks must end on the block_size grid."""
        return self.mamba_cache_mode == MambaCacheMode.ALIGN

    @property
    def checkpoints_prompt_blocks(self) -> bool:
        """Whether chunks stop at a prompt's last block boundary (rules.stop_at_last_boundary)."""
        return self.stop_at_last_boundary and self.is_aligned

    @property
    def sub_block_exception(self) -> bool:
        """Whether a chunk may advance less than one block (see rules.holds_sub_block_exception)."""
        return self.is_aligned and rules.holds_sub_block_exception(
            self.block_size, self.max_num_batched_tokens, self.long_prefill_token_threshold
        )

    @property
    def quantum(self) -> int:
        """The allocation unit of micro-slicing, tokens (see rules.quantum_tokens)."""
        return rules.quantum_tokens(self.is_aligned, self.sub_block_exception, self.block_size, self.mamba_block_size)

    def validate(self) -> SchedulerConfig:
        """Raises InvalidArgumentError on the first inconsistency; returns self when valid."""
        for name in ("max_num_batched_tokens", "max_num_seqs", "block_size", "kv_page_size"):
            _require(getattr(self, name) > 0, name, getattr(self, name), "must be > 0")
        for name in ("long_prefill_token_threshold", "max_num_prefill_tokens_per_step"):
            _require(getattr(self, name) >= 0, name, getattr(self, name), "must be >= 0 (0 turns it off)")
        _require(
            self.block_size % self.kv_page_size == 0,
            "kv_page_size",
            self.kv_page_size,
            f"must divide block_size ({self.block_size}) so that cache blocks are whole KV pages",
        )
        if self.is_aligned:
            _require(
                self.mamba_block_size > 0,
                "mamba_block_size",
                self.mamba_block_size,
                "must be > 0 when mamba_cache_mode is ALIGN",
            )
            _require(
                self.block_size % self.mamba_block_size == 0,
                "block_size",
                self.block_size,
                f"must be a multiple of mamba_block_size ({self.mamba_block_size}) when mamba_cache_mode is ALIGN",
            )
        elif self.mamba_block_size < 0:
            _require(False, "mamba_block_size", self.mamba_block_size, "must be >= 0")
        budget, quantum = self.max_num_prefill_tokens_per_step, self.quantum
        _require(
            budget % quantum == 0,
            "max_num_prefill_tokens_per_step",
            budget,
            f"must be a multiple of the prefill quantum {quantum} (lcm of mamba_block_size and block_size"
            f" while chunks must end on the block grid); use {_nearest_multiples(budget, quantum)}",
        )
        if self.has_prefill_share:
            self._validate_share()
        return self

    def _validate_share(self) -> None:
        for name in ("prefill_share", "prefill_share_min", "prefill_share_max", "prefill_share_deadband"):
            value = getattr(self, name)
            _require(math.isfinite(value) and 0.0 <= value < 1.0, name, value, "must be within [0, 1)")
        _require(
            self.prefill_share_min <= self.prefill_share_max,
            "prefill_share_min",
            self.prefill_share_min,
            f"must be <= prefill_share_max ({self.prefill_share_max})",
        )
        for name in ("prefill_share_half_life_s", "prefill_share_slew_per_s"):
            value = getattr(self, name)
            _require(math.isfinite(value) and value > 0, name, value, "must be > 0 seconds")
        _require(
            not self.micro_slice_long_prompts_only,
            "micro_slice_long_prompts_only",
            self.micro_slice_long_prompts_only,
            "must be off with a prefill share: the share counts every prefill token of a step",
        )

    def warnings(self) -> list[str]:
        """Valid but probably unintended settings, one sentence each."""
        found: list[str] = []
        if self.is_aligned and not self.sub_block_exception and self.max_num_batched_tokens < 2 * self.quantum:
            found.append(
                f"max_num_batched_tokens {self.max_num_batched_tokens} is below two quanta"
                f" ({2 * self.quantum}): once decodes run, prefills get less than one quantum and wait for"
                " the decodes to finish"
            )
        if 0 < self.max_num_batched_tokens < self.max_num_prefill_tokens_per_step:
            found.append(
                f"max_num_prefill_tokens_per_step {self.max_num_prefill_tokens_per_step} exceeds"
                f" max_num_batched_tokens {self.max_num_batched_tokens}; the smaller one applies"
            )
        return found


def _require(ok: bool, field: str, value: object, why: str) -> None:
    if not ok:
        raise InvalidArgumentError(f"config.{field} = {value} {why}")


def _nearest_multiples(value: int, quantum: int) -> str:
    lower = value // quantum * quantum
    upper = lower + quantum
    return f"{lower} or {upper}" if lower > 0 else str(upper)
