"""Our side of the served benchmarks (bench_vs_vllm.py, bench_served_cpu.py): the random checkpoint of
the benchmark size, and workers plus a gateway started on it, as processes. Only the standard library at
import: bench_vs_vllm.py imports this module under vLLM's interpreter too."""

from __future__ import annotations

import argparse
import re
import time
from pathlib import Path
from typing import Any

FAMILIES = {  # label -> (init-model arch, MoE)
    "granitemoehybrid": ("granitemoehybrid", False),
    "granitemoehybrid-moe": ("granitemoehybrid", True),
    "nemotron_h": ("nemotron_h", False),
    "nemotron_h-moe": ("nemotron_h", True),
}
SERVED_NAME = "bench"  # the model name both OpenAI servers answer to
START_TIMEOUT_S = 900.0  # a cold compile cache: every bucket and verify program of each model process, on 2 slow cores
SERVER_CACHE_MB = 2048  # both servers' cache memory: vLLM's KV space (GiB), our worker's budget (KV + states)
COMPILED_LINE = "compiled the Mamba decode step"  # gpu_worker.model.backends.cpu.compiled_decode logs it when ready


def write_model(label: str, args: argparse.Namespace, tmp: Path, mtp: bool = False) -> Path:
    """The random checkpoint of the benchmark size; `mtp`: with a multi-token-prediction head (nemotron_h)."""
    from hybridserve_cli.init_model import ModelSpec, write_random_checkpoint

    arch, moe = FAMILIES[label]
    spec = ModelSpec(vocab_size=args.vocab_size, hidden_size=args.hidden_size, intermediate_size=2 * args.hidden_size,
                     num_hidden_layers=args.layers, attn_layer_indices=(3, args.layers - 1), num_attention_heads=4,
                     num_key_value_heads=2, mamba_n_heads=8, mamba_d_state=64, mamba_chunk_size=256, arch=arch,
                     moe=moe, num_experts=8, num_experts_per_tok=2, init_std=args.init_std, mtp=mtp)  # fmt: skip
    return write_random_checkpoint(tmp / label, spec, seed=0, with_tokenizer=False)


def model_processes(log_text: str) -> int:
    """How many processes run the worker's model, from the description its log prints once loaded
    (`'model_processes': 2`; none named when the model runs in the worker's own process: one)."""
    found = re.search(r"'model_processes': (\d+)", log_text)
    return int(found.group(1)) if found else 1


def wait_decode_compile(worker: Any, timeout_s: float) -> str:
    """The worker's decode compile outcome ('compiled', 'failed', 'off'), read from its log: compiling
    runs in the background in every model process, and the timed runs should not straddle the switch
    (nor share the cores with a process still compiling: the first process done is not the last)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and worker.is_running():
        text = worker.output
        if text.count(COMPILED_LINE) >= model_processes(text):
            return "compiled"
        if "decode compile failed" in text:
            return "failed"
        if "'decode_compile': 'off'" in text:
            return "off"
        time.sleep(0.5)
    return "still compiling"


def start_ours(
    model: Path,
    scheduler: str,
    max_seqs: int,
    decode_compile: str,
    workers: int = 1,
    worker_args: tuple[str, ...] = (),
) -> tuple[Any, str, str]:
    """(the stack, gRPC address to drive offline, gateway HTTP URL): `workers` workers (the cache memory split
    between them) and a gateway in front of them, on the stack launcher (hybridserve_cli/stack.py). With
    one worker the offline load goes to it directly, with several through the gateway's gRPC port (the
    gateway routes, as it does HTTP). `stack.stop()` ends them."""
    from http_load import wait_http_ready

    from hybridserve_cli.stack import Stack

    stack = Stack(start_timeout_s=START_TIMEOUT_S)
    try:
        names = [f"worker{i}" for i in range(workers)]
        for name in names:
            stack.worker(model, [scheduler], flags=[
                "--no-prefix-caching", "--max-num-seqs", str(max_seqs), "--decode-compile", decode_compile,
                "--memory-budget-mb", str(SERVER_CACHE_MB // workers), *worker_args,
            ], name=name, wait=False)  # fmt: skip
        addresses = [stack.wait_listening(name) for name in names]
        for name in names:
            child = stack[name].child
            print(f"hybridserve decode compile ({name}): {wait_decode_compile(child, START_TIMEOUT_S)}", flush=True)
        gateway = stack.gateway(addresses, flags=["--served-model-name", SERVED_NAME])
        url = "http://" + gateway.address
        # /ready: a worker in rotation (its warm-up, the compiled programs included, is over)
        if not wait_http_ready(url, START_TIMEOUT_S, path="/ready"):
            raise RuntimeError("the gateway did not become ready")
        offline = addresses[0] if workers == 1 else gateway.grpc_address
    except BaseException:
        stack.stop()
        raise
    return stack, offline, url
