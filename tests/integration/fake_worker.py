"""A stand-in Generation server for the unit tests of the client layer (generate, loadgen) only:
it streams `max_tokens` letters, one message per token, with a small delay between them. The real
worker is exercised by test_up_generate.py."""

from __future__ import annotations

import string
import threading
import time
from collections.abc import Iterator

import grpc

from hybridserve import grpc_server
from hybridserve.errors import InvalidArgumentError
from hybridserve.v1 import generation_pb2

SERVICE = generation_pb2.DESCRIPTOR.services_by_name["Generation"]
DEFAULT_MAX_TOKENS = 16
VOCAB_SIZE = 259


class FakeGeneration:
    """Generate: token i is id 3 + i % 26, text the matching letter. Empty prompts are invalid."""

    def __init__(self, token_delay_s: float = 0.002) -> None:
        self.token_delay_s = token_delay_s
        self.requests: list[generation_pb2.GenerateRequest] = []
        self._lock = threading.Lock()
        self._counter = 0
        self._active = 0
        self.max_concurrent = 0  # most Generate calls in flight at once

    def Generate(
        self, request: generation_pb2.GenerateRequest, context: grpc.ServicerContext
    ) -> Iterator[generation_pb2.GenerateResponse]:
        prompt_ids = (
            list(request.prompt_token_ids.ids)
            if request.HasField("prompt_token_ids")
            else list(request.prompt.encode())
        )
        if not prompt_ids:
            raise InvalidArgumentError("prompt is empty: give text or token ids")
        with self._lock:
            self.requests.append(request)
            self._counter += 1
            request_id = request.request_id or f"fake-{self._counter}"
            self._active += 1
            self.max_concurrent = max(self.max_concurrent, self._active)
        try:
            yield from self._stream(request, request_id, len(prompt_ids))
        finally:
            with self._lock:
                self._active -= 1

    def _stream(
        self, request: generation_pb2.GenerateRequest, request_id: str, num_prompt_tokens: int
    ) -> Iterator[generation_pb2.GenerateResponse]:
        num_tokens = request.sampling.max_tokens or DEFAULT_MAX_TOKENS
        for i in range(num_tokens):
            time.sleep(self.token_delay_s)
            top = [generation_pb2.TopLogprobs(token_ids=[3, 4], logprobs=[-0.5, -1.5])] * min(
                request.sampling.logprobs, 1
            )
            yield generation_pb2.GenerateResponse(
                request_id=request_id, token_ids=[3 + i % 26], logprobs=[-0.5],
                text=string.ascii_lowercase[i % 26], top_logprobs=top,
            )  # fmt: skip
        usage = generation_pb2.Usage(prompt_tokens=num_prompt_tokens, cached_tokens=0, completion_tokens=num_tokens)
        yield generation_pb2.GenerateResponse(
            request_id=request_id, finish_reason=generation_pb2.FINISH_REASON_LENGTH, usage=usage
        )

    def Abort(
        self, request: generation_pb2.AbortRequest, context: grpc.ServicerContext
    ) -> generation_pb2.AbortResponse:
        return generation_pb2.AbortResponse()

    def GetInfo(
        self, request: generation_pb2.GetInfoRequest, context: grpc.ServicerContext
    ) -> generation_pb2.GetInfoResponse:
        return generation_pb2.GetInfoResponse(model="fake", vocab_size=VOCAB_SIZE, async_scheduling=True)

    def GetModelFiles(
        self, request: generation_pb2.GetModelFilesRequest, context: grpc.ServicerContext
    ) -> Iterator[generation_pb2.ModelFileChunk]:
        context.abort(grpc.StatusCode.UNIMPLEMENTED, "the fake worker serves no model files")
        yield from ()


def start_fake_worker(token_delay_s: float = 0.002) -> tuple[grpc.Server, str, FakeGeneration]:
    """A started fake worker on a free local port: (server, address, servicer)."""
    servicer = FakeGeneration(token_delay_s)
    server, port, _ = grpc_server.create_server(
        [lambda s: grpc_server.add_servicer(s, SERVICE, servicer)], host="127.0.0.1", port=0
    )
    server.start()
    return server, f"127.0.0.1:{port}", servicer


def main() -> None:
    """Serve the fake on --port (default 0) until SIGTERM, printing `listening on` like a real server."""
    import argparse

    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, default=0)
    args, _ = parser.parse_known_args()
    servicer = FakeGeneration()
    server, port, health = grpc_server.create_server(
        [lambda s: grpc_server.add_servicer(s, SERVICE, servicer)], host="127.0.0.1", port=args.port
    )
    server.start()
    grpc_server.announce("127.0.0.1", port)
    grpc_server.serve_until_signal(server, health)


if __name__ == "__main__":
    main()
