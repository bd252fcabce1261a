"""Small but realistic tokenizer folders of the three families, laid out as their checkpoints lay them out
(tokenizer.json, tokenizer_config.json, a chat template, generation_config.json, a config.json naming the
family), each a BPE trained here on a small corpus in a fraction of a second:

    granite-4.0-h  GPT-2 style byte-level BPE; `<|end_of_text|>` is BOS, EOS and no BOS is added
                   (add_bos_token false); `<|start_of_role|>`-style added special tokens; the chat template
                   in tokenizer_config.json, with a dated default system prompt
    bamba          Llama-3 style byte-level BPE (regex split, ignore_merges); `<|begin_of_text|>` added by
                   tokenizer.json's post-processor (tokenizer_config.json has no add_bos_token); the chat
                   template in chat_template.jinja (a stale one left in tokenizer_config.json)
    nemotron-h     SentencePiece-style BPE with byte fallback (`<0xAB>` pieces); `<s>` by add_bos_token, which
                   the saved post-processor carries (as transformers 4 wrote it); `<SPECIAL_n>` added tokens;
                   chat templates as a list of named ones

Variants change one thing the special-tokens rule reads (transformers 5 takes the special tokens from
tokenizer.json's post-processor alone): `bamba-add-bos-false` (add_bos_token false over a BOS-adding
post-processor), `nemotron-h-no-post-processor` (add_bos_token true, no post-processor), and
`granite-config-tokens` (tokenizer_config.json names special tokens tokenizer.json lacks)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hybrid models interleave attention layers with Mamba2 state-space layers.",
    "def main():\n    print('hello, world')\n    return 0\n",
    "Serving engines batch requests, page the KV cache and keep one state slot per sequence.",
    "I'm sure they'll say it's fine; we've done this before, haven't we?",
    "Numbers: 1, 22, 333, 4444, 55555 and 3.14159 or 2,718.",
    "Café, naïve, résumé, jalapeño, Straße, smørrebrød.",
    "  indented line\n\ttabbed line\n\nblank line above",
    "User: what is the capital of France?\nAssistant: Paris.",
    'JSON: {"key": [1, 2, 3], "nested": {"a": true, "b": null}}',
]
CJK_AND_EMOJI = ["你好，世界。", "日本語のテキスト", "안녕하세요", "🙂 emoji 🚀", "Привет, мир"]


def _added(tokenizer: Tokenizer) -> dict[str, dict[str, Any]]:
    """tokenizer_config.json's added_tokens_decoder, from the tokenizer's added tokens."""
    decoder = tokenizer.get_added_tokens_decoder()
    return {
        str(i): {"content": t.content, "lstrip": t.lstrip, "normalized": t.normalized, "rstrip": t.rstrip,
                 "single_word": t.single_word, "special": t.special}
        for i, t in sorted(decoder.items())
    }  # fmt: skip


def _train_byte_level(tokenizer: Tokenizer, num_merges: int, corpus: list[str]) -> None:
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(
        vocab_size=len(alphabet) + num_merges, initial_alphabet=alphabet, show_progress=False, special_tokens=[]
    )
    tokenizer.train_from_iterator(corpus * 3, trainer=trainer)


GRANITE_TEMPLATE = """{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content'] %}
    {%- set loop_messages = messages[1:] %}
{%- else %}
    {%- set system_message = "Knowledge Cutoff Date: April 2024.\\nToday's Date: " + strftime_now('%B %d, %Y')
        + ".\\nYou are Granite, developed by IBM." %}
    {%- set loop_messages = messages %}
{%- endif %}
{{- '<|start_of_role|>system<|end_of_role|>' + system_message + '<|end_of_text|>\\n' }}
{%- for message in loop_messages %}
    {{- '<|start_of_role|>' + message['role'] + '<|end_of_role|>' + message['content'] + '<|end_of_text|>\\n' }}
    {%- if loop.last and add_generation_prompt %}
        {{- '<|start_of_role|>assistant<|end_of_role|>' }}
    {%- endif %}
{%- endfor %}"""

LLAMA3_TEMPLATE = """{{- bos_token }}
{%- for message in messages %}
    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'
        + message['content'] | trim + '<|eot_id|>' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}"""

NEMOTRON_TEMPLATE = """{{ bos_token }}{%- for message in messages -%}
{%- if message['role'] == 'system' -%}<SPECIAL_10>System
{{ message['content'] }}
{% elif message['role'] == 'user' -%}<SPECIAL_11>User
{{ message['content'] }}
{% elif message['role'] == 'assistant' -%}<SPECIAL_11>Assistant
{{ message['content'] }}<SPECIAL_12>
{% endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}<SPECIAL_11>Assistant
{% endif -%}"""


def granite(root: Path, config_tokens: bool = False) -> list[str]:
    tokenizer = Tokenizer(models.BPE(continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    _train_byte_level(tokenizer, 300, CORPUS + CJK_AND_EMOJI)
    specials = ["<|end_of_text|>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|pad|>", "<|unk|>",
                "<|start_of_role|>", "<|end_of_role|>", "<|tool_call|>", "<|start_of_cite|>",
                "<|end_of_cite|>"]  # fmt: skip
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    tokenizer.add_tokens([AddedToken("<think>", special=False, normalized=False)])
    tokenizer.save(str(root / "tokenizer.json"))
    config: dict[str, Any] = {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": _added(tokenizer),
        "bos_token": "<|end_of_text|>",
        "chat_template": GRANITE_TEMPLATE,
        "clean_up_tokenization_spaces": True,
        "eos_token": "<|end_of_text|>",
        "errors": "replace",
        "model_max_length": 9223372036854775807,
        "pad_token": "<|pad|>",
        "padding_side": "left",
        "tokenizer_class": "GPT2Tokenizer",
        "unk_token": "<|unk|>",
    }
    extra = specials + ["<think>"]
    if config_tokens:  # named in the config only: transformers appends them to the vocabulary
        config["additional_special_tokens"] = ["<|start_of_plugin|>", "<|end_of_plugin|>"]
        extra = extra + config["additional_special_tokens"]
    _write_json(root / "tokenizer_config.json", config)
    eos = tokenizer.token_to_id("<|end_of_text|>")
    generation = {"bos_token_id": eos, "eos_token_id": eos, "pad_token_id": tokenizer.token_to_id("<|pad|>")}
    _write_json(root / "generation_config.json", generation)
    family = {"architectures": ["GraniteMoeHybridForCausalLM"], "model_type": "granitemoehybrid"}
    _write_json(root / "config.json", family)
    return extra


def bamba(root: Path, add_bos_token: bool | None = None) -> list[str]:
    tokenizer = Tokenizer(models.BPE(ignore_merges=True, fuse_unk=False))
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(LLAMA3_SPLIT), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False),
    ])  # fmt: skip
    tokenizer.decoder = decoders.ByteLevel()
    _train_byte_level(tokenizer, 320, CORPUS + CJK_AND_EMOJI)
    specials = ["<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>", "<|reserved_special_token_1|>",
                "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]  # fmt: skip
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    bos = "<|begin_of_text|>"
    bos_id = tokenizer.token_to_id(bos)
    tokenizer.post_processor = processors.Sequence([
        processors.ByteLevel(add_prefix_space=True, trim_offsets=False, use_regex=True),
        processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B:1", special_tokens=[(bos, bos_id)]),
    ])  # fmt: skip
    tokenizer.save(str(root / "tokenizer.json"))
    config: dict[str, Any] = {
        "added_tokens_decoder": _added(tokenizer),
        "bos_token": bos,
        "chat_template": "{{ 'a stale template: chat_template.jinja wins' }}",
        "clean_up_tokenization_spaces": True,
        "eos_token": "<|end_of_text|>",
        "model_input_names": ["input_ids", "attention_mask"],
        "model_max_length": 131072,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    if add_bos_token is not None:
        config["add_bos_token"] = add_bos_token
    _write_json(root / "tokenizer_config.json", config)
    (root / "chat_template.jinja").write_text(LLAMA3_TEMPLATE)
    eos_ids = [tokenizer.token_to_id("<|end_of_text|>"), tokenizer.token_to_id("<|eot_id|>")]
    generation = {"bos_token_id": bos_id, "eos_token_id": eos_ids, "temperature": 0.6, "top_p": 0.9}
    _write_json(root / "generation_config.json", generation)
    _write_json(root / "config.json", {"architectures": ["BambaForCausalLM"], "model_type": "bamba"})
    return specials


def nemotron_h(root: Path, post_processor: bool = True) -> list[str]:
    # Train pieces over the SentencePiece-normalised corpus (spaces as ▁), then lay the vocabulary out as
    # the checkpoint does: <unk>, <s>, </s>, <SPECIAL_n>, the 256 byte pieces, then the merged pieces.
    normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    trainer_tok = Tokenizer(models.BPE())
    trainer_tok.normalizer = normalizer
    trainer = trainers.BpeTrainer(vocab_size=400, show_progress=False, limit_alphabet=80, special_tokens=[])
    trainer_tok.train_from_iterator(CORPUS * 3, trainer=trainer)
    trained = json.loads(trainer_tok.to_str())["model"]
    specials = ["<unk>", "<s>", "</s>", *(f"<SPECIAL_{i}>" for i in range(3, 16))]
    vocab = {t: i for i, t in enumerate(specials)}
    vocab.update({f"<0x{b:02X}>": len(specials) + b for b in range(256)})
    for piece, _ in sorted(trained["vocab"].items(), key=lambda kv: kv[1]):
        vocab.setdefault(piece, len(vocab))
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in trained["merges"]]
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", fuse_unk=True, byte_fallback=True))
    tokenizer.normalizer = normalizer
    tokenizer.decoder = decoders.Sequence([
        decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0),
    ])  # fmt: skip
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    if post_processor:
        tokenizer.post_processor = processors.TemplateProcessing(
            single="<s>:0 $A:0", pair="<s>:0 $A:0 <s>:1 $B:1", special_tokens=[("<s>", 1)]
        )
    tokenizer.save(str(root / "tokenizer.json"))
    config = {
        "add_bos_token": True,
        "add_eos_token": False,
        "added_tokens_decoder": _added(tokenizer),
        "bos_token": "<s>",
        "chat_template": [
            {"name": "default", "template": NEMOTRON_TEMPLATE},
            {"name": "tool_use", "template": "{{ 'tools: ' + messages[0]['content'] }}"},
        ],
        "clean_up_tokenization_spaces": False,
        "eos_token": "</s>",
        "legacy": False,
        "model_max_length": 1000000000000000019884624838656,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": "<unk>",
    }
    _write_json(root / "tokenizer_config.json", config)
    generation = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0, "top_k": 20, "temperature": 0.8}
    _write_json(root / "generation_config.json", generation)
    _write_json(root / "config.json", {"architectures": ["NemotronHForCausalLM"], "model_type": "nemotron_h"})
    return specials


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n")


# name -> writer(folder) returning the layout's added-token strings (for the mixed texts)
LAYOUTS: dict[str, Callable[[Path], list[str]]] = {
    "granite-4.0-h": granite,
    "bamba": bamba,
    "nemotron-h": nemotron_h,
    "granite-config-tokens": lambda root: granite(root, config_tokens=True),
    "bamba-add-bos-false": lambda root: bamba(root, add_bos_token=False),
    "nemotron-h-no-post-processor": lambda root: nemotron_h(root, post_processor=False),
}


def write_layout(name: str, root: Path) -> list[str]:
    """Write the layout `name` into `root` (created); its added-token strings."""
    root.mkdir(parents=True, exist_ok=True)
    return LAYOUTS[name](root)
