"""A real worker serves sampling fields a request leaves unset with the checkpoint's generation_config.json
values, and a value the request sets wins; a text prompt gets the BOS tokenizer.json's post-processor adds,
unless the request says it holds its special tokens already."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from tokenizers import AddedToken, Tokenizer, models, processors

from hybridserve.v1 import generation_pb2 as pb
from tests.worker.conftest import SPEC, collect, hf_greedy, prompt_of

CONFIG_SAMPLING = {"temperature": 1.3, "top_p": 0.9, "top_k": 5}
SPECIALS = ["<pad>", "<s>", "</s>"]
LETTERS = "abcdefghijklmnopqrstuvwxyz "


@pytest.fixture(scope="module")
def checkpoint(checkpoint, tmp_path_factory) -> Path:
    """The shared tiny checkpoint, with sampling defaults and a character tokenizer that adds <s>."""
    root = tmp_path_factory.mktemp("defaults") / "tiny"
    shutil.copytree(checkpoint, root)
    path = root / "generation_config.json"
    generation = json.loads(path.read_text()) if path.exists() else {}
    path.write_text(json.dumps({**generation, **CONFIG_SAMPLING}))
    vocab = {t: i for i, t in enumerate([*SPECIALS, *LETTERS])}
    assert len(vocab) <= SPEC.vocab_size
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIALS])
    tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tokenizer.save(str(root / "tokenizer.json"))
    return root


def run(worker, prompt: list[int] | str, add_special_tokens: bool | None = None, **sampling) -> tuple[list[int], int]:
    request = pb.GenerateRequest(sampling=pb.SamplingParams(max_tokens=12, ignore_eos=True, **sampling))
    if isinstance(prompt, str):
        request.prompt = prompt
    else:
        request.prompt_token_ids.ids.extend(prompt)
    if add_special_tokens is not None:
        request.add_special_tokens = add_special_tokens
    tokens, messages = collect(worker.stub.Generate(request, timeout=60))
    return tokens, messages[-1].usage.prompt_tokens


def test_unset_sampling_takes_the_checkpoints_defaults_and_set_values_win(start_worker, hf_model):
    worker = start_worker()
    prompt = prompt_of(10, 3)
    unset, _ = run(worker, prompt, seed=11)
    assert unset == run(worker, prompt, seed=11, temperature=1.3, top_p=0.9, top_k=5)[0]
    greedy = hf_greedy(hf_model, prompt, 12)
    assert unset != greedy  # sampled at the checkpoint's temperature, not greedy
    assert run(worker, prompt, temperature=0.0)[0] == greedy  # an explicit 0 wins over 1.3
    top_k_off, _ = run(worker, prompt, seed=11, top_k=0)
    assert top_k_off == run(worker, prompt, seed=11, temperature=1.3, top_p=0.9, top_k=0)[0]
    assert top_k_off != unset  # the request's top_k=0 replaced the checkpoint's 5

    text = "hello world"
    ids = [1, *(3 + LETTERS.index(c) for c in text)]
    tokens, num_prompt_tokens = run(worker, text, temperature=0.0)
    assert num_prompt_tokens == len(ids) and tokens == hf_greedy(hf_model, ids, 12)
    tokens, num_prompt_tokens = run(worker, "<s>" + text, add_special_tokens=False, temperature=0.0)
    assert num_prompt_tokens == len(ids) and tokens == hf_greedy(hf_model, ids, 12)
