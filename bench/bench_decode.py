"""Decode-step profile of the model runner at 8..64 running sequences, split by phase and by layer kind.

Model: the benchmark model, a tiny Granite-4.0-H (hidden 256, 8 layers, attention at layers 3 and 7, 8 Mamba heads
of 64, d_state 64, dense MLP 512, vocab 512), as bench/bench_vs_vllm.py writes it. Each batch size
prefills prompts of 16..256 tokens, then times decode steps (greedy), split into:
    inputs   build_inputs (validation, packing, index tensors)
    model    the forward, per block kind (mamba, attention, mlp; norm + residual are the rest)
    logits   the LM head on the last rows
    sample   greedy sampling and the device -> list copy
With --compile the same steps also run with the Mamba decode step compiled (gpu_worker.model.
compiled_decode), interleaved with the eager runs; with --compile-step also as whole compiled decode steps
(gpu_worker.model.backends.cpu.compiled_step: one program per batch size, each batch its own bucket; the
per-kind columns are then empty, the program has no per-layer timers); with --drafts K every row is a verify
row of speculative decoding (its newest token and K random drafts, rarely accepted, so a step yields about
a token a row: the cost of a verify step, its verification and rollback included; "step" is then the
compiled verify program); with --scattered the sequences hold every other
state slot (not one contiguous run); --prompts 1000..3000 sets the prompt lengths (long contexts);
--padded-attention also runs every mode with decode attention batched over pages padded to the longest
context for every sequence in one call (the form before gpu_worker.model.backends.cpu.decode_attention's per-sequence
calls and groups), rows marked "/pad"; --unpacked also runs every mode with the projections' weights given to oneDNN
unpacked (from 16 rows, F.linear below: the form before gpu_worker.model.backends.cpu.linear's packs), rows marked
"/unpacked".
Absolute times depend on the machine and its load; compare rows measured in one run.

    .venv/bin/python bench/bench_decode.py [--batches 8,32,64] [--steps 48] [--compile] [--compile-step] [--scattered]
        [--prompts 16..256] [--padded-attention] [--unpacked] [--dtype float32|bfloat16] [--no-floor] [--drafts K]

Each row also prints its step time as a multiple of this machine's floor for the step (bench/bench_roofline.py:
the machine's one-thread gemv bandwidth and matmul rate, measured first; --no-floor skips it).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from bench_roofline import floors  # noqa: E402  (bench/, this script's folder)
from bench_roofline import measure as measure_machine  # noqa: E402
from bench_vs_vllm import PRESETS  # noqa: E402

from gpu_worker.model.attention import PagedAttention
from gpu_worker.model.backends.cpu.decode_attention import DECODE_GROUP_BYTES, LONG_CONTEXT_TOKENS
from gpu_worker.model.backends.cpu.linear import OneDnnLinear
from gpu_worker.model.mamba2 import Mamba2Mixer
from gpu_worker.model.model import Block
from gpu_worker.runner.batch import Batch, SequenceChunk
from gpu_worker.runner.input_builder import build_inputs
from gpu_worker.runner.runner import ModelRunner
from gpu_worker.runner.sampling import SamplingParams, StepSampling, sample
from gpu_worker.runner.settings import RunnerConfig
from gpu_worker.runner.tuning import keep_freed_memory
from hybridserve_cli.init_model import ModelSpec, write_random_checkpoint

SPEC = ModelSpec(
    vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=8, attn_layer_indices=(3, 7),
    num_attention_heads=4, num_key_value_heads=2, mamba_n_heads=8, mamba_d_state=64, mamba_chunk_size=256,
    arch="granitemoehybrid", init_std=0.06,
)  # fmt: skip


def preset_spec(name: str) -> ModelSpec:
    """The benchmark model at one of bench_vs_vllm.py's sizes, shaped as its model is (MLP 2 x hidden,
    attention at layer 3 and the last): today's is SPEC."""
    hidden, layers, vocab = PRESETS[name]
    return replace(SPEC, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                   attn_layer_indices=(3, layers - 1), vocab_size=vocab)  # fmt: skip


