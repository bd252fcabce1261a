"""A checkpoint's tokenizer files, read as transformers' `AutoTokenizer` reads them, so that the worker and the
gateway turn a text into the token ids transformers gives for the same folder.

Read: `tokenizer.json` (the `tokenizers` pipeline: normalizer, pre-tokenizer, model, decoder, added tokens and
its post-processor) and `tokenizer_config.json` (the named special tokens `bos_token`, `eos_token`, ...;
`add_bos_token` / `add_eos_token`; `added_tokens_decoder`; `chat_template`), and `chat_template.jinja`.

The special tokens a text gets are those tokenizer.json's post-processor adds (a TemplateProcessing: a BOS for
most checkpoints), and none when it has no post-processor; `encode(text, add_special_tokens=True)` of the
`tokenizers` library applies exactly that. transformers 5 ignores tokenizer_config.json's `add_bos_token` and
`add_eos_token` for a folder with a tokenizer.json (it drops them on load; `tokenizer.json`'s post-processor
is the single source), and so do we: a disagreement is logged at load (`special_tokens_disagreement`). A chat
prompt rendered by its template gets none (`apply_chat_template(tokenize=True)` encodes the rendered text
without special tokens: the template writes its BOS itself). The added tokens of tokenizer_config.json are added
as transformers adds them (`_add_config_tokens`)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from tokenizers import AddedToken
from tokenizers import Tokenizer as HFTokenizer

from hybridserve.errors import InvalidArgumentError
from hybridserve.generation_config import read_json_object

log = logging.getLogger(__name__)

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
# The named special tokens of tokenizer_config.json (transformers' SPECIAL_TOKENS_ATTRIBUTES), as a chat
# template sees them.
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


def read_tokenizer_config(model_dir: Path) -> dict[str, Any]:
    """tokenizer_config.json as a dict; {} when the folder has none."""
    return read_json_object(model_dir / TOKENIZER_CONFIG_FILE) or {}


def token_text(value: Any) -> str | None:
    """tokenizer_config.json writes a special token as a string or as {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def special_tokens(config: dict[str, Any]) -> dict[str, str]:
    """The named special tokens of a tokenizer_config.json: {"bos_token": "<s>", ...}."""
    return {name: text for name in SPECIAL_TOKEN_NAMES if (text := token_text(config.get(name))) is not None}


def load_tokenizer_json(model_dir: Path) -> HFTokenizer | None:
    """The folder's tokenizer.json with tokenizer_config.json applied (module docstring); None without one."""
    path = model_dir / TOKENIZER_FILE
    if not path.is_file():
        return None
    config = read_tokenizer_config(model_dir)
    try:
        tokenizer = HFTokenizer.from_file(str(path))
    except Exception as exc:  # the Rust side raises a plain Exception on a malformed file
        raise InvalidArgumentError(f"{path}: cannot load tokenizer ({exc})") from exc
    _add_config_tokens(tokenizer, config)
    if (disagreement := special_tokens_disagreement(tokenizer, config)) is not None:
        log.warning("%s: %s", model_dir, disagreement)
    return tokenizer


def _add_config_tokens(tokenizer: HFTokenizer, config: dict[str, Any]) -> None:
    """The added tokens of tokenizer_config.json, added as transformers adds them: the `added_tokens_decoder`
    entries in id order, then the named and the extra special tokens as special tokens. A token tokenizer.json
    already holds keeps its id (and takes the config's flags); one it lacks is appended."""
    decoder = config.get("added_tokens_decoder")
    entries = sorted(decoder.items(), key=lambda kv: int(kv[0])) if isinstance(decoder, dict) else []
    added = [_added_token(entry, special=None) for _, entry in entries]
    tokenizer.add_tokens([t for t in added if t is not None])
    extra = config.get("extra_special_tokens", config.get("additional_special_tokens"))
    named = [config.get(name) for name in SPECIAL_TOKEN_NAMES]
    specials = [_added_token(value, special=True) for value in [*named, *(extra if isinstance(extra, list) else [])]]
    tokenizer.add_special_tokens([t for t in specials if t is not None])


def _added_token(value: Any, special: bool | None) -> AddedToken | None:
    """An AddedToken from a config entry: a string, or {"content", "lstrip", "rstrip", ...}; `special`
    overrides the entry's flag (a plain string is special and not normalized)."""
    if isinstance(value, str):
        return AddedToken(value, special=True, normalized=False) if special else None
    if not isinstance(value, dict) or not isinstance(value.get("content"), str):
        return None
    flags = {k: bool(value[k]) for k in ("single_word", "lstrip", "rstrip", "normalized", "special") if k in value}
    if special is not None:
        flags["special"] = special
    return AddedToken(value["content"], **flags)


def special_tokens_disagreement(tokenizer: HFTokenizer, config: dict[str, Any]) -> str | None:
    """What tokenizer_config.json's add_bos_token / add_eos_token ask that tokenizer.json's post-processor does
    not do (or the reverse); None when they agree or the config says nothing."""
    ids = tokenizer.encode("", add_special_tokens=True).ids
    for flag, name, position in (("add_bos_token", "bos_token", 0), ("add_eos_token", "eos_token", -1)):
        token = token_text(config.get(name))
        if flag not in config or token is None:
            continue
        added = bool(ids) and ids[position] == tokenizer.token_to_id(token)
        if bool(config[flag]) != added:
            return (
                f"tokenizer_config.json sets {flag}={str(bool(config[flag])).lower()} but tokenizer.json's"
                f" post-processor {'adds' if added else 'does not add'} {token}; prompts follow tokenizer.json,"
                " as transformers 5 does"
            )
    return None


def chat_template_source(model_dir: Path, config: dict[str, Any]) -> str | None:
    """The folder's chat template: chat_template.jinja when present (it wins, as in transformers), else
    tokenizer_config.json's `chat_template`, a string or a list of {"name", "template"} whose "default" is used;
    None when there is none."""
    path = model_dir / CHAT_TEMPLATE_FILE
    if path.is_file():
        return path.read_text(encoding="utf-8")
    raw = config.get("chat_template")
    if isinstance(raw, str):
        return raw
    if isinstance(raw, list):
        named = {t.get("name"): t.get("template") for t in raw if isinstance(t, dict)}
        chosen = named.get("default")
        return chosen if isinstance(chosen, str) else None
    return None
