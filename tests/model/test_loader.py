"""Loading checkpoints: round trips (sharded and not; parameters back to checkpoint tensors), clear errors
for broken or mismatched folders."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from gpu_worker.model.loader import checkpoint_tensors, load_model, parse_config, read_weights
from hybridserve.errors import InvalidArgumentError
from hybridserve_cli.init_model import ModelSpec, write_random_checkpoint
from tests.model.model_helpers import hf_logits, make_runner, run_schedule, save_hf_model


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_unsharded_and_sharded_round_trip(small_checkpoint, tmp_path: Path) -> None:
    hf, path = small_checkpoint
    sharded = save_hf_model(hf, tmp_path / "sharded", max_shard_size="40KB")
    assert (sharded / "model.safetensors.index.json").exists()
    assert len(list(sharded.glob("model-*.safetensors"))) > 1
    a, b = load_model(path, device="cpu"), load_model(sharded, device="cpu")
    assert a.fingerprint == b.fingerprint, "fingerprint must not depend on sharding"
    assert a.tokenizer is None and a.eos_token_ids == (2,)
    ids = list(range(1, 30))
    ref = hf_logits(hf, ids)
    for folder in (path, sharded):
        assert (run_schedule(make_runner(folder), ids, [29]) - ref).abs().max().item() <= 1e-4


def _mapped_files() -> list[tuple[int, int, str]]:
    """(start, end, path) of this process's file-backed memory mappings (Linux)."""
    out = []
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[5].startswith("/"):
            start, end = (int(x, 16) for x in fields[0].split("-"))
            out.append((start, end, fields[5]))
    return out


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="reads Linux's /proc/self/maps")
def test_weights_are_memory_maps_of_their_shards(small_checkpoint, tmp_path: Path) -> None:
    hf, _ = small_checkpoint
    sharded = save_hf_model(hf, tmp_path / "sharded", max_shard_size="40KB")
    tensors = read_weights(sharded)  # each shard opened, mapped and closed in a thread of its own
    maps = _mapped_files()
    backing = {
        name: next((path for start, end, path in maps if start <= t.data_ptr() < end), None)
        for name, t in tensors.items()
        if t.numel()
    }
    shards = {str(p.resolve()) for p in sharded.glob("model-*.safetensors")}
    assert set(backing.values()) == shards, "every tensor lies in a mapping of its shard, every shard is mapped"
    reference = load_file(next(iter(sorted(sharded.glob("model-*.safetensors")))))
    assert all(torch.equal(tensors[n], t) for n, t in reference.items()), "valid after the files were closed"


def test_fingerprint_tracks_weights_and_config(small_checkpoint, tmp_path: Path) -> None:
    hf, path = small_checkpoint
    base = load_model(path, device="cpu").fingerprint
    assert load_model(path, device="cpu").fingerprint == base
    other = _copy(path, tmp_path / "eps")
    cfg = json.loads((other / "config.json").read_text())
    cfg["rms_norm_eps"] = 1e-6
    (other / "config.json").write_text(json.dumps(cfg))
    assert load_model(other, device="cpu").fingerprint != base


def test_missing_folder_and_files(small_checkpoint, tmp_path: Path) -> None:
    _, path = small_checkpoint
    with pytest.raises(InvalidArgumentError, match="does not exist"):
        load_model(tmp_path / "nope")
    no_cfg = _copy(path, tmp_path / "no_cfg")
    (no_cfg / "config.json").unlink()
    with pytest.raises(InvalidArgumentError, match="config.json is missing"):
        load_model(no_cfg)
    no_weights = _copy(path, tmp_path / "no_weights")
    (no_weights / "model.safetensors").unlink()
    with pytest.raises(InvalidArgumentError, match="no model.safetensors"):
        load_model(no_weights)


def test_missing_shard(small_checkpoint, tmp_path: Path) -> None:
    hf, _ = small_checkpoint
    sharded = save_hf_model(hf, tmp_path / "sharded", max_shard_size="40KB")
    next(iter(sorted(sharded.glob("model-*.safetensors")))).unlink()
    with pytest.raises(InvalidArgumentError, match="listed but missing"):
        load_model(sharded)


