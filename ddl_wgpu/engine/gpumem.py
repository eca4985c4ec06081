"""GPU memory budgets: `--gpu-memory SIZE` read (`budget`, through `runtime.sizes.parse_size`), what a job's GPU
objects would allocate measured without allocating it (`DryGpu`), and the plan a trunk job runs by (`TrunkPlan`,
`plan_trunk`).

wgpu reports no adapter's memory, so the engine cannot ask the card how much it has: the user says it
(`--gpu-memory 16GB`, or the environment's DDL_WGPU_GPU_MEMORY), and the jobs whose trunk is frozen and batched
(heal's teacher pass, accept's trunk pass, eval) plan within it (docs/heal.md#the-gpu-memory-plan):

- resident: every layer's weights uploaded once, windows in blocks of BLOCK_TOKENS;
- streamed: the embedding, final norm and head resident, two layer slots that each layer's weights pass
  through in turn (`stream.Trunk`), windows in the largest block that fits (at most MAX_BLOCK_TOKENS).

The resident plan is taken when it fits with a full block; else the streamed one; a budget that cannot hold
even the streamed trunk with one window is refused in one line that names the least budget the plan takes (found
by searching the plan itself, `least_budget`, and spelt so that the option reads it back: `sizes.size_text`), or,
where the adapter's buffer or binding limits cannot hold even one window whatever the budget, says that the
limits are the cause. Without a budget the plan is resident, as before. What a plan would allocate is counted
by building the job's real GPU objects on a `DryGpu`: the same constructors, every buffer and bind-group size
checked against the adapter's limits, but nothing allocated, compiled or uploaded; the count is therefore exact for what those constructors allocate (the tests compare
it with a real build), and a block the adapter's binding limits cannot hold is never planned.

The budget covers the engine's buffers (parameters, activations, the upload staging), the read-back staging
(as large as the largest download) and a reserve of RESERVE_FRACTION of it for what wgpu keeps beside them
(uniforms, pipelines, bind groups); not the driver's own context (a few hundred MiB on a discrete GPU) nor what
other programs hold: the user leaves that out of the budget (docs/heal.md#choosing-the-budget). Sizes are
binary: 16GB, 16G and 16GiB are 16 x 2^30 bytes (a "16 GB" card holds 16 GiB); every size option and variable
reads them through `runtime.sizes`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from ddl_wgpu.runtime.sizes import LEAST, SizeError, from_env, parse_size, size_text

__all__ = ["ENV_GPU_MEMORY", "GpuBudgetError", "SizeError", "budget", "check_decode", "least_budget", "parse_size",
           "plan_trunk", "size_text"]  # fmt: skip

ENV_GPU_MEMORY = "DDL_WGPU_GPU_MEMORY"
# windows per block: a resident block holds BLOCK_TOKENS tokens (heal's trunk pass ran 4 x 128 before: the
# GEMMs of a 64-window block run near the 16 x 1024 forward's rate); a streamed block up to MAX_BLOCK_TOKENS
# (each pass over the layers uploads every weight once per block: a bigger block spreads that further)
BLOCK_TOKENS = 8192
MAX_BLOCK_TOKENS = 32768
RESERVE_FRACTION = 0.05  # of the budget, for what wgpu and the driver allocate beside the engine's buffers


class GpuBudgetError(SizeError):
    """A budget a job cannot run within, or that the adapter's limits make moot (one line)."""


def budget(option: str | None) -> int | None:
    """The GPU memory budget in bytes: the option, else the environment's DDL_WGPU_GPU_MEMORY, else None (no
    budget: every trunk resident). Every command reads it here, before anything else, whatever its backend: a
    value it cannot read is refused even where no plan would use it."""
    if option not in (None, ""):
        return parse_size(option)
    return from_env(ENV_GPU_MEMORY)


