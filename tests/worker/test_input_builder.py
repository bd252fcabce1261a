"""The decode group's tables (input_builder._decode_tables) against their definition, element by
element: the page table padded with page 0, the causal mask over the padded width, the positions,
and the KV slot each new token is written to."""

from __future__ import annotations

import random

import torch

from gpu_worker.runner.batch import SequenceChunk
from gpu_worker.runner.input_builder import _decode_tables


def test_decode_tables_match_their_definition() -> None:
    rng = random.Random(0)
    for _ in range(100):
        page = rng.choice([1, 4, 16])
        seqs = []
        for slot in range(rng.randint(1, 12)):
            start = rng.randint(0, 200)
            num_pages = start // page + 1 + rng.randint(0, 2)  # allocation may run ahead of the position
            seqs.append(SequenceChunk((7,), start, tuple(rng.sample(range(1000), num_pages)), slot))
        table, mask, pos, slots = _decode_tables(seqs, page)
        width = max(-(-(s.start_pos + 1) // page) for s in seqs)
        assert table.dtype == pos.dtype == slots.dtype == torch.int64 and mask.dtype == torch.bool
        assert table.shape == (len(seqs), width) and mask.shape == (len(seqs), 1, 1, width * page)
        for i, s in enumerate(seqs):
            expected_row = [*s.page_ids[:width], *[0] * (width - len(s.page_ids[:width]))]
            assert table[i].tolist() == expected_row
            assert mask[i, 0, 0].tolist() == [k <= s.start_pos for k in range(width * page)]
            assert pos[i].item() == s.start_pos
            assert slots[i].item() == s.page_ids[s.start_pos // page] * page + s.start_pos % page


def test_no_decodes_give_empty_tables() -> None:
    table, mask, pos, slots = _decode_tables([], 16)
    assert table.shape == (0, 1) and mask.shape == (0, 1, 1, 16) and pos.numel() == slots.numel() == 0
