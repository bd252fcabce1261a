"""Where a model comes from: `--model` as a local checkpoint folder or a Hugging Face Hub repo id.

    resolve_model("models/tiny")                   -> that folder, served under its name ("tiny")
    resolve_model("ibm-granite/granite-4.0-h-tiny") -> the hub cache's snapshot folder, served under the id

Rule: a path that exists is a folder; otherwise an `ORG/NAME`-shaped string is a repo id, resolved by
`huggingface_hub.snapshot_download` (downloading what the cache lacks), with only the files a server
reads (`WORKER_FILES`, `GATEWAY_FILES`). The hub client does every bit of the resolving: `HF_TOKEN`,
`HF_HOME`, `HF_HUB_CACHE`, `HF_ENDPOINT` and `HF_HUB_OFFLINE` mean what they mean to every other
Hugging Face tool, `--revision` is a branch, tag or commit, `--download-dir` replaces the cache folder.
An id is served under the id itself, as vLLM serves it: it is what OpenAI clients send as `model`.

Every failure is a ModelSourceError whose one-line message names the model and what to do; the command
line prints it alone and exits 2 (hybridserve_cli.main). huggingface_hub is imported only for an id."""

from __future__ import annotations

import logging
import os
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from hybridserve.errors import InvalidArgumentError

log = logging.getLogger("hybridserve.model_source")

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")
# What a worker reads of a checkpoint (gpu_worker/model/loader.py), and nothing else of the repo.
WORKER_FILES = (
    "config.json", "generation_config.json", *TOKENIZER_FILES, "*.safetensors", "model.safetensors.index.json",
)  # fmt: skip
# The gateway holds no weights: its tokenizer and chat template only.
GATEWAY_FILES = ("config.json", "generation_config.json", *TOKENIZER_FILES)
# ORG/NAME as the hub spells repo ids: letters, digits, '-', '_', '.'; no '--' or '..', no leading '.'.
_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9_][\w.-]*")
MODEL_HELP = "a checkpoint folder, or a Hugging Face repo id ORG/NAME (downloaded into the hub cache)"
REVISION_HELP = "with a repo id: the branch, tag or commit to serve (default: the repo's main branch)"
DOWNLOAD_DIR_HELP = "with a repo id: the hub cache folder to use (default: HF_HUB_CACHE, else HF_HOME/hub)"


class ModelSourceError(InvalidArgumentError):
    """--model names no servable folder or repo; the message is one line saying what to do."""


@dataclass(frozen=True, slots=True)
class ModelSource:
    """A resolved --model: the local folder to read and the name to serve it under."""

    spec: str  # --model as given
    path: Path  # the checkpoint folder (for an id: the hub cache's snapshot folder, read-only)
    repo_id: str | None = None  # None: a local folder
    revision: str | None = None  # the revision asked for (None: the repo's main branch)
    commit: str | None = None  # the commit the snapshot is of (ids only)

    @property
    def served_name(self) -> str:
        """The model name clients send: the repo id itself, or the folder's name."""
        return self.repo_id if self.repo_id is not None else self.path.name


def is_repo_id(spec: str) -> bool:
    """True for an `ORG/NAME`-shaped string (whether or not such a folder exists here)."""
    return _REPO_ID.fullmatch(spec) is not None and "--" not in spec and ".." not in spec


def resolve_model(
    spec: str | Path,
    revision: str | None = None,
    download_dir: str | Path | None = None,
    files: Sequence[str] = WORKER_FILES,
) -> ModelSource:
    """The folder `spec` names: an existing path as it is, else a repo id's snapshot (downloading the
    `files` patterns the cache lacks, unless HF_HUB_OFFLINE). Raises ModelSourceError."""
    text = str(spec)
    path = Path(text).expanduser()
    if path.exists() or not is_repo_id(text):
        if revision is not None:
            raise ModelSourceError(
                f"--revision {revision} applies to a Hugging Face repo id, but --model {text} is a local path;"
                " drop --revision or give the id"
            )
        if not path.exists():
            raise ModelSourceError(
                f"model folder {text} does not exist: give a checkpoint folder (see `hybridserve init-model`)"
                " or a Hugging Face repo id ORG/NAME"
            )
        if not path.is_dir():
            raise ModelSourceError(f"--model {text} is a file, not a checkpoint folder")
        return ModelSource(spec=text, path=path)
    folder = download_snapshot(text, revision, download_dir, files)
    return ModelSource(spec=text, path=folder, repo_id=text, revision=revision, commit=folder.name)


