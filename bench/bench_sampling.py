"""Decode step time with the sampling controls and structured-output masks, against the same step without.

Model: the benchmark model's shape (bench/bench_decode.py: a tiny Granite-4.0-H, hidden 256, 8 layers) with
Granite-4.0-H's vocabulary of 100,352 tokens by default (the controls and masks work on [rows, vocab]
tensors, and a mask's build time grows with the vocabulary), in process on CPU. For each batch size the
prompts (64 tokens) are prefilled once per case, then decode steps are timed (`ModelRunner.execute`:
forward, the history tables' diffs, the masks built beside the forward, sampling; plus each constrained
row's matcher `advance`, as the engine pays it), the cases interleaved step group by step group so that a
busy machine slows them alike:

    a  none     greedy, no controls (the plain path)
    b  controls greedy with presence, frequency and repetition penalties and a 16-token logit_bias on every row
    c  json     a JSON-schema mask (SCHEMA) on every row; a row whose output completes starts a fresh matcher
    d  mixed    a third of the rows each: none, b's controls, c's mask

The masks are built against a synthetic byte-level vocabulary of the same size (the 256 bytes, then
lowercase words of 2 to 8 letters with and without a leading space), whose token ids the model's logits
index: none of the test tokenizers is that large, and a mask's cost follows the vocabulary's text.
Prints the median step time per case and size and each case's ratio to "a none" at that size (targets at
32 rows: b <= 1.05x, c <= 1.15x), then the mask build time per token (one matcher's fill), p50 and p99,
over every token of `--walks` random valid outputs.

    .venv/bin/python bench/bench_sampling.py [--batches 1,32,128] [--steps 4] [--repeats 24] [--vocab 100352]
"""

from __future__ import annotations

import argparse
import json
import statistics
import string
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import llguidance
import numpy as np
import torch

from gpu_worker.engine.grammar import Constraint, StepMasks
from gpu_worker.runner.batch import Batch, SequenceChunk
from gpu_worker.runner.runner import ModelRunner
from gpu_worker.runner.sampling import SamplingParams, StepSampling
from gpu_worker.runner.settings import RunnerConfig
from gpu_worker.runner.token_masks import mask_words
from hybridserve.structured_output import StructuredSpec, checked_grammar, parser_limits
from hybridserve_cli.init_model import ModelSpec, write_random_checkpoint

SPEC = ModelSpec(
    vocab_size=100_352, hidden_size=256, intermediate_size=512, num_hidden_layers=8, attn_layer_indices=(3, 7),
    num_attention_heads=4, num_key_value_heads=2, mamba_n_heads=8, mamba_d_state=64, mamba_chunk_size=256,
    arch="granitemoehybrid", init_std=0.06,
)  # fmt: skip
PROMPT_TOKENS = 64
PAGE = 16


def _controls(row: int) -> SamplingParams:
    bias = tuple(((row * 131 + k * 977) % 50_000, 2.0 if k % 2 else -2.0) for k in range(16))
    return SamplingParams(presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.1, logit_bias=bias)


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
JSON_SPEC = StructuredSpec("json_schema", json.dumps(SCHEMA))
EOS = 0  # the synthetic vocabulary's end of sequence


@dataclass(frozen=True, slots=True)
class Row:
    """One row's sampling in a case: its params, and whether a JSON-schema mask constrains it."""

    params: SamplingParams
    masked: bool = False


PLAIN = Row(SamplingParams())
# case name -> row i's sampling; add a case here to time it beside the others
CASES: dict[str, Callable[[int], Row]] = {
    "a none": lambda i: PLAIN,
    "b controls": lambda i: Row(_controls(i)),
    "c json": lambda i: Row(SamplingParams(), masked=True),
    "d mixed": lambda i: (PLAIN, Row(_controls(i)), Row(SamplingParams(), masked=True))[i % 3],
}


class Words:
    """A synthetic byte-level vocabulary for llguidance.TokenizerWrapper: EOS, the 256 bytes, then words."""

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
        self.eos_token_id = EOS
        self.bos_token_id = None
        self.special_token_ids = [EOS]

    def __call__(self, text: bytes) -> list[int]:
        return [1 + b for b in text]  # byte tokens (the matcher never tokenizes here)


def json_start(vocab: int) -> llguidance.LLMatcher:
    """SCHEMA's matcher in its start state, over a synthetic vocabulary of `vocab` tokens."""
    words = llguidance.LLTokenizer(llguidance.TokenizerWrapper(Words(vocab)))
    start = llguidance.LLMatcher(words, checked_grammar(JSON_SPEC), log_level=0, limits=parser_limits())
    assert not start.is_error(), start.get_error()
    return start


def mask_times(start: llguidance.LLMatcher, vocab: int, walks: int, seed: int = 0) -> list[float]:
    """Seconds of each mask fill over `walks` random valid outputs."""
    rng = np.random.default_rng(seed)
    bitmask = np.zeros((1, mask_words(vocab)), dtype=np.int32)
    times: list[float] = []
    for _ in range(walks):
        constraint = Constraint(start, frozenset({EOS}))
        for _ in range(2000):
            began = time.perf_counter()
            constraint.fill(bitmask, 0)
            times.append(time.perf_counter() - began)
            allowed = np.flatnonzero(np.unpackbits(bitmask.view(np.uint8), bitorder="little")[:vocab])
            if constraint.advance(int(rng.choice(allowed))):
                break
    return times


