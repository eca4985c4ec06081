"""`ProfileRecorder`: a `ddl_wgpu.runtime.gpu.Recorder` that times every dispatch on its own, for
`bench/train_step.py --profile` and `bench/heal.py --gpu-memory SIZE --profile` (GPU ms per phase and shader
family). A benchmark's instrument, so it lives here and not in the device layer.
"""

from __future__ import annotations

import numpy as np
import wgpu

from ddl_wgpu.runtime.gpu import Gpu, GpuError, Kernel, Recorder, grid


class ProfileRecorder(Recorder):
    """A Recorder for benchmarks that times every dispatch: each one gets its own compute pass with a begin
    and an end timestamp, and `profile()` returns GPU ms per kernel (`file:entry`, or the launch's bind-group
    label where its launcher gave one: gemv's shape and weight bytes) after `submit()`. The
    pass boundaries serialise dispatches the driver might otherwise overlap a little, so the sum can exceed
    a plain recording's elapsed time by a few percent; it shows where the time goes, not the step's time.
    Set `phase` before recording a part (e.g. "forward"): keys are then "phase|file:entry"."""

    PER_SET = 2048  # dispatches per query set (4096 timestamps, Vulkan's usual pool limit)

    def __init__(self, gpu: Gpu):
        super().__init__(gpu, timestamps=False)
        if "timestamp-query" not in gpu.features:
            raise GpuError("profiling needs the adapter feature timestamp-query")
        self.names: list[str] = []
        self.grids: list[tuple] = []
        # (name, grid, ms) of every dispatch, in order, after `profile()` (not `timed`: Recorder's flag for a
        # recording timed whole, which `finish` and `elapsed_ms` read)
        self.dispatch_ms: list[tuple] = []
        self.sets: list = []
        self.phase = ""

    def dispatch_all(self, dispatches):
        for kernel, bind_group, groups in dispatches:
            self.dispatch(kernel, bind_group, groups)

    def dispatch(self, kernel: Kernel, bind_group, groups):
        if isinstance(groups, int):
            groups = grid(groups)
        self._close()
        i = len(self.names) % self.PER_SET
        if i == 0:
            self.sets.append(
                self.gpu.device.create_query_set(type=wgpu.QueryType.timestamp, count=2 * self.PER_SET)
            )
        p = self.enc.begin_compute_pass(
            timestamp_writes={"query_set": self.sets[-1], "beginning_of_pass_write_index": 2 * i,
                              "end_of_pass_write_index": 2 * i + 1}
        )  # fmt: skip
        p.set_pipeline(kernel.pipeline)
        p.set_bind_group(0, bind_group)
        p.dispatch_workgroups(*groups)
        p.end()
        name = (
            getattr(bind_group, "label", "") or kernel.name
        )  # a launcher's label (gemv: its shape and bytes)
        self.names.append(f"{self.phase}|{name}" if self.phase else name)
        self.grids.append(tuple(groups))
        self.n_dispatches += 1

    def finish(self):
        self.bufs = []
        for j, qs in enumerate(self.sets):
            n = min(self.PER_SET, len(self.names) - j * self.PER_SET)
            buf = self.gpu.device.create_buffer(
                size=16 * n, usage=wgpu.BufferUsage.QUERY_RESOLVE | wgpu.BufferUsage.COPY_SRC
            )
            self.enc.resolve_query_set(qs, 0, 2 * n, buf, 0)
            self.bufs.append((buf, n))
        return super().finish()

    def profile(self) -> dict[str, float]:
        """GPU ms per kernel name, summed over its dispatches (waits for the GPU); each dispatch's own in
        `dispatch_ms`."""
        period = self.gpu.timestamp_period_ns() / 1e6
        out: dict[str, float] = {}
        self.dispatch_ms = []
        k = 0
        for buf, n in self.bufs:
            t = self.gpu.download(buf, np.uint64, 2 * n).reshape(n, 2)
            for begin, end in t:
                name, ms = self.names[k], float(end - begin) * period
                out[name] = out.get(name, 0.0) + ms
                self.dispatch_ms.append((name, self.grids[k], ms))
                k += 1
        return out


def profile_parts(gpu: Gpu, parts, timed: list | None = None) -> dict[str, float]:
    """GPU ms per "phase|kernel" of the recordings `parts`, [(phase, record(rec))] in order, every dispatch timed
    alone (a copy between them closes its pass as in a plain Recorder); `timed` (a list) gets each dispatch's
    (name, grid, ms)."""
    rec = ProfileRecorder(gpu)
    for phase, record in parts:
        rec.phase = phase
        record(rec)
    rec.submit()
    out = rec.profile()
    if timed is not None:
        timed += rec.dispatch_ms
    return out


def phase_totals(profile: dict[str, float]) -> dict[str, float]:
    """GPU ms per phase of a `profile_parts` profile."""
    out: dict[str, float] = {}
    for key, ms in profile.items():
        phase = key.split("|", 1)[0]
        out[phase] = out.get(phase, 0.0) + ms
    return out
