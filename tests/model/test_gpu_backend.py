"""The CUDA backend on a GPU: Triton kernels with and without CUDA graphs, against the torch path, the CPU
float32 runner and transformers' BambaForCausalLM, in float32 and bf16. Skipped without CUDA.

Every request is teacher-forced (its tokens are fixed in advance), so each position's logits can be
compared with one transformers forward over the whole sequence, whatever the chunking. A mix of
requests is driven together: prefill chunks (one continuing over cached context), then decode steps
whose batch widths land in different graph buckets with padding."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from gpu_worker.model.backends import attach_kernels, kernel_backend
from gpu_worker.runner.batch import Batch
from gpu_worker.runner.runner import ModelRunner
from gpu_worker.runner.settings import RunnerConfig
from tests.model.model_helpers import Request, hf_logits
from tests.worker.test_cuda_graph_runner import _drive_verify

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

FP32_TOL = 2e-3  # GPU float32: other reduction orders than the CPU reference


def _runner(
    path: Path, dtype: str, graphs: bool, device: str = "cuda", kernels: str = "auto", verify_tokens: int = 0
) -> ModelRunner:
    cfg = RunnerConfig(
        memory_budget_bytes=16 << 20, kv_page_size_tokens=4, max_num_seqs=6, num_checkpoint_slots=2,
        device=device, dtype=dtype, cuda_graph_max_batch=4 if graphs else 0, cuda_graph_max_context_tokens=256,
        verify_tokens=verify_tokens, num_draft_rows=4 * (verify_tokens - 1) if verify_tokens else 0,
    )  # fmt: skip
    if kernels == "auto":
        return ModelRunner.from_model_dir(path, cfg)
    from gpu_worker.model.loader import load_model

    loaded = load_model(path, device=device, dtype=dtype)
    attach_kernels(loaded.model, kernels)
    return ModelRunner(loaded, cfg)


def _sequences(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(11)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in (30, 21, 26, 17, 24)]


def _drive(runner: ModelRunner, seqs: list[list[int]]) -> list[torch.Tensor]:
    """Logits [len, vocab] of every position of every sequence (float32, on CPU)."""
    reqs = [Request(runner, s) for s in seqs]
    got: list[list[torch.Tensor]] = [[] for _ in seqs]

    def step(chunks: list[tuple[int, int]]) -> None:
        batch = Batch(tuple(reqs[i].chunk(n) for i, n in chunks), return_all_logits=any(n > 1 for _, n in chunks))
        out = runner.forward(batch)
        for k, (i, _) in enumerate(chunks):
            got[i].append(out.all_logits[k] if out.all_logits is not None else out.logits[k : k + 1])

    step([(0, 9), (1, 16), (2, 3)])  # fresh prefills
    step([(0, 8), (2, 20), (3, 5)])  # 0 and 2 continue over their cached context
    for width in (2, 3, 4, 1, 3, 4):  # decode steps: buckets 2, 4 (padded), 4, 1, 4, 4
        rows = [i for i in (0, 1, 2, 3) if reqs[i].num_computed < len(seqs[i])][:width]
        step([(i, 1) for i in rows])
    step([(4, 24)])
    for i, s in enumerate(seqs[:4]):
        rest = len(s) - reqs[i].num_computed
        if rest:
            step([(i, rest)])
    return [torch.cat(parts).float().cpu() for parts in got]


def _max_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max((x - y).abs().max().item() for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("graphs", [True, False])
def test_float32_kernels_match_transformers_and_the_torch_path(checkpoint, graphs: bool) -> None:
    hf, path = checkpoint
    seqs = _sequences(hf.config.vocab_size)
    runner = _runner(path, "float32", graphs)
    assert kernel_backend(runner.model) == "triton"
    assert (runner.decode_graphs is not None) == graphs
    got = _drive(runner, seqs)
    want = [hf_logits(hf, s) for s in seqs]
    assert _max_diff(got, want) <= FP32_TOL
    reference = _drive(_runner(path, "float32", False, kernels="torch"), seqs)  # torch path, same GPU
    assert _max_diff(got, reference) <= FP32_TOL


def test_graphs_replay_the_eager_kernels_exactly_enough(small_checkpoint) -> None:
    hf, path = small_checkpoint
    seqs = _sequences(hf.config.vocab_size)
    graphed, eager = _runner(path, "bfloat16", True), _runner(path, "bfloat16", False)
    info = graphed.describe()
    assert info["cuda_graph_buckets"] == "1,2,4" and int(info["cuda_graph_pool_bytes"]) > 0
    assert _max_diff(_drive(graphed, seqs), _drive(eager, seqs)) <= 1e-2


def test_graphed_verify_steps_match_the_eager_kernels_and_roll_back_alike(small_checkpoint) -> None:
    """Speculative decoding's verify steps under CUDA graphs (cuda_graphs.VerifyGraphs, captured for real):
    drafted rows and a plain one in one step, a rejected draft rolled back from the graph's span tensors,
    decode steps after it; against the eager kernels (the drafted rows as prefill chunks, their states kept
    in the pool's draft rows), float32."""
    _, path = small_checkpoint
    graphed = _runner(path, "float32", True, verify_tokens=4)
    eager = _runner(path, "float32", False, verify_tokens=4)
    assert eager.verify_graphs is None and graphed.verify_graphs is not None
    info = graphed.describe()
    assert info["cuda_graph_verify_buckets"] == "1,2,4" and int(info["cuda_graph_verify_pool_bytes"]) > 0
    got, want = _drive_verify(graphed), _drive_verify(eager)
    assert len(got) == len(want) == 8
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        assert (a.float().cpu() - b.float().cpu()).abs().max().item() <= FP32_TOL, f"output {i}"


@pytest.mark.parametrize("graphs", [True, False])
def test_bf16_tracks_float32_and_picks_the_same_greedy_tokens(checkpoint, graphs: bool) -> None:
    """bf16 weights (float32 state and softmax): logits within 10% of the float32 reference's range,
    and the greedy token of nearly every teacher-forced position agrees with float32 transformers."""
    hf, path = checkpoint
    seqs = _sequences(hf.config.vocab_size)
    runner = _runner(path, "bfloat16", graphs)
    assert runner.loaded.dtype == torch.bfloat16
    assert all(ssm.dtype == torch.float32 for _, ssm in runner.state_pool.layer_states())
    got = _drive(runner, seqs)
    want = [hf_logits(hf, s) for s in seqs]
    scale = max(w.abs().max().item() for w in want)
    assert _max_diff(got, want) <= 0.1 * scale
    agree = sum(int((g.argmax(-1) == w.argmax(-1)).sum()) for g, w in zip(got, want, strict=True))
    total = sum(len(s) for s in seqs)
    assert agree >= 0.85 * total, f"greedy agreement {agree}/{total}"


def test_bf16_matches_transformers_in_bf16_on_the_gpu(small_checkpoint) -> None:
    hf, path = small_checkpoint
    seqs = _sequences(hf.config.vocab_size)
    hf_gpu = type(hf).from_pretrained(path, dtype=torch.bfloat16).to("cuda").eval()
    got = _drive(_runner(path, "bfloat16", True), seqs)
    with torch.no_grad():
        want = [hf_gpu(torch.tensor([s], device="cuda")).logits[0].float().cpu() for s in seqs]
    scale = max(w.abs().max().item() for w in want)
    assert _max_diff(got, want) <= 0.05 * scale
    agree = sum(int((g.argmax(-1) == w.argmax(-1)).sum()) for g, w in zip(got, want, strict=True))
    assert agree >= 0.85 * sum(len(s) for s in seqs)
