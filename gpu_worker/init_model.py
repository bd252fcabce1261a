"""`hybridserve init-model DIR`: write the default model (a small Bamba trained on the Python standard library,
see `gpu_worker.demo_model`), or with `--random` a tiny seeded random Bamba for tests.

The output is a regular Hugging Face checkpoint folder (config.json, model.safetensors,
generation_config.json, tokenizer.json) that transformers' `BambaForCausalLM.from_pretrained` also loads.
Random weights are deterministic for a given spec and seed, and the Mamba parameters that shape the state
(dt_bias, A_log, D, conv bias) are randomised so the recurrent state matters."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from gpu_worker.model.config import BambaConfig
from gpu_worker.model.model import BambaForCausalLM
from gpu_worker.tokenizer import BYTE_VOCAB_SIZE, Tokenizer, build_byte_tokenizer
from hybridserve.errors import InvalidArgumentError

PAD_ID, BOS_ID, EOS_ID = 0, 1, 2  # the byte tokenizer's specials (and the Bamba config defaults)


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """Shape of a random Bamba checkpoint; the defaults are the embedded default model."""

    vocab_size: int = BYTE_VOCAB_SIZE
    hidden_size: int = 128
    intermediate_size: int = 256
    num_hidden_layers: int = 6
    attn_layer_indices: tuple[int, ...] = (2, 5)
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    mamba_n_heads: int = 4
    mamba_n_groups: int = 1
    mamba_d_state: int = 32
    mamba_d_conv: int = 4
    mamba_expand: int = 2
    mamba_chunk_size: int = 256
    init_std: float = 0.02  # std of the normal init of linear and embedding weights

    def to_hf_config(self) -> dict[str, Any]:
        """config.json contents, in the layout transformers 5.x writes."""
        return {
            "architectures": ["BambaForCausalLM"],
            "model_type": "bamba",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "attn_layer_indices": list(self.attn_layer_indices),
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "hidden_act": "silu",
            "rms_norm_eps": 1e-5,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
            "max_position_embeddings": 262144,
            "mamba_n_heads": self.mamba_n_heads,
            "mamba_d_head": self.mamba_expand * self.hidden_size // self.mamba_n_heads,
            "mamba_n_groups": self.mamba_n_groups,
            "mamba_d_state": self.mamba_d_state,
            "mamba_d_conv": self.mamba_d_conv,
            "mamba_expand": self.mamba_expand,
            "mamba_chunk_size": self.mamba_chunk_size,
            "mamba_conv_bias": True,
            "mamba_proj_bias": False,
            "time_step_limit": [0.0, {"__float__": "Infinity"}],
            "attention_bias": False,
            "mlp_bias": False,
            "tie_word_embeddings": False,
            "pad_token_id": PAD_ID,
            "bos_token_id": BOS_ID,
            "eos_token_id": EOS_ID,
            "dtype": "float32",
        }


def random_weights(config: BambaConfig, seed: int, init_std: float) -> dict[str, torch.Tensor]:
    """Seeded float32 weights for every tensor of the architecture, by parameter kind."""
    with torch.device("meta"):
        shapes = {k: tuple(v.shape) for k, v in BambaForCausalLM(config).state_dict().items()}
    g = torch.Generator().manual_seed(seed)

    def randn(shape: tuple[int, ...], std: float, mean: float = 0.0) -> torch.Tensor:
        return torch.randn(shape, generator=g) * std + mean

    out: dict[str, torch.Tensor] = {}
    for name in sorted(shapes):
        shape = shapes[name]
        if name.endswith("mamba.A_log"):
            out[name] = torch.log(torch.rand(shape, generator=g) * 15.0 + 1.0)  # A in [-16, -1]
        elif name.endswith("mamba.dt_bias"):
            out[name] = randn(shape, 1.0, -2.0)  # softplus -> dt mostly in (0.02, 1)
        elif name.endswith("mamba.D"):
            out[name] = randn(shape, 0.5, 1.0)
        elif name.endswith("conv1d.bias"):
            out[name] = randn(shape, 0.1)
        elif name.endswith("conv1d.weight"):
            out[name] = randn(shape, 0.3)
        elif "norm" in name:
            out[name] = randn(shape, 0.05, 1.0)
        else:
            out[name] = randn(shape, init_std)
    return out


def write_checkpoint(
    out_dir: str | Path, spec: ModelSpec, weights: dict[str, torch.Tensor], with_tokenizer: bool = True
) -> Path:
    """Write `weights` as a Bamba checkpoint of shape `spec` into `out_dir` (created if needed); return its path."""
    root = Path(out_dir)
    root.mkdir(parents=True, exist_ok=True)
    raw = spec.to_hf_config()
    BambaConfig.from_dict(raw)  # validates the spec
    if with_tokenizer and spec.vocab_size < BYTE_VOCAB_SIZE:
        raise InvalidArgumentError(
            f"vocab_size={spec.vocab_size} is smaller than the byte tokenizer's {BYTE_VOCAB_SIZE}"
        )
    save_file(weights, str(root / "model.safetensors"), metadata={"format": "pt"})
    (root / "config.json").write_text(json.dumps(raw, indent=2, sort_keys=True) + "\n")
    generation = {"bos_token_id": BOS_ID, "eos_token_id": EOS_ID, "pad_token_id": PAD_ID}
    (root / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    if with_tokenizer:
        Tokenizer(build_byte_tokenizer()).save(root / "tokenizer.json")
        tok_cfg = {"bos_token": "<|bos|>", "eos_token": "<|eos|>", "pad_token": "<|pad|>",
                   "tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 262144}  # fmt: skip
        (root / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2) + "\n")
    return root


def write_random_checkpoint(
    out_dir: str | Path, spec: ModelSpec | None = None, seed: int = 0, with_tokenizer: bool = True
) -> Path:
    """Write a seeded random Bamba checkpoint into `out_dir` (created if needed) and return its path."""
    spec = spec or ModelSpec()
    weights = random_weights(BambaConfig.from_dict(spec.to_hf_config()), seed, spec.init_std)
    return write_checkpoint(out_dir, spec, weights, with_tokenizer)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of `hybridserve init-model`."""
    parser.add_argument("dir", type=Path, help="folder to write the default model into")
    parser.add_argument(
        "--random", action="store_true", help="write a seeded random model instead of the trained default (tests)"
    )
    parser.add_argument("--seed", type=int, default=0, help="weight seed of --random (default 0)")
    parser.add_argument("--force", action="store_true", help="overwrite an existing checkpoint in DIR")


def run(args: argparse.Namespace) -> int:
    """Write the default (or random) model; returns the process exit code (2 when DIR already holds a checkpoint)."""
    root: Path = args.dir
    if (root / "config.json").exists() and not args.force:
        print(f"error: {root} already holds a checkpoint; pass --force to overwrite it", file=sys.stderr)
        return 2
    if args.random:
        write_random_checkpoint(root, ModelSpec(), seed=args.seed)
    else:
        from gpu_worker.demo_model.default import write_default_checkpoint  # it builds on this module

        write_default_checkpoint(root)
    from gpu_worker.model.loader import load_model  # the check below re-reads what was written

    loaded = load_model(root, device="cpu", dtype="float32")
    n_params = sum(p.numel() for p in loaded.model.parameters())
    kind = "random model" if args.random else "default model"
    print(f"wrote {kind} to {root} ({n_params} parameters, fingerprint {loaded.fingerprint[:16]})")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="hybridserve init-model", description=__doc__)
    add_arguments(parser)
    try:
        return run(parser.parse_args(argv))
    except InvalidArgumentError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
