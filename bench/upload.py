"""Host -> GPU upload bandwidth (GB/s) of one tensor the size of a Qwen3.8-27B layer (810 MiB, 0.85 GB), in each
way the runtime offers: what a streamed trunk's pass is bound by once its products run on the tensor cores
(at 4,000 tokens/s a 16 GiB block of ~10K tokens computes in ~2.5 s but uploads 54 GB).

    python3 bench/upload.py                             # 810 MiB, every mode of the runtime in use
    DDL_WGPU_RUNTIME=dawn python3 bench/upload.py       # with Dawn's host-mapped pointer
    python3 bench/upload.py --mb 256 --repeats 9 --threads 1
    python3 bench/upload.py --cold                      # the file's pages dropped from the page cache first
    python3 bench/upload.py --quick                     # 8 MiB (lavapipe: runs end to end)

The modes, each into one device-local buffer (STORAGE | COPY_DST, as a layer slot), from the same random bytes:

- `write_buffer`: `queue.write_buffer` in pieces of 16 MiB (stream.PIECE_BYTES), then a submit and a wait:
  today's path (Dawn and wgpu-native copy each piece into staging of their own, then the GPU copies it);
- `staging-new`: a MAP_WRITE | COPY_SRC buffer mapped at creation, filled, unmapped and copied with
  `copy_buffer_to_buffer`, a new buffer each upload (its creation timed apart);
- `staging-ring`: one such buffer kept, mapped again (`map_sync("WRITE")`) for each upload (the wait for the
  map timed apart); a ring of these stalled inside the trunk's stream on the H200 (docs/experiments.md);
- `host-pointer` (Dawn, feature `host-mapped-pointer`): pages of `extras.allocate_host_memory` wrapped once by
  `extras.create_buffer_from_host_memory`, filled from the array (and, timed apart, from an np.memmap of a
  file: the checkpoint's case), then copied by the GPU from those pages (DMA, no staging of Dawn's);
- `host-pointer-file` / `-file-shared` (Dawn): the file's own pages wrapped, no copy of ours: the pages holding
  the tensor mapped (MAP_PRIVATE as a read-only checkpoint allows; MAP_SHARED, which needs a writable file),
  wrapped, and the GPU copies the tensor out of them at its offset; the wrap is per upload (a checkpoint's
  tensors), timed apart.

Fills (`staging-*`, `host-pointer`) copy 16 MiB spans on `--threads` threads (np.copyto, which lets go of the
GIL), as the trunk's pool would. The file is written once into `--dir` with the tensor at 4096 + 64 bytes (a
tensor of a checkpoint starts at a multiple of 64, not of a page), and is read from the page cache unless
`--cold` (posix_fadvise DONTNEED before each read).

Printed per mode, the best of `--repeats` (after one warm-up upload): end-to-end GB/s and each part's GB/s (the
host's fill, the GPU's copy), the other parts in seconds; a mode this runtime or adapter lacks prints "-" with
the reason. Each upload is checked: the destination is cleared before it, and a sample of it (first and last
4 KiB, six windows between) read back and compared byte for byte after; a mismatch exits 1. JSON as
docs/benchmarks.md says (--json, else $OUT/upload.json, else bench/results/).

What this does not do: overlap an upload with compute (`bench/heal.py --gpu-memory` runs the streamed pass),
or time with GPU timestamps: the host's wall clock from the first call to the wait's return is what a
streamed layer waits for.
"""

from __future__ import annotations

import argparse
import faulthandler
import mmap
import os
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402
from common import adapter_line, fmt, host_info, json_path, now_iso, open_gpu, table, write_json  # noqa: E402

from ddl_wgpu.engine.stream import PIECE_BYTES  # noqa: E402

