"""A gateway started without --model takes the tokenizer, chat template and generation defaults from its
workers (Generation.GetModelFiles, hybridserve/model_files.py).

Once, at start-up: when the first workers answer GetInfo, the hash most of them report
(`model_files_hash`) is adopted; its files are streamed from one of those workers, each file and the
whole set checked against their SHA-256s and the hash, written into a temporary folder only for the
loaders to read, and that folder is removed at once. Until then no worker is in rotation (`/ready` is
503). From then on the pool routes only to workers that report the adopted hash: one serving other
files (another tokenizer or template would tokenize and render prompts differently) stays out of
rotation with a log line saying so. A gateway adopts new files by restarting."""

from __future__ import annotations

import asyncio
import collections
import hashlib
import logging
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc

from gateway.chat_template import ChatTemplate, TemplateError, load_chat_template
from gateway.pool import WorkerPool, WorkerState
from gateway.tokens import GatewayTokenizer
from hybridserve.errors import InvalidArgumentError
from hybridserve.generation_config import GenerationDefaults, read_generation_config
from hybridserve.model_files import CHUNK_BYTES, MAX_FILE_BYTES, MODEL_FILES, ModelFiles
from hybridserve.v1 import generation_pb2 as pb

log = logging.getLogger("hybridserve.gateway.model_files")

FETCH_TIMEOUT_S = 120.0  # one whole GetModelFiles stream
MAX_TOTAL_BYTES = 2 * MAX_FILE_BYTES  # every file together


class ModelFilesError(Exception):
    """The files a worker sent are not what it announced (or not files a gateway takes)."""


@dataclass(frozen=True)
class LoadedFiles:
    """What the gateway serves with, read from the fetched files."""

    files: ModelFiles
    tokenizer: GatewayTokenizer | None
    template: ChatTemplate | None
    defaults: GenerationDefaults


async def fetch_model_files(
    stub: object, expected_hash: str, metadata: Sequence[tuple[str, str]] = (), timeout_s: float = FETCH_TIMEOUT_S
) -> ModelFiles:
    """The files of `expected_hash` from one worker, verified: names from the allow-list, each file's chunks
    back to back up to its announced size and SHA-256, and the set's hash."""
    request = pb.GetModelFilesRequest(model_files_hash=expected_hash)
    parts: dict[str, bytearray] = {}
    announced: dict[str, tuple[int, str]] = {}
    total = 0
    async for chunk in stub.GetModelFiles(request, metadata=list(metadata), timeout=timeout_s):  # type: ignore[attr-defined]
        name = chunk.name
        if name not in MODEL_FILES:
            raise ModelFilesError(f"the worker sent {name!r}, not one of the model files a gateway takes")
        if len(chunk.data) > CHUNK_BYTES or not 0 <= chunk.total_size <= MAX_FILE_BYTES:
            raise ModelFilesError(f"{name}: a chunk of {len(chunk.data)} bytes of a {chunk.total_size}-byte file")
        if name not in parts:
            parts[name] = bytearray()
            announced[name] = (chunk.total_size, chunk.sha256)
        data = parts[name]
        if announced[name] != (chunk.total_size, chunk.sha256) or chunk.offset != len(data):
            raise ModelFilesError(
                f"{name}: chunk at offset {chunk.offset} does not follow the {len(data)} bytes so far"
            )
        data += chunk.data
        total += len(chunk.data)
        if len(data) > chunk.total_size or total > MAX_TOTAL_BYTES:
            raise ModelFilesError(f"{name}: more bytes than announced")
    files: dict[str, bytes] = {}
    for name, data in parts.items():
        size, digest = announced[name]
        if len(data) != size or hashlib.sha256(data).hexdigest() != digest:
            raise ModelFilesError(f"{name}: {len(data)} bytes received, which do not match its size or SHA-256")
        files[name] = bytes(data)
    received = ModelFiles.of(files)
    if received.hash != expected_hash:
        raise ModelFilesError(f"the files received hash to {received.hash}, not the announced {expected_hash}")
    return received


def load_files(files: ModelFiles, chat_template: Path | None = None) -> LoadedFiles:
    """The tokenizer, template (`chat_template` overrides the files') and defaults the files hold, read by
    the same loaders as a --model folder, from a temporary folder removed before this returns."""
    with tempfile.TemporaryDirectory(prefix="hybridserve-model-files-") as folder:
        model_dir = files.write_to(Path(folder))
        try:
            template = load_chat_template(model_dir, chat_template)
            tokenizer = GatewayTokenizer.from_model_dir(model_dir)
            defaults = read_generation_config(model_dir)
        except (TemplateError, InvalidArgumentError, OSError, ValueError) as exc:
            raise ModelFilesError(f"the workers' model files cannot be loaded: {exc}") from exc
    return LoadedFiles(files, tokenizer, template, defaults)


def majority_hash(workers: Sequence[WorkerState]) -> tuple[str, list[WorkerState]]:
    """The hash most answering workers report ('' when none does), and those workers by address."""
    reported = [w for w in workers if w.info is not None and w.info.model_files_hash]
    if not reported:
        return "", []
    counts = collections.Counter(w.info.model_files_hash for w in reported if w.info is not None)
    best = max(sorted(counts), key=lambda h: counts[h])
    return best, sorted((w for w in reported if w.info is not None and w.info.model_files_hash == best),
                        key=lambda w: w.address)  # fmt: skip


async def adopt_worker_files(
    pool: WorkerPool, on_loaded: Callable[[LoadedFiles], None], chat_template: Path | None = None
) -> LoadedFiles:
    """Waits for workers, fetches and loads the majority's files (retrying another worker, or later, on a
    failure), hands them to `on_loaded`, then lets the pool route to workers with that hash."""
    warned_empty = False
    while True:
        files_hash, holders = majority_hash(list(pool.workers.values()))
        if not files_hash and not warned_empty and any(w.info is not None for w in pool.workers.values()):
            log.error("the workers report no model_files_hash (older workers?): this gateway without --model"
                      " cannot get the tokenizer and chat template from them; give it --model DIR")  # fmt: skip
            warned_empty = True
        for worker in holders:
            try:
                files = await fetch_model_files(worker.stub, files_hash, pool.metadata)
                loaded = await asyncio.get_running_loop().run_in_executor(None, load_files, files, chat_template)
            except (grpc.aio.AioRpcError, ModelFilesError) as exc:
                detail = f"{exc.code().name}: {exc.details()}" if isinstance(exc, grpc.aio.AioRpcError) else str(exc)
                log.warning("fetching the model files from worker %s failed: %s", worker.address, detail)
                continue
            names = ", ".join(f"{n} ({len(d)} bytes)" for n, d in files.files.items()) or "none"
            log.info("model files %s from worker %s: %s", files_hash[:16], worker.address, names)
            on_loaded(loaded)
            pool.adopt_files_hash(files_hash)
            return loaded
        await asyncio.sleep(pool.poll_interval_s)