def gib(n: float) -> str:
    """A size for people: GiB from 1 GiB up, else MiB (KiB below one)."""
    for unit, shift in (("GiB", 30), ("MiB", 20)):
        if n >= 1 << shift:
            return f"{n / 2**shift:.2f} {unit}"
    return f"{n / 2**10:.1f} KiB"


def reserve_bytes(budget_bytes: int) -> int:
    """What the plan keeps out of a budget for wgpu beside the engine's buffers (module docstring)."""
    return int(RESERVE_FRACTION * budget_bytes)


def least_budget(accepts: Callable[[int], bool], start: int) -> int:
    """The least budget in bytes that `accepts` (a plan run on that budget: True when it plans, False when it
    refuses) takes, searched from `start` (a budget it refused): doubling up to one it takes, then halving the
    gap. The plan itself decides, so the size a refusal names is one the same plan then takes (the acceptance
    only grows with the budget: every test the plan makes is "bytes <= what the budget leaves")."""
    lo, hi = max(int(start), 0), max(int(start), 1 << 10)
    while not accepts(hi):
        lo, hi = hi, hi * 2
        if hi > 1 << 62:
            raise AssertionError("no budget is accepted")
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if accepts(mid):
            hi = mid
        else:
            lo = mid
    return hi


def _named(accepts: Callable[[int], bool], refused: int) -> str:
    """The least budget a plan takes, as the option reads it (`size_text`, checked to be taken)."""
    text = size_text(max(least_budget(accepts, refused), LEAST))  # never below what the option reads
    assert accepts(parse_size(text)), text  # what the refusal names, the plan takes
    return text


# ----------------------------------------------------------------------------------------------------------
# counting without allocating


class _DryBuffer:
    """What a `DryGpu` hands out for a buffer: its size and label, nothing on a device."""

    def __init__(self, size: int, label: str):
        self.size, self.label = size, label

    def destroy(self) -> None:
        pass


