"""What `hybridserve bench` sends: datasets as lists of BenchRequest, with exact prompt token counts.

    random     --random-input-len / --random-output-len tokens, each uniform within
               [len * (1 - ratio), len * (1 + ratio)] (--random-range-ratio); token ids drawn from the
               model's own tokens, so a prompt is exactly its length
    sharegpt   ShareGPT JSON (a list of {"conversations": [{"from", "value"}, ...]}): the first human
               turn is the prompt, the reply's token count the output length (as vLLM samples it)
    multiturn  seeded conversations that grow turn by turn (each turn resends the history), opening
               with one of a few shared system prompts; chat messages, turns interleaved
    trace      Mooncake-style JSONL ({"timestamp": ms, "input_length", "output_length", "hash_ids"}):
               each hash id stands for one block of --trace-block-size tokens, drawn from a generator
               seeded by the id, so equal hash ids give equal blocks (and prefix-cache hits); replayed
               at the records' timestamps

Token counts come from a Tokenizer: the server's /tokenize (ServerTokenizer) or a local model folder
(LocalTokenizer), so they are the served model's."""

from __future__ import annotations

import json
import random
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from hybridserve_cli.bench.driver import BenchRequest

DATASETS = ("random", "sharegpt", "multiturn", "trace")
_PROSE = (  # the words of the seeded text prompts
    "the of and to in is was for on that with as by at from it his an were are which this be or has had not "
    "but first one their its new after who they have her she two been other when there all also during into "
    "time more some only over many may city most year can would world between three system model cache token "
    "block state layer request server prompt batch queue step plan decode prefill stream river mountain paper"
)
_WORDS = tuple(_PROSE.split())


class Tokenizer(Protocol):
    def encode(self, text: str) -> list[int]: ...
    def count_chat(self, messages: Sequence[dict[str, str]]) -> int: ...


class ServerTokenizer:
    """The server's POST /tokenize (vLLM's shape): the ids a generation request is served on."""

    def __init__(self, base_url: str, model: str, api_key: str | None = None, timeout_s: float = 30.0) -> None:
        self.url = base_url.rstrip("/") + "/tokenize"
        self.model, self.api_key, self.timeout_s = model, api_key, timeout_s

    def _post(self, body: dict[str, Any]) -> list[int]:
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        request = urllib.request.Request(self.url, json.dumps({"model": self.model, **body}).encode(), headers)
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                return list(json.loads(response.read())["tokens"])
        except urllib.error.HTTPError as exc:
            detail = exc.read().decode(errors="replace")[:300]
            raise ValueError(f"{self.url} answered {exc.code}: {detail} (or pass --tokenizer DIR)") from None
        except OSError as exc:
            raise ValueError(f"cannot reach {self.url}: {exc} (or pass --tokenizer DIR)") from None

    def encode(self, text: str) -> list[int]:
        return self._post({"prompt": text})

    def count_chat(self, messages: Sequence[dict[str, str]]) -> int:
        return len(self._post({"messages": list(messages)}))


class LocalTokenizer:
    """A model folder's tokenizer.json (and chat template), read as the gateway reads it."""

    def __init__(self, model_dir: Path) -> None:
        from gateway.chat_template import load_chat_template
        from gateway.tokens import GatewayTokenizer

        tokenizer = GatewayTokenizer.from_model_dir(model_dir)
        if tokenizer is None:
            raise ValueError(f"--tokenizer {model_dir}: no tokenizer.json there")
        self._tok = tokenizer
        self._template = load_chat_template(model_dir)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text)

    def count_chat(self, messages: Sequence[dict[str, str]]) -> int:
        from gateway.chat_messages import Message

        if self._template is None:
            raise ValueError("the --tokenizer folder has no chat template: count chat prompts on the server")
        rendered = self._template.render([Message(m["role"], m["content"]) for m in messages])
        return len(self._tok.encode(rendered, add_special_tokens=False))


def _text(rng: random.Random, num_words: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(num_words))


def token_pool(tokenizer: Tokenizer, seed: int) -> list[int]:
    """Distinct ordinary token ids of the model (those of seeded English-like text), sorted."""
    pool = sorted(set(tokenizer.encode(_text(random.Random(seed), 400))))
    if len(pool) < 2:
        raise ValueError("the tokenizer gave fewer than two distinct tokens for plain text")
    return pool


def _lengths(rng: random.Random, mean: int, ratio: float) -> int:
    low, high = max(1, int(mean * (1 - ratio))), max(1, int(mean * (1 + ratio)))
    return rng.randint(low, high)


@dataclass(frozen=True, slots=True)
class RandomSpec:
    input_len: int = 1024
    output_len: int = 128
    range_ratio: float = 0.0  # lengths uniform within [len * (1 - r), len * (1 + r)]

    def __post_init__(self) -> None:
        if self.input_len < 1 or self.output_len < 1:
            raise ValueError("--random-input-len and --random-output-len must be >= 1")
        if not 0.0 <= self.range_ratio < 1.0:
            raise ValueError(f"--random-range-ratio must be within [0, 1), got {self.range_ratio}")


def random_requests(num: int, spec: RandomSpec, pool: Sequence[int], seed: int = 0) -> list[BenchRequest]:
    """Prompts of ids drawn from `pool` (token_pool, or a gRPC worker's ordinary ids)."""
    rng = random.Random(seed)
    out = []
    for _ in range(num):
        n = _lengths(rng, spec.input_len, spec.range_ratio)
        ids = tuple(rng.choice(pool) for _ in range(n))
        out.append(BenchRequest(prompt_len=n, output_len=_lengths(rng, spec.output_len, spec.range_ratio),
                                prompt_ids=ids))  # fmt: skip
    return out


