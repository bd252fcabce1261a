"""Speculative decoding's verify steps on the GPU: replayed from their CUDA graphs (cuda_graphs.VerifyGraphs)
against the eager Triton kernels, beside a plain decode step under graphs. Called by bench/gpu_qualify.sh.

The model is bench_gpu.py's (hidden 2048, 32 layers, bf16, generated on the device; its tiny spec on CPU
with --dry-run). Per row count R: R requests prefilled with --prompt-tokens random tokens, then --steps
timed steps of each kind, after --warmup-steps:
- plain     R decode rows, replayed from the decode graphs;
- verify    R rows, each its newest token and K random drafts, every draft rejected and rolled back after
            the step (so each step verifies at the same positions): eagerly on the kernels (each row a
            prefill chunk, its states kept in draft rows) and from the verify graphs (the rollback from the
            graph's span tensors). The rollback is part of the step's time.
Printed per R: the step times (ms), eager / graphs, a verify step in plain steps (what a drafted step must
earn back: at R rows it pays when the tokens accepted per drafted row exceed R x (verify / plain - 1) / R),
and the largest difference of the first verify step's logits, graphs against eager.

    python bench/bench_gpu_verify.py [--rows 1,4,8] [--k 4] [--out bench/results/verify.md]
    python bench/bench_gpu_verify.py --dry-run     # tiny model on CPU, kernels interpreted, graphs stood in
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import replace
from pathlib import Path

if "--dry-run" in sys.argv:  # must precede the first import of Triton
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_gpu import MID_SPEC, TINY_SPEC, EagerCapture, Requests, log, random_model, runner_config, timed  # noqa: E402

from gpu_worker.model.backends import attach_kernels  # noqa: E402
from gpu_worker.model.loader import LoadedModel  # noqa: E402
from gpu_worker.runner.batch import Batch, SequenceChunk  # noqa: E402
from gpu_worker.runner.cuda_graphs import DecodeGraphs, VerifyGraphs  # noqa: E402
from gpu_worker.runner.runner import ModelRunner  # noqa: E402
from gpu_worker.runner.speculation import Verified, roll_back  # noqa: E402


def build(loaded: LoadedModel, rows: int, per_seq: int, page: int, k: int, graphs: bool) -> ModelRunner:
    """A runner with room for `rows` requests of `per_seq` tokens, speculation of `k` drafts a row; with
    `graphs`, decode and verify graphs (stood in on CPU)."""
    cfg = replace(runner_config(loaded, rows, per_seq, page, graphs, k * rows), verify_tokens=k + 1)
    runner = ModelRunner(loaded, cfg)
    if graphs and runner.decode_graphs is None:  # CPU (dry run): run the captured steps eagerly
        max_pages = -(-cfg.cuda_graph_max_context_tokens // page)
        runner.decode_graphs = DecodeGraphs(runner._decode_logits, rows, max_pages, page, runner.device, EagerCapture())
        runner.decode_graphs.capture_all()
        runner.verify_graphs = VerifyGraphs(runner._verify_step, rows, k + 1, max_pages, page, runner.device,
                                            EagerCapture())  # fmt: skip
        runner.verify_graphs.capture_all()
    return runner


def verify_step(reqs: Requests, k: int, drafts: list[tuple[int, ...]]) -> torch.Tensor:
    """One verify step of every request (its newest token and `drafts`), all drafts rejected and rolled back;
    returns the logits of the step's last positions."""
    rows = zip(reqs.last, drafts, reqs.lens, reqs.pages, reqs.slots, strict=True)
    batch = Batch(tuple(SequenceChunk((t, *d), n, pg, s, num_draft_tokens=k) for t, d, n, pg, s in rows))
    runner = reqs.runner
    if runner.verify_graphs is not None and not runner.verify_graphs.can_run(batch):
        raise RuntimeError(f"the verify graphs do not hold a step of {len(drafts)} rows of {1 + k} tokens")
    out = runner.forward(batch)
    rejected = [Verified(i, k, (), (), ()) for i in range(len(drafts))]
    roll_back(runner.state_pool, batch, rejected, out.draft_records)
    return torch.stack([logits for _, logits in out.draft_logits])


