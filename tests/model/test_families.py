"""Granite-4.0-H and Nemotron-H beside Bamba: routing decisions against transformers before logits,
checkpoints as published (pattern strings, legacy names, "auto" head dims, sharded experts), the
registry's errors, and `init-model --arch`."""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

import hybridserve_cli.init_model as init_model
from gpu_worker.model.families import SUPPORTED_ARCHITECTURES
from gpu_worker.model.loader import load_model, parse_config
from gpu_worker.model.moe import Router
from hybridserve.errors import InvalidArgumentError
from tests.model.model_helpers import MOE_SPECS, SPECS, hf_logits, make_runner, run_schedule, save_hf_model

TOL = 1e-4


def _prompt(vocab: int, n: int, seed: int) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _margin(router: torch.nn.Module, logits: torch.Tensor, top_k: int) -> float:
    """Smallest gap, over tokens, between the last chosen and the first rejected candidate, computed the
    reference's way (Granite: raw logits; Nemotron-H: group scores, then corrected sigmoid scores)."""
    if not hasattr(router, "e_score_correction_bias"):
        top = logits.sort(dim=-1, descending=True)[0]
        return (top[:, top_k - 1] - top[:, top_k]).min().item()
    choice = logits.sigmoid() + router.e_score_correction_bias
    n_group, keep = router.num_group, router.topk_group
    grouped = choice.view(len(choice), n_group, -1)
    gaps = []
    if keep < n_group:
        group_scores = grouped.topk(2, dim=-1)[0].sum(-1).sort(dim=-1, descending=True)[0]
        gaps.append((group_scores[:, keep - 1] - group_scores[:, keep]).min().item())
        best = grouped.topk(2, dim=-1)[0].sum(-1).topk(keep, dim=-1)[1]
        mask = torch.zeros(len(choice), n_group, dtype=torch.bool).scatter_(1, best, True)
        choice = choice.masked_fill(~mask[:, :, None].expand_as(grouped).reshape(len(choice), -1), float("-inf"))
    top = choice.sort(dim=-1, descending=True)[0]
    gaps.append((top[:, top_k - 1] - top[:, top_k]).min().item())
    return min(gaps)


@pytest.mark.parametrize("name", MOE_SPECS)
def test_moe_routing_equals_the_reference_before_logits(checkpoints, name: str) -> None:
    """Every MoE layer picks the same experts with the same weights for every token, with clear margins
    (so the comparison is not at the mercy of near-ties); then the logits agree."""
    hf, path = checkpoints[name]
    ids = _prompt(hf.config.vocab_size, 48, 21)
    hf_routers = [m for m in hf.modules() if type(m).__name__.lower().endswith("topkrouter")]
    theirs: list[tuple[torch.Tensor, ...]] = []
    handles = [r.register_forward_hook(lambda _m, _i, out: theirs.append(out)) for r in hf_routers]
    ref = hf_logits(hf, ids)
    for h in handles:
        h.remove()
    runner = make_runner(path)
    ours: list[tuple[torch.Tensor, torch.Tensor]] = []
    for m in runner.model.modules():
        if isinstance(m, Router):
            m.register_forward_hook(lambda _m, _i, out: ours.append(out))
    got = run_schedule(runner, ids, [len(ids)])
    assert len(ours) == len(theirs) == len(hf_routers) > 0
    top_k = SPECS[name].top_k
    for layer, ((logits, ref_w, ref_idx), (w, idx), router) in enumerate(zip(theirs, ours, hf_routers, strict=True)):
        assert _margin(router, logits.float(), top_k) > 1e-3, f"layer {layer}: near-tie in the fixture"
        ref_idx, order = ref_idx.sort(dim=-1)
        idx, our_order = idx.sort(dim=-1)
        assert torch.equal(idx, ref_idx), f"layer {layer}: different experts"
        assert torch.allclose(w.gather(1, our_order), ref_w.float().gather(1, order), atol=1e-5), f"layer {layer}"
    assert (got - ref).abs().max().item() <= TOL


