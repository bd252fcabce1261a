"""Multi-token prediction, runner side: the MTP head (gpu_worker.model.model.MtpHead) proposes each row's
drafts for the next step, right after this step's tokens are sampled and verified.

The head at position i reads the model's final hidden state h_i and the token t_{i+1}, and predicts
t_{i+2}. Its attention blocks keep KV of their own, in the same pages as the model's (the pool's last
layers), so that KV must cover every position the model computed for the request. Per row that uses
the head (SequenceChunk.mtp_drafts >= 0), after sampling:

- catch-up  the head runs over the positions the step computed for the row, each with the token after
            it: a prefill chunk's own tokens shifted by one, then the prompt token after the chunk
            (`next_token`) or the token the step sampled; a verified row's newest token and accepted
            drafts, then the model's own token after them (rejected positions are left out). Its output
            at the last position gives the first draft (the argmax: a point-mass draft, so the
            verification's output is that of speculation off).
- chain     each further draft is the head run on its own output at the next position, with the draft
            before it as the token. Those positions lie past what the request computed, in pages the
            engine gave the row for them (gpu_worker.engine.speculation; a chain stops where the row's
            pages end), and the next step's catch-up writes the true values over them before anything
            attends to them.

A prefix-cache hit brings the head's KV with the model's (same pages), except at the hit's last position,
whose head KV was written with the token that followed it in the request that cached it: a draft may be
worse for it, never the output. The head only proposes; the runner's verification keeps the output
exact whatever it proposes."""

from __future__ import annotations

import torch

from gpu_worker.model.model import HybridForCausalLM, KVCaches
from gpu_worker.runner.batch import Batch, ForwardOutput, SequenceChunk
from gpu_worker.runner.input_builder import build_inputs
from gpu_worker.runner.sampling import StepOutput, StepSampling

Proposals = tuple[tuple[int, tuple[int, ...]], ...]


class MtpProposer:
    """Runs the MTP head after a step (module docstring). `kv_caches`: the head's attention blocks' (k, v)."""

    def __init__(
        self,
        model: HybridForCausalLM,
        kv_caches: KVCaches,
        page_size: int,
        num_slots: int,
        max_drafts: int,
        device: torch.device,
    ) -> None:
        self.model, self.kv_caches = model, kv_caches
        self.page_size, self.num_slots, self.device = page_size, num_slots, device
        self.max_drafts = max_drafts

    @torch.inference_mode()
    def propose(self, batch: Batch, out: ForwardOutput, sampling: StepSampling, sampled: StepOutput) -> Proposals:
        """(batch row, drafts) of every row with SequenceChunk.mtp_drafts > 0; writes the head's KV of every
        row with mtp_drafts >= 0."""
        assert out.hidden is not None
        token_of = dict(zip(sampling.rows, sampled.token_ids, strict=True))
        verified = {v.row: v for v in sampled.drafts}
        rows: list[int] = []
        chunks: list[SequenceChunk] = []
        sources: list[int] = []  # first packed index of each catch-up chunk's hidden states in the forward
        for i, seq in enumerate(batch.sequences):
            if seq.mtp_drafts < 0:
                continue
            if seq.num_draft_tokens:
                tokens = (*verified[i].token_ids, token_of[i])
            else:
                after = token_of.get(i, seq.next_token)
                tokens = seq.token_ids[1:] + ((after,) if after >= 0 else ())
            if not tokens:
                continue
            rows.append(i)
            chunks.append(SequenceChunk(tokens, seq.start_pos, seq.page_ids, seq.state_slot))
            sources.append(out.token_start[i])
        if not chunks:
            return ()
        packed = build_inputs(Batch(tuple(chunks)), self.page_size, self.num_slots, self.device)
        index = [0] * len(packed.input_ids)
        for chunk, start, source in zip(chunks, packed.token_start, sources, strict=True):
            index[start : start + len(chunk.token_ids)] = range(source, source + len(chunk.token_ids))
        hidden = out.hidden.index_select(0, torch.tensor(index, device=out.hidden.device))
        head = self.model.mtp_forward(packed.input_ids, hidden, packed.ctx, self.kv_caches)
        last = head.index_select(0, packed.last_index)  # [chunks, hidden]: the output at each row's last position
        wanted = [c for c, i in enumerate(rows) if batch.sequences[i].mtp_drafts > 0]
        if not wanted:
            return ()
        hidden = last[wanted]
        drafts: list[list[int]] = [[t] for t in self.model.compute_logits(hidden).argmax(-1).tolist()]
        # the chain: (index into `wanted`, the position after its last computed one, the drafts it wants),
        # each cut to the positions its pages hold
        chain: list[tuple[int, int, int]] = []
        for w, c in enumerate(wanted):
            seq = batch.sequences[rows[c]]
            after = chunks[c].start_pos + len(chunks[c].token_ids)
            want = min(seq.mtp_drafts, self.max_drafts, len(seq.page_ids) * self.page_size - after + 1)
            if want >= 2:
                chain.append((w, after, want))
        for step in range(1, self.max_drafts):
            chain = [(w, after, want) for w, after, want in chain if want > step]
            if not chain:
                break
            seqs = batch.sequences
            steps = tuple(
                SequenceChunk((drafts[w][-1],), after + step - 1, seqs[rows[wanted[w]]].page_ids,
                              seqs[rows[wanted[w]]].state_slot)
                for w, after, _ in chain
            )  # fmt: skip
            packed = build_inputs(Batch(steps), self.page_size, self.num_slots, self.device)
            ordered = [w for w, _, _ in chain]
            inputs = hidden.index_select(0, torch.tensor(ordered, device=hidden.device))  # batch order
            # the decode group is packed by state slot: gather the inputs into that order
            inputs = inputs.index_select(0, _inverse(packed.last_index, hidden.device))
            step_out = self.model.mtp_forward(packed.input_ids, inputs, packed.ctx, self.kv_caches)
            step_out = step_out.index_select(0, packed.last_index)  # back to batch order
            for (w, _, _), token in zip(chain, self.model.compute_logits(step_out).argmax(-1).tolist(), strict=True):
                drafts[w].append(token)
            hidden = hidden.index_copy(0, torch.tensor(ordered, device=hidden.device), step_out)
        return tuple((rows[c], tuple(drafts[w])) for w, c in enumerate(wanted))


def _inverse(last_index: torch.Tensor, device: torch.device) -> torch.Tensor:
    """For a decode-only packing (`last_index`: batch row -> packed index), packed index -> batch row."""
    inverse = torch.empty_like(last_index)
    inverse[last_index] = torch.arange(len(last_index), device=last_index.device)
    return inverse.to(device)
