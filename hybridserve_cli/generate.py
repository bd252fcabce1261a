"""`hybridserve generate "text"`: stream one completion from a running worker.

The completion's text goes to stdout as it arrives; a one-line summary (finish reason, token counts,
time to first token, decode tokens/s) goes to stderr. `--json` prints one JSON object instead."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

import grpc

from gpu_worker.api.client import (
    Completion,
    WorkerTarget,
    build_request,
    describe_rpc_error,
    generation_stub,
    stream_completion,
)
from hybridserve.client_security import (
    add_client_security_arguments,
    client_security_from_args,
    open_client_channel,
)
from hybridserve.settings import Flag, add_settings_arguments
from hybridserve.v1 import generation_pb2

EXIT_RPC_ERROR = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("prompt", nargs="?", help="prompt text (or use --token-ids)")
    add_settings_arguments(parser, WorkerTarget, "GENERATE", flags={"worker": Flag("worker address (host:port)")})
    parser.add_argument("--token-ids", type=parse_token_ids, metavar="ID,ID,...",
                        help="prompt as comma-separated token ids instead of text")  # fmt: skip
    parser.add_argument("--max-tokens", type=int, default=0, help="most tokens to generate (0 = the worker's default)")
    parser.add_argument(
        "--temperature",
        type=float,
        default=None,
        help="0 = greedy (default: the model's generation_config.json, else greedy)",
    )
    parser.add_argument(
        "--top-p", type=float, default=None, help="nucleus sampling, 0 or 1 = off (default: the model's, else off)"
    )
    parser.add_argument("--top-k", type=int, default=None, help="0 = off (default: the model's, else off)")
    parser.add_argument("--seed", type=int, default=None, help="sampling seed (default: nondeterministic)")
    parser.add_argument("--stop", action="extend", nargs="+", default=[], metavar="S", help="stop strings")
    parser.add_argument("--ignore-eos", action="store_true", help="keep generating past end-of-sequence")
    parser.add_argument("--logprobs", type=int, default=0, metavar="N", help="also return N top alternatives per token")
    parser.add_argument("--request-id", default="", help="request id (default: the worker picks one)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds before giving up on the call")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    add_client_security_arguments(parser)


def parse_token_ids(raw: str) -> list[int]:
    """`1,2,3` -> [1, 2, 3]; spaces are allowed, an empty list is not."""
    try:
        ids = [int(part) for part in raw.replace(" ", "").split(",") if part != ""]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{raw!r} is not a comma-separated list of integers") from None
    if not ids:
        raise argparse.ArgumentTypeError("--token-ids needs at least one id")
    return ids


def request_from_args(args: argparse.Namespace) -> generation_pb2.GenerateRequest:
    """The GenerateRequest the flags describe; ValueError when the prompt is missing or doubled."""
    if args.token_ids is not None and args.prompt is not None:
        raise ValueError("give either a prompt text or --token-ids, not both")
    if args.token_ids is None and args.prompt is None:
        raise ValueError('give a prompt, e.g. hybridserve generate "Hello", or --token-ids 1,2,3')
    return build_request(
        args.token_ids if args.token_ids is not None else args.prompt,
        max_tokens=args.max_tokens or None, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
        seed=args.seed, stop=args.stop, ignore_eos=args.ignore_eos, logprobs=args.logprobs,
        request_id=args.request_id,
    )  # fmt: skip


def format_summary(done: Completion) -> str:
    """The one-line summary printed to stderr after the text. `decode` is the rate between the first
    and the last token message as they arrived here; `throughput` is tokens over the whole call."""
    parts = [
        f"finish_reason={done.finish_reason or '?'}",
        f"prompt_tokens={done.prompt_tokens}",
        f"cached_tokens={done.cached_tokens}",
        f"completion_tokens={done.completion_tokens}",
    ]
    if done.ttft_s is not None:
        parts.append(f"ttft={done.ttft_s * 1000:.1f}ms")
    if done.decode_tokens_per_s is not None:
        parts.append(f"decode={done.decode_tokens_per_s:.1f}tok/s")
    if done.e2e_s > 0:
        parts.append(f"throughput={done.completion_tokens / done.e2e_s:.1f}tok/s")
    parts.append(f"total={done.e2e_s:.3f}s")
    return " ".join(parts)


def completion_json(done: Completion) -> dict[str, Any]:
    return {
        "request_id": done.request_id,
        "text": done.text,
        "token_ids": done.token_ids,
        "logprobs": done.logprobs,
        "top_logprobs": [{str(k): v for k, v in top.items()} for top in done.top_logprobs],
        "finish_reason": done.finish_reason,
        "usage": {"prompt_tokens": done.prompt_tokens, "cached_tokens": done.cached_tokens,
                  "completion_tokens": done.completion_tokens},
        "ttft_s": done.ttft_s,
        "decode_tokens_per_s": done.decode_tokens_per_s,
        "e2e_s": done.e2e_s,
    }  # fmt: skip


def _print_text(message: generation_pb2.GenerateResponse) -> None:
    if message.text:
        sys.stdout.write(message.text)
        sys.stdout.flush()


def _print_logprobs(done: Completion) -> None:
    for i, (token_id, logprob) in enumerate(zip(done.token_ids, done.logprobs, strict=False)):
        top = done.top_logprobs[i] if i < len(done.top_logprobs) else {}
        alternatives = " ".join(f"{k}:{v:.3f}" for k, v in top.items())
        print(f"  token {token_id:>6} logprob {logprob:8.3f}  {alternatives}".rstrip(), file=sys.stderr)


def run(args: argparse.Namespace) -> int:
    try:
        request = request_from_args(args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    with open_client_channel(args.worker, client_security_from_args(args)) as channel:
        stub = generation_stub(channel)
        try:
            done = stream_completion(stub, request, args.timeout, None if args.json else _print_text)
        except grpc.RpcError as exc:
            if not args.json:
                sys.stdout.write("\n")
            print(f"error: {describe_rpc_error(exc, args.worker)}", file=sys.stderr)
            return EXIT_USAGE if exc.code() == grpc.StatusCode.INVALID_ARGUMENT else EXIT_RPC_ERROR
        except KeyboardInterrupt:  # closing the channel cancels the call, which aborts the request
            print("\ninterrupted", file=sys.stderr)
            return EXIT_INTERRUPTED
    if args.json:
        print(json.dumps(completion_json(done)))
        return 0
    if not done.text and done.token_ids:  # a checkpoint without a tokenizer streams ids only
        sys.stdout.write(" ".join(str(t) for t in done.token_ids))
    sys.stdout.write("\n")
    sys.stdout.flush()
    if args.logprobs > 0:
        _print_logprobs(done)
    print(format_summary(done), file=sys.stderr)
    return 0
