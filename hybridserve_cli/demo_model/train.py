"""`hybridserve train-demo`: train the default model from scratch on the Python standard library.

Deterministic for a given seed, thread count and torch build: the initial weights, the training windows
and the evaluation windows all come from seeded generators. Prints a progress bar (training loss) and,
every `--eval-every` steps, the held-out loss in bits per byte. Writes `model.safetensors` (float32) and
`training.json` (the facts the model card quotes) into `--out`, by default the package's own copy, so a
rerun replaces the committed weights.

Schedule: AdamW (betas 0.9/0.95, weight decay on matrices only), linear warm-up then cosine decay to a
tenth of the peak rate, gradient norm clipped at 1.

One thread by default: the weights depend on the thread count (float reduction order), and on a small
shared machine a second OpenMP thread mostly waits for a busy core (measured: 4x slower per step on 2
loaded cores). The default run costs about 7 minutes of CPU time (1000 steps at about 0.4 s each)."""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file
from tqdm import tqdm

from gpu_worker.model.config import ModelConfig
from gpu_worker.model.families import BY_ARCHITECTURE
from gpu_worker.model.families.base import Family
from gpu_worker.model.loader import build_model, checkpoint_shapes, checkpoint_tensors, parse_config
from gpu_worker.model.mamba2 import Mamba2Mixer
from gpu_worker.model.model import HybridForCausalLM
from hybridserve_cli.demo_model.corpus import Corpus, even_windows, load_corpus, random_windows
from hybridserve_cli.demo_model.default import DEMO_SPEC, WEIGHTS_DIR
from hybridserve_cli.demo_model.train_forward import next_byte_loss

LN2 = math.log(2.0)


@dataclass(frozen=True, slots=True)
class TrainSettings:
    """Everything that decides the trained weights (with the corpus and the torch build)."""

    seed: int = 0
    steps: int = 1000
    batch_windows: int = 8  # sequences per step
    window_tokens: int = 256  # tokens per sequence (bytes)
    peak_lr: float = 3e-3
    warmup_steps: int = 100
    weight_decay: float = 0.1
    eval_every: int = 100  # steps between held-out evaluations
    eval_windows: int = 32  # held-out sequences per periodic evaluation
    final_eval_windows: int = 128  # held-out sequences in the figure the card reports
    threads: int = 1  # torch intra-op threads (one: see the module docstring)
    scan_chunk_tokens: int = 64  # SSD scan chunk length while training (the result does not depend on it)


def initial_weights(family: Family, config: ModelConfig, seed: int) -> dict[str, torch.Tensor]:
    """Seeded training init of every checkpoint tensor (checkpoint names, drawn in sorted name order), by
    parameter kind: the usual small-normal linears (residual outputs scaled down by the number of residual
    blocks), unit norms, and the Mamba2 recipe for the state parameters (A in [1, 16], dt log-uniform in
    [1e-3, 1e-1] through an inverse softplus, D = 1). The rules read Bamba's checkpoint names."""
    g = torch.Generator().manual_seed(seed)
    depth_scale = 1.0 / math.sqrt(len(config.blocks))  # a Bamba layer is two residual blocks
    out: dict[str, torch.Tensor] = {}
    for name, shape in sorted(checkpoint_shapes(family, config).items()):
        if name.endswith("mamba.A_log"):
            out[name] = torch.log(1.0 + 15.0 * torch.rand(shape, generator=g))
        elif name.endswith("mamba.dt_bias"):
            dt = torch.exp(torch.rand(shape, generator=g) * (math.log(1e-1) - math.log(1e-3)) + math.log(1e-3))
            out[name] = dt + torch.log(-torch.expm1(-dt))  # softplus(dt_bias) == dt
        elif name.endswith("mamba.D") or name.endswith("norm.weight"):
            out[name] = torch.ones(shape)
        elif name.endswith("conv1d.weight"):
            bound = 1.0 / math.sqrt(shape[-1])
            out[name] = (torch.rand(shape, generator=g) * 2.0 - 1.0) * bound
        elif name.endswith("bias"):
            out[name] = torch.zeros(shape)
        else:
            scale = depth_scale if name.endswith(("out_proj.weight", "o_proj.weight", "down_proj.weight")) else 1.0
            out[name] = torch.randn(shape, generator=g) * 0.02 * scale
    return out


def learning_rate(step: int, s: TrainSettings) -> float:
    """Linear warm-up to peak_lr, then cosine decay to peak_lr / 10 at the last step."""
    if step < s.warmup_steps:
        return s.peak_lr * (step + 1) / s.warmup_steps
    progress = (step - s.warmup_steps) / max(1, s.steps - s.warmup_steps)
    return s.peak_lr * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress)))


