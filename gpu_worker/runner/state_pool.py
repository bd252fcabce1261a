"""The Mamba state pool: per-request live slots plus checkpoint slots, for every Mamba layer.

A row holds, per Mamba layer, the conv state [conv_dim, d_conv - 1] (model dtype: the last d_conv - 1
pre-conv inputs) and the SSM state [heads, head_dim, d_state] (float32).

Lifetimes. A live slot belongs to one running request from `allocate_slot` to `free_slot`; the runner
overwrites it on every chunk of that request (and zeroes it on a chunk that starts at position 0).
A checkpoint slot holds a frozen copy of a live slot's state at a block boundary, from `save_checkpoint`
(or `import_checkpoint`) until `free_checkpoint`; `restore_checkpoint` copies it into a live slot, and
the request then continues from the checkpoint's position with the matching KV pages."""

from __future__ import annotations

import torch

from gpu_worker.model.config import ModelConfig
from gpu_worker.runner.shared_memory import Allocator
from hybridserve.errors import InvalidArgumentError, ResourceExhaustedError


def state_shapes(c: ModelConfig) -> tuple[tuple[int, int], tuple[int, int, int]]:
    """(conv, ssm) state shapes of one Mamba layer for one slot."""
    return (c.conv_dim, c.mamba_d_conv - 1), (c.mamba_n_heads, c.mamba_d_head, c.mamba_d_state)


