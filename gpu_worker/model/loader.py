"""Loads a Hugging Face checkpoint of any supported family (`gpu_worker.model.families`) from a local folder.

Folder layout: `config.json`; `model.safetensors` or `model.safetensors.index.json` + its shards;
optional `generation_config.json` (EOS ids, sampling defaults) and `tokenizer.json` (with its
`tokenizer_config.json`). Weights are memory maps of the safetensors files
(safetensors maps each file copy-on-write; a tensor keeps its mapping alive after the file is closed), so
loading reads no file into memory of its own: pages come in as the fingerprint and the placement touch
them, and on CPU a parameter in the checkpoint's dtype stays the mapped page. Shards are opened, and
their read-ahead started, concurrently: one thread each, up to MAX_LOAD_THREADS. Every failure is an
InvalidArgumentError that names the file and what to do; weight errors name the checkpoint tensors.
The returned model is in eval mode on the requested device/dtype; Mamba's A_log, D and dt_bias and the
MoE routers stay float32."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from gpu_worker.model.backends import attach_kernels
from gpu_worker.model.config import ModelConfig
from gpu_worker.model.families import family_for
from gpu_worker.model.families.base import Family, Source
from gpu_worker.model.model import HybridForCausalLM, rope_inv_freq
from gpu_worker.model.tokenizer import Tokenizer, load_tokenizer
from hybridserve.errors import InvalidArgumentError
from hybridserve.generation_config import GenerationDefaults, read_generation_config

log = logging.getLogger("hybridserve.loader")

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
MAX_LOAD_THREADS = 8  # shards opened at once
FLOAT32_PARAMS = ("mixer.A_log", "mixer.D", "mixer.dt_bias", "router.weight", "router.bias")


@dataclass(frozen=True, slots=True)
class LoadedModel:
    """A ready model and what the worker needs to serve it. Immutable after load."""

    model_dir: Path
    config: ModelConfig
    family: Family  # the adapter that read the checkpoint
    model: HybridForCausalLM  # eval mode, on `device`
    tokenizer: Tokenizer | None  # None: the checkpoint has no tokenizer.json (token-id prompts only)
    eos_token_ids: tuple[int, ...]  # from generation_config.json, else config.json
    fingerprint: str  # sha256 hex of config + weights; the prefix-cache model identity
    device: torch.device
    dtype: torch.dtype  # weight dtype (SSM state is always float32)
    # generation_config.json's sampling, for what a request leaves unset
    generation_defaults: GenerationDefaults = GenerationDefaults()


def resolve_device(device: str = "auto") -> torch.device:
    """'auto' -> cuda when available, else cpu."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """'auto' -> bfloat16 on CUDA, float32 on CPU."""
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    table = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if dtype not in table:
        raise InvalidArgumentError(f"dtype={dtype!r} is not one of auto, {', '.join(table)}")
    return table[dtype]


def load_model(model_dir: str | Path, device: str = "auto", dtype: str = "auto") -> LoadedModel:
    """Load and validate the checkpoint in `model_dir` (see module docstring)."""
    root = Path(model_dir)
    if not root.is_dir():
        raise InvalidArgumentError(f"model folder {root} does not exist (create one with `hybridserve init-model`)")
    config_path = root / "config.json"
    if not config_path.exists():
        raise InvalidArgumentError(f"{root}: config.json is missing; this is not a Hugging Face checkpoint folder")
    started = time.perf_counter()
    family, config = read_config(config_path)
    tensors = read_weights(root)
    torch_device = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, torch_device)
    generation = read_generation_config(root)
    fingerprint = fingerprint_weights(config, tensors)  # touches every byte: the mapped files are read here
    read_s = time.perf_counter() - started
    model = build_model(family, config, tensors, torch_device, torch_dtype)
    attach_kernels(model, "auto")  # the CUDA backend's kernels on CUDA, the torch reference elsewhere
    build_s = time.perf_counter() - started - read_s
    mb = sum(t.numel() * t.element_size() for t in tensors.values()) / 1e6
    log.info("weights loaded: %.1f MB read and hashed in %.2f s (%.0f MB/s), the model built on %s as %s in"
             " %.2f s", mb, read_s, mb / max(read_s, 1e-9), torch_device, str(torch_dtype).removeprefix("torch."),
             build_s)  # fmt: skip
    return LoadedModel(
        model_dir=root,
        config=config,
        family=family,
        model=model,
        tokenizer=load_tokenizer(root),
        eos_token_ids=generation.eos_token_ids or config.eos_token_ids,
        generation_defaults=generation,
        fingerprint=fingerprint,
        device=torch_device,
        dtype=torch_dtype,
    )


def read_config(path: Path) -> tuple[Family, ModelConfig]:
    """The family and the parsed, validated config of a `config.json`."""
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise InvalidArgumentError(f"{path}: not valid JSON ({exc})") from exc
    if not isinstance(raw, dict):
        raise InvalidArgumentError(f"{path}: expected a JSON object at the top level")
    return parse_config(raw, str(path))


def parse_config(raw: dict[str, Any], source: str = "config.json") -> tuple[Family, ModelConfig]:
    """The family of a config.json dict and its parsed, validated config."""
    family = family_for(raw, source)
    return family, family.parse(raw, source)


def read_weights(root: Path) -> dict[str, torch.Tensor]:
    """All tensors of the checkpoint on CPU, from one file or from the shards an index names."""
    if (root / SINGLE_FILE).exists():
        return _load_safetensors(root / SINGLE_FILE)
    index_path = root / INDEX_FILE
    if not index_path.exists():
        found = sorted(p.name for p in root.iterdir())
        raise InvalidArgumentError(
            f"{root}: no {SINGLE_FILE} or {INDEX_FILE} (found {found}); only safetensors checkpoints are served"
        )
    try:
        weight_map: dict[str, str] = json.loads(index_path.read_text())["weight_map"]
    except (json.JSONDecodeError, KeyError, TypeError) as exc:
        raise InvalidArgumentError(f"{index_path}: not a valid safetensors index ({exc})") from exc
    shards = sorted(set(weight_map.values()))
    for shard in shards:
        if not (root / shard).exists():
            raise InvalidArgumentError(f"{index_path}: shard {shard} is listed but missing from the folder")
    tensors: dict[str, torch.Tensor] = {}
    threads = max(1, min(len(shards), MAX_LOAD_THREADS, os.cpu_count() or 1))
    with ThreadPoolExecutor(threads, thread_name_prefix="load-shard") as pool:
        for part in pool.map(_load_safetensors, [root / shard for shard in shards]):  # in order: the first error
            tensors.update(part)
    missing = sorted(set(weight_map) - set(tensors))
    if missing:
        raise InvalidArgumentError(f"{index_path}: tensors {missing[:5]} are indexed but not in their shards")
    return tensors


def _load_safetensors(path: Path) -> dict[str, torch.Tensor]:
    """The file's tensors, each a view of the file's memory map (see the module docstring). The kernel is
    asked to read the file ahead in the background, so the shards' reads overlap."""
    try:
        _read_ahead(path)
        return load_file(str(path), device="cpu")
    except (SafetensorError, OSError, ValueError) as exc:
        raise InvalidArgumentError(f"{path}: corrupted or unreadable safetensors file ({exc})") from exc