def make_optimizer(model: HybridForCausalLM, s: TrainSettings) -> torch.optim.AdamW:
    """Weight decay on matrices (linears, embeddings); none on norms, biases and the Mamba vectors."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": s.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=s.peak_lr, betas=(0.9, 0.95), eps=1e-8)


@torch.no_grad()
def held_out_bits_per_byte(model: HybridForCausalLM, windows: torch.Tensor, batch_windows: int = 16) -> float:
    """Mean next-token loss over `windows`, in bits (every token is one byte but the file markers)."""
    model.eval()
    total = 0.0
    for start in range(0, windows.shape[0], batch_windows):
        part = windows[start : start + batch_windows]
        total += next_byte_loss(model, part).item() * part.shape[0]
    model.train()
    return total / windows.shape[0] / LN2


def train(s: TrainSettings, corpus: Corpus) -> tuple[HybridForCausalLM, dict[str, object]]:
    """Train from scratch; returns the model and the facts for training.json."""
    torch.set_num_threads(s.threads)
    torch.manual_seed(s.seed)
    family, config = parse_config(DEMO_SPEC.to_hf_config())
    weights = initial_weights(family, config, s.seed)
    model = build_model(family, config, weights, torch.device("cpu"), torch.float32).requires_grad_(True)
    for module in model.modules():
        if isinstance(module, Mamba2Mixer):
            module.chunk_size = s.scan_chunk_tokens
    model.train()
    optimizer = make_optimizer(model, s)
    g = torch.Generator().manual_seed(s.seed + 1)
    eval_set = even_windows(corpus.held_out, s.eval_windows, s.window_tokens + 1)
    started = time.monotonic()
    curve: list[tuple[int, float]] = []
    bar = tqdm(range(s.steps), desc="train-demo", unit="step", dynamic_ncols=True)
    for step in bar:
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(step, s)
        loss = next_byte_loss(model, random_windows(corpus.train, s.batch_windows, s.window_tokens + 1, g))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()  # type: ignore[no-untyped-call]
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        bar.set_postfix(train_bpb=f"{loss.item() / LN2:.3f}")
        if (step + 1) % s.eval_every == 0 or step + 1 == s.steps:
            bpb = held_out_bits_per_byte(model, eval_set)
            curve.append((step + 1, round(bpb, 4)))
            tqdm.write(f"step {step + 1}/{s.steps}: held-out {bpb:.3f} bits/byte ({time.monotonic() - started:.0f} s)")
    train_s = time.monotonic() - started
    final = held_out_bits_per_byte(model, even_windows(corpus.held_out, s.final_eval_windows, s.window_tokens + 1))
    facts: dict[str, object] = {
        "settings": asdict(s),
        "num_parameters": sum(p.numel() for p in model.parameters()),
        "held_out_bits_per_byte": round(final, 4),
        "held_out_curve": curve,
        "train_wall_s": round(train_s, 1),
        "train_tokens": s.steps * s.batch_windows * s.window_tokens,
        "corpus": {
            "python": platform.python_version(),
            "train_files": corpus.num_train_files,
            "train_tokens": corpus.train.numel(),
            "held_out_files": corpus.num_held_out_files,
            "held_out_tokens": corpus.held_out.numel(),
        },
        "torch": torch.__version__,
    }
    return model, facts


def save(model: HybridForCausalLM, facts: dict[str, object], out_dir: Path) -> None:
    """model.safetensors (float32, contiguous, Hugging Face Bamba names) and training.json into `out_dir`."""
    out_dir.mkdir(parents=True, exist_ok=True)
    family = BY_ARCHITECTURE[model.config.architecture]
    tensors = {k: v.contiguous().clone() for k, v in checkpoint_tensors(family, model.config, model).items()}
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    (out_dir / "training.json").write_text(json.dumps(facts, indent=2) + "\n")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of `hybridserve train-demo`."""
    d = TrainSettings()
    parser.add_argument("--out", type=Path, default=WEIGHTS_DIR, help=f"output folder (default: {WEIGHTS_DIR})")
    parser.add_argument("--seed", type=int, default=d.seed, help=f"seed (default {d.seed})")
    parser.add_argument("--steps", type=int, default=d.steps, help=f"optimizer steps (default {d.steps})")
    parser.add_argument("--threads", type=int, default=d.threads, help=f"torch threads (default {d.threads})")
    parser.add_argument("--eval-every", type=int, default=d.eval_every, help="steps between held-out evaluations")


def run(args: argparse.Namespace) -> int:
    """Train and save; returns the process exit code."""
    if args.steps <= 0 or args.threads <= 0 or args.eval_every <= 0:
        print("error: --steps, --threads and --eval-every must be positive", file=sys.stderr)
        return 2
    settings = TrainSettings(seed=args.seed, steps=args.steps, threads=args.threads, eval_every=args.eval_every)
    corpus = load_corpus()
    print(
        f"corpus: {corpus.root} ({corpus.num_train_files} files, {corpus.train.numel()} tokens for training; "
        f"{corpus.num_held_out_files} files, {corpus.held_out.numel()} tokens held out)"
    )
    model, facts = train(settings, corpus)
    save(model, facts, args.out)
    print(f"held-out {facts['held_out_bits_per_byte']} bits/byte after {settings.steps} steps "
          f"({facts['train_wall_s']} s); wrote {args.out}")  # fmt: skip
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="hybridserve train-demo", description=__doc__)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