class MambaStatePool:
    """Storage rows [0, num_slots) are live slots; rows num_slots + c are checkpoint slot c; the
    `num_draft_rows` rows after the checkpoints belong to speculation (`draft_row`)."""

    def __init__(
        self,
        num_slots: int,
        num_checkpoint_slots: int,
        num_layers: int,
        conv_shape: tuple[int, int],
        ssm_shape: tuple[int, int, int],
        conv_dtype: torch.dtype,
        device: torch.device,
        alloc: Allocator | None = None,
        num_draft_rows: int = 0,
    ) -> None:
        """`alloc` makes the storage (zeros; default torch.zeros on `device`), as for KVPagePool.
        `num_draft_rows` rows follow the checkpoints: a speculative step's states after each draft token."""
        if num_slots <= 0 or num_checkpoint_slots < 0 or num_draft_rows < 0:
            raise InvalidArgumentError(
                f"state pool needs >= 1 slot, got {num_slots} (+{num_checkpoint_slots} checkpoints,"
                f" {num_draft_rows} draft rows)"
            )
        self.num_slots, self.num_checkpoint_slots = num_slots, num_checkpoint_slots
        self.num_draft_rows = num_draft_rows
        rows = num_slots + num_checkpoint_slots + num_draft_rows
        zeros = alloc or (lambda shape, dtype: torch.zeros(shape, dtype=dtype, device=device))
        self._conv = zeros((num_layers, rows, *conv_shape), conv_dtype)
        self._ssm = zeros((num_layers, rows, *ssm_shape), torch.float32)
        self._free_slots = list(range(num_slots - 1, -1, -1))
        self._free_checkpoints = list(range(num_checkpoint_slots - 1, -1, -1))

    @staticmethod
    def bytes_per_slot(
        num_layers: int, conv_shape: tuple[int, int], ssm_shape: tuple[int, int, int], conv_dtype: torch.dtype
    ) -> int:
        conv = conv_shape[0] * conv_shape[1] * torch.empty(0, dtype=conv_dtype).element_size()
        ssm = ssm_shape[0] * ssm_shape[1] * ssm_shape[2] * 4
        return num_layers * (conv + ssm)

    def layer_states(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(conv, ssm) views per Mamba layer, indexed by storage row (live slot ids are rows)."""
        return [(self._conv[i], self._ssm[i]) for i in range(self._conv.shape[0])]

    def stacked_states(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(conv [layers, rows, conv_dim, K-1], ssm [layers, rows, H, P, N]): the storage layer_states views."""
        return self._conv, self._ssm

    # ---- live slots -------------------------------------------------------------------------------
    @property
    def num_free_slots(self) -> int:
        return len(self._free_slots)

    def allocate_slot(self) -> int:
        if not self._free_slots:
            raise ResourceExhaustedError(f"state pool: all {self.num_slots} slots are in use")
        return self._free_slots.pop()

    def free_slot(self, slot_id: int) -> None:
        self._check_slot(slot_id)
        if slot_id in self._free_slots:
            raise InvalidArgumentError(f"state pool: slot {slot_id} freed twice")
        self._free_slots.append(slot_id)

    def zero_slots(self, slot_ids: torch.Tensor) -> None:
        """Reset live slots (int64 tensor of ids on the pool's device) to the zero initial state."""
        self._conv.index_fill_(1, slot_ids, 0)
        self._ssm.index_fill_(1, slot_ids, 0)

    # ---- checkpoint slots ---------------------------------------------------------------------------
    @property
    def num_free_checkpoints(self) -> int:
        return len(self._free_checkpoints)

    def allocate_checkpoint(self) -> int:
        if not self._free_checkpoints:
            raise ResourceExhaustedError(f"state pool: all {self.num_checkpoint_slots} checkpoint slots are in use")
        return self._free_checkpoints.pop()

    def free_checkpoint(self, checkpoint_id: int) -> None:
        self._check_checkpoint(checkpoint_id)
        if checkpoint_id in self._free_checkpoints:
            raise InvalidArgumentError(f"state pool: checkpoint {checkpoint_id} freed twice")
        self._free_checkpoints.append(checkpoint_id)

    def save_checkpoint(self, slot_id: int, checkpoint_id: int) -> None:
        """Copy a live slot's current state (all layers) into a checkpoint slot."""
        self._copy_row(self._check_slot(slot_id), self._check_checkpoint(checkpoint_id))

    def restore_checkpoint(self, checkpoint_id: int, slot_id: int) -> None:
        """Copy a checkpoint into a live slot; the checkpoint stays valid."""
        self._copy_row(self._check_checkpoint(checkpoint_id), self._check_slot(slot_id))

    def export_checkpoint(self, checkpoint_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """CPU copies (conv [layers, conv_dim, K-1], ssm [layers, H, P, N]) for the shared cache tier."""
        row = self._check_checkpoint(checkpoint_id)
        return self._conv[:, row].to("cpu", copy=True), self._ssm[:, row].to("cpu", copy=True)

    def checkpoint_layout(self) -> tuple[tuple[tuple[int, ...], torch.dtype], tuple[tuple[int, ...], torch.dtype]]:
        """((conv shape, dtype), (ssm shape, dtype)) of what `export_checkpoint` returns."""
        conv_shape = (self._conv.shape[0], *self._conv.shape[2:])
        ssm_shape = (self._ssm.shape[0], *self._ssm.shape[2:])
        return (tuple(conv_shape), self._conv.dtype), (tuple(ssm_shape), self._ssm.dtype)

    def import_checkpoint(self, checkpoint_id: int, conv: torch.Tensor, ssm: torch.Tensor) -> None:
        """Write tensors from `export_checkpoint` (possibly of another worker) into a checkpoint slot."""
        row = self._check_checkpoint(checkpoint_id)
        if conv.shape != self._conv[:, row].shape or ssm.shape != self._ssm[:, row].shape:
            raise InvalidArgumentError(
                f"state pool: checkpoint shapes {list(conv.shape)}/{list(ssm.shape)} do not match this model "
                f"({list(self._conv[:, row].shape)}/{list(self._ssm[:, row].shape)})"
            )
        self._conv[:, row].copy_(conv)
        self._ssm[:, row].copy_(ssm)

    def checkpoint_row(self, checkpoint_id: int) -> int:
        """The storage row of a checkpoint slot (the mixers write boundary states there)."""
        return self._check_checkpoint(checkpoint_id)

    # ---- draft rows ---------------------------------------------------------------------------------
    def draft_row(self, index: int) -> int:
        """The storage row of draft row `index` (a speculative step's state after one draft token)."""
        if not 0 <= index < self.num_draft_rows:
            raise InvalidArgumentError(f"state pool: draft row {index} outside [0, {self.num_draft_rows})")
        return self.num_slots + self.num_checkpoint_slots + index

    def restore_draft_row(self, index: int, slot_id: int) -> None:
        """Copy a draft row into a live slot: the state after the last accepted draft token."""
        self._copy_row(self.draft_row(index), self._check_slot(slot_id))

    def _copy_row(self, src: int, dst: int) -> None:
        self._conv[:, dst].copy_(self._conv[:, src])
        self._ssm[:, dst].copy_(self._ssm[:, src])

    def _check_slot(self, slot_id: int) -> int:
        if not 0 <= slot_id < self.num_slots:
            raise InvalidArgumentError(f"state pool: slot id {slot_id} outside [0, {self.num_slots})")
        return slot_id

    def _check_checkpoint(self, checkpoint_id: int) -> int:
        if not 0 <= checkpoint_id < self.num_checkpoint_slots:
            raise InvalidArgumentError(
                f"state pool: checkpoint id {checkpoint_id} outside [0, {self.num_checkpoint_slots})"
            )
        return self.num_slots + checkpoint_id