def _read_ahead(path: Path) -> None:
    if hasattr(os, "posix_fadvise"):  # Linux and most Unixes; a hint, so elsewhere the first touch reads
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
        finally:
            os.close(fd)


def build_model(
    family: Family, config: ModelConfig, tensors: dict[str, torch.Tensor], device: torch.device, dtype: torch.dtype
) -> HybridForCausalLM:
    """Check the checkpoint's names and shapes against the architecture, then place the weights (no random init)."""
    with torch.device("meta"):
        model = HybridForCausalLM(config)
    ours = weight_sources(family, config, model)
    given = {n: t for name, t in tensors.items() if (n := family.normalise(name, config)) is not None}
    if config.tie_word_embeddings:
        given.pop("lm_head.weight", None)
    wanted = {
        name: shape for _, source, shapes in ours.values() for name, shape in zip(source.names, shapes, strict=True)
    }
    missing, unexpected = sorted(set(wanted) - set(given)), sorted(set(given) - set(wanted))
    if missing or unexpected:
        raise InvalidArgumentError(
            f"checkpoint weights do not match config.json ({config.architecture}): missing {_few(missing)}, "
            f"unexpected {_few(unexpected)}"
        )
    for name, shape in wanted.items():
        if tuple(given[name].shape) != shape:
            raise InvalidArgumentError(
                f"checkpoint tensor {name} has shape {list(given[name].shape)} but config.json implies {list(shape)}"
            )
    model.load_state_dict(place(ours, given, device, dtype), strict=not config.tie_word_embeddings, assign=True)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.embed.weight
    model.inv_freq = rope_inv_freq(config, device)  # buffers are not in the state dict; recompute on the real device
    return model.eval().requires_grad_(False)


