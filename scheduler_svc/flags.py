"""Command-line flags named after the SchedulerConfig fields (`--block-size`, `--kv-page-size`, ...),
with HYBRIDSERVE_<SERVICE>_<FIELD> environment variables as the alternative (for the worker, which
sends the config with every PlanStep: HYBRIDSERVE_WORKER_BLOCK_SIZE, ...). Defaults are the
dataclass's."""

from __future__ import annotations

import argparse
from typing import Any

from hybridserve.errors import InvalidArgumentError
from hybridserve.settings import Flag, add_settings_arguments, settings_from_args
from scheduler_svc.core import SchedulerConfig

CONFIG_FLAGS = {
    "max_num_batched_tokens": Flag("tokens (prefill + decode) one step may compute"),
    "max_num_seqs": Flag("requests one step may run (also the worker's Mamba state slots)"),
    "long_prefill_token_threshold": Flag(
        "per-request cap on a prefill chunk, tokens (0 = none; -1 = auto: with several model processes, the"
        " step's budget over their number, on the block grid, so that a step holds several prompts' chunks"
        " for them to share; else none)"
    ),
    "max_num_prefill_tokens_per_step": Flag(
        "micro-slicing: in a step with decodes, the prefills together take at most this many tokens, in"
        " quanta (0 = off)"
    ),
    "micro_slice_long_prompts_only": Flag(
        "micro-slicing caps only prompts longer than its budget; shorter ones take the rest of the step",
        switch=True,
    ),
    "prefill_share_mode": Flag(
        "the prefill compute share: in a step with decodes, prefill gets a target share of the service time"
        " (fixed: --prefill-share; auto: steered by the backlog within --prefill-share-min..max); off: none"
    ),
    "prefill_share": Flag("fixed: prefill's target share of the service time, 0..1; auto: where it starts"),
    "prefill_share_min": Flag("auto: the lowest target share"),
    "prefill_share_max": Flag("auto: the highest target share"),
    "prefill_share_deadband": Flag("auto: the target stays while the backlog's share is this close to it"),
    "prefill_share_half_life_s": Flag("half-life of the service times the share is measured on, seconds"),
    "prefill_share_slew_per_s": Flag("auto: the most the target share moves in a second"),
    "block_size": Flag("checkpoint / prefix-cache grid, tokens"),
    "mamba_block_size": Flag("recurrent block, tokens (divides --block-size)"),
    "mamba_cache_mode": Flag("align: non-final prefill chunks end on the block grid (hybrid models); none: no grid"),
    "kv_page_size": Flag("KV cache page, tokens (divides --block-size)"),
}
DERIVED = ("stop_at_last_boundary",)  # set by the worker (off: chunks keep state at every block boundary)
# --long-prefill-token-threshold: the worker picks it (gpu_worker.runner.step_split.prefill_chunk_cap)
AUTO_CHUNK_CAP = -1


def add_config_arguments(parser: argparse.ArgumentParser, service: str = "WORKER") -> None:
    group = parser.add_argument_group("scheduler config (sent with every step)")
    add_settings_arguments(
        group, SchedulerConfig, service, flags=CONFIG_FLAGS, exclude=DERIVED,
        defaults={"long_prefill_token_threshold": AUTO_CHUNK_CAP},
    )  # fmt: skip


def config_from_args(args: argparse.Namespace, **derived: Any) -> SchedulerConfig:
    """The validated config; raises InvalidArgumentError naming the bad flag's field. A chunk cap left
    on auto reads 0 here: the worker sets it once it knows how many model processes run
    (`chunk_cap_is_auto`)."""
    cap = getattr(args, "long_prefill_token_threshold", 0)
    if cap < AUTO_CHUNK_CAP:
        raise InvalidArgumentError(
            f"config.long_prefill_token_threshold = {cap} must be >= 0 (0 turns it off), or -1 for auto"
        )
    if chunk_cap_is_auto(args):
        derived = {"long_prefill_token_threshold": 0, **derived}
    return settings_from_args(SchedulerConfig, args, **derived).validate()


def chunk_cap_is_auto(args: argparse.Namespace) -> bool:
    return getattr(args, "long_prefill_token_threshold", None) == AUTO_CHUNK_CAP