class DryGpu:
    """A stand-in for `gpu.Gpu` while a job's GPU objects are built to count them: the real device's limits,
    features and name; `buffer`/`upload`/`external` count bytes (`live`, `peak`, checked against
    max-buffer-size as the real one does), `bind` checks every binding against the storage-binding limit as the
    real one does, kernels are not compiled and nothing is written. Any read-back or submit is an error (a
    constructor that ran one would be counted wrong)."""

    dry = True

    def __init__(self, gpu):
        from ddl_wgpu.runtime.gpu import GpuError

        self._error = GpuError
        self.real = gpu
        for name in (
            "limits",
            "features",
            "info",
            "max_binding",
            "max_buffer",
            "align",
            "limits_mode",
            "runtime_name",
            "matrix_configs",
            "host_buffers",
        ):
            setattr(self, name, getattr(gpu, name))
        self.name = gpu.name
        self.live = self.peak = self.allocated = 0
        self.memory_cap = None
        self._kernels: dict = {}
        self._staging = None

    def buffer(self, nbytes: int, label: str = "", usage=None):
        size = max(16, (int(nbytes) + 15) // 16 * 16)
        if size > self.max_buffer:
            raise self._error(f"buffer {label!r} of {size} bytes exceeds this adapter's max-buffer-size "
                              f"{self.max_buffer}")  # fmt: skip
        self.allocated += size
        self.live += size
        self.peak = max(self.peak, self.live)
        return _DryBuffer(size, label)

    def external(self, nbytes: int) -> None:
        """As `Gpu.external`: bytes wgpu allocates beside our buffers, counted."""
        self.live += int(nbytes)
        self.peak = max(self.peak, self.live)

    def upload(self, array, label: str = ""):
        import numpy as np

        return self.buffer(np.asarray(array).nbytes, label)

    def upload_ranges(self, arrays):
        from ddl_wgpu.runtime.gpu import Gpu

        return Gpu.upload_ranges(self, arrays)  # its layout, on this stand-in's `buffer`

    def release(self, *bufs) -> None:
        for b in bufs:
            self.live -= b.size

    def reserve_staging(self, nbytes: int) -> None:
        """The read-back staging a download of `nbytes` grows to, as `Gpu.reserve_staging`."""
        from ddl_wgpu.runtime.gpu import READBACK_MAX

        n = min(int(nbytes), min(self.max_buffer, READBACK_MAX))
        size = max((n + 3) // 4 * 4, 1 << 16)
        if self._staging is None or self._staging.size < size:
            if self._staging is not None:
                self.release(self._staging)
            self._staging = self.buffer(size, "staging")

    def drop_scratch(self) -> None:
        """As `Gpu.drop_scratch`: the staging and the launchers' device-wide scratch let go."""
        from ddl_wgpu.runtime.gpu import SCRATCH_CACHES

        if self._staging is not None:
            self.release(self._staging)
            self._staging = None
        for name in SCRATCH_CACHES:
            held = self.__dict__.pop(name, {})
            self.release(*(held.values() if isinstance(held, dict) else [held]))

    def uniform(self, layout, *, label: str = "params", **fields):
        return _DryBuffer(len(layout.pack(**fields)), label)

    def write(self, buf, array, offset: int = 0) -> None:
        pass

    def write_uniform(self, buf, layout, **fields) -> None:
        pass

    def write_fields(self, buf, layout, **fields) -> None:
        pass

    def kernel(self, file: str, entry: str, sig: str, constants=None, templates=None, workgroup=(64, 1, 1),
               uniforms=()):  # fmt: skip
        from ddl_wgpu.runtime.gpu import Kernel

        return Kernel(name=f"{file}:{entry}", sig=sig, workgroup=workgroup, pipeline=None, layout=None)

    def bind(self, kernel, *resources):
        if len(resources) != len(kernel.sig):
            raise self._error(f"{kernel.name}: {len(resources)} buffers given, signature {kernel.sig!r}")
        for i, r in enumerate(resources):
            size = r[2] if isinstance(r, tuple) else r.size
            if size > self.max_binding and kernel.sig[i] != "u":
                raise self._error(f"{kernel.name}: binding {i} ({size} bytes) exceeds the storage binding limit "
                                  f"{self.max_binding}; bind such a tensor in row chunks")  # fmt: skip
        return None

    def _no(self, *a, **k):
        raise self._error("a dry run (DryGpu) counts buffers; it cannot record, submit or read back")

    recorder = download = read = wait = run = _no


def dry_bytes(gpu, build) -> int:
    """The most bytes `build(dry_gpu)` has alive at once, counted on a `DryGpu` of `gpu` (nothing allocated)."""
    dry = DryGpu(gpu)
    build(dry)
    return dry.peak


# ----------------------------------------------------------------------------------------------------------
# the plan of a trunk job


@dataclass(frozen=True)
class TrunkPlan:
    """How a trunk job runs: `streamed` or resident, `block` windows of `window` tokens per pass over the
    layers (of `windows` in all), and the bytes it is expected to allocate: the trunk phase (`trunk_bytes`:
    `weight_bytes` of weights, the rest activations and staging) and, for heal, the draft's phase after the
    trunk's weights are released (`draft_bytes`); the peak is the larger. `budget_bytes` None: no budget."""

    job: str
    streamed: bool
    block: int
    windows: int
    window: int
    weight_bytes: int
    trunk_bytes: int
    draft_bytes: int = 0
    budget_bytes: int | None = None
    dtype: str = "f32"

    @property
    def peak_bytes(self) -> int:
        return max(self.trunk_bytes, self.draft_bytes)

    @property
    def blocks(self) -> int:
        return -(-self.windows // self.block)

    def line(self) -> str:
        """The plan a job prints at its start (one line)."""
        how = (
            "streamed (2 layer slots; embedding, final norm and head resident)"
            if self.streamed
            else "resident"
        )
        budget = (
            f"budget {gib(self.budget_bytes)}" if self.budget_bytes is not None else "no --gpu-memory budget"
        )
        draft = f", draft {gib(self.draft_bytes)}" if self.draft_bytes else ""
        return (f"gpu memory plan: {self.job} trunk {how}, {self.dtype}; blocks of {self.block} windows x "
                f"{self.window} tokens ({self.blocks} pass{'es' if self.blocks != 1 else ''} over the layers); "
                f"estimated peak {gib(self.peak_bytes)} (trunk {gib(self.trunk_bytes)}: weights "
                f"{gib(self.weight_bytes)}{draft}); {budget}")  # fmt: skip

    def to_dict(self) -> dict:
        return {"job": self.job, "mode": "streamed" if self.streamed else "resident", "block_windows": self.block,
                "windows": self.windows, "window": self.window, "blocks": self.blocks, "dtype": self.dtype,
                "weight_bytes": self.weight_bytes, "trunk_bytes": self.trunk_bytes, "draft_bytes": self.draft_bytes,
                "peak_bytes": self.peak_bytes, "budget_bytes": self.budget_bytes}  # fmt: skip


def even_block(windows: int, most: int, multiple: int = 1) -> int:
    """Windows per block: at most `most` (a multiple of `multiple`), as even as the passes allow (156 windows in
    blocks of at most 67 run as 3 x 52, not 67 + 67 + 22 padded to 67)."""
    most = max(multiple, most // multiple * multiple)
    passes = -(-windows // most)
    per = -(-windows // passes)
    return min(most, -(-per // multiple) * multiple)


def plan_trunk(job: str, windows: int, window: int, budget_bytes: int | None, trunk_bytes, weight_bytes,
               draft_bytes: int = 0, multiple: int = 1, dtype: str = "f32") -> TrunkPlan:  # fmt: skip
    """The plan of a trunk job over `windows` windows of `window` tokens (module docstring). `trunk_bytes(streamed,
    block)` counts the trunk phase (a `dry_bytes` build; GpuError when the adapter's limits cannot hold that
    block); `weight_bytes(streamed)` its weights; `draft_bytes` the draft's phase (heal); blocks are multiples of
    `multiple` windows (eval's batches). GpuBudgetError when nothing fits: naming the least budget this same plan
    takes (`least_budget` over `attempt`), or the adapter's limits where no budget would do."""
    from ddl_wgpu.runtime.gpu import GpuError

    counted: dict[
        tuple[bool, int], int | None
    ] = {}  # each build counted once: the search re-plans many budgets
    limits: list[str] = []  # what the adapter refused, for the message that blames its limits

    def cap(tokens: int) -> int:
        return max(multiple, min(-(-windows // multiple) * multiple, tokens // window // multiple * multiple))

    def count(streamed: bool, block: int) -> int | None:
        if (streamed, block) not in counted:
            try:
                counted[streamed, block] = trunk_bytes(streamed, block)
            except GpuError as e:  # a block the adapter's binding or buffer limits cannot hold
                counted[streamed, block] = None
                limits.append(str(e))
        return counted[streamed, block]

    def plan(streamed: bool, block: int, used: int, budget: int | None) -> TrunkPlan:
        return TrunkPlan(job, streamed, block, windows, window, weight_bytes(streamed), used, draft_bytes,
                         budget, dtype)  # fmt: skip

    def largest(streamed: bool, most: int, room: float) -> tuple[int, int] | None:
        """The largest block <= most (even, a multiple) whose count fits `room`, and its count."""
        lo, hi, best = 1, most // multiple, None
        while lo <= hi:  # the count grows with the block
            mid = (lo + hi) // 2
            block = even_block(windows, mid * multiple, multiple)
            used = count(streamed, block)
            if used is not None and used <= room:
                best, lo = (block, used), mid + 1
            else:
                hi = mid - 1
        return best

    full = even_block(windows, cap(BLOCK_TOKENS), multiple)

    def attempt(budget: int) -> tuple[bool, int, int] | str:
        """The plan's choice within `budget` bytes (streamed, block, bytes), or what it cannot hold ("trunk",
        "draft")."""
        room = budget - reserve_bytes(budget)
        used = count(False, full)
        if used is not None and used <= room and draft_bytes <= room:
            return False, full, used
        found = largest(True, cap(MAX_BLOCK_TOKENS), room)
        if found is None:
            return "trunk"
        return "draft" if draft_bytes > room else (True, *found)

    if budget_bytes is None:  # no budget: resident, in the largest block the adapter's limits hold
        used = count(False, full)
        found = (full, used) if used is not None else largest(False, full, math.inf)
        if found is None:
            raise GpuBudgetError(f"{job}: this adapter's buffer and binding limits cannot hold the trunk with even "
                                 f"one window of {window} tokens ({limits[-1]}): the limits are the cause",
                                 kind="adapter_limits")  # fmt: skip
        return plan(False, *found, None)
    chosen = attempt(budget_bytes)
    if not isinstance(chosen, str):
        return plan(*chosen, budget_bytes)
    if count(False, full) is None and count(True, multiple) is None:  # no budget holds it: the limits do not
        raise GpuBudgetError(f"{job}: this adapter's buffer and binding limits cannot hold the trunk with even "
                             f"one window of {window} tokens, resident or streamed ({limits[-1]}): the limits are "
                             f"the cause, not --gpu-memory {gib(budget_bytes)}, and no budget changes them",
                             kind="adapter_limits")  # fmt: skip
    least = _named(lambda b: not isinstance(attempt(b), str), budget_bytes)
    if chosen == "trunk":
        raise GpuBudgetError(f"--gpu-memory {gib(budget_bytes)} is below what the streamed trunk needs for one "
                             f"layer at a time (the resident embedding and head, two layer slots and {multiple} "
                             f"window{'s' if multiple > 1 else ''} of activations): this job needs at least "
                             f"--gpu-memory {least}")  # fmt: skip
    less = " (a smaller --batch needs less)" if job == "heal" else ""
    raise GpuBudgetError(f"--gpu-memory {gib(budget_bytes)} cannot hold {job}'s draft after the trunk: this job "
                         f"needs at least --gpu-memory {least}{less}")  # fmt: skip


# ----------------------------------------------------------------------------------------------------------
# generate: every weight read once per token, so nothing streams


def weight_bytes(cfg, dtype: str = "f32", draft: bool = False) -> int:
    """Bytes of a model's weights laid out on a GPU (`layout.plan`: 256-byte aligned, the f16 matrices of an
    f16 net in f16), its MTP draft's with `draft`: the least a decoding engine holds (its caches come on top)."""
    import dataclasses

    from ddl_ref.params import param_table
    from ddl_wgpu.engine import layout

    if not draft:
        cfg = dataclasses.replace(cfg, mtp=None)
    return sum(layout.plan(param_table(cfg), 1 << 62, dtype=dtype).arena_sizes)


def check_decode(cfg, dtype: str, budget_bytes: int | None, draft: bool = False) -> None:
    """GpuBudgetError unless the model's weights fit the budget (`generate` reads every weight once per token:
    a model that does not fit cannot stream at a useful speed), naming the least budget this check takes."""
    if budget_bytes is None:
        return
    need = weight_bytes(cfg, dtype, draft)

    def fits(budget: int) -> bool:
        return need <= budget - reserve_bytes(budget)

    if not fits(budget_bytes):
        what = f"{dtype} weights" + (" with the draft" if draft else "")
        raise GpuBudgetError(f"generate: the model needs at least --gpu-memory {_named(fits, budget_bytes)} ({what} "
                             f"{gib(need)}, before its caches); --gpu-memory is {gib(budget_bytes)}"
                             + ("" if dtype == "f16" else "; --trunk-dtype f16 halves the big matrices"))  # fmt: skip