def _rewrite_config(src: Path, dst: Path, edit) -> Path:
    shutil.copytree(src, dst)
    raw = json.loads((dst / "config.json").read_text())
    edit(raw)
    (dst / "config.json").write_text(json.dumps(raw))
    return dst


def _nemotron_as_published(raw: dict) -> None:
    """Older Nemotron-H configs: the layer pattern as a string and the mamba_-prefixed names."""
    raw["hybrid_override_pattern"] = "".join({"linear_attention": "M", "full_attention": "*", "mlp": "-", "moe": "E"}[t]
                                             for t in raw.pop("layers_block_type"))  # fmt: skip
    legacy = {"n_groups": "mamba_n_groups", "conv_kernel": "mamba_d_conv", "chunk_size": "mamba_chunk_size",
              "time_step_min": "mamba_dt_min", "use_conv_bias": "mamba_conv_bias"}  # fmt: skip
    for new, old in legacy.items():
        raw[old] = raw.pop(new)
    raw["num_hidden_layers"] = len(raw["hybrid_override_pattern"])


def _granite_as_published(raw: dict) -> None:
    """Granite-4.0-H configs: legacy layer names and an "auto" Mamba head dim."""
    raw["layer_types"] = ["mamba" if t == "linear_attention" else "attention" for t in raw["layer_types"]]
    raw["mamba_d_head"] = "auto"


@pytest.mark.parametrize(
    ("name", "edit"),
    [("nemotron_moe", _nemotron_as_published), ("nemotron_dense", _nemotron_as_published),
     ("granite_moe", _granite_as_published)],
)  # fmt: skip
def test_published_config_variants_and_sharded_experts(checkpoints, tmp_path: Path, name: str, edit) -> None:
    hf, _ = checkpoints[name]
    sharded = save_hf_model(hf, tmp_path / "sharded", max_shard_size="30KB")
    assert (sharded / "model.safetensors.index.json").exists() and len(list(sharded.glob("model-*"))) > 2
    published = _rewrite_config(sharded, tmp_path / "published", edit)
    ids = _prompt(hf.config.vocab_size, 30, 4)
    ref = hf_logits(hf, ids)
    assert load_model(published, device="cpu").fingerprint == load_model(sharded, device="cpu").fingerprint
    got = run_schedule(make_runner(published), ids, [13, 1, 16])
    assert (got - ref).abs().max().item() <= TOL


def test_unknown_architecture_lists_the_supported_ones(checkpoints) -> None:
    raw = json.loads((checkpoints["granite_dense"][1] / "config.json").read_text())
    raw["architectures"] = ["JambaForCausalLM"]
    with pytest.raises(
        InvalidArgumentError, match="JambaForCausalLM.*supported: " + ", ".join(SUPPORTED_ARCHITECTURES)
    ):
        parse_config(raw)


@pytest.mark.parametrize(
    ("name", "change", "message"),
    [
        ("nemotron_moe", {"moe_latent_size": 16}, "moe_latent_size=16 .* not supported"),
        ("nemotron_dense", {"mlp_hidden_act": "gelu"}, "mlp_hidden_act='gelu' is not supported"),
        ("nemotron_dense", {"layers_block_type": None, "hybrid_override_pattern": "M-X"}, r"pattern has \['X'\]"),
        ("nemotron_dense", {"layers_block_type": None}, "needs layers_block_type"),
        ("nemotron_moe", {"num_experts_per_tok": 9}, "num_experts_per_tok=9"),
        ("granite_dense", {"position_embedding_type": "alibi"}, "position_embedding_type='alibi' is not supported"),
        ("granite_dense", {"layer_types": ["mamba", "cross_attention", "mamba", "mamba"]}, "cross_attention"),
        ("granite_moe", {"mamba_d_head": 7}, r"mamba_n_heads\*mamba_d_head"),
    ],
)  # fmt: skip
def test_unsupported_family_config_values(checkpoints, name: str, change: dict, message: str) -> None:
    raw = json.loads((checkpoints[name][1] / "config.json").read_text())
    raw.update(change)
    with pytest.raises(InvalidArgumentError, match=message):
        parse_config(raw)


