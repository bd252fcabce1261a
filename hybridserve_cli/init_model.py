"""`hybridserve init-model DIR [--random | --arch bamba|granitemoehybrid|nemotron_h [--moe] [--mtp]]
[--chat-template granite]`: write the default model (a small Bamba trained on the Python standard library,
see `hybridserve_cli.demo_model`), or a tiny seeded random checkpoint of a family for tests (`--random`;
`--arch`, `--moe` and `--mtp` imply it; `--mtp` adds Nemotron-H's multi-token-prediction layers);
`--chat-template granite` writes a Granite-4.0-style chat template with tools.

The output is a regular Hugging Face checkpoint folder (config.json, model.safetensors,
generation_config.json, tokenizer.json) that transformers' `from_pretrained` of the family also loads.
Weights are deterministic for a given spec and seed, and the Mamba parameters that shape the state
(dt_bias, A_log, D, conv bias) are randomised so the recurrent state matters; router weights are
scaled up so top-k choices are clear."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from gpu_worker.model.families import BY_NAME, family_for, family_named
from gpu_worker.model.loader import checkpoint_shapes
from gpu_worker.model.tokenizer import BYTE_VOCAB_SIZE, Tokenizer, build_byte_tokenizer
from hybridserve.errors import InvalidArgumentError
from hybridserve_cli.chat_templates import TEMPLATES, add_chat_template

PAD_ID, BOS_ID, EOS_ID = 0, 1, 2  # the byte tokenizer's specials (and the Bamba config defaults)


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """Shape of a random checkpoint; the defaults are the embedded default model (a Bamba)."""

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
    arch: str = "bamba"  # a family name (gpu_worker.model.families)
    moe: bool = False  # MoE layers instead of dense MLPs (granitemoehybrid, nemotron_h)
    num_experts: int = 4
    num_experts_per_tok: int = 2
    mtp: bool = False  # a multi-token-prediction head (nemotron_h: `mtp.*`, for speculative decoding)

    def to_hf_config(self) -> dict[str, Any]:
        """config.json contents, in the layout transformers 5.x writes."""
        family = family_named(self.arch)
        if self.moe and family.name == "bamba":
            raise InvalidArgumentError("--moe needs an architecture with MoE layers (granitemoehybrid, nemotron_h)")
        if self.mtp and family.name != "nemotron_h":
            raise InvalidArgumentError("--mtp needs an architecture with multi-token-prediction layers (nemotron_h)")
        return family.tiny_hf_config(self) | {
            "pad_token_id": PAD_ID,
            "bos_token_id": BOS_ID,
            "eos_token_id": EOS_ID,
            "dtype": "float32",
        }


def random_weights(raw_config: dict[str, Any], seed: int, init_std: float) -> dict[str, torch.Tensor]:
    """Seeded float32 weights for every checkpoint tensor of the architecture, by parameter kind."""
    family = family_for(raw_config, "config.json")
    config = family.parse(raw_config, "config.json")
    shapes = checkpoint_shapes(family, config)
    g = torch.Generator().manual_seed(seed)

    def randn(shape: tuple[int, ...], std: float, mean: float = 0.0) -> torch.Tensor:
        return torch.randn(shape, generator=g) * std + mean

    out: dict[str, torch.Tensor] = {}
    for name in sorted(shapes):
        shape = shapes[name]
        if name.endswith("A_log"):
            out[name] = torch.log(torch.rand(shape, generator=g) * 15.0 + 1.0)  # A in [-16, -1]
        elif name.endswith("dt_bias"):
            out[name] = randn(shape, 1.0, -2.0)  # softplus -> dt mostly in (0.02, 1)
        elif name.endswith(".D"):
            out[name] = randn(shape, 0.5, 1.0)
        elif name.endswith("conv1d.bias"):
            out[name] = randn(shape, 0.1)
        elif name.endswith("conv1d.weight"):
            out[name] = randn(shape, 0.3)
        elif name.endswith(("router.layer.weight", "gate.weight")):
            out[name] = randn(shape, 1.0)  # clear top-k margins
        elif name.endswith("e_score_correction_bias"):
            out[name] = randn(shape, 0.1)
        elif "norm" in name:
            out[name] = randn(shape, 0.05, 1.0)
        else:
            out[name] = randn(shape, init_std)
    return out


def write_checkpoint(
    out_dir: str | Path, spec: ModelSpec, weights: dict[str, torch.Tensor], with_tokenizer: bool = True
) -> Path:
    """Write `weights` as a checkpoint of shape `spec` into `out_dir` (created if needed); return its path."""
    root = Path(out_dir)
    root.mkdir(parents=True, exist_ok=True)
    raw = spec.to_hf_config()
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
    """Write a random checkpoint of `spec.arch` into `out_dir` (created if needed) and return its path."""
    spec = spec or ModelSpec()
    weights = random_weights(spec.to_hf_config(), seed, spec.init_std)  # parsing validates the spec
    return write_checkpoint(out_dir, spec, weights, with_tokenizer)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of `hybridserve init-model`."""
    parser.add_argument("dir", type=Path, help="folder to write the model into")
    parser.add_argument(
        "--random", action="store_true", help="write a seeded random model instead of the trained default (tests)"
    )
    parser.add_argument(
        "--arch", choices=sorted(BY_NAME), default=None, help="family of the random model (implies --random; bamba)"
    )
    parser.add_argument("--moe", action="store_true", help="MoE layers (implies --random)")
    parser.add_argument(
        "--mtp", action="store_true",
        help="a multi-token-prediction head, for --speculative-method mtp (nemotron_h; implies --random)",
    )  # fmt: skip
    parser.add_argument(
        "--mtp-train-steps", type=int, default=0, metavar="N",
        help="with --mtp: train the head N steps on the model's own greedy continuations (seconds on CPU), so"
        " that its drafts are accepted often; 0 (default) leaves it random",
    )  # fmt: skip
    parser.add_argument("--seed", type=int, default=0, help="weight seed of a random model (default 0)")
    parser.add_argument("--force", action="store_true", help="overwrite an existing checkpoint in DIR")
    parser.add_argument(
        "--chat-template",
        choices=sorted(TEMPLATES),
        default=None,
        help="write this chat template into tokenizer_config.json (granite: Granite-4.0's layout, with tools)",
    )


