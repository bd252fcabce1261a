"""A whole decode step as one traceable function: token ids to float32 logits, for torch.compile.

The eager forward (gpu_worker.model.model) serves every step shape: it plans decode attention on the
host, walks runs of state slots, calls oneDNN per projection, and each of those is Python between small
kernels. A decode step of one row of the benchmark model spends most of its time there, not in
arithmetic (bench/bench_roofline.py). This function is the same math for a decode-only step written
without any host decision: no `.tolist()`, no data-dependent shape, every index a tensor. Dynamo traces
it once through every layer (the loop over blocks unrolls), and inductor turns it into one C++ program
of fused loops around the matmuls (gpu_worker.model.backends.cpu.compiled_step compiles and serves it).

Per layer kind, for b decode rows (row i at position p_i, state row s_i, page table T_i):
    mamba      in_proj; the conv window and SSM state of rows s_i gathered, stepped
               (decode_fused.mamba_decode_step) and written back in place; out_proj
    attention  q/k/v projections, RoPE at p_i, K/V written at slot T_i[p_i // page] * page + p_i % page,
               then SDPA over the gathered pages of T_i, keys after p_i masked (inductor calls the CPU
               flash kernel; two einsums around a softmax cost 4 ms a layer more at 32 rows); o_proj
    mlp        the dense MLP module
    moe        the router, then each row's k experts' weights gathered and applied (k weight reads per
               row, no host loop over experts); the shared expert
Equal to the eager forward up to float32 summation order (tests/model/test_compiled_step.py).

`verify_logits` is the same step for rows of up to L tokens each (speculative decoding's verify rows: the
newest token and its drafts, gpu_worker.runner.speculation; plain decode rows beside them), padded to L:
    mamba      the conv over [conv state | the row's L inputs]; the SSD recurrence over the L positions
               in closed form (short_scan.scan_spans, dt = 0 at padded positions, so they leave the state
               as it is); the final state written in place, the conv state cut after the row's last real
               token; the start states and the scan's inputs returned, so that a rejected draft's row is
               rebuilt without a second forward (short_scan.ShortSpanRecord, as the eager path keeps)
    attention  K/V of each real position written at its slot; a padded position writes its row's last
               real position's K/V again, at that slot (the same values: the order of the writes does not
               matter); then each position attends over its row's pages, keys after it masked (with the
               CUDA backend's kernels attached, through its paged decode kernel, a decode row a position
               reading only the keys up to it: gpu_worker.runner.cuda_graphs.VerifyGraphs replays this
               function, as it stands, under CUDA graphs)
Logits at every position (verification samples each one)."""

from __future__ import annotations

from typing import cast

import torch
import torch.nn.functional as F

from gpu_worker.model.attention import PagedAttention
from gpu_worker.model.backends.cpu import ssm_update
from gpu_worker.model.backends.cpu.decode_fused import decode_inputs, gated_norm, mamba_decode_step
from gpu_worker.model.backends.cpu.linear import OneDnnLinear, packed_linear
from gpu_worker.model.backends.cpu.logit_stats import logit_stats_op
from gpu_worker.model.backends.cpu.short_scan import scan_spans
from gpu_worker.model.layers import MLP, activate, apply_rope, rope_cos_sin
from gpu_worker.model.mamba2 import Mamba2Mixer
from gpu_worker.model.model import Block, HybridForCausalLM, KVCaches, StateTensors
from gpu_worker.model.moe import MoE

