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
the big matrices of an f16 trunk, `layout.F16_SUFFIXES`) exactly as `Net.load` converts it, and checked finite
the first time it goes up (`lazy.refuse_non_finite`, piece by piece on the thread pool: a NaN or infinite weight is
one line naming the tensor).

Uploads: `queue.write_buffer`, a piece of at most PIECE_BYTES per call, from the source's own memory where it
is stored in the slot's dtype (a view of the checkpoint's map or of the array: no copy of ours), else from a
piece the thread pool converted. wgpu copies each piece into a staging buffer of its own, freed when the submit
that carries it is done; before writing a layer the host waits for the submit of the layer two before it, so
no more than two layers' staging is alive (counted in the plan: `staging_bytes`) and the host runs at most one
layer ahead of the GPU (on the H200 an unbounded host ran 20 GB of staging ahead, 2026-12-03). The next layer
is prepared while this one is written. A mapped staging ring filled by the thread pool was
tried and stalled on the H200 (docs/experiments.md).

Where the device has host-mapped memory (Dawn's host-mapped-pointer: `Gpu.host_buffer`), each layer goes
through two buffers on host memory instead, the default (env DDL_WGPU_UPLOAD=host; `write` forces the path
above). The pieces are copied into the host buffer of the layer two before (its submit waited for, as above)
on the thread pool, and the layer's submit carries `copy_buffer_to_buffer`s from it: the GPU reads the host
pages itself, with no single-threaded copy into staging and no staging in device memory. The same bytes land
in the slot (a word's rest zeroed as `Gpu.write` pads it), so the results are the same bits. Measured on an
H100 through Dawn (`bench/upload.py --modes ...`, a 27B layer): `write_buffer` 1.06 GB/s, host buffers 19.5-20.0;
the 27B heal trunk pass streamed within 16 GB ran out of its 150 s with `write` and at 1,890 tokens/s (0.795x
resident) with host buffers (BENCHMARKS.md). wgpu-native has no host-mapped memory and keeps `write`. With
host buffers the layers take no staging in device memory, so the plan (`staging_bytes`) counts only the
resident tensors' pieces (that run counted two layers' staging, about 1.4 GiB at the 27B, that it did not use).
"""

from __future__ import annotations

import collections
import dataclasses
import gc
import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from ddl_ref.config import ModelConfig
from ddl_ref.params import ddl_layer_specs, layer_specs, param_table
from ddl_wgpu.engine import layout
from ddl_wgpu.engine.inference import InferenceWork
from ddl_wgpu.engine.layout import EMBED
from ddl_wgpu.engine.net import Net
from ddl_wgpu.files.container_format import bf16_to_f32
from ddl_wgpu.files.lazy import refuse_non_finite
from ddl_wgpu.runtime.gpu import Call, GpuError

LAYER = "model.layers."
PIECE_BYTES = 16 << 20  # a conversion task of the thread pool, and the most one write_buffer call copies
STREAM_SLOTS = 2  # layer slots of a streamed trunk: layer i + 1 uploads while layer i runs
# How a layer goes up (module docstring): "host" (host buffers where the device has them, the default) or "write"
ENV_UPLOAD = "DDL_WGPU_UPLOAD"
UPLOADS = ("host", "write")  # the default first
_NP = {"f32": np.float32, "f16": np.float16}
_STORED = {np.dtype(np.float32): "f32", np.dtype(np.float16): "f16", np.dtype(np.float64): "f64"}


def is_layer(name: str) -> bool:
    return name.startswith(LAYER)


class WeightSource:
    """The trunk's tensors as stored: an open checkpoint (`container.Checkpoint`; read through its memory map,
    a piece at a time; bf16 as raw bits) or a dict of float arrays. `pieces` yields a tensor piece by piece in a
    slot's dtype, converted as `Net.load` converts (f16: the same rounding and the same overflow check)."""

    def __init__(self, params=None, checkpoint=None):
        if (params is None) == (checkpoint is None):
            raise ValueError("a weight source is a dict of arrays or a checkpoint")
        self.params, self.ck = params, checkpoint
        # tensors found finite (`lazy.refuse_non_finite`, on the pool as they are first uploaded): a streamed trunk
        # uploads every layer once per block, and checks it only the first time
        self.where = checkpoint.path if checkpoint is not None else "the model"
        self.finite: set[str] = set()

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
        if name not in self.finite:  # the rows read, as they are read (a few rows: cheap)
            refuse_non_finite(picked, stored, name, self.where)
        out = np.empty(picked.shape, _NP[dtype])
        self._convert(name, out, picked, stored, False)  # checked when the table was uploaded
        return out.astype(np.float32, copy=False).reshape(*ids.shape, width)

    def _spans(self, n: int, itemsize: int) -> list[tuple[int, int]]:
        step = max(64, PIECE_BYTES // itemsize // 64 * 64)  # whole words of f16 too
        return [(e, min(n, e + step)) for e in range(0, n, step)]

    def pieces(self, name: str, dtype: str, pool):
        """(element offset, converted piece) of tensor `name` in `dtype`, converted a few at a time on `pool`; a
        tensor stored in `dtype` comes as views of its own memory (nothing to convert or check: the upload
        reads the checkpoint's map or the array itself: on the H200 the pass then waited on no copy of ours)."""
        raw, stored = self.raw(name)
        target = np.dtype(_NP[dtype])
        spans = self._spans(raw.size, target.itemsize)
        check = name not in self.finite  # each piece checked on the pool, the first time the tensor goes up

        def view(sp):
            if check:
                refuse_non_finite(raw[sp[0] : sp[1]], stored, name, self.where)
            return sp[0], raw[sp[0] : sp[1]]

        def one(sp):
            if check:
                refuse_non_finite(raw[sp[0] : sp[1]], stored, name, self.where)
            out = np.empty(sp[1] - sp[0], target)
            self._convert(name, out, raw[sp[0] : sp[1]], stored, True)
            return sp[0], out

        if stored == dtype and not check:
            for e0, e1 in spans:
                yield e0, raw[e0:e1]
            return
        ahead, each = _workers(), (pool.map if pool is not None else map)
        for s in range(0, len(spans), ahead):
            yield from each(view if stored == dtype else one, spans[s : s + ahead])
        self.finite.add(name)


def upload_mode() -> str:
    """Env DDL_WGPU_UPLOAD, else "host" (which falls back to "write" where the device has no host-mapped
    memory); an unknown name is a GpuError."""
    value = (os.environ.get(ENV_UPLOAD) or UPLOADS[0]).strip().lower()
    if value not in UPLOADS:
        raise GpuError(f"{ENV_UPLOAD}={value!r}: one of {', '.join(UPLOADS)}")
    return value


def host_uploads(gpu) -> bool:
    """Whether a trunk's layers on `gpu` go up through host buffers: `upload_mode` "host" and a device with
    host-mapped memory (`Gpu.host_buffers`; a `gpumem.DryGpu` answers as its real device)."""
    return upload_mode() == "host" and gpu.host_buffers


def host_plan(pieces) -> tuple[int, list, list]:
    """Where each piece of a layer ((arena, byte offset, array) as `LayerStream._prepare` makes them) goes in a host
    buffer: packed in order, each at a multiple of 4 (copy_buffer_to_buffer's alignment) -> (bytes used,
    [(host offset, the piece's bytes)], [(arena, host offset, slot offset, bytes)]: the copies, adjacent ones
    merged, each a whole number of words: a piece's last word padded with zeros, as `Gpu.write` pads it)."""
    pos, fills, copies = 0, [], []
    for arena, offset, piece in pieces:
        raw = np.ascontiguousarray(piece).reshape(-1).view(np.uint8)
        n = -(-raw.nbytes // 4) * 4
        fills.append((pos, raw))
        last = copies[-1] if copies else None
        if last and last[0] == arena and last[1] + last[3] == pos and last[2] + last[3] == offset:
            last[3] += n
        else:
            copies.append([arena, pos, offset, n])
        pos += n
    return pos, fills, [tuple(c) for c in copies]


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
        # wgpu's staging of our uploads at any moment (module docstring, "Uploads"): two layers, or two pieces
        # of a resident tensor where a piece is larger; counted from here until `drop_staging`. Layers that go
        # up through host buffers (`host_uploads`) take no staging: only the resident tensors' pieces count
        piece = min(
            PIECE_BYTES, max([s.numel for s in param_table(cfg) if not is_layer(s.name)], default=0) * 4
        )
        layers = [] if host_uploads(gpu) else [sum(k.arena_sizes) for k in self.kind]
        self.staging_bytes = 2 * max([*layers, piece])
        gpu.external(self.staging_bytes)
        untied = not cfg.tie_embeddings
        self.head = Net(gpu, cfg, None, inference=True, dtype=dtype, loader=self._load_head,
                        names=lambda n: not is_layer(n) and not (untied and n == EMBED))  # fmt: skip
        self.embed = (Net(gpu, cfg, None, inference=True, dtype=dtype, loader=self._load_head,
                          names=lambda n: n == EMBED) if untied else None)  # fmt: skip
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
        pending = 0
        for spec in net.table:
            s = net.slots[spec.name]
            for e0, piece in self.source.pieces(spec.name, s.dtype, self.pool):
                self.gpu.write(net.p[s.arena], piece, s.offset + e0 * s.itemsize)
                pending += piece.nbytes
                if pending >= self.staging_bytes // 2:  # wgpu's staging of these writes: at most one layer's
                    self.gpu.wait_for(self.gpu.submit_indexed(self.gpu.recorder().finish()))
                    pending = 0

    def layer_tensors(self, i: int):
        """(name, its Slot) of layer i's tensors."""
        return [(n, self.slots[n]) for n in self.layer_names[i]]

    def drop_staging(self) -> None:
        """No more uploads (a resident trunk once loaded, a streamed one once run): their staging uncounted."""
        self.gpu.external(-self.staging_bytes)
        self.staging_bytes = 0

    def release(self) -> None:
        """Free every slot (the trunk has run); the head stays (heal's draft reads it)."""
        self.drop_staging()
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


class LayerStream:
    """Layers into their slots (module docstring, "Uploads"): `stage(i)` starts preparing layer i's pieces on
    the coordinating thread (converted on the pool where they must be); `bring(i, rec, then)` waits for them,
    starts preparing layer `then`, waits for the layer submitted two before it and queues the writes (carried
    by `rec`'s submit); `submitted(index)` records a layer's submission index, `settle()` waits for the last."""

    def __init__(self, weights: TrunkWeights, pool):
        self.w, self.gpu, self.pool = weights, weights.gpu, pool
        self.coord = ThreadPoolExecutor(1, thread_name_prefix="ddl-stage")
        self.staged: dict = {}  # layer -> future of its pieces
        self.recent: collections.deque = collections.deque(
            maxlen=2
        )  # the last two layers' submission indices
        # the way in force: "host" where the layers go up through host buffers (`host_uploads`, as the trunk's
        # staging count assumed), else "write"; the two host buffers taking turns are made at the first upload
        self.mode = "host" if host_uploads(self.gpu) else "write"
        self.host: list | None = None
        self.turn = 0

    def stage(self, i: int) -> None:
        if i not in self.staged and self.w.holds[i % self.w.S] != i:
            self.staged[i] = self.coord.submit(self._prepare, i)

    def _prepare(self, i: int):
        return [(s.arena, s.offset + e0 * s.itemsize, piece) for name, s in self.w.layer_tensors(i)
                for e0, piece in self.w.source.pieces(name, s.dtype, self.pool)]  # fmt: skip

    def bring(self, i: int, rec, then: int | None = None) -> None:
        """... and, once layer i is prepared, start preparing layer `then` while layer i is written (on the
        H200 a layer's preparation waited for the write before it: 0.36 s a layer where either alone takes
        half)."""
        s = i % self.w.S
        if self.w.holds[s] == i:
            return
        self.stage(i)
        pieces = self.staged.pop(i).result()
        if then is not None and then != i:
            self.stage(then)
        if len(self.recent) == 2:  # the layer two submits back is done: its staging (and older) is freed
            self.gpu.wait_for(self.recent[0])
        dst = self.w.bufs[s]
        if self.mode == "host":
            self._from_host(pieces, dst, rec)
        else:
            for arena, offset, piece in pieces:
                self.gpu.write(dst[arena], piece, offset)
        self.w.holds[s] = i

    def _host_buffers(self) -> list:
        """The two host buffers, each as large as the largest layer's packed pieces (`host_plan`)."""
        words = max(sum(-(-s.nbytes // 4) * 4 for _, s in self.w.layer_tensors(i))
                    for i in range(self.w.cfg.n_layers))  # fmt: skip
        return [self.gpu.host_buffer(words, label=f"layer_host{k}") for k in range(2)]

    def _from_host(self, pieces, dst, rec) -> None:
        """The pieces into the host buffer the layer two submits back used (that submit is done: `bring` waited
        for it; a layer that needed no upload takes no turn, and the submit two back is then later still), filled
        on the pool, and `rec`'s submit copies them into the slot."""
        if self.host is None:
            self.host = self._host_buffers()
        host, buf = self.host[self.turn % 2]
        self.turn += 1
        used, fills, copies = host_plan(pieces)
        if used > host.size:
            raise GpuError(f"a layer's pieces take {used} bytes, more than the {host.size}-byte host buffer")

        def fill(job):
            pos, raw = job
            host[pos : pos + raw.nbytes] = raw
            # the word's rest zeroed, as Gpu.write pads it
            host[pos + raw.nbytes : pos + -(-raw.nbytes // 4) * 4] = 0

        list(self.pool.map(fill, fills) if self.pool is not None else map(fill, fills))
        for arena, src, offset, n in copies:
            rec.copy(buf, src, dst[arena], offset, n)

    def submitted(self, index: int) -> None:
        self.recent.append(index)

    def settle(self) -> None:
        """Wait for the last layer's submit: no upload staging is left alive."""
        if self.recent:
            self.gpu.wait_for(self.recent[-1])

    def close(self) -> None:
        for fut in self.staged.values():
            fut.cancel()
        self.coord.shutdown(wait=True)
        self.staged = {}
        for _, buf in self.host or ():  # Dawn frees the pages once the submits that copy from them are done
            buf.destroy()
        self.host = None


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
                 streamed: bool = False, slots: int = STREAM_SLOTS):  # fmt: skip
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
        self.stream = None if self.dry else LayerStream(self.weights, self.pool)
        self._works: dict = {}
        self.released = False
        if not self.streamed:
            if not self.dry:
                self._load_all()
            self.weights.drop_staging()

    def _load_all(self) -> None:
        """Every layer into its own slot, a layer per submit, at most two layers' staging alive (`LayerStream`),
        none once loaded."""
        L = self.weights.cfg.n_layers
        for i in range(L):
            rec = self.gpu.recorder()
            self.stream.bring(i, rec, then=i + 1 if i + 1 < L else None)
            self.stream.submitted(self.gpu.submit_indexed(rec.finish()))
        self.stream.settle()

    def work(self, batch: int, seq: int) -> TrunkPass:
        if self.released:
            raise GpuError("this trunk has run and been released: its blocks' weights are gone")
        if (batch, seq) not in self._works:
            self._works[(batch, seq)] = TrunkPass(self, batch, seq)
        return self._works[(batch, seq)]

    def record_forward(self, work: TrunkPass, rec, tap=None):
        """`work`'s forward into `rec` -> the recorder to record its tail into. Resident: recorded whole.
        Streamed: layer i's weights brought into its slot, its Call recorded, submitted, layer i + 1 staged
        (after the last layer, the first: the next block's), and so on. `tap(i, rec)`, when given, records
        before layer i's Call (the EAGLE-3 teacher copies the residual stream at a layer's input there)."""
        if not self.streamed and tap is None:
            work._fwd.record(rec)
            return rec
        L = len(work.layer_calls)
        work.embed_call.record(rec)
        for i, call in enumerate(work.layer_calls):
            if self.streamed:
                self.stream.bring(i, rec, then=(i + 1) % L)
            if tap is not None:
                tap(i, rec)
            call.record(rec)
            if self.streamed:
                self.stream.submitted(self.gpu.submit_indexed(rec.finish()))
                rec = self.gpu.recorder()
        work.tail_call.record(rec)
        return rec

    def release(self) -> None:
        """Free the layer slots, the upload staging and the works (the trunk has run); the head stays."""
        self.released = True
        if self.stream is not None:
            self.stream.close()
        self.weights.release()
        self._works.clear()
        if self.pool is not None:
            self.pool.shutdown(wait=True)
            self.pool = None
        gc.collect()  # the works' buffers are freed when collected (`gpu.Gpu.live` counts them down)
