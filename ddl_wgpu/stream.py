"""The frozen trunk of the batched jobs (heal's teacher pass, accept's trunk pass, eval) on the GPU, its blocks'
weights resident or streamed layer by layer: `Trunk`.

A frozen trunk run over many windows is a batched prefill, and batched work can stream its weights: windows go
through in blocks, and for each layer in order its weights are uploaded into a slot, applied to every window of
the block, and the slot reused. The embedding, the final norm and the head stay resident (`TrunkWeights.head`,
an inference `net.Net` of those tensors, which heal's draft shares); the blocks' weights live in slots
(`TrunkWeights`): one per layer when resident, two when streamed (layer i in slot i % 2, so layer i + 1 is
uploaded while layer i computes). The work is `TrunkPass`, an `inference.InferenceWork` over the slots whose
forward is one Call per layer: resident, all of them are recorded into one submit as before; streamed, each
layer is its own submit, and the next layer's upload starts as soon as this one is submitted (`LayerStream`).
Same kernels, same launches, the same order of every reduction: only where the weights live changes, so the
two give the same bits. The forward's GEMMs never slice K (`Blocks.split_k` = 1): no row's sums depend on how
many windows share its block.

Weights come from a `WeightSource`: a checkpoint read through its memory map, a piece at a time (never the
whole model in host memory), or a dict of arrays; each tensor is converted to the slot's dtype (f32, or f16 for
the big matrices of an f16 trunk, `layout.F16_SUFFIXES`) exactly as `Net.load` converts it.

Uploads (`ENV_UPLOAD`, `UPLOAD_MODES`; the first is the default):
- "write": `queue.write_buffer` per tensor piece from arrays the thread pool prepares (wgpu makes a staging
  buffer per call); no staging of our own, no mapping. The default since the H200 run of 2026-12-03, in which
  the mapped pass of the Qwen3.8-27B trunk did not finish in 7 minutes (BENCHMARKS.md); "write" was not
  measured there.
- "mapped": two staging buffers of one layer each, mapped for writing; a layer is converted straight
  into one by a pool of threads (numpy's copies release the GIL) while the GPU runs the layer before it, and
  copied into its slot at the start of its own submit; the staging buffer is mapped again when that submit is
  done. One host copy, reused memory, several cores (the issue measured a mapped staging buffer at 5.7 GB/s
  and `queue.write_buffer` at 3.8 on the H200, one thread each). Its promises are resolved by wgpu-py's poll
  thread: on lavapipe it gives the resident bits, on the H200 it stalled (see above).
`bench/heal.py --gpu-memory` measures the streamed pass under both beside the resident one.
"""

from __future__ import annotations

import dataclasses
import gc
import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from ddl_ref.config import ModelConfig
from ddl_ref.params import ddl_layer_specs, layer_specs
from ddl_wgpu import layout
from ddl_wgpu.container_format import bf16_to_f32
from ddl_wgpu.gpu import Call, GpuError
from ddl_wgpu.inference import InferenceWork
from ddl_wgpu.layout import EMBED
from ddl_wgpu.net import Net

LAYER = "model.layers."
ENV_UPLOAD = "DDL_WGPU_UPLOAD"
UPLOAD_MODES = ("write", "mapped")
PIECE_BYTES = 16 << 20  # a conversion/copy task of the thread pool
STREAM_SLOTS = 2  # layer slots of a streamed trunk: layer i + 1 uploads while layer i runs
_NP = {"f32": np.float32, "f16": np.float16}
_STORED = {np.dtype(np.float32): "f32", np.dtype(np.float16): "f16", np.dtype(np.float64): "f64"}


def upload_mode(mode: str | None = None) -> str:
    value = (mode or os.environ.get(ENV_UPLOAD) or UPLOAD_MODES[0]).strip().lower()
    if value not in UPLOAD_MODES:
        raise GpuError(f"unknown upload mode {value!r} (from {ENV_UPLOAD}); use one of {list(UPLOAD_MODES)}")
    return value


def is_layer(name: str) -> bool:
    return name.startswith(LAYER)


