"""Input checks of one planning step. Each failure names the request, the field and the value."""

from __future__ import annotations

import math

from hybridserve.errors import InvalidArgumentError
from scheduler_svc.core.rules import pages_for_tokens
from scheduler_svc.core.state import RequestState, StepInput


def validate_step(step: StepInput) -> None:
    """Raises InvalidArgumentError on the first inconsistency in the config or the request states."""
    config = step.config.validate()
    if step.step_index < 0:
        raise InvalidArgumentError(f"step_index = {step.step_index} must be >= 0")
    if step.num_free_kv_pages < 0:
        raise InvalidArgumentError(f"num_free_kv_pages = {step.num_free_kv_pages} must be >= 0")
    if step.share is not None:
        step.share.validate()
    if len(step.running) > config.max_num_seqs:
        raise InvalidArgumentError(
            f"{len(step.running)} running requests exceed config.max_num_seqs = {config.max_num_seqs}"
        )
    if step.pinned_kv_pages:
        _validate_pinned(step)
    ids = [r.request_id for r in step.running] + [r.request_id for r in step.waiting]
    unique = len(set(ids)) == len(ids)
    if unique and all(map(_is_running_ok, step.running)) and all(map(_is_waiting_ok, step.waiting)):
        return  # the fast path; the loop below only runs to name what is wrong
    seen: set[str] = set()
    for queue, requests in (("running", step.running), ("waiting", step.waiting)):
        for index, request in enumerate(requests):
            if not _is_consistent(request, queue == "waiting") or request.request_id in seen:
                _explain(request, f"{queue}[{index}]", queue == "waiting", seen)
            seen.add(request.request_id)


def _validate_pinned(step: StepInput) -> None:
    """Each pinned count belongs to a distinct waiting request with a hit and fits its computed tokens."""
    waiting = {r.request_id: r for r in step.waiting}
    seen: set[str] = set()
    for index, pinned in enumerate(step.pinned_kv_pages):
        where = f"pinned_kv_pages[{index}] (request_id {pinned.request_id!r})"
        request = waiting.get(pinned.request_id)
        if request is None:
            raise InvalidArgumentError(
                f"{where}: no waiting request has this id; only a waiting request's prefix-cache hit pins pages"
            )
        if pinned.request_id in seen:
            raise InvalidArgumentError(f"{where}: listed twice; send one count per waiting request")
        seen.add(pinned.request_id)
        if request.num_computed_tokens == 0:
            raise InvalidArgumentError(
                f"{where}: the request has no prefix-cache hit (num_computed_tokens = 0), so it pins no pages;"
                " leave it out"
            )
        held = pages_for_tokens(request.num_computed_tokens, step.config.kv_page_size)
        if not 0 <= pinned.num_kv_pages <= held:
            raise InvalidArgumentError(
                f"{where}: num_kv_pages = {pinned.num_kv_pages} must be >= 0 and at most the {held} pages of its"
                f" {request.num_computed_tokens} computed tokens (its hit)"
            )


def _is_consistent(r: RequestState, is_waiting: bool) -> bool:
    """The checks _explain spells out, as one predicate."""
    return _is_waiting_ok(r) if is_waiting else _is_running_ok(r)


def _is_running_ok(r: RequestState) -> bool:
    computed, prompt, output = r.num_computed_tokens, r.num_prompt_tokens, r.num_output_tokens
    if not r.request_id or prompt < 1 or computed < 0 or output < 0 or r.max_tokens < output or r.max_tokens < 1:
        return False
    if not math.isfinite(r.arrival_time):
        return False
    if computed < prompt:
        return output == 0 and r.num_draft_tokens == 0
    return computed == prompt + output - 1 and r.num_draft_tokens >= 0