# Projections of at least ONEDNN_MIN_BYTES of float32 weight go to oneDNN from ONEDNN_ROWS rows, the rest
# to F.linear (MKL's sgemm). MKL's few-row path reads a large weight far below the bandwidth, and its
# one-row sgemv runs on one thread: a 100,352 x 768 LM head at 8 rows, one thread, Intel, 67.8 ms by
# F.linear, 36.5 ms by oneDNN on the plain weight; at one row on two threads, AMD EPYC, 23.4 ms against
# 10.8 ms (linear.PLAIN_FEW_ROWS_BYTES). On small weights oneDNN's per-call reorder of the
# plain weight costs more than it saves: benchmark model, whole step at 8 rows 6.57 ms with F.linear
# throughout, 10.36 ms with oneDNN from 512 KB. The 100k-vocab model's 8-row step: 120 ms with F.linear
# throughout, 79 ms with oneDNN from 2 MB, 76 ms from 512 KB, 88 ms for the LM head alone (16 MB).
ONEDNN_ROWS = 1
ONEDNN_MIN_BYTES = 2 << 20
# From this many rows a projection the eager forward packs takes its pack here too (linear.packed_linear). On
# AMD cores MKL's sgemm takes its AVX2 path and oneDNN's prepacked AVX-512 one runs the benchmark model's
# projections about twice as fast at 8 to 32 rows (linear's tables); at one row the extern call's dispatch
# (about 11 us, 37 projections a step) outweighs it.
PACKED_ROWS = 2
# bfloat16 weights of at least PACKED_ONE_ROW_BYTES take their pack from one row too: F.linear in bfloat16
# is oneDNN on the plain weight, reordered every call. One row, two threads, AMD EPYC (AVX-512 BF16), us,
# F.linear against packed: 768 -> 3,080 122 / 57, the 100,352 x 768 head 8.9 / 6.2 ms. Smaller weights
# gain less than the extern call costs: the benchmark model's one-row program, 3.43 ms with F.linear
# throughout, 4.01 ms with packs from 512 KB (256 -> 1,160 and 256 -> 1,024).
PACKED_ONE_ROW_BYTES = 2 << 20


def linear(module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The module's projection: where the eager forward packs it (OneDnnLinear), on its prepacked weight
    from PACKED_ROWS rows, as there (bfloat16 weights of at least PACKED_ONE_ROW_BYTES from one row); else on
    its plain weight, oneDNN from ONEDNN_ROWS rows or F.linear."""
    projection = cast(torch.nn.Linear, module)
    if isinstance(module, OneDnnLinear) and module.packs and x.dtype == module.weight.dtype:
        size = module.weight.numel() * module.weight.element_size()
        few = 1 if x.dtype == torch.bfloat16 and size >= PACKED_ONE_ROW_BYTES else PACKED_ROWS
        if x.shape[0] >= max(few, module.min_rows):
            return cast(torch.Tensor, packed_linear(x, projection.weight, projection.bias))
    return project(x, projection.weight, projection.bias)


@torch.library.custom_op("hybridserve::onednn_linear", mutates_args=())
def onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """oneDNN's linear on a plain weight, opaque to inductor (its own lowering of the op wants a frozen,
    prepacked weight): a call of the program's, not a loop of its own."""
    out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return out


@onednn_linear.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty(x.shape[0], weight.shape[0])


