"""GPU qualification benchmark: prefill and decode throughput of the runner on a mid-size random Bamba,
side by side: the torch reference path, the Triton kernels eager, and the kernels under CUDA graphs;
plus each decode step against the HBM bandwidth floor. Called by bench/gpu_qualify.sh.

Model (generated on the device, seeded, never written to disk): hidden 2048, 32 layers with attention at
9, 18 and 27 (16 heads, 4 KV heads, head dim 128), Mamba2 with 64 heads of 64 channels, state 128, one
group; SwiGLU 8192; vocab 32000; bf16 weights, float32 SSM state (about 2.3 B parameters, 4.6 GB).
Per batch size B: B prompts of --prompt-tokens random tokens are prefilled (packed, at most
--max-forward-tokens per forward), then --decode-steps greedy decode steps are timed after warm-up.
Each step ends with the argmax on the host, as an engine's step does.

HBM floor of one decode step = bytes that must cross HBM / peak bandwidth (4.8 TB/s for an H200):
every weight once (the embedding only for its B rows), the KV of every context token of the attention
layers, and every sequence's Mamba state read and written. The measured copy bandwidth (a device-to-
device copy of 2 GiB) is printed next to the peak.

    python bench/bench_gpu.py --out bench/results/gpu_bench.md [--batches 1,8,32,128,256]
    python bench/bench_gpu.py --dry-run     # tiny model on CPU, kernels under Triton's interpreter
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

if "--dry-run" in sys.argv:  # must precede the first import of Triton
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

from gpu_worker.model.backends import attach_kernels, kernel_backend  # noqa: E402
from gpu_worker.model.families import family_for  # noqa: E402
from gpu_worker.model.loader import LoadedModel, build_model, weight_sources  # noqa: E402
from gpu_worker.model.model import HybridForCausalLM  # noqa: E402
from gpu_worker.runner.batch import Batch, SequenceChunk  # noqa: E402
from gpu_worker.runner.cuda_graphs import DecodeGraphs  # noqa: E402
from gpu_worker.runner.kv_pool import KVPagePool  # noqa: E402
from gpu_worker.runner.runner import ModelRunner  # noqa: E402
from gpu_worker.runner.settings import RunnerConfig  # noqa: E402
from gpu_worker.runner.state_pool import MambaStatePool  # noqa: E402
from hybridserve_cli.init_model import ModelSpec  # noqa: E402

PEAK_HBM_BYTES_PER_S = 4.8e12  # H200 SXM datasheet
MID_SPEC = ModelSpec(
    vocab_size=32000, hidden_size=2048, intermediate_size=8192, num_hidden_layers=32, attn_layer_indices=(9, 18, 27),
    num_attention_heads=16, num_key_value_heads=4, mamba_n_heads=64, mamba_n_groups=1, mamba_d_state=128,
    mamba_chunk_size=256,
)  # fmt: skip
TINY_SPEC = ModelSpec(
    vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4, attn_layer_indices=(1, 3),
    num_attention_heads=4, num_key_value_heads=2, mamba_n_heads=4, mamba_d_state=16, mamba_chunk_size=16,
)  # fmt: skip


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S', time.gmtime())}] {msg}", flush=True)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def random_model(spec: ModelSpec, device: torch.device, dtype: torch.dtype, seed: int) -> LoadedModel:
    """The spec's Bamba with seeded random weights made on the device (as `init_model.random_weights`)."""
    raw = spec.to_hf_config()
    family = family_for(raw, "config.json")
    config = family.parse(raw, "config.json")
    with torch.device("meta"):
        model = HybridForCausalLM(config)
    shapes = {
        n: shape
        for _, src, src_shapes in weight_sources(family, config, model).values()
        for n, shape in zip(src.names, src_shapes, strict=True)
    }  # fmt: skip (checkpoint names)
    g = torch.Generator(device=device).manual_seed(seed)

    def randn(shape: tuple[int, ...], std: float, mean: float = 0.0, dt: torch.dtype = dtype) -> torch.Tensor:
        return torch.randn(shape, generator=g, device=device, dtype=dt) * std + mean

    tensors: dict[str, torch.Tensor] = {}
    for name, shape in sorted(shapes.items()):
        if name.endswith("A_log"):
            tensors[name] = torch.log(torch.rand(shape, generator=g, device=device) * 15.0 + 1.0)
        elif name.endswith("dt_bias"):
            tensors[name] = randn(shape, 1.0, -2.0, torch.float32)
        elif name.endswith(".D"):
            tensors[name] = randn(shape, 0.5, 1.0, torch.float32)
        elif name.endswith("conv1d.bias"):
            tensors[name] = randn(shape, 0.1)
        elif name.endswith("conv1d.weight"):
            tensors[name] = randn(shape, 0.3)
        elif "norm" in name:
            tensors[name] = randn(shape, 0.05, 1.0)
        else:
            tensors[name] = randn(shape, spec.init_std)
    built = build_model(family, config, tensors, device, dtype)
    return LoadedModel(Path("random"), config, family, built, None, (), f"random-{seed}", device, dtype)


