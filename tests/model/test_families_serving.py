"""Every family served end to end: a real Scheduler and worker over gRPC, greedy tokens against
transformers' generate(), a prefix-cache hit and preemption under a small KV budget giving the cold
run's tokens, and GetInfo naming the architecture."""

from __future__ import annotations

import random
import threading
from dataclasses import replace
from pathlib import Path

import grpc
import pytest

from gpu_worker.api.server import build_prefix_cache
from gpu_worker.api.service import GenerationServicer, add_to_server
from gpu_worker.engine.engine import Engine
from gpu_worker.engine.settings import EngineSettings
from gpu_worker.runner.model_process import ProcessRunner, build_runner
from gpu_worker.runner.settings import RunnerConfig
from hybridserve import grpc_server
from hybridserve.v1 import generation_pb2 as pb
from hybridserve.v1 import generation_pb2_grpc as pb_grpc
from scheduler_svc.client import SchedulerClient
from tests.model.model_helpers import FAMILY_SPECS
from tests.worker.conftest import SCHEDULER, budget_for_pages, collect, greedy_request, hf_greedy


class Served:
    """A worker (runner + engine + Generation service on port 0) for one checkpoint; stopped by `close`.
    Speculation drafts without `Payoff` (its stop depends on measured step times: tests assert behaviour)."""

    def __init__(
        self, path: Path, scheduler: str, prefix_caching: bool = False, num_kv_pages: int | None = None,
        speculative_tokens: int = 0, runner: dict[str, object] | None = None, speculative_method: str = "ngram",
        **engine: object,
    ) -> None:  # fmt: skip
        config = replace(SCHEDULER, stop_at_last_boundary=prefix_caching)
        runner_config = RunnerConfig(
            memory_budget_bytes=16 << 20, kv_page_size_tokens=config.kv_page_size, max_num_seqs=config.max_num_seqs,
            num_checkpoint_slots=16, device="cpu", dtype="float32", num_draft_rows=speculative_tokens * 8,
            mtp_draft_tokens=speculative_tokens if speculative_method == "mtp" else 0,
        )  # fmt: skip
        if num_kv_pages is not None:
            budget = budget_for_pages(runner_config, path, num_kv_pages)
            runner_config = replace(runner_config, memory_budget_bytes=budget)
        runner_config = replace(runner_config, **(runner or {}))  # type: ignore[arg-type]
        settings = EngineSettings(
            scheduler=config, runner=runner_config, scheduler_addresses=(scheduler,),
            num_speculative_tokens=speculative_tokens, speculative_max_rows=8, speculative_method=speculative_method,
            speculative_payoff=False, **engine,  # type: ignore[arg-type]
        )  # fmt: skip
        self.client = SchedulerClient((scheduler,), deadline_s=settings.scheduler_deadline_s,
                                      give_up_after_s=settings.scheduler_give_up_s)  # fmt: skip
        model = build_runner(path, runner_config)  # in process unless `runner` asks for model processes
        if runner_config.compile_step_sizes:  # the programs compile in the warm-up, as a served worker's do
            model.warm_up()
        prefix = build_prefix_cache(model, settings, prefix_caching)
        self.engine = Engine(model, self.client.plan, settings, prefix=prefix)
        self.engine.start()
        self.server, port, _ = grpc_server.create_server([add_to_server(GenerationServicer(self.engine, path.name))])
        self.server.start()
        self.channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        self.stub = pb_grpc.GenerationStub(self.channel)

    def generate(self, prompt: list[int], max_tokens: int) -> tuple[list[int], int]:
        """Greedy tokens and the prompt tokens served from the prefix cache."""
        tokens, messages = collect(self.stub.Generate(greedy_request(prompt, max_tokens), timeout=120))
        return tokens, messages[-1].usage.cached_tokens

    def close(self) -> None:
        self.channel.close()
        self.server.stop(None)
        self.engine.stop()
        self.client.close()
        if isinstance(self.engine.runner, ProcessRunner):
            self.engine.runner.close()


def _prompt(vocab: int, n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, vocab) for _ in range(n)]


@pytest.mark.slow
@pytest.mark.parametrize("name", FAMILY_SPECS)
def test_family_serves_greedy_64_tokens_prefix_hits_and_preemption(checkpoints, scheduler_address, name) -> None:
    hf, path = checkpoints[name]
    vocab, block = hf.config.vocab_size, SCHEDULER.block_size
    cold = Served(path, scheduler_address)
    try:
        info = cold.stub.GetInfo(pb.GetInfoRequest(), timeout=10)
        assert info.architecture == type(hf).__name__
        for length, seed in ((5, 1), (37, 2)):
            prompt = _prompt(vocab, length, seed)
            assert cold.generate(prompt, 64)[0] == hf_greedy(hf, prompt, 64), f"prompt of {length}"
    finally:
        cold.close()

    prefix = _prompt(vocab, 3 * block, 3)
    warm = Served(path, scheduler_address, prefix_caching=True)
    try:
        for suffix_seed in (4, 5):
            prompt = prefix + _prompt(vocab, 7, suffix_seed)
            tokens, cached = warm.generate(prompt, 12)
            assert cached == (0 if suffix_seed == 4 else 3 * block), "the second request hits the 3-block prefix"
            assert tokens == hf_greedy(hf, prompt, 12)
    finally:
        warm.close()

    tight = Served(path, scheduler_address, num_kv_pages=30)  # 120 tokens of KV for 4 requests of ~60
    jobs = [_prompt(vocab, 24 + 3 * i, 10 + i) for i in range(4)]
    results: dict[int, list[int]] = {}
    try:
        threads = [threading.Thread(target=lambda i=i: results.__setitem__(i, tight.generate(jobs[i], 30)[0]))
                   for i in range(len(jobs))]  # fmt: skip
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
        assert tight.engine.counters.num_preemptions > 0, "the KV budget was meant to force preemption"
    finally:
        tight.close()
    assert results == {i: hf_greedy(hf, p, 30) for i, p in enumerate(jobs)}
