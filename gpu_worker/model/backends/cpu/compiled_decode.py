"""The Mamba2 decode step compiled with torch.compile (inductor), built off the serving path.

Compiling takes seconds to a minute (inductor writes C++ and builds it; later starts reuse its on-disk
cache), so `DecodeCompiler.start` runs it in a background thread, beside the rest of the start-up; a
served worker reports ready once it ended (gpu_worker.runner.warmup), unless it serves while warming, when
the model decodes eagerly meanwhile. The runner attaches the compiled step to every mixer between two
steps once it is ready (`attach_if_ready`). Warm-up compiles, on scratch tensors (never the pools), the
graphs serving needs: a batch of one sequence and a batch of any size >= 2 (a dynamic batch dimension),
each for state rows at the start of their storage and further in. Every Mamba layer of a model has the
same shapes and passes its weights as arguments, so they share those graphs. Afterwards calls run under
the "eager_on_recompile" stance: an input the warm-up did not foresee runs eagerly rather than stalling a
step on a compile.

Thread counts. torch.compile's guards check torch's intra-op thread count (its global state): a graph
compiled on one thread and called on two fails them, and under that stance runs eagerly, silently. The
runner's steps change the count by their size (gpu_worker.runner.tuning.StepThreads), so every graph is
compiled once under each count a decode step may run on (`threads`; `on_threads`).

Decode rows are updated in place in the pools, one call per run of consecutive state slots; a group
scattered over many runs is gathered, stepped and scattered back (as the eager path does)."""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from gpu_worker.model.backends.cpu.decode_fused import MambaDims, mamba_decode_step
from gpu_worker.model.context import ForwardContext

if TYPE_CHECKING:
    from gpu_worker.model.mamba2 import Mamba2Mixer

log = logging.getLogger("hybridserve.worker.compile")
STANCE = "eager_on_recompile"  # after warm-up: never compile on the serving path
# A decode group of at most this many runs of consecutive slots is stepped in place run by run (a call
# costs ~20 us); more scattered ones are gathered and scattered back (~0.5 ms a layer at 32 sequences).
MAX_RUNS = 6


@contextlib.contextmanager
def on_threads(count: int) -> Iterator[None]:
    """Torch's intra-op thread count set to `count` for the block (the calling thread's), then set back:
    what a graph is compiled under is part of its guards (module docstring, thread counts)."""
    before = torch.get_num_threads()
    if count != before:
        torch.set_num_threads(count)
    try:
        yield
    finally:
        if torch.get_num_threads() != before:
            torch.set_num_threads(before)


def hybridserve_cache(name: str) -> Path | None:
    """~/.cache/hybridserve/`name`, where the home folder is writable; else None."""
    home = Path.home()
    return home / ".cache" / "hybridserve" / name if os.access(home, os.W_OK) else None


def use_persistent_cache() -> None:
    """Inductor's on-disk cache under ~/.cache/hybridserve/inductor unless TORCHINDUCTOR_CACHE_DIR names
    one (its own default lies under /tmp, gone after a reboot); read when a compile starts, inherited
    by the model processes. Called by the runner before it compiles."""
    folder = hybridserve_cache("inductor")
    if folder is not None:  # else inductor's own default
        os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(folder))


def can_compile(device: torch.device) -> bool:
    """Inductor on CPU needs a C++ compiler; on CUDA the Triton kernels and CUDA graphs serve decode."""
    return device.type == "cpu" and any(shutil.which(cc) for cc in ("c++", "g++", "clang++"))


def mixer_dims(mixer: Mamba2Mixer) -> MambaDims:
    return MambaDims(
        d_inner=mixer.d_inner, conv_dim=mixer.conv_dim, num_heads=mixer.num_heads, head_dim=mixer.head_dim,
        num_groups=mixer.num_groups, state_size=mixer.state_size, dt_min=mixer.dt_min, dt_max=mixer.dt_max,
        eps=mixer.norm.eps,
    )  # fmt: skip


def slot_runs(ctx: ForwardContext) -> list[tuple[int, int, int]]:
    """The decode group as runs of consecutive state slots: (first row, first slot, length), computed
    once per forward (the group is sorted by slot, so a run of slots is a run of rows)."""
    cached = ctx.derived.get(slot_runs)
    if cached is not None:
        return cached  # type: ignore[return-value]
    runs: list[tuple[int, int, int]] = []
    if ctx.decode_slot_start is not None:
        runs.append((0, ctx.decode_slot_start, ctx.num_decode))
    else:
        slots: list[int] = ctx.decode_state_slots.tolist()
        for row, slot in enumerate(slots):
            if runs and runs[-1][1] + runs[-1][2] == slot:
                runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
            else:
                runs.append((row, slot, 1))
    ctx.derived[slot_runs] = runs
    return runs


