"""Command-line flags named after the SchedulerConfig fields (`--block-size`, `--kv-page-size`, ...),
with HYBRIDSERVE_<FIELD> environment variables as the alternative. Used by the worker, which sends
the config with every PlanStep."""

from __future__ import annotations

import argparse

from hybridserve.cliutil import env_default
from scheduler_svc.core import MambaCacheMode, SchedulerConfig

# field -> (default, help)
DEFAULTS: dict[str, tuple[int, str]] = {
    "max_num_batched_tokens": (2048, "tokens (prefill + decode) one step may compute"),
    "max_num_seqs": (32, "requests one step may run (also the worker's Mamba state slots)"),
    "long_prefill_token_threshold": (0, "per-request cap on a prefill chunk, tokens (0 = none)"),
    "max_num_prefill_tokens_per_step": (0, "micro-slicing budget of a step with decodes (0 = off)"),
    "block_size": (256, "checkpoint / prefix-cache grid, tokens"),
    "mamba_block_size": (64, "recurrent block, tokens (divides --block-size)"),
    "kv_page_size": (16, "KV cache page, tokens (divides --block-size)"),
}


def add_config_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("scheduler config (sent with every step)")
    for name, (default, text) in DEFAULTS.items():
        group.add_argument(
            "--" + name.replace("_", "-"), type=int, default=env_default(name.upper(), default, int), help=text
        )
    group.add_argument(
        "--mamba-cache-mode",
        choices=["align", "none"],
        default=env_default("MAMBA_CACHE_MODE", "align"),
        help="align: non-final prefill chunks end on the block grid (hybrid models); none: no grid",
    )


def config_from_args(args: argparse.Namespace) -> SchedulerConfig:
    """The validated config; raises InvalidArgumentError naming the bad flag's field."""
    return SchedulerConfig(
        **{name: getattr(args, name) for name in DEFAULTS},
        mamba_cache_mode=MambaCacheMode.ALIGN if args.mamba_cache_mode == "align" else MambaCacheMode.NONE,
    ).validate()