class WeightSource:
    """The trunk's tensors as stored: an open checkpoint (`container.Checkpoint`; read through its memory map,
    a piece at a time; bf16 as raw bits) or a dict of float arrays. `fill` converts one tensor into a slot's
    memory, `pieces` yields it converted piece by piece; both as `Net.load` converts (f16: the same rounding and
    the same overflow check)."""

    def __init__(self, params=None, checkpoint=None):
        if (params is None) == (checkpoint is None):
            raise ValueError("a weight source is a dict of arrays or a checkpoint")
        self.params, self.ck = params, checkpoint

    def raw(self, name: str) -> tuple[np.ndarray, str]:
        """(the tensor as stored, flat, without a copy where possible; its dtype "f32", "f16", "bf16", "f64")."""
        if self.ck is not None:
            info = self.ck.info(name)
            return self.ck.tensor(name, copy=False).reshape(-1), info.dtype
        a = np.asarray(self.params[name])
        if a.dtype not in _STORED:
            a = a.astype(np.float32)
        return a.reshape(-1), _STORED[a.dtype]

    @staticmethod
    def _convert(name: str, out: np.ndarray, raw: np.ndarray, stored: str, check: bool) -> None:
        if stored == "bf16":
            if out.dtype == np.float32:
                out.view(np.uint32)[...] = raw.astype(np.uint32) << 16
            else:
                out[...] = bf16_to_f32(raw)
        else:
            out[...] = raw  # numpy's cast: the rounding `astype` does (Net.load)
        if check and out.dtype == np.float16 and not np.isfinite(out).all():
            src = bf16_to_f32(raw) if stored == "bf16" else raw
            if np.isfinite(src).all():
                raise GpuError(f"parameter {name} overflows float16 (max |x| {float(np.abs(src).max()):.4g})")

    def rows(self, name: str, ids, dtype: str, width: int) -> np.ndarray:
        """Rows `ids` (int, any shape) of the tensor `name` of rows of `width` values, as a GPU table of `dtype`
        holds them (converted as `fill` converts them), in float32 -> (*ids.shape, width): the table's gather,
        done on the host (a memory-mapped checkpoint reads those rows only)."""
        raw, stored = self.raw(name)
        ids = np.asarray(ids)
        picked = raw.reshape(-1, width)[ids.reshape(-1)]
        out = np.empty(picked.shape, _NP[dtype])
        self._convert(name, out, picked, stored, False)  # checked when the table was uploaded
        return out.astype(np.float32, copy=False).reshape(*ids.shape, width)

    def _spans(self, n: int, itemsize: int) -> list[tuple[int, int]]:
        step = max(64, PIECE_BYTES // itemsize // 64 * 64)  # whole words of f16 too
        return [(e, min(n, e + step)) for e in range(0, n, step)]

    def fill(self, name: str, out: np.ndarray, pool, check: bool = True) -> None:
        """Tensor `name` converted into `out` (flat, the slot's dtype), its pieces on `pool`'s threads."""
        raw, stored = self.raw(name)
        if raw.size != out.size:
            raise GpuError(f"parameter {name} has {raw.size} values, its slot {out.size}")
        spans = self._spans(raw.size, out.itemsize)
        list(
            pool.map(
                lambda sp: self._convert(name, out[sp[0] : sp[1]], raw[sp[0] : sp[1]], stored, check), spans
            )
        )

    def pieces(self, name: str, dtype: str, pool):
        """(element offset, converted piece) of tensor `name` in `dtype`, converted a few at a time on `pool`."""
        raw, stored = self.raw(name)
        target = np.dtype(_NP[dtype])
        spans = self._spans(raw.size, target.itemsize)

        def one(sp):
            out = np.empty(sp[1] - sp[0], target)
            self._convert(name, out, raw[sp[0] : sp[1]], stored, True)
            return sp[0], out

        ahead = _workers()
        for s in range(0, len(spans), ahead):
            yield from pool.map(one, spans[s : s + ahead])


def _workers() -> int:
    return max(1, min(8, os.cpu_count() or 1))


class TrunkWeights:
    """The trunk's weights on the GPU, as a `net.Net` reads them for its works: the final norm, the head (and a
    Deep Delta model's expansion and readout) in `head`, an inference Net of those tensors only, and the
    embedding in it too when tied, else in `embed`, a Net of its own (heal's draft phase gathers its rows on the
    host instead: `release_embedding`); every block's tensors in a slot (`slots` of them: one per layer when
    None; layer i in slot i % slots), each laid out like a one-block Net of that block's kind (a hybrid has two
    kinds; a slot is as large as the largest kind it takes). `view`, `wdtype`, `row_views`, `slots` answer for every tensor of the trunk, so the
    works (`Blocks`, `Vocab`, `heal_gpu.DraftInput`) and a draft sharing the embedding/head (`Net(shared=...)`)
    use it as a Net. Frozen: no gradients or moments."""

    inference = True
    has_state = frozenset()
    g = m = v = ()  # no gradient or moment arenas (frozen)

    def __init__(self, gpu, cfg: ModelConfig, source: WeightSource | None, dtype: str = "f32",
                 slots: int | None = None, pool=None):  # fmt: skip
        self.gpu, self.cfg, self.dtype, self.source = gpu, cfg, dtype, source
        self.pool = pool
        self.dry = getattr(gpu, "dry", False)
        untied = not cfg.tie_embeddings
        self.head = Net(gpu, cfg, None, inference=True, dtype=dtype, loader=self._load_head,
                        names=lambda n: not is_layer(n) and not (untied and n == EMBED))  # fmt: skip
        self.embed = (Net(gpu, cfg, None, inference=True, dtype=dtype, loader=self._load_head,
                          names=lambda n: n == EMBED) if untied else None)  # fmt: skip
        L = cfg.n_layers
        self.S = L if slots is None else max(1, min(int(slots), L))
        self.layer_names: list[list[str]] = []
        self.kind: list[layout.Layout] = []  # per layer: the layout of its slot
        kinds: dict = {}
        for i in range(L):
            prefix = f"{LAYER}{i}."
            specs = layer_specs(cfg, i) + ddl_layer_specs(cfg, i)
            local = [dataclasses.replace(s, name=s.name[len(prefix) :]) for s in specs]
            sig = tuple((s.name, s.shape) for s in local)
            if sig not in kinds:
                try:
                    kinds[sig] = layout.plan(local, gpu.max_buffer, dtype=dtype)
                except layout.LayoutError as e:
                    raise GpuError(str(e)) from e
            self.kind.append(kinds[sig])
            self.layer_names.append([s.name for s in specs])
        self.arena_sizes = []  # per slot, per arena: bytes (the largest of the layers it takes)
        for s in range(self.S):
            lays = self.kind[s :: self.S]
            n = max(len(k.arena_sizes) for k in lays)
            self.arena_sizes.append([max(k.arena_sizes[a] if a < len(k.arena_sizes) else 0 for k in lays)
                                     for a in range(n)])  # fmt: skip
        self.bufs = [[gpu.buffer(n, label=f"layer_slot{s}.{a}") for a, n in enumerate(sizes)]
                     for s, sizes in enumerate(self.arena_sizes)]  # fmt: skip
        self.holds: list[int | None] = [None] * self.S  # the layer each slot holds
        self.slots = dict(self.head.slots)  # a layer tensor's Slot: its arena within its layer's slot
        if self.embed is not None:  # its arena after the head's (`p`)
            e = self.embed.slots[EMBED]
            self.slots[EMBED] = dataclasses.replace(e, arena=len(self.head.p) + e.arena)
        for i, names in enumerate(self.layer_names):
            prefix = f"{LAYER}{i}."
            for n in names:
                self.slots[n] = dataclasses.replace(self.kind[i].slots[n[len(prefix) :]], name=n)
        # the resident arenas (the head's, then the embedding's): what a Net sharing the embedding/head binds
        self.p = self.head.p + (self.embed.p if self.embed is not None else [])

    # -- as a Net -----------------------------------------------------------------------------------------

    @property
    def head_name(self) -> str:
        return self.head.head_name

    @property
    def num_params(self) -> int:
        return sum(s.numel for s in self.slots.values())

    @property
    def weight_bytes(self) -> int:
        """Bytes of the weights on the GPU: the resident arenas and the slots."""
        resident = sum(self.head.arena_sizes) + (sum(self.embed.arena_sizes) if self.embed is not None else 0)
        return resident + sum(sum(sizes) for sizes in self.arena_sizes)

    def _resident(self, name: str) -> Net:
        if self.embed is None or name != EMBED:
            return self.head
        if not self.embed.p:
            raise GpuError(f"{EMBED}: released after the trunk's pass (`release_embedding`)")
        return self.embed

    def _layer(self, name: str) -> tuple[int, layout.Slot] | None:
        if not is_layer(name):
            return None
        i = int(name[len(LAYER) :].split(".", 1)[0])
        return i, self.slots[name]

    def view(self, name: str, kind: str = "p"):
        if kind != "p":
            raise GpuError(f"gradient/moment view of {name}: the trunk is frozen (inference only)")
        hit = self._layer(name)
        if hit is None:
            return self._resident(name).view(name)
        i, s = hit
        if s.nbytes > self.gpu.max_binding:
            raise GpuError(f"parameter {name} ({s.nbytes} bytes) exceeds this adapter's storage binding limit "
                           f"{self.gpu.max_binding}")  # fmt: skip
        return (self.bufs[i % self.S][s.arena], s.offset, s.bind_bytes)

    def row_views(self, name: str, kind: str = "p"):
        if self._layer(name) is None:
            return self._resident(name).row_views(name, kind)
        rows = self.slots[name].shape[0]
        return [(0, rows, self.view(name, kind))]

    def wdtype(self, name: str) -> str:
        return self.slots[name].dtype

    # -- loading ------------------------------------------------------------------------------------------

    def _load_head(self, net: Net) -> None:
        """The resident tensors, piece by piece from the source (bounded host memory)."""
        if self.dry:
            return
        for spec in net.table:
            s = net.slots[spec.name]
            for e0, piece in self.source.pieces(spec.name, s.dtype, self.pool):
                self.gpu.write(net.p[s.arena], piece, s.offset + e0 * s.itemsize)

    def layer_tensors(self, i: int):
        """(name, its Slot) of layer i's tensors."""
        return [(n, self.slots[n]) for n in self.layer_names[i]]

    def release(self) -> None:
        """Free every slot (the trunk has run); the head stays (heal's draft reads it)."""
        for bufs in self.bufs:
            self.gpu.release(*bufs)
        self.bufs, self.holds = [[] for _ in range(self.S)], [None] * self.S

    def release_embedding(self) -> bool:
        """Free an untied embedding (heal's draft gathers its rows on the host: `WeightSource.rows`) -> whether
        there was one to free (a tied one is the head)."""
        if self.embed is None or not self.embed.p:
            return False
        self.gpu.release(*self.embed.p)
        self.embed.p = []
        return True


def staging(weights: TrunkWeights) -> list[list]:
    """The "mapped" upload's two staging buffers, per arena of the largest slot (`Gpu.upload_buffer`)."""
    sizes = [max(s[a] if a < len(s) else 0 for s in weights.arena_sizes)
             for a in range(max(len(s) for s in weights.arena_sizes))]  # fmt: skip
    return [
        [weights.gpu.upload_buffer(n, f"upload_staging{r}.{a}") for a, n in enumerate(sizes)]
        for r in range(2)
    ]


class LayerStream:
    """Layers into their slots (module docstring, "Uploads"): `stage(i)` starts preparing layer i on the thread
    pool; `bring(i, rec)` puts it into its slot before the work recorded next in `rec` (mapped: the staging
    copy recorded into `rec`; write: `queue.write_buffer`s queued before `rec`'s submit); `submitted()` after
    that submit (mapped: the staging buffer is mapped again once the GPU is done with it). The first upload
    of each layer checks f16 overflow; later ones re-read the same bytes."""

    def __init__(self, weights: TrunkWeights, mode: str, pool):
        self.w, self.gpu, self.mode, self.pool = weights, weights.gpu, mode, pool
        self.coord = ThreadPoolExecutor(1, thread_name_prefix="ddl-stage")
        self.staged: dict = {}  # layer -> (future, staging index)
        self.checked: set = set()
        self.ring, self.promises, self._used, self._next = [], [], [], 0
        if mode == "mapped":
            self.ring = staging(weights)
            self.promises = [None, None]

    def stage(self, i: int) -> None:
        if i in self.staged or self.w.holds[i % self.w.S] == i:
            return
        r = self._next
        self._next ^= 1
        promises = self.promises[r] if self.ring else None
        if self.ring:
            self.promises[r] = None
        self.staged[i] = (self.coord.submit(self._prepare, i, r, promises), r)

    def _prepare(self, i: int, r: int, promises):
        check = i not in self.checked
        if self.mode == "write":
            return [(s.arena, s.offset + e0 * s.itemsize, piece) for name, s in self.w.layer_tensors(i)
                    for e0, piece in self.w.source.pieces(name, s.dtype, self.pool)]  # fmt: skip
        for p in promises or ():
            p.sync_wait()
        arrays = [self.gpu.mapped_array(b) for b in self.ring[r]]
        for name, s in self.w.layer_tensors(i):
            out = arrays[s.arena][s.offset : s.offset + s.nbytes].view(_NP[s.dtype])
            self.w.source.fill(name, out, self.pool, check)
        return None

    def bring(self, i: int, rec) -> None:
        s = i % self.w.S
        if self.w.holds[s] == i:
            return
        self.stage(i)
        fut, r = self.staged.pop(i)
        pieces = fut.result()
        self.checked.add(i)
        dst = self.w.bufs[s]
        if self.mode == "write":
            for arena, offset, piece in pieces:
                self.gpu.write(dst[arena], piece, offset)
        else:
            for a, buf in enumerate(self.ring[r]):
                buf.unmap()
                n = self.w.kind[i].arena_sizes[a] if a < len(self.w.kind[i].arena_sizes) else 0
                if n:
                    rec.copy(buf, 0, dst[a], 0, n)
            self._used.append(r)
        self.w.holds[s] = i

    def submitted(self) -> None:
        for r in self._used:
            self.promises[r] = [self.gpu.map_for_write(b) for b in self.ring[r]]
        self._used = []

    def close(self) -> None:
        for fut, _r in self.staged.values():
            fut.cancel()
        self.coord.shutdown(wait=True)
        self.staged = {}
        for bufs in self.ring:
            self.gpu.release(*bufs)
        self.ring = []


class TrunkPass(InferenceWork):
    """`InferenceWork` over a `Trunk`'s weights: the same forward, kept as one Call per layer (`layer_calls`,
    between `embed_call` and `tail_call`) so a streamed trunk can submit layer by layer (`record_forward`). Its
    forward GEMMs never slice K (`Blocks.split_k`); a forward-only trunk's mixer kinds share the block input's
    norm and the MLP's activations (one kind runs at a time)."""

    split_k = 1

    def __init__(self, trunk: Trunk, batch: int, seq: int):
        self.trunk = trunk
        super().__init__(trunk.weights, batch, seq)
        self.vocab.split_k = 1

    def _shared_layer_acts(self) -> list[dict]:
        """One activation set per mixer kind, as `Blocks._shared_layer_acts`, except that one kind runs at a time:
        every kind shares the block input's norm and the MLP's buffers, and a later kind's own buffers are an
        earlier kind's (the smallest one large enough) where one is free (a hybrid's Gated DeltaNet and
        attention sets: a third less activation memory at the Qwen3.8-27B shape)."""
        streams = [self.act(self.S, "x_even"), self.act(self.S, "x_odd")]
        share: dict = {"x": streams[0]}  # a kind's own block input goes unused: each layer reads a stream
        kinds: dict[str, dict] = {}
        free: list = []  # buffers of earlier kinds only those kinds use
        out = []
        for i in range(self.cfg.n_layers):
            mixer = self.cfg.layer_type(i)
            if mixer not in kinds:
                self._reuse = list(free)
                a = kinds[mixer] = self.block_acts(f"_{mixer}", self.S, mixer, share)
                self._reuse = None
                share = {k: a[k] for k in ("x", "h", "r1", "xm", "h2", "r2", "gate", "up", "s")}
                shared = {id(b) for b in share.values()}
                for k, b in a.items():
                    if k != "mixer" and id(b) not in shared and all(b is not f for f in free):
                        free.append(b)
            out.append(dict(kinds[mixer], x=streams[i % 2]))
        return out

    def act(self, n: int, label: str):
        """A new activation buffer, or while a later mixer kind's set is built (`_shared_layer_acts`) the
        smallest free one of an earlier kind that holds n floats."""
        pool = getattr(self, "_reuse", None)
        fit = [b for b in pool or () if b.size >= 4 * n]
        if not fit:
            return super().act(n, label)
        b = min(fit, key=lambda b: b.size)
        pool.remove(b)
        return b

    def forward_calls(self) -> Call:
        x0 = self.L[0]["x"] if self.L else self.xS
        self.embed_call = self.embed_forward(x0)
        self.layer_calls = []
        for i, a in enumerate(self.L):
            out = self.L[i + 1]["x"] if i + 1 < len(self.L) else self.xS
            self.layer_calls.append(self.block_forward(a, out, f"{LAYER}{i}.", self.ddl))
        tail = self._compress("model.readout.", self.xL, self.xS) if self.dv > 1 else Call()
        self.tail_call = tail + self.final_norm_forward()
        call = self.embed_call
        for c in self.layer_calls:
            call = call + c
        return call + self.tail_call

    def record_forward(self, rec):
        return self.trunk.record_forward(self, rec)


class Trunk:
    """A frozen trunk (`cfg` without its draft) on the GPU, resident (every layer uploaded once) or `streamed`
    (two slots; module docstring), and its works (`work(batch, seq)`: a `TrunkPass`). `release()` frees the
    slots and the works once the trunk has run; `weights.head` stays."""

    def __init__(self, gpu, cfg: ModelConfig, source: WeightSource | None, dtype: str = "f32",
                 streamed: bool = False, upload: str | None = None, slots: int = STREAM_SLOTS):  # fmt: skip
        if dtype not in _NP:
            raise GpuError(f"trunk dtype {dtype!r} is not one of {list(_NP)}")
        if dtype == "f16" and "shader-f16" not in gpu.features:
            raise GpuError(f"f16 weights (--trunk-dtype f16) need the adapter feature shader-f16, which "
                           f"{gpu.name} does not offer; use f32")  # fmt: skip
        self.gpu, self.streamed = gpu, bool(streamed)
        self.dry = getattr(gpu, "dry", False)
        self.pool = None if self.dry else ThreadPoolExecutor(_workers(), thread_name_prefix="ddl-weights")
        self.cfg = cfg = dataclasses.replace(cfg, mtp=None)
        self.weights = TrunkWeights(gpu, cfg, source, dtype, slots if streamed else None, self.pool)
        self.mode = upload_mode(upload) if streamed else "write"
        self.stream = None if self.dry else LayerStream(self.weights, self.mode, self.pool)
        self._dry_staging = []
        if self.streamed and self.mode == "mapped" and self.dry:  # counted as the real stream allocates it
            self._dry_staging = [b for bufs in staging(self.weights) for b in bufs]
        self._works: dict = {}
        self.released = False
        if not self.streamed and not self.dry:
            self._load_all()

    def _load_all(self) -> None:
        """Every layer into its own slot, a layer per submit (wgpu keeps its staging until then)."""
        L = self.weights.cfg.n_layers
        for i in range(L):
            self.stream.stage(i)
            if i + 1 < L:
                self.stream.stage(i + 1)
            rec = self.gpu.recorder()
            self.stream.bring(i, rec)
            rec.submit()
            self.stream.submitted()

    def work(self, batch: int, seq: int) -> TrunkPass:
        if self.released:
            raise GpuError("this trunk has run and been released: its blocks' weights are gone")
        if (batch, seq) not in self._works:
            self._works[(batch, seq)] = TrunkPass(self, batch, seq)
        return self._works[(batch, seq)]

    def record_forward(self, work: TrunkPass, rec):
        """`work`'s forward into `rec` -> the recorder to record its tail into. Resident: recorded whole.
        Streamed: layer i's weights brought into its slot, its Call recorded, submitted, layer i + 1 staged
        (after the last layer, the first: the next block's), and so on."""
        if not self.streamed:
            work._fwd.record(rec)
            return rec
        L = len(work.layer_calls)
        work.embed_call.record(rec)
        for i, call in enumerate(work.layer_calls):
            self.stream.bring(i, rec)
            call.record(rec)
            rec.submit()
            self.stream.submitted()
            self.stream.stage((i + 1) % L)
            rec = self.gpu.recorder()
        work.tail_call.record(rec)
        return rec

    def release(self) -> None:
        """Free the layer slots, the upload staging and the works (the trunk has run); the head stays."""
        self.released = True
        if self.stream is not None:
            self.stream.close()
        self.gpu.release(*self._dry_staging)
        self._dry_staging = []
        self.weights.release()
        self._works.clear()
        if self.pool is not None:
            self.pool.shutdown(wait=True)
            self.pool = None
        gc.collect()  # the works' buffers are freed when collected (`gpu.Gpu.live` counts them down)
