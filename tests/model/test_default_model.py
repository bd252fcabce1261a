"""The default model (the committed trained weights): its held-out loss through our runner equals the loss
through transformers' Bamba and is at most 3.0 bits per byte; the training forward equals the runner on
those weights; the folder `init-model` writes carries the model card and a chat template transformers renders."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoTokenizer
from transformers import BambaForCausalLM as HFBamba

from gpu_worker.model.loader import load_model
from hybridserve_cli.demo_model.corpus import corpus_files, encode_document, even_windows, is_held_out, stdlib_root
from hybridserve_cli.demo_model.default import training_facts, write_default_checkpoint
from hybridserve_cli.demo_model.train_forward import dense_logits
from tests.model.model_helpers import make_runner, run_schedule

MAX_BITS_PER_BYTE = 3.0  # the default model's bar; a uniform guess over bytes is 8
NUM_WINDOWS, WINDOW_TOKENS = 6, 384  # held-out sample: windows at even offsets through the held-out files


@pytest.fixture(scope="module")
def default_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_default_checkpoint(tmp_path_factory.mktemp("default-model"))


@pytest.fixture(scope="module")
def held_out() -> torch.Tensor:
    """[NUM_WINDOWS, WINDOW_TOKENS + 1] token windows from the held-out stdlib files of this interpreter."""
    root = stdlib_root()
    docs = [encode_document((root / rel).read_bytes()) for rel in corpus_files(root) if is_held_out(rel)]
    return even_windows(torch.cat(docs), NUM_WINDOWS, WINDOW_TOKENS + 1)


def summed_nats(logits: torch.Tensor, targets: torch.Tensor) -> float:
    return float(F.cross_entropy(logits.float(), targets, reduction="sum").item())


def test_held_out_loss_through_the_runner_equals_transformers_and_is_at_most_3_bits(
    default_dir: Path, held_out: torch.Tensor
) -> None:
    runner = make_runner(default_dir, page_size=16)
    hf = HFBamba.from_pretrained(default_dir, dtype=torch.float32).eval()
    ours = theirs = 0.0
    for window in held_out:
        inputs, targets = window[:-1].tolist(), window[1:]
        # a chunked prefill, one single-token step, then the rest: the paths a served request takes
        got = run_schedule(runner, inputs, [100, 1, len(inputs) - 101])
        with torch.no_grad():
            ref = hf(torch.tensor([inputs])).logits[0]
        ours += summed_nats(got, targets)
        theirs += summed_nats(ref, targets)
    num_tokens = held_out.shape[0] * WINDOW_TOKENS
    ours_bpb, theirs_bpb = ours / num_tokens / math.log(2), theirs / num_tokens / math.log(2)
    assert abs(ours_bpb - theirs_bpb) <= 1e-4, (ours_bpb, theirs_bpb)
    assert ours_bpb <= MAX_BITS_PER_BYTE, f"held-out loss {ours_bpb:.3f} bits/byte"


def test_the_training_forward_equals_the_runner_on_the_trained_weights(
    default_dir: Path, held_out: torch.Tensor
) -> None:
    model = load_model(default_dir, device="cpu", dtype="float32").model
    with torch.no_grad():
        dense = dense_logits(model, held_out[:2, :-1])
    runner = make_runner(default_dir, page_size=16)
    for row in range(2):
        got = run_schedule(runner, held_out[row, :-1].tolist(), [WINDOW_TOKENS])
        assert (got - dense[row]).abs().max().item() <= 1e-4


def test_the_folder_carries_the_card_and_a_chat_template_transformers_renders(default_dir: Path) -> None:
    facts = training_facts()
    assert facts["held_out_bits_per_byte"] <= MAX_BITS_PER_BYTE
    card = (default_dir / "README.md").read_text()
    assert f"{facts['held_out_bits_per_byte']} bits per byte" in card
    assert "Python Software Foundation" in card and f"{facts['settings']['steps']} AdamW steps" in card
    tok = AutoTokenizer.from_pretrained(default_dir)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == "System: Be brief.\n\nUser: Hi!\n\nAssistant:"
    assert tok.apply_chat_template(messages, tokenize=False) == "System: Be brief.\n\nUser: Hi!\n\n"