def weight_sources(
    family: Family, config: ModelConfig, model: HybridForCausalLM
) -> dict[str, tuple[tuple[int, ...], Source, tuple[tuple[int, ...], ...]]]:
    """Our parameter name -> (its shape, the checkpoint tensors it is built from, their shapes)."""
    out = {}
    for name, param in model.state_dict().items():
        if config.tie_word_embeddings and name == "lm_head.weight":
            continue
        shape = tuple(param.shape)
        source = family.source_of(name, config)
        out[name] = (shape, source, source.shapes(shape))
    return out


def place(
    ours: dict[str, tuple[tuple[int, ...], Source, tuple[tuple[int, ...], ...]]],
    given: dict[str, torch.Tensor],
    device: torch.device,
    dtype: torch.dtype,
) -> dict[str, torch.Tensor]:
    """Our parameters from checkpoint tensors (names already checked): each `Source` combined, on
    `device` in `dtype` (FLOAT32_PARAMS stay float32). `checkpoint_tensors` is the inverse."""
    placed = {}
    for ours_name, (_, source, _) in ours.items():
        parts = [given[n] for n in source.names]
        tensor = (
            parts[0] if source.combine == "one" else torch.cat(parts) if source.combine == "cat" else torch.stack(parts)
        )
        placed[ours_name] = tensor.to(
            device=device, dtype=torch.float32 if ours_name.endswith(FLOAT32_PARAMS) else dtype
        )
    return placed


def checkpoint_tensors(family: Family, config: ModelConfig, model: HybridForCausalLM) -> dict[str, torch.Tensor]:
    """The inverse of `place`: our parameters as checkpoint tensors under the family's canonical names
    (`cat` sources split on dim 0, `stack` sources unbound; views of the parameters, detached).

    A tied `lm_head` is left out, as tied checkpoints leave it out."""
    params = model.state_dict()
    out: dict[str, torch.Tensor] = {}
    for ours_name, (_, source, _) in weight_sources(family, config, model).items():
        tensor = params[ours_name].detach()
        if source.combine == "one":
            parts: tuple[torch.Tensor, ...] = (tensor,)
        elif source.combine == "cat":
            parts = tensor.split(tensor.shape[0] // len(source.names))
        else:
            parts = tensor.unbind(0)
        out.update(zip(source.names, parts, strict=True))
    return out


def checkpoint_shapes(family: Family, config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Checkpoint tensor name -> the shape `config` implies, for every tensor the family reads."""
    with torch.device("meta"):
        model = HybridForCausalLM(config)
    sources = weight_sources(family, config, model).values()
    return {n: shape for _, src, shapes in sources for n, shape in zip(src.names, shapes, strict=True)}


def _few(names: list[str]) -> str:
    return f"{names[:5]}{' ...' if len(names) > 5 else ''}"


def fingerprint_weights(config: ModelConfig, tensors: dict[str, torch.Tensor]) -> str:
    """sha256 over the canonical config and every tensor (name, dtype, shape, bytes) in name order.

    Independent of sharding and of config.json keys the model does not read."""
    h = hashlib.sha256(config.to_canonical_json().encode())
    for name in sorted(tensors):
        t = tensors[name].contiguous().reshape(-1)
        h.update(f"{name}|{t.dtype}|{list(t.shape)}".encode())
        if t.numel():
            h.update(t.view(torch.uint8).numpy().data)  # the buffer itself: no copy of the mapped bytes
    return h.hexdigest()
