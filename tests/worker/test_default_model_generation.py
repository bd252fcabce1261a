"""The default model served over gRPC: greedy text completions equal transformers' generate() on the
committed weights, and read as text (printable characters, not byte noise)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import BambaForCausalLM as HFBamba

from gpu_worker.model.tokenizer import load_tokenizer
from hybridserve.v1 import generation_pb2 as pb
from hybridserve_cli.demo_model.default import write_default_checkpoint
from tests.worker.conftest import hf_greedy

PROMPTS = ("def fibonacci(n):", "import os\n\n\n", 'class Stack:\n    """')
MAX_TOKENS = 48


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Overrides the conftest's tiny random checkpoint: `start_worker` serves the default model."""
    return write_default_checkpoint(tmp_path_factory.mktemp("default-model"))


def test_greedy_text_completions_equal_transformers_generate(start_worker, checkpoint: Path) -> None:
    hf = HFBamba.from_pretrained(checkpoint, dtype=torch.float32).eval()
    tokenizer = load_tokenizer(checkpoint)
    assert tokenizer is not None
    worker = start_worker()
    for prompt in PROMPTS:
        request = pb.GenerateRequest(prompt=prompt, sampling=pb.SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))
        messages = list(worker.stub.Generate(request, timeout=120))
        tokens = [t for m in messages for t in m.token_ids]
        assert tokens == hf_greedy(hf, tokenizer.encode(prompt), MAX_TOKENS), prompt
        text = "".join(m.text for m in messages)
        assert text == tokenizer.decode(tokens)
        readable = sum(c.isprintable() or c in "\n\t" for c in text)
        assert readable >= 0.95 * len(text) and len(text) >= MAX_TOKENS // 2, repr(text)
