"""`hybridserve train-demo` in miniature: the corpus split, a short run on a synthetic corpus whose
weights `init-model` can serve (written, loaded by the runner, equal to the training forward), and the
training forward against the runner on every family."""

from __future__ import annotations

from pathlib import Path

import torch

from gpu_worker.model.loader import load_model
from gpu_worker.model.tokenizer import BYTE_VOCAB_SIZE, Tokenizer, build_byte_tokenizer
from hybridserve_cli.demo_model.corpus import (
    HELD_OUT_HASH_BELOW,
    Corpus,
    byte_token_ids,
    corpus_files,
    encode_document,
    is_held_out,
    stdlib_root,
)
from hybridserve_cli.demo_model.default import write_default_checkpoint
from hybridserve_cli.demo_model.train import TrainSettings, save, train
from hybridserve_cli.demo_model.train_forward import dense_logits
from tests.model.model_helpers import make_runner, run_schedule


def test_the_split_is_by_path_and_leaves_tests_out() -> None:
    files = corpus_files(stdlib_root())
    assert Path("json/decoder.py") in files and Path("os.py") in files
    assert not any({"test", "tests", "site-packages", "encodings"} & set(f.parts[:-1]) for f in files)
    held = [f for f in files if is_held_out(f)]
    assert 0.5 * len(files) * HELD_OUT_HASH_BELOW / 256 < len(held) < 2 * len(files) * HELD_OUT_HASH_BELOW / 256
    assert is_held_out(Path("csv.py")) == is_held_out(Path("csv.py"))  # a pure function of the path


def test_documents_encode_as_the_byte_tokenizer_encodes_them() -> None:
    """The corpus's byte -> id table is the tokenizer's (ids follow ByteLevel symbol order, not byte value)."""
    table = byte_token_ids()
    assert sorted(table.tolist()) == list(range(3, BYTE_VOCAB_SIZE))
    tokenizer = Tokenizer(build_byte_tokenizer())
    text = "".join(chr(c) for c in range(0xD800)) + "\U0001f642 \U0010ffff def f(x):\n\treturn x  # ok\n"
    assert encode_document(text.encode()).tolist() == [1, *tokenizer.encode(text), 2]
    assert encode_document(b"").tolist() == [1, 2]
    assert tokenizer.decode(encode_document(b"\xc0\xff\x80").tolist()[1:-1]) == "\ufffd" * 3  # lone bytes


def synthetic_corpus() -> Corpus:
    text = b"def add(x, y):\n    return x + y\n\n"
    stream = encode_document(text * 200)
    return Corpus(Path("synthetic"), stream, stream[:400], 1, 1)


def test_a_short_run_learns_and_its_weights_are_served(tmp_path: Path) -> None:
    settings = TrainSettings(
        steps=30, batch_windows=4, window_tokens=32, peak_lr=1e-2, warmup_steps=5, eval_every=10,
        eval_windows=4, final_eval_windows=4,
    )  # fmt: skip
    model, facts = train(settings, synthetic_corpus())
    curve = facts["held_out_curve"]
    assert isinstance(curve, list) and [step for step, _ in curve] == [10, 20, 30]
    assert curve[-1][1] < 4.0 < 8.0, curve  # 8 bits/byte is a uniform guess; the text repeats
    save(model, facts, tmp_path / "weights")
    folder = write_default_checkpoint(tmp_path / "model", weights_dir=tmp_path / "weights")
    served = load_model(folder, device="cpu", dtype="float32").model
    ids = synthetic_corpus().train[:40]
    with torch.no_grad():
        dense = dense_logits(served, ids[None])[0]
    got = run_schedule(make_runner(folder), ids.tolist(), [17, 1, 22])
    assert (got - dense).abs().max().item() <= 1e-4
    assert "30 AdamW steps" in (folder / "README.md").read_text()


def test_the_training_forward_equals_the_runner_for_every_family(family_checkpoint) -> None:
    """Multipliers, RoPE or none, MoE blocks: the dense forward is the runner's on any family's model."""
    _, folder = family_checkpoint
    model = load_model(folder, device="cpu", dtype="float32").model
    ids = torch.randint(3, model.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        dense = dense_logits(model, ids)
    runner = make_runner(folder)
    for row in range(2):
        got = run_schedule(runner, ids[row].tolist(), [9, 1, 14])
        assert (got - dense[row]).abs().max().item() <= 1e-4
