"""The byte tokenizer and `init-model`: the default checkpoint loads here and in transformers."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from transformers import BambaForCausalLM as HFBamba

import hybridserve_cli.init_model as init_model
from gpu_worker.model.loader import load_model
from gpu_worker.model.tokenizer import (
    BYTE_VOCAB_SIZE,
    SPECIAL_TOKENS,
    IncrementalDetokenizer,
    Tokenizer,
    build_byte_tokenizer,
)
from tests.model.model_helpers import make_runner, run_schedule


def test_byte_tokenizer_round_trips_any_text() -> None:
    tok = Tokenizer(build_byte_tokenizer())
    assert tok.vocab_size == BYTE_VOCAB_SIZE
    for text in ("hello world", "  leading spaces", "ünïcödé ✓ 漢字 🙂", "", "tab\tnew\nline"):
        ids = tok.encode(text)
        assert len(ids) == len(text.encode())
        assert all(3 <= i < BYTE_VOCAB_SIZE for i in ids)
        assert tok.decode(ids) == text
    assert tok.token_to_id("<|eos|>") == 2


def test_incremental_detokenizer_holds_back_partial_utf8() -> None:
    tok = Tokenizer(build_byte_tokenizer())
    text = "a✓b🙂"
    detok = IncrementalDetokenizer(tok)
    pieces = [detok.push([i]) for i in tok.encode(text)]
    assert "".join(pieces) == text
    assert pieces[1] == "" and pieces[3] == "✓"


@settings(max_examples=100, deadline=None)
@given(st.text(max_size=200), st.lists(st.integers(1, 5), min_size=1, max_size=50))
def test_incremental_detokenizer_equals_the_full_decode(text: str, push_sizes: list[int]) -> None:
    """Pushed in uneven groups, the deltas concatenate to the full decode of every id (a text without the
    special tokens' spellings: those encode as the special tokens, which decoding skips; see below)."""
    assume(not any(special in text for special in SPECIAL_TOKENS))
    tok = Tokenizer(build_byte_tokenizer())
    ids = tok.encode(text)
    detok = IncrementalDetokenizer(tok)
    pieces, index, turn = [], 0, 0
    while index < len(ids):
        size = push_sizes[turn % len(push_sizes)]
        pieces.append(detok.push(ids[index : index + size]))
        index, turn = index + size, turn + 1
    assert "".join(pieces) == tok.decode(ids) == text


def test_a_special_tokens_spelling_in_text_is_that_token_and_decodes_skipped() -> None:
    """As transformers' tokenizers do: "<|eos|>" typed in a prompt is the EOS token, and text decoded
    for a client leaves special tokens out, streamed or whole."""
    tok = Tokenizer(build_byte_tokenizer())
    ids = tok.encode("a<|eos|>b")
    assert ids == [*tok.encode("a"), SPECIAL_TOKENS.index("<|eos|>"), *tok.encode("b")]
    assert tok.decode(ids) == "ab" and tok.decode(ids, skip_special_tokens=False) == "a<|eos|>b"
    detok = IncrementalDetokenizer(tok)
    assert "".join(detok.push([i]) for i in ids) == "ab"


def _args(path: Path, force: bool = False, *flags: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    init_model.add_arguments(parser)
    return parser.parse_args([str(path), *(["--force"] if force else []), *flags])


def test_init_model_writes_a_loadable_default(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "default"
    assert init_model.run(_args(path)) == 0
    assert "wrote BambaForCausalLM model" in capsys.readouterr().out
    for name in ("config.json", "model.safetensors", "generation_config.json", "tokenizer.json"):
        assert (path / name).exists()
    loaded = load_model(path, device="cpu")
    assert loaded.tokenizer is not None and loaded.eos_token_ids == (2,)
    assert loaded.config.vocab_size == BYTE_VOCAB_SIZE
    mamba = loaded.model.blocks[0].mixer
    assert mamba.dt_bias.std() > 0 and mamba.D.std() > 0 and mamba.A_log.std() > 0
    assert init_model.run(_args(path)) == 2
    assert "--force" in capsys.readouterr().err
    assert init_model.run(_args(path, force=True)) == 0
    assert load_model(path, device="cpu").fingerprint == loaded.fingerprint, "seeded: same weights"

    hf = HFBamba.from_pretrained(path, dtype=torch.float32).eval()
    ids = loaded.tokenizer.encode("The default model, checked against transformers.")
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    got = run_schedule(make_runner(path), ids, [10, 1, len(ids) - 11])
    assert (got - ref).abs().max().item() <= 1e-4


def test_init_model_random_writes_the_seeded_random_model(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`--random` is the tiny random checkpoint (as `write_random_checkpoint` makes it), not the trained default."""
    assert init_model.run(_args(tmp_path / "random", False, "--random", "--seed", "3")) == 0
    assert "wrote random model" in capsys.readouterr().out
    assert init_model.run(_args(tmp_path / "default")) == 0
    init_model.write_random_checkpoint(tmp_path / "reference", seed=3)
    names = ("random", "default", "reference")
    fingerprints = {name: load_model(tmp_path / name, device="cpu").fingerprint for name in names}
    assert fingerprints["random"] == fingerprints["reference"] != fingerprints["default"]
    assert (tmp_path / "default" / "README.md").exists() and not (tmp_path / "random" / "README.md").exists()