def test_corrupted_weights(small_checkpoint, tmp_path: Path) -> None:
    _, path = small_checkpoint
    bad = _copy(path, tmp_path / "bad")
    data = (bad / "model.safetensors").read_bytes()
    (bad / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(InvalidArgumentError, match="corrupted or unreadable"):
        load_model(bad)
    (bad / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{garbage")
    with pytest.raises(InvalidArgumentError, match="corrupted or unreadable"):
        load_model(bad)


def test_config_that_does_not_match_the_weights(small_checkpoint, tmp_path: Path) -> None:
    _, path = small_checkpoint
    bad = _copy(path, tmp_path / "bad")
    cfg = json.loads((bad / "config.json").read_text())
    cfg["intermediate_size"] += 8
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(InvalidArgumentError, match=r"feed_forward.gate_proj.weight has shape .* implies"):
        load_model(bad)
    cfg["intermediate_size"] -= 8
    cfg["num_hidden_layers"] += 1
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(InvalidArgumentError, match="missing .*layers.4"):
        load_model(bad)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            {"model_type": "llama", "architectures": ["LlamaForCausalLM"]},
            "unsupported architecture.*supported: BambaForCausalLM, GraniteMoeHybridForCausalLM, NemotronHForCausalLM",
        ),
        ({"hidden_act": "gelu"}, "hidden_act='gelu' is not supported"),
        ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4}}, "rope_type"),
        ({"num_key_value_heads": 3}, "num_key_value_heads"),
        ({"mamba_d_head": 7}, "mamba_n_heads\\*mamba_d_head"),
        ({"attn_layer_indices": [9]}, "attn_layer_indices"),
        ({"time_step_limit": [0.0]}, "time_step_limit"),
        ({"hidden_size": "64"}, "hidden_size must be an integer"),
    ],
)
def test_unsupported_config_values(small_checkpoint, change: dict, message: str) -> None:
    _, path = small_checkpoint
    raw = json.loads((path / "config.json").read_text())
    raw.update(change)
    with pytest.raises(InvalidArgumentError, match=message):
        parse_config(raw)[1]


def test_time_step_limit_infinity_is_parsed(small_checkpoint) -> None:
    _, path = small_checkpoint
    raw = json.loads((path / "config.json").read_text())
    assert raw["time_step_limit"][1] == {"__float__": "Infinity"}
    cfg = parse_config(raw)[1]
    assert cfg.time_step_min == 0.0 and cfg.time_step_max == float("inf")
    raw["time_step_limit"] = [0.001, 0.1]
    assert parse_config(raw)[1].time_step_max == 0.1


def test_tied_embeddings_share_storage(checkpoints) -> None:
    _, path = checkpoints["mha_1group"]
    model = load_model(path, device="cpu").model
    assert model.lm_head.weight.data_ptr() == model.embed.weight.data_ptr()
    assert model.blocks[2].mixer.A_log.dtype == torch.float32


@pytest.mark.parametrize(
    ("arch", "moe"),
    [("bamba", False), ("granitemoehybrid", False), ("granitemoehybrid", True), ("nemotron_h", False),
     ("nemotron_h", True)],
)  # fmt: skip
def test_checkpoint_tensors_invert_the_placement(tmp_path: Path, arch: str, moe: bool) -> None:
    """Loaded parameters converted back give the file's tensors exactly (fused, concatenated, stacked)."""
    folder = write_random_checkpoint(tmp_path / arch, ModelSpec(arch=arch, moe=moe), seed=3, with_tokenizer=False)
    loaded = load_model(folder, device="cpu", dtype="float32")
    written = load_file(str(folder / "model.safetensors"))
    back = checkpoint_tensors(loaded.family, loaded.config, loaded.model)
    assert sorted(back) == sorted(written)
    for name, tensor in written.items():
        assert back[name].shape == tensor.shape and torch.equal(back[name], tensor), name