def project(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [rows, in] @ weight [out, in]^T (+ bias): oneDNN from ONEDNN_ROWS rows for weights of at least
    ONEDNN_MIN_BYTES (float32), else F.linear (MKL)."""
    big = weight.numel() * weight.element_size() >= ONEDNN_MIN_BYTES
    if x.shape[0] >= ONEDNN_ROWS and big and weight.dtype == torch.float32 and weight.device.type == "cpu":
        return cast(torch.Tensor, onednn_linear(x, weight, bias))
    return F.linear(x, weight, bias)


def mamba_decode(
    mixer: Mamba2Mixer, h: torch.Tensor, state_slots: torch.Tensor, conv: torch.Tensor, ssm: torch.Tensor
) -> torch.Tensor:
    """h [b, hidden] -> [b, hidden]; pool rows `state_slots` of conv [rows, conv_dim, K-1] and ssm
    [rows, H, P, N] advanced one token in place (a slot given twice gets the same values twice). The SSM
    state through ssm_update's kernel where it is loaded: one pass over the rows, in place (its module
    docstring); else gathered, stepped and scattered back in torch."""
    from gpu_worker.model.backends.cpu.compiled_decode import mixer_dims

    dims = mixer_dims(mixer)
    zxbcdt = linear(mixer.in_proj, h)
    conv_rows = conv.index_select(0, state_slots)
    weight = mixer.conv1d.weight[:, 0, :]
    if ssm_update.LOADED:
        z, x, B, C, dt, decay = decode_inputs(
            zxbcdt, conv_rows, weight, mixer.conv1d.bias, mixer.dt_bias, mixer.A_log, dims
        )  # fmt: skip
        conv.index_copy_(0, state_slots, conv_rows)
        y = torch.ops.hybridserve.ssm_decode_update(ssm, state_slots, x, dt, decay, B, C, mixer.D.float())
        out = gated_norm(y.view(h.shape[0], dims.d_inner), z, mixer.norm.weight, dims)
        return linear(mixer.out_proj, out)
    ssm_rows = ssm.index_select(0, state_slots)
    y = mamba_decode_step(
        zxbcdt, conv_rows, ssm_rows, weight, mixer.conv1d.bias, mixer.dt_bias, mixer.A_log, mixer.D,
        mixer.norm.weight, dims,
    )  # fmt: skip
    conv.index_copy_(0, state_slots, conv_rows)
    ssm.index_copy_(0, state_slots, ssm_rows)
    return linear(mixer.out_proj, y)


def attention_decode(
    attn: PagedAttention,
    h: torch.Tensor,
    cos: torch.Tensor | None,
    sin: torch.Tensor | None,
    positions: torch.Tensor,
    write_slots: torch.Tensor,
    page_table: torch.Tensor,
    page_size: int,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
) -> torch.Tensor:
    """h [b, hidden] -> [b, hidden]; this step's K/V written at `write_slots`, then each row attends over
    its pages (page_table [b, W], W * page_size >= position + 1)."""
    b = h.shape[0]
    kvh, group, d = attn.num_kv_heads, attn.group, attn.head_dim
    q = linear(attn.q_proj, h).view(b, attn.num_heads, d)
    k = linear(attn.k_proj, h).view(b, kvh, d)
    if cos is not None and sin is not None:
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    v = linear(attn.v_proj, h).view(b, kvh, d)
    k_cache.index_copy_(0, write_slots, k)
    v_cache.index_copy_(0, write_slots, v)
    width = page_table.shape[1] * page_size
    pages = page_table.reshape(-1)
    keys = k_cache.view(-1, page_size, kvh, d).index_select(0, pages).view(b, width, kvh, d)
    values = v_cache.view(-1, page_size, kvh, d).index_select(0, pages).view(b, width, kvh, d)
    qg = q.view(b, kvh, group, d)
    visible = torch.arange(width, device=h.device)[None, :] <= positions[:, None]  # [b, width]
    out = F.scaled_dot_product_attention(
        qg, keys.transpose(1, 2), values.transpose(1, 2), attn_mask=visible[:, None, None, :], scale=attn.scale
    )  # [b, kvh, g, d]
    return linear(attn.o_proj, out.reshape(b, attn.num_heads * d))


def moe_decode(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    """x [b, hidden] -> [b, hidden]: each row's k chosen experts, their weights gathered per row."""
    weights, experts = moe.router(x)  # [b, k] float32, [b, k] int64
    up = moe.experts_up.index_select(0, experts.reshape(-1))  # [b * k, up, hidden]
    down = moe.experts_down.index_select(0, experts.reshape(-1))  # [b * k, hidden, I]
    b, k = experts.shape
    xs = x.repeat_interleave(k, dim=0)  # [b * k, hidden]
    hmid = activate(torch.bmm(up, xs[:, :, None])[:, :, 0], moe.activation)  # [b * k, I]
    y = torch.bmm(down, hmid[:, :, None])[:, :, 0].float()  # [b * k, hidden]
    out: torch.Tensor = (y.view(b, k, -1) * weights[:, :, None]).sum(dim=1).to(x.dtype)
    if moe.shared is not None:
        out = out + mlp_decode(moe.shared, x)
    return out