class CompiledMambaDecode:
    """Callable as `Mamba2Mixer.fused_decode`: (mixer, zxbcdt [b, width], ctx, conv pool, ssm pool) ->
    the gated-normed [b, d_inner] of the decode group (out_proj input), pool rows updated."""

    def __init__(self, dims: MambaDims) -> None:
        self.dims = dims
        self._step: Callable[..., torch.Tensor] = torch.compile(mamba_decode_step)
        self.stance = STANCE  # tests use "fail_on_recompile" to prove the warm-up covers serving

    def _args(
        self, mixer: Mamba2Mixer, zxbcdt: torch.Tensor, conv_rows: torch.Tensor, ssm_rows: torch.Tensor
    ) -> tuple[object, ...]:
        weight = mixer.conv1d.weight[:, 0, :]  # [conv_dim, K]
        return (zxbcdt, conv_rows, ssm_rows, weight, mixer.conv1d.bias, mixer.dt_bias, mixer.A_log, mixer.D,
                mixer.norm.weight, self.dims)  # fmt: skip

    def warm_up(self, mixer: Mamba2Mixer, conv_state: torch.Tensor, ssm_state: torch.Tensor) -> None:
        """Compile the graphs on scratch tensors of the kinds serving passes (the guards check them):
        state rows are ordinary tensors (aliases of the pools, or gathered outside inference mode),
        zxbcdt an inference tensor (the forward runs in inference mode)."""
        width = mixer.in_proj.out_features
        device = conv_state.device
        # batch 1 and any batch >= 2; rows at the start of their storage (gathered rows, a run from slot 0)
        # or further in (any other run): the graphs specialise on a storage offset of 0
        for b, skip in ((1, 0), (1, 1), (2, 0), (2, 1)):
            conv_rows = torch.zeros(skip + b, *conv_state.shape[1:], dtype=conv_state.dtype, device=device)
            ssm_rows = torch.zeros(skip + b, *ssm_state.shape[1:], dtype=ssm_state.dtype, device=device)
            conv_rows, ssm_rows = conv_rows[skip:].detach(), ssm_rows[skip:].detach()
            with torch.inference_mode():
                zxbcdt = torch.zeros(b, width, dtype=mixer.in_proj.weight.dtype, device=device)
                if b > 1:  # one graph for every batch size >= 2
                    for t in (zxbcdt, conv_rows, ssm_rows):
                        torch._dynamo.mark_dynamic(t, 0)
                self._step(*self._args(mixer, zxbcdt, conv_rows, ssm_rows))

    def __call__(
        self,
        mixer: Mamba2Mixer,
        zxbcdt: torch.Tensor,
        ctx: ForwardContext,
        conv_state: torch.Tensor,
        ssm_state: torch.Tensor,
    ) -> torch.Tensor:
        runs = slot_runs(ctx)
        with torch.compiler.set_stance(self.stance):
            if len(runs) <= MAX_RUNS:  # step the pool rows in place, one call per run of slots
                outs = []
                for row, slot, n in runs:
                    # detached aliases, not views: a view's guards would check its base (the whole pool)
                    conv_rows, ssm_rows = conv_state[slot : slot + n].detach(), ssm_state[slot : slot + n].detach()
                    outs.append(self._step(*self._args(mixer, zxbcdt[row : row + n], conv_rows, ssm_rows)))
                return outs[0] if len(outs) == 1 else torch.cat(outs)
            rows = ctx.decode_state_slots
            with torch.inference_mode(False):  # ordinary tensors, as the pools' aliases: the same graphs
                conv_rows, ssm_rows = conv_state.index_select(0, rows), ssm_state.index_select(0, rows)
            out = self._step(*self._args(mixer, zxbcdt, conv_rows, ssm_rows))
        conv_state.index_copy_(0, rows, conv_rows)
        ssm_state.index_copy_(0, rows, ssm_rows)
        return out


class DecodeCompiler:
    """Compiles a model's Mamba decode step in a background thread and attaches it when ready.

    States: "compiling" (eager meanwhile), "ready" (compiled, not yet attached), "attached", or
    "failed: ..." (eager for good; the reason is logged)."""

    def __init__(
        self, model: torch.nn.Module, states: list[tuple[torch.Tensor, torch.Tensor]], threads: tuple[int, ...] = ()
    ) -> None:
        """`threads`: the thread counts decode steps run on (module docstring); none: the current one."""
        from gpu_worker.model.mamba2 import Mamba2Mixer

        self._mixers = [m for m in model.modules() if isinstance(m, Mamba2Mixer)]
        self._states = states
        self._threads = threads or (torch.get_num_threads(),)
        self._compiled: CompiledMambaDecode | None = None
        self._done = threading.Event()
        self.status = "compiling" if self._mixers else "failed: the model has no Mamba layers"
        self.seconds = 0.0  # how long the compile took, once it ended
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if not self._mixers:
            self._done.set()
            return
        self._thread = threading.Thread(target=self._compile, name="decode-compile", daemon=True)
        self._thread.start()

    def _compile(self) -> None:
        started = time.perf_counter()
        try:
            compiled = CompiledMambaDecode(mixer_dims(self._mixers[0]))
            conv, ssm = self._states[0]
            # four graphs a thread count (CompiledMambaDecode.warm_up)
            with torch._dynamo.config.patch(recompile_limit=max(8, 4 * len(self._threads))):
                for count in self._threads:
                    with on_threads(count):
                        compiled.warm_up(self._mixers[0], conv, ssm)
            self.seconds = time.perf_counter() - started
            self._compiled, self.status = compiled, "ready"
            log.info("compiled the Mamba decode step in %.1f s", self.seconds)
        except Exception as exc:  # a missing toolchain, an inductor limit: decode stays eager
            self.seconds = time.perf_counter() - started
            self.status = f"failed: {type(exc).__name__}: {exc}"[:300]
            log.warning("decode compile failed after %.1f s, decoding eagerly: %s", self.seconds, self.status)
        finally:
            self._done.set()

    def wait(self, timeout_s: float | None = None) -> bool:
        """Blocks until the compile ended (ready or failed); True when it did within `timeout_s`."""
        return self._done.wait(timeout_s)

    @property
    def compiled(self) -> CompiledMambaDecode | None:
        """The compiled step once ready (what `attach_if_ready` attaches)."""
        return self._compiled

    def attach_if_ready(self) -> bool:
        """Called by the engine thread between steps: points every mixer at the compiled step once it
        is ready. True when attached."""
        if self.status == "attached":
            return True
        if self._compiled is None:
            return False
        for mixer in self._mixers:
            mixer.fused_decode = self._compiled
        self.status = "attached"
        return True