def download_snapshot(
    repo_id: str,
    revision: str | None = None,
    download_dir: str | Path | None = None,
    files: Sequence[str] = WORKER_FILES,
) -> Path:
    """The snapshot folder of `repo_id` at `revision` in the hub cache, filled with the `files`
    patterns first (online) or as cached (HF_HUB_OFFLINE=1). Raises ModelSourceError."""
    import httpx2
    import huggingface_hub
    from huggingface_hub import constants

    _quiet_progress_without_terminal()
    logging.getLogger("httpx2").setLevel(logging.WARNING)  # not a log line per request
    cache = str(download_dir) if download_dir is not None else constants.HF_HUB_CACHE
    at = f" at revision {revision}" if revision else ""
    log.debug("resolving %s%s in the hub cache %s%s", repo_id, at, cache, " (offline)" if _offline() else "")
    try:
        folder = huggingface_hub.snapshot_download(
            repo_id, revision=revision, cache_dir=download_dir, allow_patterns=list(files)
        )
    except (OSError, ValueError, httpx2.HTTPError) as exc:  # every error the hub client raises on purpose
        raise ModelSourceError(hub_error_message(exc, repo_id, revision, cache)) from None
    log.info("model %s%s: %s", repo_id, at, folder)
    return Path(folder)


def hub_error_message(exc: BaseException, repo_id: str, revision: str | None, cache: str) -> str:
    """One line naming `repo_id` and what to do about `exc` (an error of huggingface_hub)."""
    from huggingface_hub import constants
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    hub = constants.ENDPOINT
    rev = revision or constants.DEFAULT_REVISION
    if isinstance(exc, GatedRepoError):
        return (
            f"{repo_id} is a gated model: accept its terms on {hub}/{repo_id} and set HF_TOKEN to a token of"
            f" that account{' (the token given has no access)' if _has_token() else ''}"
        )
    if isinstance(exc, RepositoryNotFoundError):
        return (
            f"{repo_id}: no such model on {hub} and no such folder here; check the id (ORG/NAME), or set"
            f" HF_TOKEN to a token that can read it if it is private"
        )
    if isinstance(exc, RevisionNotFoundError):
        return f"{repo_id} has no revision {rev!r}: give a branch, tag or commit of the repo to --revision"
    if isinstance(exc, LocalEntryNotFoundError):
        missing = "is only partly in" if "incomplete" in str(exc) else "is not in"
        if _offline():
            return (
                f"{repo_id} (revision {rev}) {missing} the hub cache {cache} and HF_HUB_OFFLINE is set: run"
                f" `hybridserve download {repo_id}` with network access and the same cache, or unset HF_HUB_OFFLINE"
            )
        return (
            f"{repo_id} (revision {rev}) {missing} the hub cache {cache} and {hub} could not be reached: check"
            f" the network (HF_ENDPOINT, proxy), or fill the cache with `hybridserve download {repo_id}`"
        )
    if isinstance(exc, HfHubHTTPError) and exc.response is not None:
        status = exc.response.status_code
        if status == 401:
            return f"{repo_id}: {hub} refused the token in HF_TOKEN (401); set HF_TOKEN to a valid token"
        return f"{repo_id}: {hub} answered {status} ({_first_line(exc)}); try again, or check HF_ENDPOINT"
    if isinstance(exc, OSError) and not isinstance(exc, HfHubHTTPError):
        return f"{repo_id}: cannot fill the hub cache {cache} ({_first_line(exc)}); check its space and permissions"
    return f"{repo_id}: {type(exc).__name__}: {_first_line(exc)}"


def _first_line(exc: BaseException) -> str:
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return lines[0] if lines else type(exc).__name__


def _offline() -> bool:
    from huggingface_hub import constants

    return bool(constants.is_offline_mode())


def _has_token() -> bool:
    from huggingface_hub import get_token

    return get_token() is not None


def _quiet_progress_without_terminal() -> None:
    """Progress bars on a terminal only (an init container's log gets our two log lines instead),
    unless HF_HUB_DISABLE_PROGRESS_BARS says otherwise."""
    if "HF_HUB_DISABLE_PROGRESS_BARS" in os.environ or sys.stderr.isatty():
        return
    from huggingface_hub.utils.tqdm import disable_progress_bars

    disable_progress_bars()
