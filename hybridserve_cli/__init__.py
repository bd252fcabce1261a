"""`hybridserve`: one command, one subcommand per role; the top layer of the import graph.

A server's subcommand lives with its service (`scheduler_svc.server`, ...); the commands that belong
to no one service (`up`, `generate`, `bench`, `qualify`, `init-model`, `timeline`) live in this
package, with the stack launcher they share (stack.py) and the default model (demo_model/). Each is
a module exposing add_arguments(parser) and run(args) -> exit code, imported only when its
subcommand is built, so `hybridserve scheduler` never loads torch.

Layering (tests/test_layering.py): this package may import every service and nothing outside it
(tests and benchmarks aside) imports it; `hybridserve/` (errors, gRPC plumbing, telemetry, settings,
generated code, child processes) is a leaf that imports no service. That is why the command line is
a top-level package of its own rather than `hybridserve.cli`."""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

from hybridserve.model_source import ModelSourceError

# subcommand -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "up": ("hybridserve_cli.up", "start scheduler, worker (and cache) on this machine with embedded defaults"),
    "scheduler": ("scheduler_svc.server", "serve the stateless Scheduler (step planner)"),
    "worker": ("gpu_worker.api.server", "serve the Generation API on one GPU (or the CPU)"),
    "cache": ("cache_svc.server", "serve the BlockCache (prefix-cache checkpoints in Redis)"),
    "gateway": ("gateway.server", "serve the OpenAI HTTP API and the gRPC Generation API in front of workers"),
    "generate": ("hybridserve_cli.generate", "stream a completion from a running worker"),
    "bench": ("hybridserve_cli.bench.command", "serving benchmark (OpenAI HTTP or gRPC) in vLLM bench serve's terms"),
    "qualify": ("hybridserve_cli.qualify.command", "two worker profiles, one seeded workload, the qualification gates"),
    "download": ("hybridserve_cli.download", "fill the hub cache with a model ahead of time (images, init containers)"),
    "init-model": ("hybridserve_cli.init_model", "write the default model (trained, or --random) to a folder"),
    "train-demo": ("hybridserve_cli.demo_model.train", "train the default model from scratch on the Python stdlib"),
    "health": ("hybridserve_cli.health", "exit 0 when a server's grpc.health.v1 check says SERVING (probes)"),
    "replay": ("scheduler_svc.replay", "re-plan recorded engine steps offline; show the plan or a diff"),
    "timeline": ("hybridserve_cli.timeline.command", "recorded engine steps as an HTML timeline (and Perfetto JSON)"),
}


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hybridserve", description="Serving stack for hybrid LLMs.")
    parser.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING, ERROR")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (module_name, summary) in COMMANDS.items():
        command = sub.add_parser(name, help=summary, description=summary)
        if only == name:  # only the chosen command's module is imported (`hybridserve --help` loads none)
            module = importlib.import_module(module_name)
            module.add_arguments(command)
            command.set_defaults(run=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    chosen = next((a for a in argv if a in COMMANDS), None)
    args = build_parser(only=chosen).parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    try:
        return int(args.run(args))
    except ModelSourceError as exc:  # --model names nothing servable: one line, the usage exit code
        print(f"hybridserve {args.command}: {exc}", file=sys.stderr, flush=True)
        return 2
