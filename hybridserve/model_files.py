"""The model files a gateway needs and a worker hands it (Generation.GetModelFiles): the tokenizer, the
chat template and the generation defaults, from a fixed allow-list of names (MODEL_FILES), never
weights or anything else of the folder.

Their hash (GetInfo.model_files_hash) is SHA-256 over each file in name order of its name, a NUL byte,
its size (8 bytes, little-endian) and its own SHA-256: equal hashes mean the same tokenizer, template
and defaults, so a gateway can tell whether its workers agree before it fetches anything. Pure: bytes
and paths, no gRPC."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from hybridserve.errors import InvalidArgumentError
from hybridserve.model_source import GATEWAY_FILES

MODEL_FILES = tuple(sorted(GATEWAY_FILES))  # what a gateway reads of a checkpoint (model_source.py)
CHUNK_BYTES = 1 << 20  # one ModelFileChunk's data at most
MAX_FILE_BYTES = 256 << 20  # a larger file is refused on both sides (a 256k vocabulary's is ~ 30 MB)


@dataclass(frozen=True)
class ModelFiles:
    """The allow-listed files of one model, by name, and their hash."""

    files: Mapping[str, bytes]
    hash: str

    @staticmethod
    def of(files: Mapping[str, bytes]) -> ModelFiles:
        return ModelFiles(dict(sorted(files.items())), files_hash(files))

    def write_to(self, directory: Path) -> Path:
        """Writes the files into `directory` (a model folder the loaders read); returns it."""
        for name, data in self.files.items():
            (directory / name).write_bytes(data)
        return directory


def files_hash(files: Mapping[str, bytes]) -> str:
    digest = hashlib.sha256()
    for name in sorted(files):
        data = files[name]
        digest.update(name.encode() + b"\x00" + len(data).to_bytes(8, "little") + hashlib.sha256(data).digest())
    return digest.hexdigest()


def read_model_files(model_dir: Path) -> ModelFiles:
    """The allow-listed files the folder has (a hub snapshot's links followed), read once."""
    files = {}
    for name in MODEL_FILES:
        path = model_dir / name
        if not path.is_file():
            continue
        size = path.stat().st_size
        if size > MAX_FILE_BYTES:
            raise InvalidArgumentError(f"{path} is {size} bytes; model files over {MAX_FILE_BYTES} bytes are refused")
        files[name] = path.read_bytes()
    return ModelFiles.of(files)
