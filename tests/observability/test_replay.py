"""Step replay: recorded steps re-plan to the recorded plans byte for byte; a changed config shows
the difference."""

from __future__ import annotations

import base64
import json
from concurrent.futures import ThreadPoolExecutor

from google.protobuf import json_format

import hybridserve_cli as cli
from gpu_worker.observers.recording import StepRecorder
from scheduler_svc import convert
from scheduler_svc.core import plan_step
from scheduler_svc.replay import replay_file
from scheduler_svc.step_records import encode_plan
from tests.observability.conftest import greedy, prompt_of
from tests.scheduler.helpers import config, seed_step


def test_recorded_run_replays_byte_for_byte_and_differs_under_a_changed_config(start_stack, tmp_path, capsys):
    record = tmp_path / "steps.jsonl"
    stack = start_stack(record=record, traced=False)
    prompts = [prompt_of(40 + 9 * i, i) for i in range(3)]
    with ThreadPoolExecutor(3) as pool:
        list(pool.map(lambda p: list(stack.stub.Generate(greedy(p, 6), timeout=60)), prompts))
    stack.stop()
    results = replay_file(record)
    assert len(results) == stack.engine.counters.num_steps > 3
    for r in results:
        assert r.recorded is not None
        assert r.replayed.SerializeToString(deterministic=True) == r.recorded.SerializeToString(deterministic=True)

    assert cli.main(["replay", str(record)]) == 0
    out = capsys.readouterr().out
    assert f"{len(results)} steps replayed, {len(results)} identical, 0 differ" in out

    assert cli.main(["replay", str(record), "--step", "0"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("step 0: quantum 16,") and "prefill" in out

    code = cli.main(["replay", str(record), "--config-override", "max_num_batched_tokens=8"])
    out = capsys.readouterr().out
    assert code == 1
    assert "--- recorded step 0" in out and "+++ replayed step 0" in out
    assert "+step 0: quantum 8," in out  # the sub-block exception now holds: quantum = mamba_block_size


def test_recorded_drafts_show_in_replay_and_the_timeline(start_stack, tmp_path, capsys):
    """A speculating worker's record: the plans with their draft grants replay byte for byte, and each
    step's verifications (drafted, accepted, rejected) show in `replay --step N` and the timeline."""
    from hybridserve_cli.timeline.records import load_records
    from hybridserve_cli.timeline.view import build_timeline

    record = tmp_path / "steps.jsonl"
    stack = start_stack(record=record, traced=False, speculative_tokens=4)
    head = prompt_of(24, 3)
    list(stack.stub.Generate(greedy(head + head, 64), timeout=60))  # its greedy output loops: drafts accepted
    stack.stop()
    counters = stack.engine.counters
    assert counters.num_draft_tokens > 0
    results = replay_file(record)
    assert all(r.is_identical for r in results)
    assert sum(d for r in results for _, d, _ in r.drafts) == counters.num_draft_tokens
    assert sum(a for r in results for _, _, a in r.drafts) == counters.num_accepted_tokens
    drafted = next(r for r in results if r.drafts)
    assert cli.main(["replay", str(record), "--step", str(drafted.step_index)]) == 0
    (_, d, a), *_ = drafted.drafts
    assert f"drafts verified: {d} drafted, {a} accepted, {d - a} rejected" in capsys.readouterr().out
    steps = build_timeline(load_records(record)).steps
    assert sum(s.num_draft_tokens for s in steps) == counters.num_draft_tokens
    assert sum(s.num_accepted_tokens for s in steps) == counters.num_accepted_tokens


def test_seed_livelock_step_replays_and_json_records_are_read(tmp_path, capsys):
    """The livelock's step (three prefills, 4096 budget, 2048 grid): recorded in the JSON form, it
    replays identically; without micro-slicing the plan differs."""
    step = seed_step(1)
    path = tmp_path / "seed.jsonl"
    record = {
        "step_index": 1,
        "request": json_format.MessageToDict(convert.step_to_pb(step)),
        "plan": base64.b64encode(encode_plan(plan_step(step))).decode(),
    }
    path.write_text(json.dumps(record) + "\n")
    assert cli.main(["replay", str(path)]) == 0
    assert "step 1: identical" in capsys.readouterr().out
    code = cli.main(["replay", str(path), "--config-override", "max_num_prefill_tokens_per_step=0", "--no-check"])
    out = capsys.readouterr().out
    assert code == 0 and "-step 1: quantum 2048, decode 1 + prefill 4096" in out


def test_bad_override_and_sampling(tmp_path, capsys):
    path = tmp_path / "s.jsonl"
    recorder = StepRecorder(path, sample_rate=0.5, seed=1)
    step = seed_step()
    plan = plan_step(step)
    for i in range(200):
        if recorder.should_record():
            recorder.record(i, step, plan, 0.001)
    recorder.close()
    assert 60 < recorder.num_recorded < 140
    assert cli.main(["replay", str(path), "--config-override", "max_num_prefill_tokens_per_step=2304"]) == 2
    assert "2304" in capsys.readouterr().err
    assert cli.main(["replay", str(path), "--config-override", "nope=1"]) == 2
    assert config().block_size == 2048