def plain_step(reqs: Requests) -> None:
    rows = zip(reqs.last, reqs.lens, reqs.pages, reqs.slots, strict=True)
    reqs.runner.forward(Batch(tuple(SequenceChunk((t,), n, pg, s) for t, n, pg, s in rows)))


def measure(args: argparse.Namespace, loaded: LoadedModel, rows: int) -> str:
    device, vocab = loaded.device, loaded.config.vocab_size
    g = torch.Generator().manual_seed(rows)
    prompts = [torch.randint(0, vocab, (args.prompt_tokens,), generator=g).tolist() for _ in range(rows)]
    drafts = [tuple(torch.randint(0, vocab, (args.k,), generator=g).tolist()) for _ in range(rows)]
    per_seq = args.prompt_tokens + args.k + 2
    times: dict[str, float] = {}
    first: dict[str, torch.Tensor] = {}
    for mode in ("eager", "graphs"):
        runner = build(loaded, rows, per_seq, args.page_size, args.k, mode == "graphs")
        if mode == "graphs" and runner.verify_graphs is None:
            raise RuntimeError("no verify graphs were captured")
        reqs = Requests(runner, prompts)
        reqs.allocate(per_seq)
        reqs.prefill(args.max_forward_tokens)
        first[mode] = verify_step(reqs, args.k, drafts).float().cpu()
        for _ in range(args.warmup_steps):
            verify_step(reqs, args.k, drafts)
        times[f"verify {mode}"] = timed(
            device, lambda r=reqs: [verify_step(r, args.k, drafts) for _ in range(args.steps)]
        )
        if mode == "graphs":
            for _ in range(args.warmup_steps):
                plain_step(reqs)
            times["plain"] = timed(device, lambda r=reqs: [plain_step(r) for _ in range(args.steps)])
        reqs.release()
        del runner, reqs
    ms = {name: 1e3 * t / args.steps for name, t in times.items()}
    diff = (first["graphs"] - first["eager"]).abs().max().item()
    return (
        f"| {rows} | {ms['plain']:.3f} | {ms['verify eager']:.3f} | {ms['verify graphs']:.3f} | "
        f"{ms['verify eager'] / ms['verify graphs']:.2f}x | {ms['verify graphs'] / ms['plain']:.2f} | {diff:.2e} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dry-run", action="store_true", help="tiny model on CPU, interpreter kernels")
    parser.add_argument("--rows", default=None, help="comma-separated row counts (default 1,4,8)")
    parser.add_argument("--k", type=int, default=4, help="drafts a row")
    parser.add_argument("--prompt-tokens", type=int, default=None)
    parser.add_argument("--steps", type=int, default=None, help="timed steps of each kind")
    parser.add_argument("--warmup-steps", type=int, default=3)
    parser.add_argument("--max-forward-tokens", type=int, default=8192)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--out", type=Path, default=None, help="markdown report file")
    args = parser.parse_args()
    dry = args.dry_run
    args.prompt_tokens = args.prompt_tokens or (12 if dry else 256)
    args.steps = args.steps or (2 if dry else 30)
    device = torch.device("cpu" if dry else "cuda")
    dtype = torch.float32 if dry else torch.bfloat16
    name = "CPU (dry run)" if dry else torch.cuda.get_device_name(device)
    log(f"device {name}; generating the model")
    loaded = random_model(TINY_SPEC if dry else MID_SPEC, device, dtype, seed=0)
    attach_kernels(loaded.model, "triton")
    lines = [
        f"# Verify steps under CUDA graphs: {'DRY RUN on CPU (tiny model, graphs stood in)' if dry else name}",
        "",
        f"K = {args.k} drafts a row, every one rejected and rolled back; prompts of {args.prompt_tokens} tokens; "
        f"{args.steps} timed steps after {args.warmup_steps}; ms a step; 'verify / plain' = a verify step "
        "under graphs in plain decode steps under graphs; 'logits diff' = first verify step, graphs vs eager.",
        "",
        "| rows | plain ms | verify eager ms | verify graphs ms | eager / graphs | verify / plain | logits diff |",
        "|---|---|---|---|---|---|---|",
    ]
    started = time.perf_counter()
    for rows in [int(r) for r in (args.rows or "1,4,8").split(",")]:
        lines.append(measure(args, loaded, rows))
        log(lines[-1])
    lines += ["", f"total {time.perf_counter() - started:.0f} s"]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out is not None:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