def mlp_decode(mlp: MLP, x: torch.Tensor) -> torch.Tensor:
    return linear(mlp.down_proj, activate(linear(mlp.up_proj, x), mlp.activation))


def decode_tokens(
    model: HybridForCausalLM,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    write_slots: torch.Tensor,
    state_slots: torch.Tensor,
    page_table: torch.Tensor,
    page_size: int,
    kv_caches: KVCaches,
    states: StateTensors,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One decode token per row: input_ids, positions, write_slots, state_slots [b] int64, page_table
    [b, W] int64 -> (float32 logits [b, vocab], each row's first maximal index [b] int64 and logsumexp [b]
    float32, from the sampler's kernel: logit_stats; the final hidden states [b, hidden], after the final
    norm, which the MTP head reads: gpu_worker.runner.mtp). A plain row's token and its log-probability (logits[token]
    - logsumexp) are thus chosen in the program; the sampler reads them (sampling.sample_rows' `stats`), and
    rows with controls, masks or alternatives take their tokens from the logits, as after an eager step. The
    pools are updated in place, row after row: a row that repeats a later row's inputs (a bucket's padding,
    gpu_worker.model.backends.cpu.compiled_step) is overwritten by it."""
    c = model.config
    hidden = F.embedding(input_ids, model.embed.weight)
    if c.embedding_multiplier != 1.0:
        hidden = hidden * c.embedding_multiplier
    cos = sin = None
    if c.rotary_dim:
        cos, sin = rope_cos_sin(positions, model.inv_freq, hidden.dtype)
    attn_i = mamba_i = 0
    for module in model.blocks:
        block = cast(Block, module)
        h = block.norm(hidden)
        if block.kind == "mamba":
            conv, ssm = states[mamba_i]
            h = mamba_decode(cast(Mamba2Mixer, block.mixer), h, state_slots, conv, ssm)
            mamba_i += 1
        elif block.kind == "attention":
            k_cache, v_cache = kv_caches[attn_i]
            attn = cast(PagedAttention, block.mixer)
            h = attention_decode(attn, h, cos, sin, positions, write_slots, page_table, page_size, k_cache, v_cache)
            attn_i += 1
        elif block.kind == "moe":
            h = moe_decode(cast(MoE, block.mixer), h)
        else:
            h = mlp_decode(cast(MLP, block.mixer), h)
        hidden = hidden + (h if c.residual_multiplier == 1.0 else h * c.residual_multiplier)
    final = model.final_norm(hidden)
    logits = linear(model.lm_head, final).float()
    if c.logits_scaling != 1.0:
        logits = logits / c.logits_scaling
    first_max, lse = logit_stats_op(logits)
    return logits, first_max, lse, final


# What a Mamba layer of a verify step returns for the rollback: its start states [b, H, P, N], a [b, H, L],
# xdt [b, H, L, P], B [b, H, L, N] (short_scan.ShortSpans) and the conv window [b, conv_dim, K-1+L].
STACK = False
SpanTensors = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def mamba_verify(
    mixer: Mamba2Mixer, h: torch.Tensor, lengths: torch.Tensor, state_slots: torch.Tensor, conv: torch.Tensor,
    ssm: torch.Tensor,
) -> tuple[torch.Tensor, SpanTensors]:  # fmt: skip
    """h [b * L, hidden] -> ([b * L, hidden], the layer's SpanTensors); rows of lengths[i] <= L real tokens.
    Pool rows `state_slots` of conv [rows, conv_dim, K-1] and ssm [rows, H, P, N] end after each row's
    last real token."""
    from gpu_worker.model.backends.cpu.compiled_decode import mixer_dims

    d = mixer_dims(mixer)
    b = state_slots.shape[0]
    length = h.shape[0] // b
    zxbcdt = linear(mixer.in_proj, h)
    z, xbc, dt = torch.split(zxbcdt, [d.d_inner, d.conv_dim, d.num_heads], dim=-1)
    window = torch.cat([conv.index_select(0, state_slots), xbc.view(b, length, d.conv_dim).transpose(1, 2)], dim=-1)
    weight = mixer.conv1d.weight[:, 0, :]  # [conv_dim, K]
    width = weight.shape[1]
    mixed = sum(window[:, :, k : k + length] * weight[None, :, k : k + 1] for k in range(width))
    assert isinstance(mixed, torch.Tensor)
    if mixer.conv1d.bias is not None:
        mixed = mixed + mixer.conv1d.bias[None, :, None]
    keep = torch.arange(width - 1, device=h.device)[None, None, :] + lengths[:, None, None]  # after the last real
    conv.index_copy_(0, state_slots, window.gather(2, keep.expand(b, d.conv_dim, width - 1)))
    xbc = F.silu(mixed).transpose(1, 2)  # [b, L, conv_dim]
    gn = d.num_groups * d.state_size
    per_group = d.num_heads // d.num_groups
    x = xbc[..., : d.d_inner].float().reshape(b, length, d.num_heads, d.head_dim).transpose(1, 2)  # [b, H, L, P]
    B, C = (
        part.float().reshape(b, length, d.num_groups, d.state_size).repeat_interleave(per_group, dim=2).transpose(1, 2)
        for part in (xbc[..., d.d_inner : d.d_inner + gn], xbc[..., d.d_inner + gn :])
    )  # [b, H, L, N]
    real = torch.arange(length, device=h.device)[None, :] < lengths[:, None]  # [b, L]
    dt = torch.clamp(F.softplus(dt.float() + mixer.dt_bias.float()), d.dt_min, d.dt_max).view(b, length, -1)
    dts = (dt * real[..., None]).transpose(1, 2)  # [b, H, L]: 0 at padded positions
    initial = ssm.index_select(0, state_slots)
    y, final, a, xdt = scan_spans(x, dts, B, C, -torch.exp(mixer.A_log.float()), mixer.D, initial)
    ssm.index_copy_(0, state_slots, final)
    out = gated_norm(y.transpose(1, 2).reshape(b * length, d.d_inner), z, mixer.norm.weight, d)
    return linear(mixer.out_proj, out), (initial, a, xdt, B, window)


def attention_verify(
    attn: PagedAttention,
    h: torch.Tensor,
    cos: torch.Tensor | None,
    sin: torch.Tensor | None,
    positions: torch.Tensor,
    write_slots: torch.Tensor,
    take: torch.Tensor,
    page_table: torch.Tensor,
    page_size: int,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
) -> torch.Tensor:
    """h [b * L, hidden] -> [b * L, hidden]. positions and write_slots [b, L]; take [b, L] the position
    whose K/V each position writes (itself, or its row's last real one)."""
    b, length = positions.shape
    kvh, group, dim = attn.num_kv_heads, attn.group, attn.head_dim
    q = linear(attn.q_proj, h).view(b * length, attn.num_heads, dim)
    k = linear(attn.k_proj, h).view(b * length, kvh, dim)
    if cos is not None and sin is not None:
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    v = linear(attn.v_proj, h).view(b, length, kvh, dim)
    pick = take[:, :, None, None].expand(b, length, kvh, dim)
    slots = write_slots.reshape(-1)
    k_cache.index_copy_(0, slots, k.view(b, length, kvh, dim).gather(1, pick).view(b * length, kvh, dim))
    v_cache.index_copy_(0, slots, v.gather(1, pick).view(b * length, kvh, dim))
    ops = attn.ops
    if ops is not None:  # the CUDA backend's kernels (a verify step under a CUDA graph): each position a decode row
        seen = positions.gather(1, take).reshape(-1)  # a padded position attends as its row's last real one
        table = page_table.repeat_interleave(length, dim=0)  # [b * L, W]
        out = ops.paged_rows_attention(q, k_cache, v_cache, table, seen + 1, page_size, attn.scale)
        return linear(attn.o_proj, out.reshape(b * length, attn.num_heads * dim))
    width = page_table.shape[1] * page_size
    pages = page_table.reshape(-1)
    keys = k_cache.view(-1, page_size, kvh, dim).index_select(0, pages).view(b, width, kvh, dim)
    values = v_cache.view(-1, page_size, kvh, dim).index_select(0, pages).view(b, width, kvh, dim)
    # queries [b, kvh, L * group, d], position-major within a KV head
    qg = q.view(b, length, kvh, group, dim).permute(0, 2, 1, 3, 4).reshape(b, kvh, length * group, dim)
    visible = torch.arange(width, device=h.device)[None, None, :] <= positions[:, :, None]  # [b, L, width]
    mask = visible[:, None, :, None, :].expand(b, 1, length, group, width).reshape(b, 1, length * group, width)
    out = F.scaled_dot_product_attention(
        qg, keys.transpose(1, 2), values.transpose(1, 2), attn_mask=mask, scale=attn.scale
    )  # [b, kvh, L * group, d]
    out = out.view(b, kvh, length, group, dim).permute(0, 2, 1, 3, 4).reshape(b * length, attn.num_heads * dim)
    return linear(attn.o_proj, out)


def verify_logits(
    model: HybridForCausalLM,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    write_slots: torch.Tensor,
    lengths: torch.Tensor,
    state_slots: torch.Tensor,
    page_table: torch.Tensor,
    page_size: int,
    kv_caches: KVCaches,
    states: StateTensors,
) -> tuple[torch.Tensor, list[torch.Tensor], torch.Tensor]:
    """Rows of up to L tokens (module docstring): input_ids, positions, write_slots [b, L] int64 (a padded
    position: any token, its position, its row's last real slot), lengths and state_slots [b], page_table
    [b, W] -> (float32 logits [b, L, vocab], the start states and the Mamba layers' SpanTensors stacked on a
    leading layer dimension: short_scan.StackedSpanRecord's tensors, the final hidden states [b, L, hidden]
    as decode_tokens returns them). Pools updated in place, row after row, as decode_tokens does."""
    c = model.config
    b, length = input_ids.shape
    steps = torch.arange(length, device=input_ids.device)[None, :]
    take = torch.minimum(steps, lengths[:, None] - 1)  # [b, L]
    hidden = F.embedding(input_ids.reshape(-1), model.embed.weight)
    if c.embedding_multiplier != 1.0:
        hidden = hidden * c.embedding_multiplier
    cos = sin = None
    if c.rotary_dim:
        cos, sin = rope_cos_sin(positions.reshape(-1), model.inv_freq, hidden.dtype)
    spans: list[SpanTensors] = []
    attn_i = mamba_i = 0
    for module in model.blocks:
        block = cast(Block, module)
        h = block.norm(hidden)
        if block.kind == "mamba":
            conv, ssm = states[mamba_i]
            h, kept = mamba_verify(cast(Mamba2Mixer, block.mixer), h, lengths, state_slots, conv, ssm)
            spans.append(kept)
            mamba_i += 1
        elif block.kind == "attention":
            k_cache, v_cache = kv_caches[attn_i]
            attn = cast(PagedAttention, block.mixer)
            h = attention_verify(
                attn, h, cos, sin, positions, write_slots, take, page_table, page_size, k_cache, v_cache
            )  # fmt: skip
            attn_i += 1
        elif block.kind == "moe":
            h = moe_decode(cast(MoE, block.mixer), h)
        else:
            h = mlp_decode(cast(MLP, block.mixer), h)
        hidden = hidden + (h if c.residual_multiplier == 1.0 else h * c.residual_multiplier)
    final = model.final_norm(hidden)
    logits = linear(model.lm_head, final).float()
    if c.logits_scaling != 1.0:
        logits = logits / c.logits_scaling
    stacked = [torch.stack(parts) for parts in zip(*spans, strict=True)] if spans else []
    return logits.view(b, length, -1), stacked, final.view(b, length, -1)