class Clock:
    """Accumulates wall seconds per label (CPU ops run synchronously, so wall time is op time)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.on = False

    def wrap(self, label: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            if not self.on:
                return fn(*args, **kwargs)
            t0 = time.perf_counter()
            out = fn(*args, **kwargs)
            self.seconds[label] += time.perf_counter() - t0
            return out

        return timed


def instrument(runner: ModelRunner, clock: Clock) -> None:
    """Time the mixers by kind and the LM head (instance attributes shadow the class methods)."""
    for module in runner.model.blocks:
        assert isinstance(module, Block)
        module.mixer.forward = clock.wrap(module.kind, module.mixer.forward)  # type: ignore[method-assign]
    runner.model.compute_logits = clock.wrap("logits", runner.model.compute_logits)  # type: ignore[method-assign]


def run_batch(
    runner: ModelRunner, clock: Clock, b: int, steps: int, scattered: bool, prompt_range: tuple[int, int],
    drafts: int = 0,
) -> dict[str, float]:  # fmt: skip
    """Decode `steps` steps of b sequences (the same prompts for every call with this b); with `drafts`, each
    row a verify row of its newest token and that many drafts (random tokens), through runner.execute
    (verification and rollback included)."""
    g = torch.Generator().manual_seed(b)
    kv, states = runner.kv_pool, runner.state_pool
    lens = torch.randint(prompt_range[0], prompt_range[1] + 1, (b,), generator=g).tolist()
    prompts = [torch.randint(3, 512, (k,), generator=g).tolist() for k in lens]
    slots = [states.allocate_slot() for _ in range(2 * b if scattered else b)]
    held, slots = slots, slots[1::2] if scattered else slots
    warm = 8
    pages = [tuple(kv.allocate(kv.pages_for_tokens(len(p) + (warm + steps + 1) * (1 + drafts)))) for p in prompts]
    done = [len(p) for p in prompts]  # tokens computed per row
    params, positions = [SamplingParams()] * b, [0] * b
    greedy = StepSampling(tuple(range(b)))
    batch = Batch(tuple(SequenceChunk(tuple(p), 0, pg, s) for p, pg, s in zip(prompts, pages, slots, strict=True)))
    last = sample(runner.forward(batch).logits, params, positions).token_ids
    total = 0.0
    for step in range(steps + warm):
        if step == warm:
            clock.seconds.clear()
            clock.on = True
            total = 0.0
        t0 = time.perf_counter()
        batch = Batch(
            tuple(
                SequenceChunk(
                    (t, *torch.randint(3, 512, (drafts,), generator=g).tolist()), n, pg, s, num_draft_tokens=drafts
                )
                for n, t, pg, s in zip(done, last, pages, slots, strict=True)
            )
        )
        if clock.on:
            t1 = time.perf_counter()
            build_inputs(
                batch, runner.kv_page_size_tokens, states.num_slots, runner.device
            )  # timed copy of the step's own
            clock.seconds["inputs"] += time.perf_counter() - t1
        t1 = time.perf_counter()
        if drafts:
            out = runner.execute(batch, greedy)
            t2 = time.perf_counter()
            last = out.token_ids
            done = [n + 1 + len(v.token_ids) for n, v in zip(done, out.drafts, strict=True)]
        else:
            logits = runner.forward(batch).logits
            t2 = time.perf_counter()
            last = sample(logits, params, positions).token_ids
            done = [n + 1 for n in done]
        t3 = time.perf_counter()
        if clock.on:
            clock.seconds["forward"] += t2 - t1
            clock.seconds["sample"] += t3 - t2
            total += t3 - t0 - (t1 - t0)  # the extra build_inputs above is not part of the step
    clock.on = False
    for pg in pages:
        kv.free(list(pg))
    for s in held:
        states.free_slot(s)
    ms = {k: 1000 * v / steps for k, v in clock.seconds.items()}
    ms["step"] = 1000 * total / steps
    return ms


def set_padded_attention(runner: ModelRunner, padded: bool) -> None:
    """Decode attention batched over padded pages for every sequence in one call, or long contexts one by
    one and many short ones in groups."""
    for module in runner.model.modules():
        if isinstance(module, PagedAttention):
            module.decode_long_context_tokens = 1 << 62 if padded else LONG_CONTEXT_TOKENS
            module.decode_group_bytes = 1 << 62 if padded else DECODE_GROUP_BYTES


def set_packed(runner: ModelRunner, packed: bool) -> None:
    """Projections with their weights prepacked for oneDNN (the default where packing is on) or not."""
    for module in runner.model.modules():
        if isinstance(module, OneDnnLinear):
            module.set_packing(packed)


def set_compiled(runner: ModelRunner, compiled: bool) -> None:
    """Route the Mamba decode rows through the compiled step (attached) or the eager code."""
    compiler = runner.decode_compiler
    assert compiler is not None and compiler.attach_if_ready(), f"decode compile: {compiler and compiler.status}"
    step = compiler.compiled if compiled else None
    for module in runner.model.modules():
        if isinstance(module, Mamba2Mixer):
            module.fused_decode = step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", default="8,32,64")
    parser.add_argument("--steps", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=3, help="best of this many runs per batch size")
    parser.add_argument("--compile", action="store_true", help="also the compiled Mamba step, interleaved")
    parser.add_argument("--compile-step", action="store_true", help="also whole compiled decode steps, interleaved")
    parser.add_argument("--scattered", action="store_true", help="every other state slot (gathered state rows)")
    parser.add_argument("--prompts", default="16..256", help="prompt lengths LO..HI (tokens)")
    parser.add_argument("--padded-attention", action="store_true", help="also decode attention padded to the longest")
    parser.add_argument("--unpacked", action="store_true", help="also the projections' weights unpacked")
    parser.add_argument("--preset", choices=sorted(PRESETS), default="today",
                        help="the model's size, as bench_vs_vllm.py --preset: " + "; ".join(
                            f"{k} hidden {v[0]}, {v[1]} layers, vocab {v[2]}" for k, v in PRESETS.items()))  # fmt: skip
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"), help="the model's dtype")
    parser.add_argument("--no-floor", action="store_true", help="skip measuring the machine's floor (bench_roofline)")
    parser.add_argument("--drafts", type=int, default=0, help="verify steps: each row its token and this many drafts")
    args = parser.parse_args()
    lo, hi = (int(x) for x in args.prompts.split(".."))
    keep_freed_memory()
    batches = [int(x) for x in args.batches.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        spec = preset_spec(args.preset)
        path = write_random_checkpoint(Path(tmp) / "m", spec, seed=0, with_tokenizer=False)
        head_dim = spec.hidden_size // spec.num_attention_heads
        token_kv = 2 * len(spec.attn_layer_indices) * spec.num_key_value_heads * head_dim * 4  # K+V, float32
        kv_bytes = token_kv * max(batches) * (hi + args.steps + 64)  # with slack
        config = RunnerConfig(
            max_num_seqs=2 * max(batches), num_checkpoint_slots=0, decode_compile="on" if args.compile else "off",
            compile_step_sizes=",".join(map(str, batches)) if args.compile_step else "", dtype=args.dtype,
            memory_budget_bytes=max(256 << 20, kv_bytes * (1 + args.drafts) + (128 << 20)),
            num_draft_rows=args.drafts * max(batches), verify_tokens=1 + args.drafts if args.drafts else 0,
        )  # fmt: skip
        t0 = time.perf_counter()
        runner = ModelRunner.from_model_dir(path, config)
        if runner.decode_compiler is not None:
            runner.decode_compiler.wait()
        programs = runner.decode_steps
        if programs is not None:
            runner.warm_up()  # compiles every batch size's program
            assert programs.status == "ready", programs.status
        print(f"runner ready in {time.perf_counter() - t0:.1f} s; {runner.describe()}")
        print(f"threads {torch.get_num_threads()}; ms per decode step (best of {args.repeats} x {args.steps} steps)")
        clock = Clock()
        instrument(runner, clock)
        cols = ("step", "inputs", "forward", "mamba", "attention", "mlp", "logits", "sample")
        modes = ("eager", "compiled") if args.compile else ("eager",)
        if args.compile_step:
            modes = (*modes, "step")
        if args.padded_attention:
            modes = tuple(m for mode in modes for m in (mode, f"{mode}/pad"))
        if args.unpacked:
            modes = tuple(m for mode in modes for m in (mode, f"{mode}/unpacked"))
        print(f"prompts {lo}..{hi} tokens")
        machine = None
        if not args.no_floor and args.dtype == "float32":  # the floors count float32 weights
            threads = torch.get_num_threads()
            torch.set_num_threads(1)  # the floor is one core's
            machine = measure_machine(24, 512)
            torch.set_num_threads(threads)
        if machine is not None:
            l3, dram, peak = machine.l3_bytes_per_s / 1e9, machine.dram_bytes_per_s / 1e9, machine.flops_per_s / 1e9
            print(f"floor (bench/bench_roofline.py, one core): gemv {l3:.1f} GB/s from L3, {dram:.1f} GB/s from DRAM,"
                  f" matmul {peak:.1f} GFLOP/s; x floor = step / the floor at the prompts' mean context")  # fmt: skip
        print(f"{'batch':>6}{'mode':>20}" + "".join(f"{c:>10}" for c in cols) + f"{'tok/s':>9}{'x floor':>9}")
        for b in batches:
            runs: dict[str, list[dict[str, float]]] = {m: [] for m in modes}
            for _ in range(args.repeats):  # interleaved, so a load spike hits both alike
                for mode in modes:
                    if args.compile:
                        set_compiled(runner, mode.startswith("compiled") or mode == "step")
                    runner.decode_steps = programs if mode == "step" else None
                    set_padded_attention(runner, "/pad" in mode)
                    set_packed(runner, "/unpacked" not in mode)
                    runs[mode].append(run_batch(runner, clock, b, args.steps, args.scattered, (lo, hi), args.drafts))
            for mode in modes:
                best = min(runs[mode], key=lambda r: r["step"])
                row = "".join(f"{best.get(c, 0.0):>10.2f}" for c in cols)
                floor_ms = (
                    None
                    if machine is None
                    else floors(spec, b * (1 + args.drafts), machine, (lo + hi) // 2).seconds * 1e3
                )
                times = "" if floor_ms is None else f"{best['step'] / floor_ms:>9.1f}"
                print(f"{b:>6}{mode:>20}{row}{1000 * b / best['step']:>9.0f}{times}")
        print("forward includes inputs (built again inside it), mixers, norms and logits; mixers are timed by kind")


if __name__ == "__main__":
    main()
