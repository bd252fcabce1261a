"""The routed mixture-of-experts block: a router picks k experts per token, each expert runs once over
the tokens routed to it (tokens sorted by expert, one matmul pair per expert), and the weighted
outputs are summed back per token; an optional shared expert sees every token."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from gpu_worker.model.config import MoEConfig
from gpu_worker.model.layers import MLP, activate


class Router(nn.Module):
    """Token -> (weights [T, k] float32, expert ids [T, k] int64), exactly as the family's reference."""

    def __init__(self, hidden_size: int, moe: MoEConfig) -> None:
        super().__init__()
        self.moe = moe
        self.weight = nn.Parameter(torch.empty(moe.num_experts, hidden_size))
        self.bias: nn.Parameter | None = None  # sigmoid routing's score correction (chooses, never weights)
        if moe.router == "sigmoid_grouped":
            self.bias = nn.Parameter(torch.zeros(moe.num_experts))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.bias is None:
            return self._softmax_topk(x)
        return self._sigmoid_grouped(x, self.bias)

    def _softmax_topk(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Granite: top-k of the logits, then a softmax over just those k (float32 whatever the model dtype)."""
        logits = F.linear(x.float(), self.weight.float())  # [T, E]
        top, index = logits.topk(self.moe.top_k, dim=-1)
        return torch.softmax(top, dim=-1), index

    def _sigmoid_grouped(self, x: torch.Tensor, bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Nemotron-H: sigmoid scores; experts chosen by score + bias within the best `topk_group` groups
        (a group scores the sum of its best two); weights are the chosen raw scores, optionally
        normalised, times `routed_scaling_factor`."""
        m = self.moe
        scores = F.linear(x.float(), self.weight.float()).sigmoid()  # [T, E]
        choice = scores + bias.float()
        num_tokens = choice.shape[0]
        grouped = choice.view(num_tokens, m.n_group, m.num_experts // m.n_group)
        group_scores = grouped.topk(2, dim=-1)[0].sum(dim=-1)  # [T, n_group]
        best_groups = group_scores.topk(m.topk_group, dim=-1, sorted=False)[1]
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best_groups, True)
        choice = choice.masked_fill(~keep[:, :, None].expand_as(grouped).reshape(num_tokens, -1), float("-inf"))
        index = choice.topk(m.top_k, dim=-1, sorted=False)[1]
        weights = scores.gather(1, index)
        if m.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * m.routed_scaling_factor, index


class MoE(nn.Module):
    """Routed experts (stacked weights [E, out, in]) plus an optional shared expert."""

    def __init__(self, hidden_size: int, moe: MoEConfig) -> None:
        super().__init__()
        self.activation = moe.activation
        up_width = 2 * moe.intermediate_size if moe.activation == "swiglu" else moe.intermediate_size
        self.router = Router(hidden_size, moe)
        self.experts_up = nn.Parameter(torch.empty(moe.num_experts, up_width, hidden_size))
        self.experts_down = nn.Parameter(torch.empty(moe.num_experts, hidden_size, moe.intermediate_size))
        self.shared: MLP | None = None
        if moe.shared_intermediate_size:
            self.shared = MLP(hidden_size, moe.shared_intermediate_size, moe.shared_activation, moe.shared_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden]."""
        weights, experts = self.router(x)
        out = self.routed(x, weights, experts)
        if self.shared is not None:
            out = out + self.shared(x)
        return out

    def routed(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """Sum over each token's k experts of weight * expert(token), computed expert by expert over the
        tokens sorted by expert id (each expert's tokens are one contiguous run)."""
        num_tokens, top_k = experts.shape
        flat = experts.reshape(-1)
        order = torch.argsort(flat, stable=True)  # (token, slot) pairs grouped by expert
        token = order // top_k
        counts = torch.bincount(flat, minlength=self.experts_up.shape[0]).tolist()
        grouped = x.index_select(0, token)
        outs: list[torch.Tensor] = []
        start = 0
        for expert, n in enumerate(counts):
            if n:
                h = activate(F.linear(grouped[start : start + n], self.experts_up[expert]), self.activation)
                outs.append(F.linear(h, self.experts_down[expert]))
                start += n
        y = torch.cat(outs).float() * weights.reshape(-1).index_select(0, order).float()[:, None]
        out = torch.zeros(num_tokens, x.shape[1], dtype=torch.float32, device=x.device).index_add_(0, token, y)
        return out.to(x.dtype)