def run(args: argparse.Namespace) -> int:
    """Write the default (or a random) model; returns the process exit code (2 when DIR already holds a checkpoint)."""
    root: Path = args.dir
    if (root / "config.json").exists() and not args.force:
        print(f"error: {root} already holds a checkpoint; pass --force to overwrite it", file=sys.stderr)
        return 2
    random = args.random or args.arch is not None or args.moe or args.mtp
    if random:
        spec = ModelSpec(arch=args.arch or ("nemotron_h" if args.mtp else "bamba"), moe=args.moe, mtp=args.mtp)
        write_random_checkpoint(root, spec, seed=args.seed)
        if args.mtp and args.mtp_train_steps > 0:
            from hybridserve_cli.demo_model.mtp_head import train_mtp_head  # it loads the checkpoint just written

            loss = train_mtp_head(root, args.mtp_train_steps, seed=args.seed)
            print(f"trained the MTP head {args.mtp_train_steps} steps on the model's greedy continuations (loss"
                  f" {loss:.3f})")  # fmt: skip
    else:
        from hybridserve_cli.demo_model.default import write_default_checkpoint  # it builds on this module

        write_default_checkpoint(root)
    if args.chat_template is not None:
        add_chat_template(root, args.chat_template)
    from gpu_worker.model.loader import load_model  # the check below re-reads what was written

    loaded = load_model(root, device="cpu", dtype="float32")
    n_params = sum(p.numel() for p in loaded.model.parameters())
    arch = f"{loaded.config.architecture}{' (MoE)' if args.moe else ''}{' with an MTP head' if args.mtp else ''}"
    # named as asked: `--random` says so, `--arch` names the family, the default names its family and that it is trained
    kind = f"random model ({arch})" if args.random else f"{arch} model" if random else f"{arch} model (trained default)"
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