@pytest.mark.parametrize("name", ["nemotron_moe", "granite_moe"])
def test_missing_or_misshapen_tensors_are_named(checkpoints, tmp_path: Path, name: str) -> None:
    from safetensors.torch import load_file, save_file

    _, path = checkpoints[name]
    bad = tmp_path / "bad"
    shutil.copytree(path, bad)
    tensors = load_file(str(bad / "model.safetensors"))
    expert = next(k for k in sorted(tensors) if "experts.1." in k or "input_linear" in k)
    dropped = {k: v for k, v in tensors.items() if k != expert}
    save_file(dropped, str(bad / "model.safetensors"))
    with pytest.raises(InvalidArgumentError, match=f"missing \\['{expert}'\\]"):
        load_model(bad)
    tensors[expert] = tensors[expert][..., :-1].contiguous()
    save_file(tensors, str(bad / "model.safetensors"))
    with pytest.raises(InvalidArgumentError, match=f"checkpoint tensor {expert} has shape .* implies"):
        load_model(bad)


@pytest.mark.parametrize(("arch", "moe"), [("granitemoehybrid", True), ("nemotron_h", False), ("nemotron_h", True)])
def test_init_model_writes_each_family(tmp_path: Path, arch: str, moe: bool, capsys) -> None:
    path = tmp_path / arch
    parser = argparse.ArgumentParser()
    init_model.add_arguments(parser)
    assert init_model.run(parser.parse_args([str(path), "--arch", arch, *(["--moe"] if moe else [])])) == 0
    loaded = load_model(path, device="cpu")
    assert ("moe" in loaded.config.blocks) == moe and loaded.family.name == arch
    assert loaded.tokenizer is not None and f"wrote {loaded.config.architecture}" in capsys.readouterr().out
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    assert type(hf).__name__ == loaded.config.architecture
    ids = loaded.tokenizer.encode("Tiny checkpoints of every family load in transformers too.")
    got = run_schedule(make_runner(path), ids, [9, 1, len(ids) - 10])
    assert (got - hf_logits(hf, ids)).abs().max().item() <= TOL


def test_init_model_rejects_moe_for_bamba(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgumentError, match="--moe needs"):
        init_model.write_random_checkpoint(tmp_path / "x", init_model.ModelSpec(moe=True))


def test_nemotron_mtp_weights_and_model_prefix_are_accepted(checkpoints, tmp_path: Path) -> None:
    """A checkpoint with multi-token-prediction tensors that its config names no layers for (skipped; a
    served head: tests/model/test_mtp_runner.py) and the `model.` prefix transformers uses in memory loads
    and gives the same logits."""
    from safetensors.torch import load_file, save_file

    hf, path = checkpoints["nemotron_moe"]
    variant = tmp_path / "mtp"
    shutil.copytree(path, variant)
    tensors = {k.replace("backbone.", "model.", 1): v for k, v in load_file(str(path / "model.safetensors")).items()}
    tensors["mtp.layers.0.norm.weight"] = torch.ones(hf.config.hidden_size)
    save_file(tensors, str(variant / "model.safetensors"))
    raw = json.loads((variant / "config.json").read_text())
    raw["num_nextn_predict_layers"] = 0
    (variant / "config.json").write_text(json.dumps(raw))
    ids = _prompt(hf.config.vocab_size, 20, 8)
    got = run_schedule(make_runner(variant), ids, [20])
    assert (got - hf_logits(hf, ids)).abs().max().item() <= TOL
