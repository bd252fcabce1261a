"""The engine's sampling: a step whose rows are all plain greedy samples them without looking at
each request (RequestTable.num_running_sampled is 0); any other step goes row by row. Either way a
request gets the tokens, log-probabilities and alternatives it gets alone. The fake runner's logits
depend only on a chunk's last token, so a request's outputs are the same alone or batched."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from gpu_worker.engine.engine import Engine
from gpu_worker.engine.request import GenerationParams, Request, RequestOutput, StopChecker
from gpu_worker.engine.settings import EngineSettings
from gpu_worker.runner.batch import Batch, ForwardOutput
from gpu_worker.runner.kv_pool import KVPagePool
from gpu_worker.runner.protocol import LogitsRunner, PoolSet
from gpu_worker.runner.sampling import SamplingParams
from gpu_worker.runner.settings import RunnerConfig
from gpu_worker.runner.state_pool import MambaStatePool
from scheduler_svc.core import MambaCacheMode, SchedulerConfig, plan_step

VOCAB = 64
PAGE = 4
CONFIG = SchedulerConfig(
    max_num_batched_tokens=32, max_num_seqs=4, long_prefill_token_threshold=0, max_num_prefill_tokens_per_step=16,
    block_size=16, mamba_block_size=8, mamba_cache_mode=MambaCacheMode.ALIGN, kv_page_size=PAGE,
)  # fmt: skip
CPU = torch.device("cpu")
# Per last token, the next token's logits: several close candidates, so that sampling at a
# temperature draws different tokens, and integer ties, so that the argmax's first-index rule shows.
TABLE = torch.randint(0, 6, (VOCAB, VOCAB), generator=torch.Generator().manual_seed(2)).float() / 2


class TableRunner(LogitsRunner):
    """Real page and slot pools (no layers); each row's logits are TABLE[its chunk's last token]."""

    def __init__(self) -> None:
        self.kv_pool = KVPagePool(256, PAGE, 0, 1, 1, torch.float32, CPU)
        self.state_pool = MambaStatePool(CONFIG.max_num_seqs, 0, 0, (1, 1), (1, 1, 1), torch.float32, CPU)
        self.pools = PoolSet(self.kv_pool, self.state_pool, 0, 0, torch.device("cpu"))
        self.eos_token_ids = (2,)

    def forward(self, batch: Batch, while_waiting: Callable[[], None] | None = None) -> ForwardOutput:
        if while_waiting is not None:
            while_waiting()
        return ForwardOutput(logits=TABLE[[seq.token_ids[-1] for seq in batch.sequences]])


def make_request(rid: str, sampling: SamplingParams, prompt_len: int, max_tokens: int) -> Request:
    return Request(
        request_id=rid, prompt_token_ids=[3 + (i * 7) % 50 for i in range(prompt_len)],
        params=GenerationParams(sampling, max_tokens, (), True), arrival_time=time.monotonic(), deadline=None,
        stop_checker=StopChecker(None, ()),
    )  # fmt: skip


def run(jobs: dict[str, tuple[SamplingParams, int, int]]) -> tuple[dict[str, list[RequestOutput]], Engine]:
    """Every job's events, all submitted at once to a fresh engine (stopped on return)."""
    settings = EngineSettings(
        scheduler=CONFIG, runner=RunnerConfig(kv_page_size_tokens=PAGE, max_num_seqs=CONFIG.max_num_seqs),
        scheduler_addresses=("in-process",),
    )  # fmt: skip
    engine = Engine(TableRunner(), plan_step, settings)  # type: ignore[arg-type]
    engine.start()
    try:
        requests = {rid: make_request(rid, *job) for rid, job in jobs.items()}
        for r in requests.values():
            engine.submit(r)
        outputs: dict[str, list[RequestOutput]] = {}
        for rid, r in requests.items():
            events = [r.events.get(timeout=20)]
            while events[-1].finish_reason is None and events[-1].error is None:
                events.append(r.events.get(timeout=20))
            outputs[rid] = events
    finally:
        engine.stop()
    return outputs, engine


def flat(events: list[RequestOutput]) -> tuple[list[int], list[float], list[tuple[tuple[int, float], ...]]]:
    assert all(e.error is None for e in events)
    return (
        [t for e in events for t in e.token_ids],
        [lp for e in events for lp in e.logprobs],
        [top for e in events for top in e.top_logprobs],
    )


JOBS = {  # sampling, prompt tokens, max_tokens
    "plain": (SamplingParams(), 9, 12),
    "plain-2": (SamplingParams(), 13, 7),
    "greedy-top": (SamplingParams(num_logprobs=3), 5, 10),
    "seeded": (SamplingParams(temperature=1.5, seed=4), 7, 12),
    "seeded-top": (SamplingParams(temperature=1.0, top_k=8, seed=9, num_logprobs=2), 11, 9),
}


def test_each_request_gets_alone_what_it_gets_batched_with_any_mates() -> None:
    alone = {rid: run({rid: job})[0][rid] for rid, job in JOBS.items()}
    plain_only, engine = run({rid: JOBS[rid] for rid in ("plain", "plain-2")})  # the plain steps' path
    assert engine.table.num_running_sampled == 0
    mixed, engine = run(dict(JOBS))  # four at a time: mates come and go, rows mixed and plain
    assert engine.table.num_running_sampled == 0
    for rid, (sampling, _, max_tokens) in JOBS.items():
        tokens, logprobs, tops = flat(alone[rid])
        assert len(tokens) == max_tokens
        for batched in [mixed[rid]] + ([plain_only[rid]] if rid in plain_only else []):
            b_tokens, b_logprobs, b_tops = flat(batched)
            assert b_tokens == tokens, rid
            assert b_logprobs == logprobs, rid
            assert b_tops == tops, rid
        if sampling.num_logprobs:
            assert all(len(top) == sampling.num_logprobs for top in tops)
        else:
            assert tops == [()] * max_tokens
        if sampling.temperature == 0:  # the first maximal logit, and its log-probability
            context = [3 + (i * 7) % 50 for i in range(JOBS[rid][1])] + tokens
            logp = TABLE.log_softmax(-1)
            assert tokens == [int(TABLE[last].argmax()) for last in context[-max_tokens - 1 : -1]]
            for last, token, lp in zip(context[-max_tokens - 1 : -1], tokens, logprobs, strict=True):
                assert abs(logp[last, token].item() - lp) < 1e-6
    seeded_tokens = flat(alone["seeded"])[0]
    context = [3 + (i * 7) % 50 for i in range(7)] + seeded_tokens
    greedy_would_be = [int(TABLE[last].argmax()) for last in context[-13:-1]]
    assert seeded_tokens != greedy_would_be, "temperature 1.5 over close logits should draw off the argmax"
