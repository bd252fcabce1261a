"""`hybridserve download ID [--revision R] [--download-dir D]`: fill the Hugging Face hub cache with the
files a worker reads of repo ID (hybridserve.model_source.WORKER_FILES) ahead of time, for images and
init containers, and print the snapshot folder. Workers and gateways then serve `--model ID` from the
cache, with HF_HUB_OFFLINE=1 if they should never reach the hub. The token comes from HF_TOKEN."""

from __future__ import annotations

import argparse

from hybridserve.model_source import DOWNLOAD_DIR_HELP, REVISION_HELP, ModelSourceError, download_snapshot, is_repo_id


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("repo_id", metavar="ORG/NAME", help="a Hugging Face repo id")
    parser.add_argument("--revision", default=None, help=REVISION_HELP)
    parser.add_argument("--download-dir", default=None, metavar="DIR", help=DOWNLOAD_DIR_HELP)


def run(args: argparse.Namespace) -> int:
    if not is_repo_id(args.repo_id):
        raise ModelSourceError(f"{args.repo_id!r} is not a Hugging Face repo id: give it as ORG/NAME")
    print(download_snapshot(args.repo_id, args.revision, args.download_dir), flush=True)
    return 0
