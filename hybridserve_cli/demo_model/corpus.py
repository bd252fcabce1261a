"""The demo model's corpus: the Python standard library's own source, as byte-token streams.

Every machine that runs this project has it, and it may be redistributed (PSF License Agreement).
Source files include their docstrings and comments, so the corpus is code and English together.

Files: every `*.py` under the running interpreter's stdlib folder, minus test suites, `site-packages`,
caches and the generated codec tables in `encodings/`. Split: a file is held out when the first byte of
sha256(its path relative to the stdlib folder) is below HELD_OUT_HASH_BELOW (1/16 of files). The split
depends on the path alone, so it is the same on every machine and for every Python version (a file
held out under 3.11 is held out under 3.12).

Stream layout: files in path order, each as <|bos|> its bytes <|eos|>, in the byte tokenizer's ids (the
ids of the 256 byte tokens follow the order of their ByteLevel symbols, not byte values: see
`byte_token_ids`)."""

from __future__ import annotations

import hashlib
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from gpu_worker.model.tokenizer import build_byte_tokenizer

BOS_ID, EOS_ID = 1, 2
HELD_OUT_HASH_BELOW = 16  # of 256: the held-out share of files is 1/16
SKIPPED_DIRS = frozenset({"site-packages", "test", "tests", "idle_test", "__pycache__", "encodings"})


@dataclass(frozen=True, slots=True)
class Corpus:
    """The two token streams and what went into them."""

    root: Path  # the stdlib folder read
    train: torch.Tensor  # [num_train_tokens] int64
    held_out: torch.Tensor  # [num_held_out_tokens] int64
    num_train_files: int
    num_held_out_files: int


def stdlib_root() -> Path:
    """The running interpreter's standard library folder."""
    return Path(sysconfig.get_paths()["stdlib"])


def corpus_files(root: Path) -> list[Path]:
    """The stdlib source files of the corpus, as paths relative to `root`, sorted."""
    files = []
    for path in root.rglob("*.py"):
        rel = path.relative_to(root)
        if not SKIPPED_DIRS & set(rel.parts[:-1]) and path.is_file():
            files.append(rel)
    return sorted(files)


def is_held_out(rel_path: Path) -> bool:
    """The split rule (see module docstring): by a hash of the relative path, never of the content."""
    return hashlib.sha256(rel_path.as_posix().encode()).digest()[0] < HELD_OUT_HASH_BELOW


def byte_symbols() -> list[str]:
    """The ByteLevel symbol of each byte value (the GPT-2 table the `tokenizers` ByteLevel pre-tokenizer uses):
    printable Latin-1 bytes stand for themselves, the other 68 map in order to U+0100 onwards."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1), *range(ord("\xae"), 256)]
    others = iter(range(256, 256 + 256 - len(kept)))
    return [chr(b) if b in kept else chr(next(others)) for b in range(256)]


def byte_token_ids() -> np.ndarray:
    """[256] int64: the byte tokenizer's id of each byte value, so a stream encodes with one table lookup."""
    vocab = build_byte_tokenizer().get_vocab()
    return np.array([vocab[symbol] for symbol in byte_symbols()], dtype=np.int64)


def encode_document(data: bytes, table: np.ndarray | None = None) -> torch.Tensor:
    """<|bos|> bytes <|eos|> as token ids [len(data) + 2]; `table` is `byte_token_ids()` (built if None)."""
    table = byte_token_ids() if table is None else table
    body = torch.from_numpy(table[np.frombuffer(data, dtype=np.uint8)])
    return torch.cat([torch.tensor([BOS_ID]), body, torch.tensor([EOS_ID])])


def load_corpus(root: Path | None = None) -> Corpus:
    """Read and split the corpus (about 11 MB of source: a few seconds)."""
    root = root or stdlib_root()
    table = byte_token_ids()
    train: list[torch.Tensor] = []
    held_out: list[torch.Tensor] = []
    for rel in corpus_files(root):
        (held_out if is_held_out(rel) else train).append(encode_document((root / rel).read_bytes(), table))
    if not train or not held_out:
        raise FileNotFoundError(f"{root}: no standard library sources found to train on")
    return Corpus(root, torch.cat(train), torch.cat(held_out), len(train), len(held_out))


def random_windows(stream: torch.Tensor, num_windows: int, window_tokens: int, g: torch.Generator) -> torch.Tensor:
    """`num_windows` windows of `window_tokens` consecutive tokens at seeded random offsets: [n, w]."""
    starts = torch.randint(0, stream.numel() - window_tokens, (num_windows,), generator=g)
    return stream[starts[:, None] + torch.arange(window_tokens)[None, :]]


def even_windows(stream: torch.Tensor, num_windows: int, window_tokens: int) -> torch.Tensor:
    """`num_windows` windows at evenly spaced offsets (a fixed evaluation set): [n, w]."""
    span = stream.numel() - window_tokens
    starts = torch.tensor([i * span // max(1, num_windows - 1) for i in range(num_windows)])
    return stream[starts[:, None] + torch.arange(window_tokens)[None, :]]
