"""Structured outputs' cost: the token mask's build time per token, and the decode step with a JSON-schema
mask on every row against none.

1. Mask build (`mask`): a matcher of SCHEMA walks to the end of a valid output, choosing a random allowed
   token each step; the time of each mask fill (gpu_worker.engine.grammar.Constraint.fill) is recorded,
   p50 and p99 over every token of WALKS walks. Vocabularies: the default model's (the byte tokenizer, 259
   tokens), and a synthetic 100,000-token byte-level vocabulary (the 256 bytes plus lowercase words of 2 to
   8 letters, with and without a leading space: none of the test tokenizers is that large).
2. Decode step (`step`): the default model in process (gpu_worker.runner.runner.ModelRunner), ROWS rows
   decoding after a 16-token prompt each, greedy; per step `execute` plus each constrained row's
   `advance`, as the engine pays them. Cases, named as bench/bench_sampling.py's will be:
       (a) none        no row constrained
       (c) json-mask   a JSON-schema mask on every row (a row whose grammar completes starts a fresh matcher)
       (d) mixed       every other row constrained
   The ratio is the case's median step time over (a)'s. Target: (c) <= 1.15x (a) at 32 rows.

Absolute times depend on the machine and its load; compare rows of one run.

    nice -n 19 .venv/bin/python bench/bench_structured.py [--rows 1,32,128] [--steps 40] [--walks 20]
"""

from __future__ import annotations

import argparse
import json
import string
import tempfile
import time
from pathlib import Path

import llguidance
import numpy as np
import torch

from gpu_worker.engine.grammar import Constraint, GrammarCompiler, StepMasks
from gpu_worker.runner.batch import Batch, SequenceChunk
from gpu_worker.runner.protocol import StepSampling, mask_words
from gpu_worker.runner.runner import ModelRunner
from gpu_worker.runner.settings import RunnerConfig
from hybridserve.structured_output import StructuredSpec, checked_grammar, parser_limits
from hybridserve_cli.demo_model.default import write_default_checkpoint

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 4},
        "kind": {"enum": ["person", "robot", "other"]},
    },
    "required": ["name", "age", "tags", "kind"],
    "additionalProperties": False,
}
SPEC = StructuredSpec("json_schema", json.dumps(SCHEMA))
PROMPT_TOKENS = 16


def percentiles(samples: list[float]) -> tuple[float, float]:
    a = np.array(samples)
    return float(np.percentile(a, 50)), float(np.percentile(a, 99))


def walk_times(start: llguidance.LLMatcher, vocab: int, eos: int, walks: int, seed: int = 0) -> list[float]:
    """Seconds of each mask fill over `walks` random valid outputs."""
    rng = np.random.default_rng(seed)
    bitmask = np.zeros((1, mask_words(vocab)), dtype=np.int32)
    times: list[float] = []
    for _ in range(walks):
        constraint = Constraint(start, frozenset({eos}))
        for _ in range(2000):
            began = time.perf_counter()
            constraint.fill(bitmask, 0)
            times.append(time.perf_counter() - began)
            allowed = np.flatnonzero(np.unpackbits(bitmask.view(np.uint8), bitorder="little")[:vocab])
            if constraint.advance(int(rng.choice(allowed))):
                break
    return times


class _Words:
    """A synthetic byte-level vocabulary for llguidance.TokenizerWrapper: bytes, then words."""

    def __init__(self, size: int) -> None:
        rng = np.random.default_rng(1)
        tokens: list[bytes] = [b"<eos>"] + [bytes([b]) for b in range(256)]
        seen = set(tokens)
        letters = np.array(list(string.ascii_lowercase))
        while len(tokens) < size:
            word = "".join(rng.choice(letters, size=int(rng.integers(2, 9))))
            token = (" " + word if rng.random() < 0.5 else word).encode()
            if token not in seen:
                seen.add(token)
                tokens.append(token)
        self.tokens = tokens
        self.eos_token_id = 0
        self.bos_token_id = None
        self.special_token_ids = [0]

    def __call__(self, text: bytes) -> list[int]:
        return [1 + b for b in text]  # byte tokens (the matcher never tokenizes here)


def mask_case(label: str, start: llguidance.LLMatcher, vocab: int, eos: int, walks: int) -> None:
    times = walk_times(start, vocab, eos, walks)
    p50, p99 = percentiles(times)
    print(
        f"mask  {label:<28} vocab {vocab:>7}  tokens {len(times):>6}  p50 {p50 * 1e6:8.1f} us  p99 {p99 * 1e6:8.1f} us"
    )


