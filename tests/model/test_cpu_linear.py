"""Projections through oneDNN on CPU (gpu_worker.model.backends.cpu.linear): the same results as `F.linear` up to
float32 rounding, for few and many rows (padded to a row bucket or not), with and without bias, with
the weight prepacked or not; the pack follows the parameter when its storage or values change, and is
off for models over the size cap; the switch keeps parameters, tied weights and the state dict;
autograd takes `F.linear`; warming packs every weight and builds each shape's kernels once per bucket."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from gpu_worker.model.backends.cpu.linear import (
    EXACT_ROWS,
    MKL_MAX_BYTES,
    MKL_MAX_ROWS,
    ONEDNN_MIN_ROWS,
    PACK_FEW_ROWS_BYTES,
    PACK_HOST_SHARE,
    PACK_MAX_BYTES,
    PACKED_MIN_ROWS,
    PLAIN_FEW_ROWS_BYTES,
    ROW_BUCKET,
    OneDnnLinear,
    bucket_rows,
    mkl_takes_avx512,
    onednn_available,
    pack_available,
    pack_limit,
    packs_dtype,
    small_projections,
    use_onednn_linears,
    warm_onednn_linears,
)

pytestmark = pytest.mark.skipif(not onednn_available(), reason="this torch build has no oneDNN")


@pytest.mark.parametrize(
    "rows",
    [1, PACKED_MIN_ROWS - 1, PACKED_MIN_ROWS, 8, ONEDNN_MIN_ROWS - 1, ONEDNN_MIN_ROWS, ONEDNN_MIN_ROWS + 1, 47, 700],
)
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("packs", [True, False])
def test_onednn_linear_matches_f_linear(rows: int, bias: bool, packs: bool) -> None:
    torch.manual_seed(rows)
    layer = nn.Linear(96, 40, bias=bias)
    reference = F.linear(x := torch.randn(rows, 96), layer.weight, layer.bias)
    use_onednn_linears(layer)
    assert isinstance(layer, OneDnnLinear)
    assert layer.packs == pack_available()  # a small model packs
    layer.set_packing(packs and pack_available())
    with torch.inference_mode():
        got = layer(x)
        batched = layer(x.view(1, rows, 96))  # leading dims are kept
    assert got.shape == reference.shape and batched.shape == (1, rows, 40)
    torch.testing.assert_close(got, reference, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(batched[0], reference, rtol=1e-5, atol=1e-5)


def test_switch_keeps_parameters_tied_weights_and_state_dict() -> None:
    model = nn.Sequential(nn.Embedding(10, 16), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 10, bias=False))
    model[3].weight = model[0].weight  # tied like an LM head
    before = {k: v.clone() for k, v in model.state_dict().items()}
    assert use_onednn_linears(model) == 2
    assert [type(m).__name__ for m in model] == ["Embedding", "OneDnnLinear", "ReLU", "OneDnnLinear"]
    assert model[3].weight is model[0].weight
    after = model.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)


def test_autograd_takes_f_linear() -> None:
    layer = nn.Linear(8, 4)
    use_onednn_linears(layer)
    x = torch.randn(ONEDNN_MIN_ROWS * 2, 8, requires_grad=True)
    layer(x).sum().backward()
    assert x.grad is not None and layer.weight.grad is not None


def test_rows_padded_to_a_bucket_give_each_row_its_own_result() -> None:
    """Row counts between two buckets run padded to the next one: every real row gets the
    result it gets alone, whatever the other rows hold, and nothing of the padding comes back."""
    torch.manual_seed(0)
    layer = nn.Linear(64, 24)
    use_onednn_linears(layer)
    base = torch.randn(ROW_BUCKET * 4, 64)
    with torch.inference_mode():
        whole = layer(base)  # a multiple of the bucket: no padding
        for rows in range(ROW_BUCKET * 2 + 1, ROW_BUCKET * 4):
            part = layer(base[:rows])
            assert part.shape == (rows, 24)
            torch.testing.assert_close(part, whole[:rows], rtol=1e-6, atol=1e-6)
            changed = base[:rows].clone()
            changed[-1] += 1.0  # only the last row's result may move
            moved = layer(changed)
            torch.testing.assert_close(moved[:-1], part[:-1], rtol=1e-6, atol=1e-6)
            assert not torch.allclose(moved[-1], part[-1])


@pytest.mark.parametrize("packs", [True, False])
def test_warming_calls_each_shape_once_per_bucket(packs: bool) -> None:
    """One call per distinct projection shape and row bucket from the fewest rows oneDNN takes (shared
    shapes warm once); every weight is packed where packing is on; the layers are left as they were."""
    model = nn.Sequential(nn.Linear(64, 24), nn.Linear(24, 64), nn.Linear(64, 24), nn.Linear(64, 24, bias=False))
    use_onednn_linears(model)
    packs = packs and pack_available()
    for layer in model:
        layer.set_packing(packs)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    fewest = PACKED_MIN_ROWS if packs else ONEDNN_MIN_ROWS  # small weights: not from one row
    assert all(layer.min_rows == fewest for layer in model)
    buckets = len({bucket_rows(rows) for rows in range(fewest, 128 + 1)})
    exact = len(range(fewest, EXACT_ROWS + 1))  # few rows run unpadded, then 8-row buckets below 64
    assert buckets == exact + len(range(16 if packs else fewest, 64, 8)) + len(range(64, 129, 16))
    assert warm_onednn_linears(model, 128) == 3 * buckets  # (64, 24, bias) twice: warmed once
    assert warm_onednn_linears(model, fewest - 1) == 0
    capped = len({bucket_rows(rows) for rows in range(fewest, 32 + 1)})
    assert warm_onednn_linears(model, 128, row_caps={model[3]: 32}) == 2 * buckets + capped  # the LM head's cap
    assert all((layer._pack is not None) == packs for layer in model)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in before.items())


@pytest.mark.skipif(not pack_available(), reason="this torch build cannot pack a weight for oneDNN")
def test_large_weights_take_the_pack_from_one_row() -> None:
    """A weight of PACK_FEW_ROWS_BYTES or more goes to oneDNN packed from one row (reading it dominates), a
    smaller one from PACKED_MIN_ROWS; one row gives F.linear's result either way."""
    out_features = PACK_FEW_ROWS_BYTES // 4 // 64
    model = nn.Sequential(nn.Linear(64, out_features), nn.Linear(out_features, 8))
    use_onednn_linears(model)
    assert [layer.min_rows for layer in model] == [1, PACKED_MIN_ROWS]
    x = torch.randn(1, 64)
    with torch.inference_mode():
        hidden = model[0](x)
        assert model[0]._pack is not None and model[1]._pack is None
        torch.testing.assert_close(hidden, F.linear(x, model[0].weight, model[0].bias), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(model[1](hidden), F.linear(hidden, model[1].weight, model[1].bias))


def test_large_unpacked_weights_take_onednn_from_one_row() -> None:
    """Without packing (a model over the pack's cap), a float32 weight of PLAIN_FEW_ROWS_BYTES or more goes to
    oneDNN from one row (MKL's one-row sgemv keeps to one thread), a smaller one from ONEDNN_MIN_ROWS."""
    out_features = PLAIN_FEW_ROWS_BYTES // 4 // 64
    model = nn.Sequential(nn.Linear(64, out_features), nn.Linear(out_features, 8))
    use_onednn_linears(model)
    for layer in model:
        layer.set_packing(False)
    assert [layer.min_rows for layer in model] == [1, ONEDNN_MIN_ROWS]
    x = torch.randn(1, 64)
    with torch.inference_mode():
        torch.testing.assert_close(model[0](x), F.linear(x, model[0].weight, model[0].bias), rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not pack_available(), reason="this torch build cannot pack a weight for oneDNN")
def test_the_pack_follows_the_parameter() -> None:
    """A pack made from one weight is not used once the parameter's storage is swapped (as a model
    process swaps its weights for the worker's shared ones) or its values change in place."""
    torch.manual_seed(0)
    layer = nn.Linear(32, 16)
    use_onednn_linears(layer)
    x = torch.randn(8, 32)
    with torch.inference_mode():
        layer(x)
    first = layer._pack
    with torch.no_grad():
        layer.weight.data = torch.randn(16, 32)  # a new storage
    with torch.inference_mode():
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)
    assert layer._pack is not first
    with torch.no_grad():
        layer.weight.mul_(-2.0)  # same storage, new values
    with torch.inference_mode():
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)


