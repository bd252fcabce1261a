"""The default model: the committed trained weights, written out as a checkpoint folder with a model card.

`write_default_checkpoint(dir)` writes what `write_random_checkpoint` writes (config.json,
generation_config.json, tokenizer.json) with the trained `model.safetensors` from this package, plus a
`tokenizer_config.json` that carries a chat template (jinja, rendered as transformers renders it) and a
`README.md` model card whose figures come from the `training.json` that `hybridserve train-demo` wrote
next to the weights."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from safetensors.torch import load_file

from hybridserve_cli.init_model import ModelSpec, write_checkpoint

WEIGHTS_DIR = Path(__file__).resolve().parent / "weights"  # package data: model.safetensors, training.json
DEMO_SPEC = ModelSpec()  # the architecture the committed weights were trained with

# Turns as "Role: text" paragraphs, then "Assistant:" to prompt the reply. The model was never trained on
# dialogue; the template lets chat requests run end to end. With tools, a "Tools:" paragraph lists them (one
# JSON object a line) and says how to call one; an assistant's calls are written as
# <tool_call>{"name", "arguments"}</tool_call> (the gateway's `granite` parser reads them back), and tool
# results are "Tool: text" paragraphs.
CHAT_TEMPLATE = (
    "{%- if tools -%}"
    "{{- 'Tools:\\n' -}}"
    "{%- for tool in tools -%}{{- (tool | tojson) + '\\n' -}}{%- endfor -%}"
    '{{- \'To call a tool, write <tool_call>{"name": NAME, "arguments": {...}}</tool_call>.\\n\\n\' -}}'
    "{%- endif -%}"
    "{%- for message in messages -%}"
    "{{- (message['role'] | capitalize) + ': ' + (message['content'] or '') -}}"
    "{%- for call in message['tool_calls'] or [] -%}"
    "{{- '<tool_call>' + ({'name': call['function']['name'], 'arguments': call['function']['arguments']} | tojson)"
    " + '</tool_call>' -}}"
    "{%- endfor -%}"
    "{{- '\\n\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- 'Assistant:' -}}{%- endif -%}"
)


def tokenizer_config() -> dict[str, Any]:
    """tokenizer_config.json of the default model, with its chat template."""
    return {
        "bos_token": "<|bos|>",
        "eos_token": "<|eos|>",
        "pad_token": "<|pad|>",
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": 262144,
        "chat_template": CHAT_TEMPLATE,
    }


def training_facts(weights_dir: Path = WEIGHTS_DIR) -> dict[str, Any]:
    """What train-demo recorded about the committed weights."""
    facts: dict[str, Any] = json.loads((weights_dir / "training.json").read_text())
    return facts


def model_card(facts: dict[str, Any], spec: ModelSpec = DEMO_SPEC) -> str:
    """README.md of the default model folder: what it is, how it was made, what it is (not) good for."""
    s, c = facts["settings"], facts["corpus"]
    num_attn = len(spec.attn_layer_indices)
    return f"""# hybridserve demo model

A {facts["num_parameters"] / 1e6:.2f}M-parameter hybrid language model in the Hugging Face Bamba format:
{spec.num_hidden_layers} layers ({num_attn} attention, at {list(spec.attn_layer_indices)}; \
{spec.num_hidden_layers - num_attn} Mamba2), hidden size {spec.hidden_size}, a byte-level tokenizer
(ids 0-2 are `<|pad|>`, `<|bos|>`, `<|eos|>`; ids 3-258 are the 256 byte values). Trained from
scratch on CPU by `hybridserve train-demo`; `hybridserve init-model DIR` writes it. `transformers`'
`BambaForCausalLM` loads this folder as well.

## Data

The Python {c["python"]} standard library's own source (`*.py` files with their docstrings and comments;
test suites, `site-packages` and the generated `encodings/` tables left out), each file framed as
`<|bos|>` bytes `<|eos|>`: {c["train_files"]} files ({c["train_tokens"]} tokens) for training,
{c["held_out_files"]} files ({c["held_out_tokens"]} tokens) held out. The split is by path: a file is
held out when the first byte of sha256 of its path relative to the stdlib folder is below 16 (1/16 of
the files), so the same files are held out on every machine and Python version.

Licence of the data: the Python Software Foundation License Agreement (version 2), which permits
derivative works and their redistribution provided the agreement and the PSF's copyright notice
("Copyright (c) 2001 Python Software Foundation; All Rights Reserved", with the years of the release)
are kept with them; the full text is `LICENSE.txt` beside this card (copied from the standard library). The weights are
distributed under the same terms.

## Training

{s["steps"]} AdamW steps of {s["batch_windows"]} windows x {s["window_tokens"]} bytes
({facts["train_tokens"]} tokens seen), peak learning rate {s["peak_lr"]} (warm-up {s["warmup_steps"]}
steps, cosine decay), weight decay {s["weight_decay"]}, seed {s["seed"]}, torch {facts["torch"]} with
{s["threads"]} CPU thread(s): {facts["train_wall_s"]} s of wall-clock time on the machine that trained it.

## Result

Held-out loss: **{facts["held_out_bits_per_byte"]} bits per byte** ({s["final_eval_windows"]} windows
of {s["window_tokens"]} bytes at even offsets through the held-out files; a uniform guess over bytes is 8).

## Good for

- Seeing the serving stack work: completions of code prompts read as Python-like code and English-like
  comments, so wrong output (a cache or scheduling bug) shows by eye.
- Tests and benchmarks on CPU: small, deterministic, exact parity with transformers.

## Not good for

Anything that needs correct code, facts or instructions followed. It has read only Python source and
writes plausible-looking but meaningless code. It was never trained on dialogue: the chat template
(`tokenizer_config.json`: "Role: text" paragraphs, then "Assistant:") only lets chat requests run end to
end. It rarely emits `<|eos|>`, so set a token limit.
"""


def write_default_checkpoint(out_dir: str | Path, weights_dir: Path = WEIGHTS_DIR) -> Path:
    """Write the trained default model into `out_dir` (created if needed) and return its path."""
    root = write_checkpoint(out_dir, DEMO_SPEC, load_file(str(weights_dir / "model.safetensors")))
    (root / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(), indent=2) + "\n")
    (root / "README.md").write_text(model_card(training_facts(weights_dir)))
    # The data's licence travels with the derived weights, as the PSF agreement asks.
    (root / "LICENSE.txt").write_text((WEIGHTS_DIR / "PSF-LICENSE.txt").read_text())
    return root