def decode_case(runner: ModelRunner, compiler: GrammarCompiler, rows: int, steps: int, every: int | None) -> float:
    """Median seconds of a decode step of `rows` rows; `every`: constrain rows i % every == 0 (None: none)."""
    kv, states = runner.kv_pool, runner.state_pool
    slots = [states.allocate_slot() for _ in range(rows)]
    pages = [kv.allocate(kv.pages_for_tokens(PROMPT_TOKENS + steps + 2)) for _ in range(rows)]
    tokens = [[(7 * i + j) % 200 + 3 for j in range(PROMPT_TOKENS)] for i in range(rows)]
    constrained = [i for i in range(rows) if every is not None and i % every == 0]
    constraints = {i: compiler.compile(SPEC) for i in constrained}
    outputs: dict[int, list[int]] = {i: [] for i in constrained}
    try:
        prefill = Batch(
            tuple(SequenceChunk(tuple(t), 0, tuple(p), s) for t, p, s in zip(tokens, pages, slots, strict=True))
        )
        first = runner.execute(prefill, StepSampling(tuple(range(rows))))
        for i, token in enumerate(first.token_ids):
            tokens[i].append(token)
        times = []
        for _ in range(steps):
            batch = Batch(tuple(SequenceChunk((t[-1],), len(t) - 1, tuple(p), s)
                                for t, p, s in zip(tokens, pages, slots, strict=True)))  # fmt: skip
            began = time.perf_counter()
            if constrained:
                masks = StepMasks([constraints[i] for i in constrained], [outputs[i] for i in constrained],
                                  compiler.words)  # fmt: skip
                sampling = StepSampling(tuple(range(rows)), (), (), tuple(constrained), masks)
            else:
                sampling = StepSampling(tuple(range(rows)))
            out = runner.execute(batch, sampling)
            for i in constrained:
                outputs[i].append(out.token_ids[i])
                if constraints[i].advance(out.token_ids[i]):  # complete: a fresh output starts
                    constraints[i], outputs[i] = compiler.compile(SPEC), []
            times.append(time.perf_counter() - began)
            for i, token in enumerate(out.token_ids):
                tokens[i].append(token)
        return float(np.median(times))
    finally:
        for p, s in zip(pages, slots, strict=True):
            kv.free(p)
            states.free_slot(s)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="1,32,128")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--walks", type=int, default=20)
    args = parser.parse_args()
    rows_list = [int(r) for r in args.rows.split(",")]
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_default_checkpoint(Path(tmp) / "default")
        config = RunnerConfig(
            device="cpu", dtype="float32", max_num_seqs=max(rows_list), memory_budget_bytes=512 << 20,
            kv_page_size_tokens=16, num_checkpoint_slots=0, cpu_warm_rows=0,
        )  # fmt: skip
        runner = ModelRunner.from_model_dir(model_dir, config)
        runner.warm_up()
        loaded = runner.loaded
        compiler = GrammarCompiler(loaded.tokenizer, loaded.config.vocab_size, loaded.eos_token_ids)
        print(f"schema: {json.dumps(SCHEMA)}")
        default_start = compiler.compile(SPEC)._start
        mask_case("default model (bytes)", default_start, compiler.vocab_size, loaded.eos_token_ids[0], args.walks)
        words = _Words(100_000)
        big = llguidance.LLTokenizer(llguidance.TokenizerWrapper(words))
        big_start = llguidance.LLMatcher(big, checked_grammar(SPEC), log_level=0, limits=parser_limits())
        assert not big_start.is_error(), big_start.get_error()
        mask_case("synthetic 100k (words)", big_start, len(words.tokens), 0, args.walks)
        for rows in rows_list:
            decode_case(runner, compiler, rows, 4, 1)  # warm: this batch size's first steps, and the mask path
            base = decode_case(runner, compiler, rows, args.steps, None)
            for label, every in (("(a) none", None), ("(c) json-mask every row", 1), ("(d) mixed (every 2nd)", 2)):
                seconds = base if every is None else decode_case(runner, compiler, rows, args.steps, every)
                print(f"step  rows {rows:>4}  {label:<26} median {seconds * 1e3:8.2f} ms  x{seconds / base:5.2f}")
        runner.close()


if __name__ == "__main__":
    main()