def _is_waiting_ok(r: RequestState) -> bool:
    computed, prompt = r.num_computed_tokens, r.num_prompt_tokens
    if not (bool(r.request_id) and 0 <= computed < prompt and r.num_output_tokens == 0 and r.max_tokens >= 1):
        return False
    if r.num_draft_tokens:
        return False
    return math.isfinite(r.arrival_time)


def _explain(request: RequestState, position: str, is_waiting: bool, seen: set[str]) -> None:
    """Raises the InvalidArgumentError that names what is wrong with `request`."""
    if not request.request_id:
        raise InvalidArgumentError(f"{position}.request_id must not be empty")
    where = f"{position} (request_id {request.request_id!r})"
    if request.request_id in seen:
        raise InvalidArgumentError(f"{where}: duplicate request_id; ids must be unique in one step")
    _validate_request(request, where, is_waiting)


def _validate_request(request: RequestState, where: str, is_waiting: bool) -> None:
    prompt, computed, output = (
        request.num_prompt_tokens,
        request.num_computed_tokens,
        request.num_output_tokens,
    )
    if not math.isfinite(request.arrival_time):
        raise InvalidArgumentError(
            f"{where}: arrival_time = {request.arrival_time} must be a finite number (a monotonic clock"
            " reading, e.g. seconds); the queue is ordered by it"
        )
    if prompt < 1:
        raise InvalidArgumentError(f"{where}: num_prompt_tokens = {prompt} must be >= 1")
    if computed < 0 or output < 0:
        raise InvalidArgumentError(
            f"{where}: num_computed_tokens = {computed} and num_output_tokens = {output} must be >= 0"
        )
    if request.max_tokens < max(output, 1):
        raise InvalidArgumentError(
            f"{where}: max_tokens = {request.max_tokens} must be >= 1 and >= num_output_tokens ({output})"
        )
    if is_waiting and computed >= prompt:
        raise InvalidArgumentError(
            f"{where}: a waiting request must have prompt tokens left to compute: num_computed_tokens"
            f" = {computed} must be < num_prompt_tokens = {prompt} (a prefix-cache hit counts at most"
            " num_prompt_tokens - 1 tokens; a preempted request comes back with its outputs folded into"
            " num_prompt_tokens and num_output_tokens = 0)"
        )
    if is_waiting and output != 0:
        raise InvalidArgumentError(
            f"{where}: num_output_tokens = {output} in a waiting request; it must be 0 (a preempted"
            " request comes back with its outputs folded into num_prompt_tokens)"
        )
    if computed < prompt and output != 0:
        raise InvalidArgumentError(
            f"{where}: num_output_tokens = {output} while prefilling (num_computed_tokens {computed} <"
            f" num_prompt_tokens {prompt}); a recomputing request folds its outputs into the prompt"
        )
    if computed >= prompt and computed != prompt + output - 1:
        raise InvalidArgumentError(
            f"{where}: num_computed_tokens = {computed} is beyond what a decode can be at; once the prompt"
            f" ({prompt} tokens) is computed it must equal num_prompt_tokens + num_output_tokens - 1"
            f" = {prompt + output - 1}"
        )
    _validate_drafts(request, where, is_waiting)


def _validate_drafts(request: RequestState, where: str, is_waiting: bool) -> None:
    drafts = request.num_draft_tokens
    if drafts < 0:
        raise InvalidArgumentError(f"{where}: num_draft_tokens = {drafts} must be >= 0 (0: no draft tokens)")
    if drafts and is_waiting:
        raise InvalidArgumentError(
            f"{where}: num_draft_tokens = {drafts} on a waiting request; only a running decode verifies draft"
            " tokens, so send 0 until it decodes"
        )
    if drafts and request.num_computed_tokens < request.num_prompt_tokens:
        raise InvalidArgumentError(
            f"{where}: num_draft_tokens = {drafts} while prefilling (num_computed_tokens"
            f" {request.num_computed_tokens} < num_prompt_tokens {request.num_prompt_tokens}); only a running"
            " decode verifies draft tokens, so send 0 until its prompt is computed"
        )
