"""The families' tokenizers as the worker and the gateway read them equal transformers' AutoTokenizer on the
same folder (tests/tokenizer_layouts.py writes them): `encode`, `decode` and the chat template, rendered and
tokenized, on 200 mixed texts each."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from gateway.chat_messages import Message
from gateway.chat_template import load_chat_template
from gateway.tokens import GatewayTokenizer
from gpu_worker.model.tokenizer import Tokenizer, load_tokenizer
from hybridserve.tokenizer_files import special_tokens_disagreement
from tests.tokenizer_layouts import LAYOUTS, write_layout

NUM_TEXTS = 200
PIECES = [
    "Hello", "world", "the", " quick brown fox", "don't", "I'm", "it's", "3.14159", "12345678", "x = f(y) + 1;",
    "naïve café", "Straße", "ÆØÅ", "Ελληνικά", "привет", "مرحبا", "नमस्ते", "你好世界", "日本語のテキスト", "안녕하세요",
    "😀", "👩‍💻", "🏳️‍🌈", "👍🏽", "e\u0301", "\u200b", "\ufeff", "\x00", "\x7f", "\U0010ffff",
    "   ", "\t\t", "\n", "\n\n\n", "\r\n", " \n ", "\t \n", "        ", "<", "|>", "<|", "<s", "</s", "<0x41>",
    "<|start_of", "<SPECIAL_", "<|begin_of_text|>", "<|eot_id|>", "<SPECIAL_10>", "<think>", "{\"a\": [1, 2]}",
]  # fmt: skip
EDGE_CASES = ["", " ", "\n", "  leading", "trailing  ", "\n\nnewlines\n\n", "a  b   c    d"]


def mixed_texts(added_tokens: list[str], seed: int = 0) -> list[str]:
    """NUM_TEXTS texts: the edge cases, then random joins of the pieces and the layout's added tokens."""
    rng = random.Random(seed)
    pool = PIECES + added_tokens * 2
    texts = [*EDGE_CASES, *added_tokens[:3], "".join(added_tokens[:3])]
    while len(texts) < NUM_TEXTS:
        parts = [rng.choice(pool) for _ in range(rng.randint(1, 12))]
        texts.append("".join(p + rng.choice(["", "", " ", "\n"]) for p in parts))
    return texts


class Layout:
    def __init__(self, name: str, root: Path) -> None:
        import transformers
        from transformers import AutoTokenizer

        transformers.logging.set_verbosity_error()
        self.name = name
        self.added_tokens = write_layout(name, root)
        self.root = root
        self.reference = AutoTokenizer.from_pretrained(str(root))
        worker = load_tokenizer(root)
        gateway = GatewayTokenizer.from_model_dir(root)
        assert worker is not None and gateway is not None
        self.worker: Tokenizer = worker
        self.gateway: GatewayTokenizer = gateway
        self.texts = mixed_texts(self.added_tokens)


@pytest.fixture(scope="module", params=list(LAYOUTS))
def layout(request, tmp_path_factory) -> Layout:
    return Layout(request.param, tmp_path_factory.mktemp("tokenizers") / request.param)


def test_encode_and_decode_equal_transformers(layout):
    ref, worker, gateway = layout.reference, layout.worker, layout.gateway
    assert worker.vocab_size == len(ref)
    for text in layout.texts:
        expected = ref.encode(text)
        assert worker.encode(text) == expected, (layout.name, text)
        assert gateway.encode(text) == expected, (layout.name, text)
        assert worker.encode(text, add_special_tokens=False) == ref.encode(text, add_special_tokens=False)
        for skip in (False, True):
            assert worker.decode(expected, skip_special_tokens=skip) == ref.decode(expected, skip_special_tokens=skip)
    rng = random.Random(1)  # id sequences no text encodes to: split UTF-8, lone byte pieces, specials anywhere
    for _ in range(50):
        ids = [rng.randrange(len(ref)) for _ in range(rng.randint(1, 16))]
        for skip in (False, True):
            assert worker.decode(ids, skip_special_tokens=skip) == ref.decode(ids, skip_special_tokens=skip), ids


def test_chat_template_renders_and_tokenizes_as_transformers(layout):
    template = load_chat_template(layout.root)
    assert template is not None
    rng = random.Random(2)
    texts = layout.texts
    for i, text in enumerate(texts):
        messages = [Message("user", text)]
        if i % 3 == 0:
            messages.insert(0, Message("system", rng.choice(texts)))
        if i % 4 == 1:
            messages += [Message("assistant", rng.choice(texts)), Message("user", rng.choice(texts))]
        dicts = [{"role": m.role, "content": m.content} for m in messages]
        rendered = template.render(messages)
        assert rendered == layout.reference.apply_chat_template(dicts, add_generation_prompt=True, tokenize=False)
        expected = layout.reference.apply_chat_template(dicts, add_generation_prompt=True, return_dict=False)
        assert layout.gateway.encode(rendered, add_special_tokens=False) == expected, (layout.name, messages)
        assert layout.worker.encode(rendered, add_special_tokens=False) == expected


def test_special_tokens_follow_the_post_processor_and_disagreements_are_named(layout):
    """transformers 5 takes a prompt's special tokens from tokenizer.json alone; a tokenizer_config.json
    flag that asks otherwise is named at load."""
    ref = layout.reference
    bos = ref.bos_token_id
    adds_bos = layout.name in ("bamba", "bamba-add-bos-false", "nemotron-h")
    assert (layout.worker.encode("hi")[:1] == [bos]) is adds_bos
    assert (ref.encode("hi")[:1] == [bos]) is adds_bos
    import json

    config = json.loads((layout.root / "tokenizer_config.json").read_text())
    message = special_tokens_disagreement(layout.worker.rust, config)
    if layout.name in ("bamba-add-bos-false", "nemotron-h-no-post-processor"):
        assert message is not None and "add_bos_token" in message
    else:
        assert message is None
