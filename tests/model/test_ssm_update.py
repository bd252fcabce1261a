"""The compiled decode programs' native pieces (gpu_worker.model.backends.cpu.ssm_update and linear.packed_linear):
the SSM update kernel equals the torch form of the Mamba decode step (decode_fused.mamba_decode_step) at
scattered slots and several groups, advances a slot that padding rows repeat before its real row once,
refuses a slot outside the pool without writing, and runs in place inside a compiled graph; the packed
projection op equals F.linear, on the module's pack or, for a weight no module packs, on the plain one."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from gpu_worker.model.backends.cpu import ssm_update
from gpu_worker.model.backends.cpu.decode_fused import MambaDims, decode_inputs, gated_norm, mamba_decode_step
from gpu_worker.model.backends.cpu.linear import onednn_available, pack_available, packed_linear, use_onednn_linears

DIMS = MambaDims(d_inner=32, conv_dim=32 + 2 * 2 * 16, num_heads=4, head_dim=8, num_groups=2, state_size=16,
                 dt_min=0.0, dt_max=float("inf"), eps=1e-5)  # fmt: skip
ROWS = 10  # pool rows


@pytest.fixture(scope="module")
def kernel() -> None:
    if not ssm_update.load():
        pytest.skip("no C compiler builds the kernel here")


def _layer(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    d = DIMS
    return {
        "conv_weight": torch.randn(d.conv_dim, 4, generator=g) * 0.3, "conv_bias": torch.randn(d.conv_dim, generator=g),
        "dt_bias": torch.randn(d.num_heads, generator=g), "A_log": torch.randn(d.num_heads, generator=g),
        "D": torch.randn(d.num_heads, generator=g), "norm_weight": torch.rand(d.d_inner, generator=g) + 0.5,
        "conv": torch.randn(ROWS, d.conv_dim, 3, generator=g),
        "ssm": torch.randn(ROWS, d.num_heads, d.head_dim, d.state_size, generator=g),
    }  # fmt: skip


def _torch_step(w: dict[str, torch.Tensor], zxbcdt: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """The programs' torch form: rows gathered, stepped, scattered back (pools in `w` updated)."""
    conv_rows, ssm_rows = w["conv"].index_select(0, slots), w["ssm"].index_select(0, slots)
    out = mamba_decode_step(zxbcdt, conv_rows, ssm_rows, w["conv_weight"], w["conv_bias"], w["dt_bias"], w["A_log"],
                            w["D"], w["norm_weight"], DIMS)  # fmt: skip
    w["conv"].index_copy_(0, slots, conv_rows)
    w["ssm"].index_copy_(0, slots, ssm_rows)
    return out


def _kernel_step(w: dict[str, torch.Tensor], zxbcdt: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """decode_program.mamba_decode's kernel form."""
    conv_rows = w["conv"].index_select(0, slots)
    z, x, B, C, dt, decay = decode_inputs(zxbcdt, conv_rows, w["conv_weight"], w["conv_bias"], w["dt_bias"],
                                          w["A_log"], DIMS)  # fmt: skip
    w["conv"].index_copy_(0, slots, conv_rows)
    y = torch.ops.hybridserve.ssm_decode_update(w["ssm"], slots, x, dt, decay, B, C, w["D"])
    return gated_norm(y.view(slots.shape[0], DIMS.d_inner), z, w["norm_weight"], DIMS)


def _zxbcdt(rows: int, seed: int) -> torch.Tensor:
    d = DIMS
    return torch.randn(rows, d.d_inner + d.conv_dim + d.num_heads, generator=torch.Generator().manual_seed(seed))


def test_the_kernel_equals_the_torch_step_at_scattered_slots(kernel: None) -> None:
    slots = torch.tensor([7, 2, 5, 0, 9])
    reference, native = _layer(0), _layer(0)
    for step in range(3):  # the state carries over
        zxbcdt = _zxbcdt(len(slots), seed=step)
        want, got = _torch_step(reference, zxbcdt, slots), _kernel_step(native, zxbcdt, slots)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(native["ssm"], reference["ssm"], rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(native["conv"], reference["conv"], rtol=0, atol=0)
    untouched = [r for r in range(ROWS) if r not in slots.tolist()]
    assert torch.equal(native["ssm"][untouched], _layer(0)["ssm"][untouched])


def test_padding_rows_before_their_real_row_read_the_slot_and_the_real_row_advances_it_once(kernel: None) -> None:
    """A bucket's padding repeats its first real row (slot 4) before it: that slot advances once, from the
    old state, and every copy reads the same output as the real row."""
    reference, native = _layer(1), _layer(1)
    real = _zxbcdt(2, seed=3)
    want = _torch_step(reference, real, torch.tensor([4, 1]))
    padded = torch.cat([real[:1].expand(3, -1), real])  # three padding rows, then the real rows
    got = _kernel_step(native, padded, torch.tensor([4, 4, 4, 4, 1]))
    torch.testing.assert_close(got[3:], want, rtol=1e-5, atol=1e-5)
    for row in range(3):
        torch.testing.assert_close(got[row], want[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(native["ssm"], reference["ssm"], rtol=1e-6, atol=1e-6)


def test_a_slot_outside_the_pool_is_refused_and_nothing_is_written(kernel: None) -> None:
    w = _layer(2)
    before = w["ssm"].clone()
    d = DIMS
    x, dt, decay = torch.randn(2, d.num_heads, d.head_dim), torch.rand(2, d.num_heads), torch.rand(2, d.num_heads)
    B, C = torch.randn(2, d.num_groups, d.state_size), torch.randn(2, d.num_groups, d.state_size)
    with pytest.raises(IndexError, match="outside the pool"):
        torch.ops.hybridserve.ssm_decode_update(w["ssm"], torch.tensor([3, ROWS]), x, dt, decay, B, C, w["D"])
    assert torch.equal(w["ssm"], before)


def test_the_kernel_updates_the_pool_in_place_inside_a_compiled_graph(kernel: None) -> None:
    reference, native = _layer(4), _layer(4)
    slots, zxbcdt = torch.tensor([6, 3, 8]), _zxbcdt(3, seed=5)
    want = _torch_step(reference, zxbcdt, slots)
    program = torch.compile(_kernel_step, fullgraph=True)
    got = program(native, zxbcdt, slots)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(native["ssm"], reference["ssm"], rtol=1e-6, atol=1e-6)


@pytest.mark.skipif(not (onednn_available() and pack_available()), reason="this torch build cannot pack for oneDNN")
@pytest.mark.parametrize("rows", [2, 8, 33])
def test_packed_linear_equals_f_linear(rows: int) -> None:
    torch.manual_seed(rows)
    layer = nn.Linear(64, 96)
    x = torch.randn(rows, 64)
    reference = F.linear(x, layer.weight, layer.bias)
    with torch.inference_mode():
        weight = torch.randn(96, 64)
        stranger = packed_linear(x, weight, None)  # no module packs it: the plain weight
        torch.testing.assert_close(stranger, F.linear(x, weight), rtol=1e-5, atol=1e-5)
        use_onednn_linears(layer)
        assert layer.packs
        got = packed_linear(x, layer.weight, layer.bias)
    assert layer._pack is not None  # the module's pack was made and used
    torch.testing.assert_close(got, reference, rtol=1e-5, atol=1e-5)