def sharegpt_requests(path: Path, num: int, tokenizer: Tokenizer, seed: int = 0, output_len: int = 0,
                      chat: bool = False) -> list[BenchRequest]:  # fmt: skip
    """Seeded sample of `num` conversations (vLLM's filter: prompt and reply >= 4 tokens, prompt
    <= 1024, both <= 2048); output_len > 0 replaces the reply's length."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"--dataset-path {path}: not a ShareGPT JSON file ({exc})") from None
    if not isinstance(data, list):
        raise ValueError(f"--dataset-path {path}: ShareGPT JSON is a list of conversations")
    pairs = [(c["conversations"][0]["value"], c["conversations"][1]["value"]) for c in data
             if isinstance(c, dict) and len(c.get("conversations") or []) >= 2]  # fmt: skip
    random.Random(seed).shuffle(pairs)
    out: list[BenchRequest] = []
    for prompt, reply in pairs:
        if len(out) == num:
            break
        messages = ({"role": "user", "content": prompt},)
        prompt_len = tokenizer.count_chat(messages) if chat else len(tokenizer.encode(prompt))
        reply_len = output_len or len(tokenizer.encode(reply))
        if prompt_len < 4 or reply_len < 4 or prompt_len > 1024 or prompt_len + reply_len > 2048:
            continue
        out.append(BenchRequest(prompt_len, reply_len, messages=messages) if chat
                   else BenchRequest(prompt_len, reply_len, prompt_text=prompt))  # fmt: skip
    if len(out) < num:
        raise ValueError(f"--dataset-path {path}: {len(out)} usable conversations, --num-prompts asks {num}")
    return out


@dataclass(frozen=True, slots=True)
class MultiturnSpec:
    turns: int = 4  # user turns per conversation
    system_prompts: int = 2  # distinct system prompts the conversations share
    system_words: int = 200
    turn_words: int = 40  # words per user turn and per (seeded) assistant reply
    output_len: int = 64


def multiturn_requests(num: int, spec: MultiturnSpec, tokenizer: Tokenizer, seed: int = 0) -> list[BenchRequest]:
    """`num` chat requests: ceil(num / turns) conversations, turn t of each resending turns < t (the
    assistant's replies are seeded text, so a rerun sends the same bytes); turns interleaved over
    the conversations, turn order kept within each."""
    if spec.turns < 1 or spec.system_prompts < 1:
        raise ValueError("multiturn needs >= 1 turn and >= 1 system prompt")
    rng = random.Random(seed)
    systems = [_text(rng, spec.system_words) for _ in range(spec.system_prompts)]
    conversations = []
    for c in range(-(-num // spec.turns)):
        history = [{"role": "system", "content": systems[c % len(systems)]}]
        turns = []
        for _ in range(spec.turns):
            history = [*history, {"role": "user", "content": _text(rng, spec.turn_words)}]
            turns.append(tuple(history))
            history = [*history, {"role": "assistant", "content": _text(rng, spec.turn_words)}]
        conversations.append(turns)
    ordered = [conv[t] for t in range(spec.turns) for conv in conversations][:num]
    return [BenchRequest(tokenizer.count_chat(m), spec.output_len, messages=m, kind="multiturn") for m in ordered]


def trace_requests(path: Path, pool: Sequence[int], block_size: int = 512, seed: int = 0,
                   num: int = 0) -> list[BenchRequest]:  # fmt: skip
    """The trace's records (the first `num`, 0 = all), arrivals relative to the first timestamp."""
    if block_size < 1:
        raise ValueError("--trace-block-size must be >= 1")
    records = []
    try:
        lines = path.read_text().splitlines()
    except OSError as exc:
        raise ValueError(f"--dataset-path {path}: {exc}") from None
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            records.append((float(record["timestamp"]), int(record["input_length"]), int(record["output_length"]),
                            [int(h) for h in record.get("hash_ids", [])]))  # fmt: skip
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"{path}:{number}: not a trace record ({exc}); need timestamp, input_length, "
                             "output_length, hash_ids") from None  # fmt: skip
    records = records[:num] if num else records
    t0 = min((r[0] for r in records), default=0.0)
    return [
        BenchRequest(
            prompt_len=n,
            output_len=out,
            prompt_ids=_trace_prompt(n, ids, block_size, pool, f"{seed}-{i}"),
            arrival_s=(ts - t0) / 1000.0,
            kind="trace",
        )  # fmt: skip
        for i, (ts, n, out, ids) in enumerate(records)
    ]


def _trace_prompt(num_tokens: int, hash_ids: Sequence[int], block_size: int, pool: Sequence[int],
                  record_seed: str) -> tuple[int, ...]:  # fmt: skip
    """Block i holds the tokens of hash_ids[i]'s generator; tokens past the hash ids come from the
    record's own generator (shared with no other record); the prompt is cut at num_tokens."""
    seed = record_seed.split("-")[0]
    tokens: list[int] = []
    for hash_id in hash_ids:
        if len(tokens) >= num_tokens:
            break
        rng = random.Random(f"{seed}-block-{hash_id}")
        tokens.extend(rng.choice(pool) for _ in range(block_size))
    if len(tokens) < num_tokens:
        rng = random.Random(f"{record_seed}-tail")
        tokens.extend(rng.choice(pool) for _ in range(num_tokens - len(tokens)))
    return tuple(tokens[:num_tokens])