def runner_config(
    loaded: LoadedModel, max_batch: int, tokens_per_seq: int, page: int, graphs: bool, draft_rows: int = 0
) -> RunnerConfig:
    """A memory budget that holds `max_batch` state slots and their KV pages (and `draft_rows` more states,
    speculation's), nothing more."""
    c = loaded.config
    kv_per_token = KVPagePool.bytes_per_token(c.num_attention_layers, c.num_key_value_heads, c.head_dim, loaded.dtype)
    state = MambaStatePool.bytes_per_slot(
        c.num_mamba_layers, (c.conv_dim, c.mamba_d_conv - 1), (c.mamba_n_heads, c.mamba_d_head, c.mamba_d_state),
        loaded.dtype,
    )  # fmt: skip
    pages = max_batch * -(-tokens_per_seq // page) + 2
    return RunnerConfig(
        memory_budget_bytes=state * (max_batch + draft_rows) + max(kv_per_token, 1) * page * pages,
        kv_page_size_tokens=page, num_draft_rows=draft_rows,
        max_num_seqs=max_batch, num_checkpoint_slots=0, device=str(loaded.device),
        dtype=str(loaded.dtype).removeprefix("torch."), cuda_graph_max_batch=max_batch if graphs else 0,
        cuda_graph_max_context_tokens=-(-tokens_per_seq // page) * page,
    )  # fmt: skip


class EagerCapture:
    """Dry run: the CPU stand-in for graph capture (runs the captured step eagerly on replay)."""

    def __call__(self, step: Callable[[], None]) -> Callable[[], None]:
        step()
        return step


@dataclass
class Requests:
    """B teacher-free greedy requests: their slots, pages and computed lengths."""

    runner: ModelRunner
    prompts: list[list[int]]
    slots: list[int] = field(default_factory=list)
    pages: list[tuple[int, ...]] = field(default_factory=list)
    lens: list[int] = field(default_factory=list)
    last: list[int] = field(default_factory=list)
    generated: list[list[int]] = field(default_factory=list)  # tokens of the timed decode steps

    def allocate(self, tokens_per_seq: int) -> None:
        kv, pool = self.runner.kv_pool, self.runner.state_pool
        self.slots = [pool.allocate_slot() for _ in self.prompts]
        self.pages = [tuple(kv.allocate(kv.pages_for_tokens(tokens_per_seq))) for _ in self.prompts]

    def release(self) -> None:
        for s, p in zip(self.slots, self.pages, strict=True):
            self.runner.state_pool.free_slot(s)
            self.runner.kv_pool.free(list(p))

    def prefill(self, max_forward_tokens: int) -> None:
        self.lens, self.last = [0] * len(self.prompts), [0] * len(self.prompts)
        group: list[int] = []
        for i, p in enumerate(self.prompts):
            if group and (len(group) + 1) * len(p) > max_forward_tokens:
                self._prefill_group(group)
                group = []
            group.append(i)
        self._prefill_group(group)

    def _prefill_group(self, rows: list[int]) -> None:
        seqs = tuple(SequenceChunk(tuple(self.prompts[i]), 0, self.pages[i], self.slots[i]) for i in rows)
        for i, t in zip(rows, self.runner.forward(Batch(seqs)).logits.argmax(-1).tolist(), strict=True):
            self.lens[i], self.last[i] = len(self.prompts[i]), t

    def decode(self, steps: int) -> None:
        for _ in range(steps):
            rows = zip(self.last, self.lens, self.pages, self.slots, strict=True)
            seqs = tuple(SequenceChunk((t,), n, pg, s) for t, n, pg, s in rows)
            self.last = self.runner.forward(Batch(seqs)).logits.argmax(-1).tolist()
            self.lens = [n + 1 for n in self.lens]
            for out, t in zip(self.generated, self.last, strict=False):
                out.append(t)


def timed(device: torch.device, fn: Callable[[], object]) -> float:
    sync(device)
    t0 = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - t0


def copy_bandwidth(device: torch.device, num_bytes: int) -> float:
    """Bytes/s of a device-to-device copy (read + write counted), best of 5."""
    src = torch.empty(num_bytes // 2, dtype=torch.float16, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = min(timed(device, lambda: dst.copy_(src)) for _ in range(5))
    return 2 * num_bytes / best


def step_floor_bytes(runner: ModelRunner, batch: int, mean_context: float) -> float:
    """Bytes one decode step must move through HBM (see the module docstring)."""
    model = runner.model
    seen: set[int] = set()
    weights = 0
    for p in model.parameters():
        if p.data_ptr() not in seen:
            seen.add(p.data_ptr())
            weights += p.numel() * p.element_size()
    emb = model.embed.weight
    if not runner.config.tie_word_embeddings:  # the embedding is gathered, not read whole
        weights -= emb.numel() * emb.element_size() - batch * emb.shape[1] * emb.element_size()
    kv = batch * mean_context * runner.kv_bytes_per_token
    return weights + kv + 2 * batch * runner.state_bytes_per_request


@dataclass
class Row:
    batch: int
    cells: dict[str, str] = field(default_factory=dict)  # column -> printed value
    step_s: dict[str, float] = field(default_factory=dict)  # mode -> seconds per decode step
    tokens: dict[str, list[list[int]]] = field(default_factory=dict)  # mode -> greedy tokens per sequence


class Report:
    """The markdown report, rewritten after every measurement so a cut-off run still leaves one."""

    COLUMNS = ("batch", "prefill tok/s torch", "prefill tok/s triton", "decode tok/s torch", "decode tok/s triton",
               "decode tok/s graphs", "graphs vs eager", "same greedy tokens", "step ms", "HBM floor ms",
               "of floor")  # fmt: skip

    def __init__(self, path: Path | None, header: list[str]) -> None:
        self.path, self.header = path, header
        self.rows: list[Row] = []
        self.notes: list[str] = []

    def write(self) -> None:
        lines = [*self.header, "", "| " + " | ".join(self.COLUMNS) + " |", "|" + "---|" * len(self.COLUMNS)]
        for r in self.rows:
            lines.append("| " + " | ".join([str(r.batch)] + [r.cells.get(c, "-") for c in self.COLUMNS[1:]]) + " |")
        text = "\n".join([*lines, "", *self.notes, ""])
        if self.path is not None:
            self.path.write_text(text)
        print(text, flush=True)


def measure_mode(args: argparse.Namespace, mode: str, runner: ModelRunner, prompts: list[list[int]], row: Row) -> None:
    """One mode at one batch size: prefill throughput (eager modes), then timed decode steps."""
    batch, device = len(prompts), runner.device
    attach_kernels(runner.model, "torch" if mode == "torch" else "triton")
    reqs = Requests(runner, prompts)
    reqs.allocate(args.prompt_tokens + args.warmup_steps + args.decode_steps + 1)
    try:
        if mode != "graphs":
            if batch == args.batches[0]:
                reqs.prefill(args.max_forward_tokens)  # warm-up (Triton compiles)
            seconds = timed(device, lambda: reqs.prefill(args.max_forward_tokens))
            row.cells[f"prefill tok/s {mode}"] = f"{batch * args.prompt_tokens / seconds:,.0f}"
        else:
            reqs.prefill(args.max_forward_tokens)
        reqs.decode(args.warmup_steps)
        reqs.generated = [[] for _ in prompts]
        seconds = timed(device, lambda: reqs.decode(args.decode_steps))
    finally:
        reqs.release()
        attach_kernels(runner.model, "triton")
    row.cells[f"decode tok/s {mode}"] = f"{batch * args.decode_steps / seconds:,.0f}"
    row.step_s[mode], row.tokens[mode] = seconds / args.decode_steps, reqs.generated
    log(f"batch {batch} {mode}: decode {batch * args.decode_steps / seconds:,.0f} tok/s "
        f"({1e3 * seconds / args.decode_steps:.2f} ms/step)")  # fmt: skip


def measure_batch(args: argparse.Namespace, runners: dict[str, ModelRunner], batch: int, row: Row) -> list[str]:
    """Prefill (torch, triton) and decode (torch, triton, graphs) at one batch size; returns failure notes.
    The torch reference runs only up to --reference-max-batch (it is the slow one)."""
    eager = runners["triton"]
    g = torch.Generator().manual_seed(batch)
    vocab = eager.config.vocab_size
    prompts = [torch.randint(3, vocab, (args.prompt_tokens,), generator=g).tolist() for _ in range(batch)]
    modes = ([("torch", eager)] if batch <= args.reference_max_batch else []) + [("triton", eager)]
    modes += [("graphs", runners["graphs"])] if "graphs" in runners else []
    notes = []
    for mode, runner in modes:
        try:
            measure_mode(args, mode, runner, prompts, row)
        except Exception as exc:  # one failing mode must not lose the others
            row.cells[f"decode tok/s {mode}"] = "FAILED"
            notes.append(f"- batch {batch} {mode}: FAILED {type(exc).__name__}: {exc}")
            log(notes[-1])
    best = "graphs" if "graphs" in row.step_s else "triton"
    if best in row.step_s:
        step_s = row.step_s[best]
        mean_ctx = args.prompt_tokens + args.warmup_steps + args.decode_steps / 2
        floor_s = step_floor_bytes(eager, batch, mean_ctx) / PEAK_HBM_BYTES_PER_S
        row.cells["step ms"] = f"{1e3 * step_s:.2f}"
        row.cells["HBM floor ms"] = f"{1e3 * floor_s:.3f}"
        row.cells["of floor"] = f"{100 * floor_s / step_s:.0f}%"
    if "graphs" in row.step_s and "triton" in row.step_s:
        row.cells["graphs vs eager"] = f"{row.step_s['triton'] / row.step_s['graphs']:.2f}x"
        runs = zip(row.tokens["triton"], row.tokens["graphs"], strict=True)
        pairs = [(a, b) for x, y in runs for a, b in zip(x, y, strict=True)]
        row.cells["same greedy tokens"] = f"{100 * sum(a == b for a, b in pairs) / max(len(pairs), 1):.0f}%"
    return notes


def build_runners(args: argparse.Namespace, loaded: LoadedModel) -> tuple[dict[str, ModelRunner], list[str]]:
    """The eager runner and (unless --no-graphs) the graph runner; both share the model's weights."""
    notes: list[str] = []
    max_batch, per_seq = max(args.batches), args.prompt_tokens + args.warmup_steps + args.decode_steps + 1
    attach_kernels(loaded.model, "triton")
    runners = {"triton": ModelRunner(loaded, runner_config(loaded, max_batch, per_seq, args.page_size, False))}
    if args.no_graphs:
        return runners, notes
    t0 = time.perf_counter()
    try:
        graphed = ModelRunner(loaded, runner_config(loaded, max_batch, per_seq, args.page_size, True))
        if graphed.decode_graphs is None:  # CPU (dry run): the stand-in capture
            cfg = graphed.runner_config
            graphed.decode_graphs = DecodeGraphs(
                graphed._decode_logits, max_batch, -(-cfg.cuda_graph_max_context_tokens // cfg.kv_page_size_tokens),
                cfg.kv_page_size_tokens, graphed.device, EagerCapture(),
            )  # fmt: skip
            graphed.decode_graphs.capture_all()
        runners["graphs"] = graphed
        info = graphed.decode_graphs.describe() if graphed.decode_graphs else {}
        pool_mib = int(info.get("cuda_graph_pool_bytes", 0)) / 2**20
        notes.append(f"- CUDA graphs: buckets {info.get('cuda_graph_buckets')}, captured in "
                     f"{time.perf_counter() - t0:.1f} s, pool {pool_mib:.0f} MiB")  # fmt: skip
    except Exception as exc:  # a failed capture must not cost the eager measurements
        notes.append(f"- CUDA graph capture FAILED: {type(exc).__name__}: {exc}")
        log(notes[-1])
    return runners, notes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dry-run", action="store_true", help="tiny model on CPU, interpreter kernels")
    parser.add_argument("--batches", default=None, help="comma-separated batch sizes (default 1,8,32,128,256)")
    parser.add_argument("--prompt-tokens", type=int, default=None)
    parser.add_argument("--decode-steps", type=int, default=None)
    parser.add_argument("--warmup-steps", type=int, default=3)
    parser.add_argument("--max-forward-tokens", type=int, default=16384)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--no-graphs", action="store_true")
    parser.add_argument("--reference-max-batch", type=int, default=32, help="largest batch for the torch path")
    parser.add_argument("--time-budget-s", type=float, default=200.0, help="skip remaining batch sizes past this")
    parser.add_argument("--out", type=Path, default=None, help="markdown report file")
    args = parser.parse_args()
    dry = args.dry_run
    args.batches = [int(b) for b in (args.batches or ("1,2,4" if dry else "1,8,32,128,256")).split(",")]
    args.prompt_tokens = args.prompt_tokens or (12 if dry else 256)
    args.decode_steps = args.decode_steps or (4 if dry else 32)
    device = torch.device("cpu" if dry else "cuda")
    dtype = torch.float32 if dry else torch.bfloat16
    started = time.perf_counter()
    torch.manual_seed(0)
    name = "CPU (dry run)" if dry else torch.cuda.get_device_name(device)
    log(f"device {name}; torch {torch.__version__}; generating the model")
    bw = copy_bandwidth(device, (16 << 20) if dry else (2 << 30))
    loaded = random_model(TINY_SPEC if dry else MID_SPEC, device, dtype, seed=0)
    params = sum(p.numel() for p in loaded.model.parameters())
    log(f"model ready: {params / 1e6:,.1f} M parameters; copy bandwidth {bw / 1e9:,.0f} GB/s")
    runners, notes = build_runners(args, loaded)
    eager = runners["triton"]
    header = [
        f"# GPU qualification: {'DRY RUN on CPU (tiny model, interpreter kernels)' if dry else name}",
        "",
        f"- torch {torch.__version__}, kernels {kernel_backend(loaded.model)}, "
        f"dtype {str(dtype).removeprefix('torch.')}, {params / 1e6:,.1f} M parameters "
        f"({'tiny spec' if dry else 'hidden 2048, 32 layers, attention at 9/18/27'})",
        f"- prompts of {args.prompt_tokens} tokens, {args.decode_steps} timed decode steps after {args.warmup_steps} "
        f"warm-up; KV page {args.page_size} tokens; at most {args.max_forward_tokens} tokens per prefill forward",
        f"- copy bandwidth (device to device, read + write) {bw / 1e9:,.0f} GB/s; HBM floor uses the "
        f"{PEAK_HBM_BYTES_PER_S / 1e12:.1f} TB/s peak",
        f"- KV bytes/token {eager.kv_bytes_per_token}, state bytes/request {eager.state_bytes_per_request}",
        *notes,
        "- prefill is eager in every mode (graphs are for decode); 'graphs vs eager' = eager kernel step time / "
        "graph step time; 'step ms' = one decode step with graphs (eager without); 'of floor' = HBM floor / "
        "step ms; 'same greedy tokens' = share of the timed decode tokens that graphs and eager kernels chose "
        "alike (bf16: GEMM shapes differ by bucket); the torch path runs up to batch "
        f"{args.reference_max_batch}",
    ]  # fmt: skip
    report = Report(args.out, header)
    for batch in args.batches:
        if time.perf_counter() - started > args.time_budget_s:
            report.notes.append(f"- batch {batch}: skipped, past the {args.time_budget_s:.0f} s budget")
            continue
        row = Row(batch)
        report.rows.append(row)
        report.notes += measure_batch(args, runners, batch, row)
        report.write()
    if device.type == "cuda":
        report.notes.append(f"- peak memory allocated {torch.cuda.max_memory_allocated(device) / 2**30:.1f} GiB")
    report.notes.append(f"- total {time.perf_counter() - started:.0f} s")
    report.write()


if __name__ == "__main__":
    main()