def test_models_over_the_cap_keep_their_weights_unpacked(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each process running the model would hold its own pack: over PACK_MAX_BYTES of projection
    weights, none is made, and few rows take F.linear as before."""
    import gpu_worker.model.backends.cpu.linear as cpu_linear

    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64))
    monkeypatch.setattr(cpu_linear, "PACK_MAX_BYTES", 64 * 64 * 4)  # one layer's weight fits, two do not
    use_onednn_linears(model)
    assert not any(layer.packs for layer in model)
    with torch.inference_mode():
        model(torch.randn(8, 64))
    assert all(layer._pack is None for layer in model)


@pytest.mark.skipif(not (pack_available() and packs_dtype(torch.bfloat16)),
                    reason="no native bfloat16 path in oneDNN on these cores")  # fmt: skip
@pytest.mark.parametrize("rows", [1, 8, 47])
def test_bfloat16_weights_take_the_pack_from_one_row(rows: int) -> None:
    """bfloat16 weights are packed where oneDNN has a native bfloat16 path, and every row count takes the
    pack (F.linear is oneDNN on the plain weight, reordered each call): the result is F.linear's up to
    bfloat16 rounding of the sums."""
    torch.manual_seed(rows)
    model = nn.Sequential(nn.Linear(96, 40), nn.Linear(40, 8, bias=False)).to(torch.bfloat16)
    use_onednn_linears(model)
    assert [(layer.packs, layer.min_rows) for layer in model] == [(True, 1), (True, 1)]
    x = torch.randn(rows, 96, dtype=torch.bfloat16)
    with torch.inference_mode():
        hidden = model[0](x)
        out = model[1](hidden)
        plain = F.linear(x, model[0].weight, model[0].bias), F.linear(hidden, model[1].weight)
    assert all(layer._pack is not None for layer in model)
    assert hidden.dtype == out.dtype == torch.bfloat16
    torch.testing.assert_close(hidden, plain[0], rtol=1.6e-2, atol=1e-2)
    torch.testing.assert_close(out, plain[1], rtol=1.6e-2, atol=1e-2)


def test_half_precision_weights_are_not_packed() -> None:
    """float16 has no packed path here: its projections stay F.linear's."""
    model = nn.Sequential(nn.Linear(32, 16)).to(torch.float16)
    use_onednn_linears(model)
    assert not model[0].packs
    x = torch.randn(4, 32, dtype=torch.float16)
    with torch.inference_mode():
        torch.testing.assert_close(model(x), F.linear(x, model[0].weight, model[0].bias))
    assert model[0]._pack is None


def test_the_pack_limit_follows_the_host() -> None:
    """At most PACK_MAX_BYTES, and a 1/PACK_HOST_SHARE share of the host's memory where that is less."""
    assert pack_limit(0) == PACK_MAX_BYTES  # unknown
    assert pack_limit(64 * PACK_MAX_BYTES) == PACK_MAX_BYTES
    assert pack_limit(8 << 30) == (8 << 30) // PACK_HOST_SHARE
    model = nn.Sequential(nn.Linear(64, 64))
    use_onednn_linears(model, max_pack_bytes=64 * 64 * 4 - 1)
    assert not model[0].packs


@pytest.mark.skipif(not pack_available(), reason="this torch build cannot pack a weight for oneDNN")
def test_small_float32_weights_stay_with_mkl_up_to_its_rows() -> None:
    """With `mkl_small` (Intel cores), a float32 weight under MKL_MAX_BYTES is F.linear's, bit for bit, up to
    MKL_MAX_ROWS rows and takes its pack from the next row; larger and bfloat16 weights keep their packs from one
    row, and without it the small weight takes its pack from PACKED_MIN_ROWS rows."""
    torch.manual_seed(0)
    wide = (MKL_MAX_BYTES // 4) // 256 + 1  # out features of a 256-wide float32 weight just over the bound
    model = nn.Sequential(nn.Linear(256, 64), nn.Linear(64, 256), nn.Linear(256, wide, bias=False))
    half = nn.Sequential(nn.Linear(256, 64)).to(torch.bfloat16)
    use_onednn_linears(model, mkl_small=True)
    use_onednn_linears(half, mkl_small=True)
    assert [layer.min_rows for layer in model] == [MKL_MAX_ROWS + 1, MKL_MAX_ROWS + 1, 1]
    assert half[0].min_rows == 1 and all(layer.packs for layer in model)
    with torch.inference_mode():
        for rows in (1, 8, MKL_MAX_ROWS):
            x = torch.randn(rows, 256)
            assert torch.equal(model[0](x), F.linear(x, model[0].weight, model[0].bias))
        x = torch.randn(MKL_MAX_ROWS + 1, 256)
        torch.testing.assert_close(model[0](x), F.linear(x, model[0].weight, model[0].bias), rtol=1e-5, atol=1e-5)
    assert model[0]._pack is not None  # the pack was taken from MKL_MAX_ROWS + 1 rows
    plain = nn.Sequential(nn.Linear(256, 64))
    use_onednn_linears(plain)
    assert plain[0].min_rows == PACKED_MIN_ROWS


def test_small_projections_resolve_by_the_cores() -> None:
    assert small_projections("auto") == ("mkl" if mkl_takes_avx512() else "onednn")
    assert small_projections("mkl") == "mkl" and small_projections("onednn") == "onednn"


def test_the_small_projections_setting_is_checked() -> None:
    from gpu_worker.runner.settings import RunnerConfig
    from hybridserve.errors import InvalidArgumentError

    assert RunnerConfig().cpu_small_projections == "auto"
    with pytest.raises(InvalidArgumentError, match="cpu_small_projections must be one of auto, mkl, onednn"):
        RunnerConfig(cpu_small_projections="blas")