# MiB: a Qwen3.8-27B layer in f16 (0.85 GB, docs/experiments.md "Streaming the trunk's weights")
LAYER_MB = 810
QUICK_MB = 8
SPAN = 16 << 20  # a fill thread's copy
FILE_OFFSET = 4096 + 64  # where the tensor starts in the file: 64-aligned as a checkpoint's, not page-aligned
SAMPLE = 4096  # bytes of each window read back
MODES = ("write_buffer", "staging-new", "staging-ring", "host-pointer", "host-pointer-file",
         "host-pointer-file-shared")  # fmt: skip
HOST_POINTER = "host-mapped-pointer"


class Mismatch(Exception):
    """The bytes read back are not the bytes uploaded."""


class Unavailable(Exception):
    """The mode does not exist on this runtime or adapter (printed as "-" with the reason)."""


class Bench:
    def __init__(self, gpu, src: np.ndarray, path: Path, threads: int, cold: bool):
        import wgpu

        self.gpu, self.src, self.n, self.path, self.cold = gpu, src, src.nbytes, path, cold
        self.wgpu = wgpu
        self.pool = ThreadPoolExecutor(threads, thread_name_prefix="fill") if threads > 1 else None
        self.dst = gpu.buffer(self.n, label="upload_dst")
        rng = np.random.default_rng(1)
        inner = rng.integers(1, max(2, (self.n - SAMPLE) // 4), 6) * 4
        self.windows = sorted({0, max(0, self.n - SAMPLE), *(int(x) for x in inner)})
        self.extras = None
        if gpu.runtime_name == "dawn":
            from wgpudawn.backends.dawn import extras

            self.extras = extras
        self.keep: dict = {}  # buffers a mode keeps between uploads (staging-ring's, host-pointer's)

    # -- helpers ------------------------------------------------------------------------------------------

    def fill(self, dst: np.ndarray, src: np.ndarray) -> None:
        """dst[:] = src, in SPAN pieces on the threads."""
        if self.pool is None:
            np.copyto(dst, src)
            return
        spans = [(lo, min(src.size, lo + SPAN)) for lo in range(0, src.size, SPAN)]
        list(self.pool.map(lambda s: np.copyto(dst[s[0] : s[1]], src[s[0] : s[1]]), spans))

    def copy_wait(self, src_buf, src_offset: int = 0) -> None:
        enc = self.gpu.device.create_command_encoder()
        enc.copy_buffer_to_buffer(src_buf, src_offset, self.dst, 0, self.n)
        self.gpu.queue.submit([enc.finish()])
        self.gpu.wait()

    def clear(self) -> None:
        enc = self.gpu.device.create_command_encoder()
        enc.clear_buffer(self.dst)
        self.gpu.queue.submit([enc.finish()])
        self.gpu.wait()

    def verify(self, what: str) -> None:
        for lo in self.windows:
            k = min(SAMPLE, self.n - lo)
            got = self.gpu.download(self.dst, np.uint8, k, lo)
            if not np.array_equal(got, self.src[lo : lo + k]):
                bad = int(np.flatnonzero(got != self.src[lo : lo + k])[0]) + lo
                raise Mismatch(f"{what}: byte {bad} of the destination differs from the source")

    def file_map(self) -> np.memmap:
        """The tensor in the file, as a checkpoint's reader maps it; its pages dropped first with --cold."""
        if self.cold:
            self.drop_cache()
        return np.memmap(self.path, np.uint8, "r", offset=FILE_OFFSET, shape=(self.n,))

    def drop_cache(self) -> None:
        fd = os.open(self.path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)

    def need_host_pointer(self) -> None:
        if self.extras is None:
            raise Unavailable(f"wgpu-native has no host-mapped pointer (runtime {self.gpu.runtime_name}; "
                              f"DDL_WGPU_RUNTIME=dawn)")  # fmt: skip
        if HOST_POINTER not in self.gpu.features:
            raise Unavailable(f"the adapter lacks Dawn's feature {HOST_POINTER}")

    # -- the modes: each uploads self.src into self.dst once -> {part: seconds} ----------------------------

    def write_buffer(self) -> dict:
        mv = memoryview(self.src)
        t0 = time.perf_counter()
        for lo in range(0, self.n, PIECE_BYTES):
            self.gpu.queue.write_buffer(self.dst, lo, mv[lo : lo + PIECE_BYTES])
        t1 = time.perf_counter()
        self.gpu.queue.submit([self.gpu.device.create_command_encoder().finish()])  # carries the writes
        self.gpu.wait()
        t2 = time.perf_counter()
        return {"total": t2 - t0, "write_calls": t1 - t0, "submit_wait": t2 - t1}

    def _mapped(self, buf) -> np.ndarray:
        # the mapped range as an array, so that the threads can fill it (`write_mapped` is one memcpy)
        return np.frombuffer(buf._experimental_get_mapped_range(0, self.n), np.uint8)

    def staging_new(self) -> dict:
        U = self.wgpu.BufferUsage
        t0 = time.perf_counter()
        stg = self.gpu.device.create_buffer(
            size=self.n, usage=U.MAP_WRITE | U.COPY_SRC, mapped_at_creation=True
        )
        t1 = time.perf_counter()
        fill, copy = self._fill_unmap_copy(stg)
        stg.destroy()
        return {"total": time.perf_counter() - t0, "create": t1 - t0, "fill": fill, "copy": copy}

    def staging_ring(self) -> dict:
        U = self.wgpu.BufferUsage
        if "ring" not in self.keep:
            self.keep["ring"] = self.gpu.device.create_buffer(size=self.n, usage=U.MAP_WRITE | U.COPY_SRC)
        stg = self.keep["ring"]
        t0 = time.perf_counter()
        stg.map_sync(self.wgpu.MapMode.WRITE, 0, self.n)
        t1 = time.perf_counter()
        fill, copy = self._fill_unmap_copy(stg)
        return {"total": time.perf_counter() - t0, "map": t1 - t0, "fill": fill, "copy": copy}

    def _fill_unmap_copy(self, stg) -> tuple[float, float]:
        """Both staging modes' second half: fill the mapped buffer, unmap it, copy it to the destination and
        wait; the seconds of the fill and of the copy."""
        t0 = time.perf_counter()
        self.fill(self._mapped(stg), self.src)
        t1 = time.perf_counter()
        stg.unmap()
        self.copy_wait(stg)
        return t1 - t0, time.perf_counter() - t1

    def host_pointer(self) -> dict:
        """Fill from the file's map, copy (checked), then fill from the array (checked on the host)."""
        self.need_host_pointer()
        wrap = None
        if "host" not in self.keep:
            mem = self.extras.allocate_host_memory(self.gpu.device, self.n)
            t0 = time.perf_counter()
            buf = self.extras.create_buffer_from_host_memory(
                self.gpu.device, mem, usage=self.wgpu.BufferUsage.COPY_SRC, label="upload_host"
            )
            wrap = time.perf_counter() - t0
            self.keep["host"] = (np.frombuffer(mem, np.uint8)[: self.n], buf)
        host, buf = self.keep["host"]
        src = self.file_map()
        t0 = time.perf_counter()
        self.fill(host, src)
        t1 = time.perf_counter()
        self.copy_wait(buf)
        t2 = time.perf_counter()
        del src
        self.verify("host-pointer (filled from the file)")
        for lo in self.windows:  # so that the array's fill is checked, not the file's left over
            host[lo : lo + SAMPLE] = 0
        t3 = time.perf_counter()
        self.fill(host, self.src)
        t4 = time.perf_counter()
        for lo in self.windows:
            if not np.array_equal(host[lo : lo + SAMPLE], self.src[lo : lo + SAMPLE]):
                raise Mismatch(f"host-pointer: the host memory at {lo} is not the array after the fill")
        out = {"total": (t4 - t3) + (t2 - t1), "fill": t4 - t3, "fill_file": t1 - t0, "copy": t2 - t1,
               "total_file": t2 - t0}  # fmt: skip
        if wrap is not None:
            out["wrap_once"] = wrap
        return out

    def _file_pointer(self, shared: bool) -> dict:
        self.need_host_pointer()
        align = self.extras.get_host_memory_alignment(self.gpu.device)
        if align % mmap.ALLOCATIONGRANULARITY:
            raise Unavailable(f"the host-pointer alignment {align} is not a multiple of mmap's "
                              f"{mmap.ALLOCATIONGRANULARITY}")  # fmt: skip
        base = FILE_OFFSET // align * align  # the pages that hold the tensor
        length = -(-(FILE_OFFSET + self.n) // align) * align - base
        if self.cold:
            self.drop_cache()
        t0 = time.perf_counter()
        with open(self.path, "r+b" if shared else "rb") as f:
            access = mmap.ACCESS_WRITE if shared else mmap.ACCESS_COPY
            pages = mmap.mmap(f.fileno(), length, access=access, offset=base)
        t1 = time.perf_counter()
        buf = self.extras.create_buffer_from_host_memory(
            self.gpu.device, pages, usage=self.wgpu.BufferUsage.COPY_SRC, label="upload_file"
        )
        t2 = time.perf_counter()
        self.copy_wait(buf, FILE_OFFSET - base)
        t3 = time.perf_counter()
        buf.destroy()
        del buf
        self.extras.process_events()  # Dawn lets go of the pages (its dispose callback) once it has seen them idle
        return {"total": t3 - t0, "map": t1 - t0, "wrap": t2 - t1, "copy": t3 - t2}

    def host_pointer_file(self) -> dict:
        return self._file_pointer(shared=False)

    def host_pointer_file_shared(self) -> dict:
        return self._file_pointer(shared=True)

    def close(self) -> None:
        for v in self.keep.values():
            (v[1] if isinstance(v, tuple) else v).destroy()
        self.keep.clear()
        if self.pool is not None:
            self.pool.shutdown()


def measure(b: Bench, mode: str, repeats: int, watchdog: float) -> dict:
    """One warm-up upload and `repeats` timed ones, each checked -> {"seconds": {part: [s, ...]}} or the reason
    the mode is missing. A mode stuck past `watchdog` seconds dumps every thread's stack and ends the run
    (the mapped ring's stall on the H200 left nothing to read)."""
    once = getattr(b, mode.replace("-", "_"))
    seconds: dict = {}
    faulthandler.dump_traceback_later(watchdog, exit=True)
    try:
        for r in range(1 + repeats):
            b.clear()
            parts = once()
            b.verify(mode)
            if r:
                for k, v in parts.items():
                    seconds.setdefault(k, []).append(v)
    except Unavailable as e:
        return {"available": False, "reason": str(e)}
    finally:
        faulthandler.cancel_dump_traceback_later()
    return {"available": True, "seconds": seconds}


def write_file(path: Path, src: np.ndarray) -> None:
    """The tensor at FILE_OFFSET after zeros, the file padded to a whole 64 KiB (the host-pointer wrap takes
    whole pages of it, whatever the alignment up to that)."""
    with open(path, "wb") as f:
        f.write(b"\0" * FILE_OFFSET)
        f.write(memoryview(src))
        f.write(b"\0" * (-(FILE_OFFSET + src.nbytes) % (64 << 10)))
        f.flush()
        os.fsync(f.fileno())


def gbs(n: int, seconds: list | None) -> float | None:
    return n / min(seconds) / 1e9 if seconds else None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mb", type=int, default=None, help=f"MiB uploaded (default {LAYER_MB}: a 27B layer)")
    ap.add_argument("--quick", action="store_true", help=f"{QUICK_MB} MiB, 2 repeats (lavapipe)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=max(1, min(8, os.cpu_count() or 1)),
                    help="fill threads (default: the trunk pool's, min(8, cores))")  # fmt: skip
    ap.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of {', '.join(MODES)}")
    ap.add_argument(
        "--cold", action="store_true", help="drop the file's pages from the page cache before a read"
    )
    ap.add_argument(
        "--dir", default=None, help="where the file goes (default: the system's temporary folder)"
    )
    ap.add_argument(
        "--watchdog", type=float, default=300.0, help="seconds a mode may take before the run ends"
    )
    ap.add_argument("--device", default=None)
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    if a.quick:
        a.mb, a.repeats = a.mb or QUICK_MB, min(a.repeats, 2)
    modes = [m.strip() for m in a.modes.split(",") if m.strip()]
    if unknown := [m for m in modes if m not in MODES]:
        ap.error(f"unknown mode(s) {unknown}: of {', '.join(MODES)}")
    n = (a.mb or LAYER_MB) << 20
    gpu = open_gpu(a.device)
    print(adapter_line(gpu))
    if n > gpu.max_buffer:
        print(f"error: {n} bytes exceed the adapter's max-buffer-size {gpu.max_buffer}; use a smaller --mb",
              file=sys.stderr)  # fmt: skip
        return 2
    src = np.frombuffer(np.random.default_rng(0).bytes(n), np.uint8)
    results: dict = {}
    failed = []
    with tempfile.TemporaryDirectory(prefix="ddl-upload-", dir=a.dir) as tmp:
        path = Path(tmp) / "tensor.bin"
        write_file(path, src)
        b = Bench(gpu, src, path, a.threads, a.cold)
        try:
            for mode in modes:
                print(f"  {mode} ...", flush=True)
                try:
                    results[mode] = measure(b, mode, a.repeats, a.watchdog)
                except Mismatch as e:
                    results[mode] = {"available": True, "error": str(e)}
                    failed.append(str(e))
        finally:
            b.close()
    rows = []
    for mode in modes:
        r = results[mode]
        if not r.get("available"):
            rows.append([mode, "-", "-", "-", "-", r["reason"]])
            continue
        if "error" in r:
            rows.append([mode, "-", "-", "-", "-", f"MISMATCH: {r['error']}"])
            continue
        s = r["seconds"]
        r["gbs"] = {k: gbs(n, v) for k, v in s.items()}
        r["best_s"] = {k: min(v) for k, v in s.items()}
        r["median_s"] = {k: float(np.median(v)) for k, v in s.items()}
        extra = [
            f"{k} {min(v):.3f} s" for k, v in s.items() if k not in ("total", "fill", "copy", "fill_file")
        ]
        if "fill_file" in s:
            extra.insert(0, f"fill from the file {fmt(gbs(n, s['fill_file']), '.2f')} GB/s "
                            f"({'cold' if a.cold else 'page cache'})")  # fmt: skip
        rows.append([mode, fmt(gbs(n, s["total"]), ".2f"), fmt(gbs(n, s.get("fill")), ".2f"),
                     fmt(gbs(n, s.get("copy")), ".2f"), fmt(min(s["total"]), ".3f"), "; ".join(extra)])  # fmt: skip
    print(table(["mode", "end to end GB/s", "host fill GB/s", "GPU copy GB/s", "best s", "other parts"], rows,
                f"upload of {n / 1e9:.3f} GB ({n >> 20} MiB), best of {a.repeats}, {a.threads} fill threads"))  # fmt: skip
    out = {
        "time": now_iso(),
        "adapter": adapter_line(gpu),
        "host": host_info(),
        "runtime": gpu.runtime_name,
        "features": sorted(gpu.features),
        "bytes": n,
        "repeats": a.repeats,
        "threads": a.threads,
        "cold": a.cold,
        "file_offset": FILE_OFFSET,
        "piece_bytes": PIECE_BYTES,
        "modes": results,
    }
    write_json(json_path(a.json, "upload.json"), out)
    if failed:
        print("error: " + "; ".join(failed), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
