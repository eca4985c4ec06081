"""The decoder's cache on the GPU (`decode.WgpuEngine`): `GpuCache`, by position, what `ddl_ref.decode.TrunkCache`
holds (per full-attention layer the keys and values, TC's and EC's histories, the trunk rows a draft reads,
the RoPE tables), and per Gated DeltaNet layer its running state (`GdnCache`).

A Gated DeltaNet layer (hybrid trunks) is not cached by position but by its running state (`GdnCache`): the
conv window (the in_proj_qkv rows of the k−1 positions before the next pass) and the recurrent state
(Hv, Dk, Dv). A pass of n rows runs the mixer from them (the conv's `hist` is the window, the rule's
`state_in` the state) and leaves the state and window after its last row. So that a speculative verify can
be rolled back to its last accepted row, the pass also keeps, per layer: the state before every row and after
the last (the rule with tc = 1 writes them, n + 1 slots per value head) and [the window before the pass; the
pass's rows]. `rollback(length)` to a position inside the last pass copies the slot of that row into the state
and rows length − start .. + k − 2 of the kept rows into the window (`take_rows`, the row from the positions
table through the `slot` buffer: no download, one submit). A pass longer than `keep` rows (a prompt; keep =
depth + 1, at least k − 1) keeps its start and end only (tc = n: a long prompt's every state would not fit);
a roll-back further back than the last pass, or into a long one, is refused with one line; to 0 resets.
Everything per layer lives in the cache, not in the layer's activations, which the layers of a forward-only
net share (`Blocks.shares_acts`).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from ddl_ref import ops as ref_ops
from ddl_ref.params import linear_conv_channels
from ddl_wgpu.engine.layout import F32
from ddl_wgpu.ops import decode as k_dec
from ddl_wgpu.ops import elementwise as k_ew
from ddl_wgpu.runtime.gpu import Call, Gpu, GpuError


@dataclasses.dataclass
class GdnCache:
    """A Gated DeltaNet layer's decoding state on the GPU (module docstring). `win` (k−1, Ch): the conv's
    inputs (the in_proj_qkv rows) of the k−1 positions before the next pass (None when k = 1); `state`
    (Hv, Dk, Dv): the recurrent state after the last position; for the roll-back, the last pass's `states`
    (per value head, the state before each row and after the last: n + 1 slots, or 2 for a pass of more than
    `keep` rows) and `prev` ([the window before the pass; the pass's first rows], (k−1 + keep, Ch))."""

    win: object
    state: object
    states: object
    prev: object


class GpuCache:
    """Per-position state on the GPU (module docstring): `kv[i]` = (keys, values) of full-attention layer i
    (None for a Gated DeltaNet layer), `gdn[i]` the `GdnCache` of linear-attention layer i (None for
    full attention), `hist[site]` TC inputs (site 2i / 2i+1: block i's attention / MLP compressor, 2L: the
    readout), `ehist` EC embeddings, `hidden` the trunk rows a draft reads; `meta` the start of the next pass,
    `slot` a roll-back's row. `keep`: the longest pass whose every row's recurrent state is kept (a roll-back
    can land inside it; at least k−1, so its rows also hold the next window)."""

    def __init__(self, gpu: Gpu, cfg, capacity: int, layer_types, with_hidden: bool, tc: bool, ec: bool,
                 keep: int = 1):  # fmt: skip
        K, D, C, dv = cfg.n_kv_heads, cfg.head_dim, cfg.d_model, cfg.ddl_dv
        layers = len(layer_types)
        self.gpu, self.cfg, self.capacity, self.length = gpu, cfg, capacity, 0
        self.keep = max(int(keep), cfg.linear_conv_kernel - 1, 1)
        self.last: tuple[int, int] | None = None  # (start, rows) of the last trunk pass
        kv = capacity * K * D * F32
        self.kv = [
            (gpu.buffer(kv, label=f"kcache{i}"), gpu.buffer(kv, label=f"vcache{i}"))
            if t == "full_attention"
            else None
            for i, t in enumerate(layer_types)
        ]
        self.gdn = [self._gdn(i) if t == "linear_attention" else None for i, t in enumerate(layer_types)]
        self.hist = (
            [gpu.buffer(capacity * C * dv * F32, label=f"tc_hist{s}") for s in range(2 * layers + 1)]
            if tc
            else []
        )
        self.ehist = gpu.buffer(capacity * C * F32, label="ec_hist") if ec else None
        self.hidden = gpu.buffer(capacity * C * F32, label="hidden_cache") if with_hidden else None
        self.meta = gpu.buffer(16, label="meta")
        self.slot = gpu.buffer(16, label="rollback_slot")
        cos, sin = ref_ops.rope_tables(capacity, D, cfg.rope_theta, np.float64, cfg.rope_dim)
        self.cos = gpu.upload(cos.astype(np.float32), "rope_cos_cache")
        self.sin = gpu.upload(sin.astype(np.float32), "rope_sin_cache")
        self.rope = gpu.upload(np.stack([cos, sin]).astype(np.float32), "rope_tables_cache")  # rope_store's
        self._undo: dict = {}

    def gdn_sizes(self) -> tuple[int, int, int, int, int]:
        """(Ch, k, Hv, E = Dk·Dv, window floats) of the Gated DeltaNet layers."""
        cfg = self.cfg
        k = cfg.linear_conv_kernel
        Ch = linear_conv_channels(cfg)
        return Ch, k, cfg.linear_v_heads, cfg.linear_k_dim * cfg.linear_v_dim, (k - 1) * Ch

    def _gdn(self, i: int) -> GdnCache:
        g = self.gpu
        Ch, k, Hv, E, W = self.gdn_sizes()
        # gpu buffers start zeroed: the window before position 0 and the state S_0 are zeros
        return GdnCache(
            win=g.buffer(W * F32, label=f"gdn_window{i}") if W else None,
            state=g.buffer(Hv * E * F32, label=f"gdn_state{i}"),
            states=g.buffer(Hv * (self.keep + 1) * E * F32, label=f"gdn_pass_states{i}"),
            prev=g.buffer((W + self.keep * Ch) * F32, label=f"gdn_pass_rows{i}") if W else None,
        )

    @property
    def has_gdn(self) -> bool:
        return any(c is not None for c in self.gdn)

    def pass_slots(self, n: int) -> int:
        """State slots per value head a pass of n rows writes: every row's (tc = 1), or, past `keep` rows, the
        start and the end only (tc = n: the states of a long prompt's every row would not fit)."""
        return n + 1 if n <= self.keep else 2

    def rewind(self, length: int, positions) -> None:
        """The Gated DeltaNet layers' window and state back to `length` (a roll-back, on the GPU): 0 resets
        them; otherwise `length` must lie in the last pass (at its start when it was longer than `keep`),
        whose per-row states and rows are still in `states` and `prev`."""
        g = self.gpu
        if length == 0:
            if "reset" not in self._undo:
                call = Call()
                for c in filter(None, self.gdn):
                    for buf in (c.win, c.state):
                        if buf is not None:
                            call += k_ew.fill(g, buf, buf.size // F32, 0.0)
                self._undo["reset"] = call
            self._undo["reset"].run(g)
            self.last = None
            return
        s, n = self.last if self.last is not None else (self.length, 0)
        if not s <= length <= s + n:
            raise GpuError(f"cannot roll a Gated DeltaNet layer's state back to {length}: the cache keeps "
                           f"the states of its last pass only (positions {s}..{s + n})")  # fmt: skip
        j = length - s
        if j == n:
            return
        if n > self.keep and j:
            raise GpuError(f"cannot roll a Gated DeltaNet layer's state back to {length}: a pass of {n} rows "
                           f"(more than {self.keep}) keeps its states at its start and end only")  # fmt: skip
        slots = self.pass_slots(n)
        if slots not in self._undo:
            Ch, k, Hv, E, W = self.gdn_sizes()
            call = Call()
            for c in filter(None, self.gdn):
                state = (c.state, c.states, Hv, E, slots * E, E, None)
                if c.win is None:
                    call += k_dec.take_rows(g, *state[:2], self.slot, *state[2:6])
                else:  # and positions j .. j + k − 2 of [window before; the pass's rows]
                    call += k_dec.take_rows2(g, state, (c.win, c.prev, 1, W, 0, Ch, None), self.slot)
            self._undo[slots] = call
        rec = g.recorder()
        rec.copy(positions, 4 * j, self.slot, 0, 4)
        self._undo[slots].record(rec)
        rec.submit()

    def recurrent(self, i: int) -> tuple[np.ndarray | None, np.ndarray]:
        """Layer i's (window (k−1, Ch) or None, state (Hv, Dk, Dv)) downloaded (tests and inspection)."""
        c, cfg = self.gdn[i], self.cfg
        Ch, k, Hv, E, W = self.gdn_sizes()
        win = self.gpu.download(c.win, np.float32, W).reshape(k - 1, Ch) if c.win is not None else None
        state = self.gpu.download(c.state, np.float32, Hv * E)
        return win, state.reshape(Hv, cfg.linear_k_dim, cfg.linear_v_dim)