class Rows:
    """One case's requests: prompts prefilled, then one decode step at a time."""

    def __init__(
        self, runner: ModelRunner, n: int, row: Callable[[int], Row], start: llguidance.LLMatcher, seed: int
    ) -> None:
        g = torch.Generator().manual_seed(seed)
        self.runner = runner
        self.start = start
        self.prompts = [torch.randint(3, 50_000, (PROMPT_TOKENS,), generator=g).tolist() for _ in range(n)]
        self.outputs: list[list[int]] = [[] for _ in range(n)]
        rows = [row(i) for i in range(n)]
        self.params = [r.params for r in rows]
        self.masked = [i for i, r in enumerate(rows) if r.masked]
        self.constraints = {i: Constraint(start, frozenset({EOS})) for i in self.masked}
        self.constrained_outputs: dict[int, list[int]] = {i: [] for i in self.masked}
        self.words = mask_words(runner.loaded.config.vocab_size)
        self.slots = [runner.state_pool.allocate_slot() for _ in range(n)]
        self.pages: list[list[int]] = [[] for _ in range(n)]
        self.computed = [0] * n
        self.step(prefill=True)

    def _chunk(self, i: int, tokens: list[int]) -> SequenceChunk:
        end = self.computed[i] + len(tokens)
        need = self.runner.kv_pool.pages_for_tokens(end) - len(self.pages[i])
        if need > 0:
            self.pages[i] += self.runner.kv_pool.allocate(need)
        chunk = SequenceChunk(tuple(tokens), self.computed[i], tuple(self.pages[i]), self.slots[i])
        self.computed[i] = end
        return chunk

    def step(self, prefill: bool = False) -> float:
        n = len(self.prompts)
        chunks = tuple(
            self._chunk(i, self.prompts[i] if prefill else [self.outputs[i][-1]]) for i in range(n)
        )  # fmt: skip
        sampling = StepSampling.of(range(n), self.params, list(zip(self.prompts, self.outputs, strict=True)))
        masked = () if prefill else self.masked  # the prompt's first token unconstrained: a fresh output follows
        started = time.perf_counter()
        if masked:
            masks = StepMasks([self.constraints[i] for i in masked], [self.constrained_outputs[i] for i in masked],
                              self.words)  # fmt: skip
            sampling = replace(sampling, masked=tuple(masked), masks=masks)
        out = self.runner.execute(Batch(chunks), sampling)
        for i in masked:
            token = out.token_ids[i]
            self.constrained_outputs[i].append(token)
            if self.constraints[i].advance(token):  # complete: a fresh output starts
                self.constraints[i], self.constrained_outputs[i] = Constraint(self.start, frozenset({EOS})), []
        seconds = time.perf_counter() - started
        for i, token in enumerate(out.token_ids):
            self.outputs[i].append(token)
        return seconds

    def release(self) -> None:
        for pages, slot in zip(self.pages, self.slots, strict=True):
            self.runner.kv_pool.free(pages)
            self.runner.state_pool.free_slot(slot)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", default="1,32,128")
    parser.add_argument("--steps", type=int, default=4, help="decode steps per case per repeat")
    parser.add_argument("--repeats", type=int, default=24, help="interleaved rounds over the cases")
    parser.add_argument("--vocab", type=int, default=SPEC.vocab_size)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--walks", type=int, default=20, help="random valid outputs the mask build is timed over")
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        path = write_random_checkpoint(Path(tmp) / "m", replace(SPEC, vocab_size=args.vocab), seed=0)
        slots = len(CASES) * max(batches)
        config = RunnerConfig(
            memory_budget_bytes=1536 << 20, kv_page_size_tokens=PAGE, max_num_seqs=slots, num_checkpoint_slots=0,
            device="cpu", dtype="float32", cpu_threads=args.threads, decode_compile="off", cpu_warm_rows=0,
        )  # fmt: skip
        runner = ModelRunner.from_model_dir(path, config)
        start = json_start(args.vocab)
        print(f"vocab {args.vocab}, {args.threads} thread(s), prompts {PROMPT_TOKENS} tokens, "
              f"{args.steps} steps x {args.repeats} interleaved repeats per case")  # fmt: skip
        print(f"{'rows':>5} {'case':<12} {'median ms':>10} {'vs a none':>10}")
        for n in batches:
            rows = {name: Rows(runner, n, row, start, seed=k) for k, (name, row) in enumerate(CASES.items())}
            times: dict[str, list[float]] = {name: [] for name in CASES}
            for name in CASES:  # one untimed step each: the history tables' first writes
                rows[name].step()
            for _ in range(args.repeats):
                for name, case in rows.items():
                    times[name] += [case.step() for _ in range(args.steps)]
            base = statistics.median(times["a none"])
            for name in CASES:
                median = statistics.median(times[name])
                print(f"{n:>5} {name:<12} {median * 1e3:>10.3f} {median / base:>9.3f}x")
            for case in rows.values():
                case.release()
        runner.close()
        fills = np.array(mask_times(start, args.vocab, args.walks))
        p50, p99, mean = np.percentile(fills, 50) * 1e6, np.percentile(fills, 99) * 1e6, fills.mean() * 1e6
        print(f"mask build per token (vocab {args.vocab}, {len(fills)} tokens of {args.walks} outputs): "
              f"p50 {p50:.1f} us, p99 {p99:.1f} us, mean {mean:.1f} us")  # fmt: skip


if __name__ == "__main__":
    main()
