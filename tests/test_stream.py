"""The layer-streamed trunk (`stream.Trunk`) and the GPU memory plan (`gpumem`): a tiny transformer, a tiny Deep
Delta model and a tiny hybrid (three blocks each, so two slots take turns and a hybrid's slot holds both kinds of
block), each forced to stream by a budget below what its resident plan needs, give the resident plan's results
bit for bit: heal's teacher rows and its healed file, accept's acceptance, eval's loss and spectral diagnostics
(and the trunk's rows equal the plain `Net` + `InferenceWork` forward's). The plan's count of what it allocates
equals the allocation; the plan line; a budget below one layer refused in one line; generate refusing a model
past the budget; the driver's out-of-memory as one line; heal's scratch file gone after success, failure and
Ctrl-C."""

from __future__ import annotations

import collections
import gc
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import replace

import numpy as np
import pytest
from conftest import REPO
from helpers import make_model, make_text, perturbed, tiny_cfg

from ddl_ref.config import MtpConfig, apply_arch
from ddl_wgpu import backend
from ddl_wgpu.data import ByteTokenizer, eval_windows
from ddl_wgpu.engine import gpumem, heal_gpu
from ddl_wgpu.files import hostmem
from ddl_wgpu.files.container import open_checkpoint
from ddl_wgpu.files.modelfile import Model, load_model
from ddl_wgpu.jobs import accept, heal

HEAL = heal.HealConfig(chain=2, window=24, tokens=600, batch=2, eval_every=3, patience=0, lr=3e-3, epochs=0.25,
                       refresh=3)  # fmt: skip


def kinds() -> dict:
    """Three-block models with a draft: two slots take turns, and the hybrid's (L L F) slot 0 holds both kinds."""
    mtp = MtpConfig(trunk_hidden="post_norm")
    return {
        "transformer": tiny_cfg(n_layers=3, qk_norm="pre_rope", mtp=mtp),
        "ddl": tiny_cfg(
            n_layers=3, mtp=mtp, residual="delta", ddl_dv=4, ddl_compressor="cc", ddl_expand_embed=True
        ),
        "hybrid": replace(apply_arch(tiny_cfg(n_layers=3, mtp=mtp), "qwen3_5"), rotary_dim=4),
    }


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("stream")
    return {name: make_model(d / f"{name}.ddlw", cfg) for name, cfg in kinds().items()}, make_text(
        d / "t.txt", 400
    )


def squeezed(plan_of) -> int:
    """A budget under which `plan_of(budget)` streams in more than one block: the largest of a descending series
    below the resident plan's need."""
    budget = int(plan_of(None).peak_bytes / (1 - gpumem.RESERVE_FRACTION))
    for _ in range(40):
        budget = budget * 7 // 8
        try:
            p = plan_of(budget)
        except gpumem.GpuBudgetError:
            continue
        if p.streamed and p.blocks > 1:
            return budget
    raise AssertionError("no budget makes this trunk stream")


# ----------------------------------------------------------------------------------------------------------
# without a GPU


def test_sizes_and_the_budget(monkeypatch):
    assert gpumem.parse_size("16GB") == gpumem.parse_size("16G") == gpumem.parse_size("16GiB") == 16 << 30
    assert gpumem.parse_size("512MiB") == 512 << 20 and gpumem.parse_size("1.5k") == 1536
    assert gpumem.parse_size("17179869184") == 16 << 30
    for bad in ("", "lots", "16 GBs", "-1G", "0.1k"):
        with pytest.raises(gpumem.SizeError, match="--gpu-memory"):
            gpumem.parse_size(bad)
    monkeypatch.delenv(gpumem.ENV_GPU_MEMORY, raising=False)
    assert gpumem.budget(None) is None and gpumem.budget("2G") == 2 << 30
    monkeypatch.setenv(gpumem.ENV_GPU_MEMORY, "3G")
    assert gpumem.budget(None) == 3 << 30 and gpumem.budget("1G") == 1 << 30  # the option wins
    assert gpumem.even_block(156, 67) == 52 and gpumem.even_block(10, 4, multiple=3) == 3


def test_the_plan_takes_the_resident_trunk_when_it_fits_else_streams_else_refuses():
    # the trunk phase grows with the block: 1000 bytes of weights resident, 400 streamed, 10 per window
    def trunk(streamed, block):
        return (400 if streamed else 1000) + 10 * block

    def weights(streamed):
        return 400 if streamed else 1000

    def plan(budget, draft=300):
        return gpumem.plan_trunk("heal", 500, 20, budget, trunk, weights, draft_bytes=draft)

    assert (
        not plan(None).streamed
        and plan(None).block == gpumem.even_block(500, gpumem.BLOCK_TOKENS // 20) == 250
    )
    big = plan(20000)
    assert not big.streamed and big.trunk_bytes <= 20000 * (1 - gpumem.RESERVE_FRACTION)
    mid = plan(3000)
    assert mid.streamed and mid.trunk_bytes <= 3000 * 0.95 and mid.block == gpumem.even_block(500, mid.block)
    assert "streamed" in mid.line() and f"{mid.blocks} passes" in mid.line() and "budget" in mid.line()
    with pytest.raises(gpumem.GpuBudgetError, match="below what the streamed trunk needs"):
        plan(430)
    with pytest.raises(gpumem.GpuBudgetError, match="draft after the trunk"):
        plan(600, draft=900)


# ----------------------------------------------------------------------------------------------------------
# the trunk


@pytest.mark.parametrize("name", ["transformer", "ddl", "hybrid"])
def test_streamed_teacher_gives_the_resident_and_the_plain_forward_bits(gpu, monkeypatch, name):
    """topk_rows through two slots (f16 on the hybrid) equal the resident trunk's, and the
    plain Net + InferenceWork forward's top-k and hidden rows; the plan's dry count equals the allocation."""
    from ddl_wgpu.engine.inference import InferenceWork
    from ddl_wgpu.engine.net import Net

    cfg = kinds()[name]
    dtype = "f16" if name == "hybrid" else "f32"
    m = Model(cfg, perturbed(cfg))
    rng = np.random.default_rng(3)
    ids, lengths = rng.integers(0, 256, (5, 20)), np.array([20, 17, 20, 9, 20])
    resident = backend.make_teacher("wgpu", m, 2, trunk_dtype=dtype, plan=heal_gpu._Shape(False, 5))
    want = resident.topk_rows(ids, lengths, 6)
    _, _, pre, post = resident.topk_hidden(ids, 6)
    trunk = {n: a for n, a in m.params.items() if not n.startswith("model.mtp.")}
    plain = Net(gpu, replace(cfg, mtp=None), trunk, inference=True, dtype=dtype, work_class=InferenceWork)
    work = plain.work(5, 20)
    top, probs = work.topk(ids, 6)
    np.testing.assert_array_equal(top, want[0])
    np.testing.assert_array_equal(probs, want[1])
    np.testing.assert_array_equal(work.hidden()[1], post)
    streamed = backend.make_teacher("wgpu", m, 2, trunk_dtype=dtype, plan=heal_gpu._Shape(True, 2))
    assert streamed.net.S == 2
    for _ in range(2):  # the second pass re-uploads every slot
        got = [streamed.topk_rows(ids[s : s + 2], lengths[s : s + 2], 6) for s in range(0, 5, 2)]
        for a, b in zip(want, (np.concatenate(x) for x in zip(*got, strict=True)), strict=True):
            np.testing.assert_array_equal(a, b)
    streamed.release()
    # what the plan counts is what the teacher allocates, buffer by buffer (from a device without scratch)
    backend.open_gpu(None).drop_scratch()
    made, dry = collections.Counter(), collections.Counter()
    create = type(gpu)._create

    def counted(g, size, *a, **k):
        made.update([size])
        return create(g, size, *a, **k)

    monkeypatch.setattr(type(gpu), "_create", counted)
    t = backend.make_teacher("wgpu", m, 2, trunk_dtype=dtype, plan=heal_gpu._Shape(True, 2))
    t.work(20)._topk_call(6)
    monkeypatch.setattr(type(gpu), "_create", create)

    class Counting(gpumem.DryGpu):
        def buffer(self, nbytes, label="", usage=None):
            b = super().buffer(nbytes, label)
            dry.update([b.size])
            return b

    t = heal_gpu.WgpuTeacher(
        Counting(gpu), heal_gpu.fake_params(cfg), cfg, 2, dtype, plan=heal_gpu._Shape(True, 2)
    )
    t.work(20)._topk_call(6)
    assert dry == made


def test_the_host_buffer_plan_lands_the_bytes_write_lands(monkeypatch):
    """`stream.host_plan`: the pieces packed at whole words, copied back by its copies, give the slot exactly what
    `Gpu.write` gives it (a piece's last word padded with zeros, the bytes between tensors untouched); adjacent
    pieces of a tensor go in one copy. DDL_WGPU_UPLOAD takes host (the default) or write only."""
    from ddl_wgpu.engine import stream

    rng = np.random.default_rng(0)
    big = rng.standard_normal(40).astype(np.float32)
    odd = rng.standard_normal(7).astype(np.float16)  # 14 bytes: a word's half to pad
    pieces = [(0, 0, big[:24]), (0, 96, big[24:]), (0, 192, odd), (1, 16, odd[:3]), (0, 160, big[:4])]
    slots = {a: np.full(256, 0xAB, np.uint8) for a in (0, 1)}
    want = {a: v.copy() for a, v in slots.items()}
    for arena, offset, piece in pieces:  # what Gpu.write puts there
        b = piece.view(np.uint8)
        want[arena][offset : offset + b.nbytes] = b
        want[arena][offset + b.nbytes : offset + -(-b.nbytes // 4) * 4] = 0
    used, fills, copies = stream.host_plan(pieces)
    host = np.full(used, 0xCD, np.uint8)
    for pos, raw in fills:  # as LayerStream._from_host fills it
        host[pos : pos + raw.nbytes] = raw
        host[pos + raw.nbytes : pos + -(-raw.nbytes // 4) * 4] = 0
    for arena, src, offset, n in copies:
        assert src % 4 == 0 and offset % 4 == 0 and n % 4 == 0
        slots[arena][offset : offset + n] = host[src : src + n]
    for a in slots:
        np.testing.assert_array_equal(slots[a], want[a])
    assert used == 160 + 16 + 8 + 16 and len(copies) == 4  # big's two pieces in one copy
    monkeypatch.delenv(stream.ENV_UPLOAD, raising=False)
    assert stream.upload_mode() == "host"
    monkeypatch.setenv(stream.ENV_UPLOAD, "Write")
    assert stream.upload_mode() == "write"
    monkeypatch.setenv(stream.ENV_UPLOAD, "mapped")
    with pytest.raises(stream.GpuError, match="DDL_WGPU_UPLOAD='mapped': one of host, write"):
        stream.upload_mode()


def test_host_buffer_uploads_give_the_write_uploads_bits(monkeypatch):
    """The default uploads on a Dawn device with host-mapped-pointer (lavapipe's has it) go through host buffers:
    the f16 hybrid's teacher streamed through two slots (twice: every slot uploaded again) and loaded resident
    gives the bits of the streamed teacher that writes its layers (DDL_WGPU_UPLOAD=write: `queue.write_buffer`),
    and no layer goes up through `Gpu.write`."""
    from ddl_wgpu.engine import stream
    from ddl_wgpu.runtime import gpu as g

    try:
        g.resolve("dawn", None, g.select_adapter)
        dawn = g.Gpu(runtime="dawn")
    except g.GpuError as e:
        pytest.skip(f"Dawn cannot run here: {e}")
    if not dawn.host_buffers:
        pytest.skip(f"{dawn.name} has no host-mapped-pointer under Dawn")
    cfg = kinds()["hybrid"]
    m = Model(cfg, perturbed(cfg))
    ids, lengths = np.random.default_rng(3).integers(0, 256, (4, 20)), np.array([20, 17, 9, 20])

    def teacher(streamed: bool):
        return heal_gpu.WgpuTeacher(dawn, m.params, cfg, 2, "f16", plan=heal_gpu._Shape(streamed, 2))

    def rows(t):
        got = [t.topk_rows(ids[s : s + 2], lengths[s : s + 2], 6) for s in range(0, 4, 2)]
        return [np.concatenate(x) for x in zip(*got, strict=True)]

    monkeypatch.setenv(stream.ENV_UPLOAD, "write")
    t = teacher(True)
    want = rows(t)
    assert t.trunk.stream.mode == "write" and t.trunk.stream.host is None
    t.release()
    monkeypatch.delenv(stream.ENV_UPLOAD)
    writes = []
    write = type(dawn).write
    monkeypatch.setattr(
        type(dawn), "write", lambda gg, buf, *a, **k: (writes.append(buf.label), write(gg, buf, *a, **k))
    )
    for streamed in (True, False):
        t = teacher(streamed)
        for _ in range(2 if streamed else 1):
            for a, b in zip(want, rows(t), strict=True):
                np.testing.assert_array_equal(a, b)
        assert t.trunk.stream.mode == "host" and t.trunk.stream.turn >= 3, streamed
        t.release()
    assert not [w for w in writes if w.startswith("layer_slot")], writes


def test_host_buffer_uploads_count_no_layer_staging(gpu, monkeypatch):
    """The staging a trunk counts (`staging_bytes`, in the plan and the engine's count alike): two layers where
    they are written, only the resident tensors' two pieces where they go up through host buffers (a device
    with host-mapped memory, uploads "host"); counted on the plan's dry device, as the memory plan counts."""
    from ddl_wgpu.engine import stream

    cfg = tiny_cfg(ffn_hidden=512)  # layers larger than the embedding, so the two counts differ
    piece = 4 * cfg.vocab_size * cfg.d_model  # the largest resident tensor, the embedding
    got = {}
    for feature, mode in ((False, "host"), (True, "write"), (True, "host")):
        monkeypatch.setenv(stream.ENV_UPLOAD, mode)
        dry = gpumem.DryGpu(gpu)
        dry.host_buffers = feature  # as `Gpu.host_buffers` answers on a device with host-mapped-pointer
        w = stream.TrunkWeights(dry, cfg, None, "f32", 2, None)
        layer = max(sum(k.arena_sizes) for k in w.kind)
        got[feature, mode] = w.staging_bytes
    assert layer > piece and got[False, "host"] == got[True, "write"] == 2 * layer
    assert got[True, "host"] == 2 * piece


@pytest.mark.parametrize("streamed", [False, True])
def test_uploads_keep_at_most_the_counted_staging_alive(gpu, monkeypatch, streamed):
    """wgpu keeps each `queue.write_buffer`'s staging until the submit carrying it is done: the bytes written
    into submits not yet waited for never exceed what the trunk counts for them (`staging_bytes`: two layers),
    loading a resident trunk and streaming through two slots alike (on the H200 an unbounded host queued 20 GB)."""
    cfg = kinds()["transformer"]
    m = Model(cfg, perturbed(cfg))
    G = type(gpu)
    write, submit, wait_for = G.write, G.submit_indexed, G.wait_for
    st = {"pending": 0, "open": {}, "most": 0, "waits": 0}

    def counting_write(g, buf, array, offset=0):
        st["pending"] += np.asarray(array).nbytes
        st["most"] = max(st["most"], st["pending"] + sum(st["open"].values()))
        return write(g, buf, array, offset)

    def counting_submit(g, cb):
        index = submit(g, cb)
        st["open"][index], st["pending"] = st["pending"], 0
        return index

    def counting_wait(g, index):
        st["waits"] += 1
        for k in [k for k in st["open"] if k <= index]:
            del st["open"][k]
        return wait_for(g, index)

    monkeypatch.setattr(G, "write", counting_write)
    monkeypatch.setattr(G, "submit_indexed", counting_submit)
    monkeypatch.setattr(G, "wait_for", counting_wait)
    external = G.external
    monkeypatch.setattr(G, "external", lambda g, n: (st.setdefault("counted", n), external(g, n)))
    g = backend.open_gpu(None)  # the teacher's device
    g.reset_peak()
    live0 = g.live
    t = backend.make_teacher("wgpu", m, 2, plan=heal_gpu._Shape(streamed, 2))
    w = t.trunk.weights
    assert t.trunk.gpu is g
    layer = max(sum(k.arena_sizes) for k in w.kind)
    # counted while uploads may come: a streamed trunk until released, a resident one while it loads
    assert st["counted"] >= 2 * layer and w.staging_bytes == (st["counted"] if streamed else 0)
    ids = np.random.default_rng(0).integers(0, 256, (4, 20))
    for s in range(0, 4, 2):
        t.topk_rows(ids[s : s + 2], np.full(2, 20), 6)
    assert st["waits"] >= 2 and 0 < st["most"] <= st["counted"]
    assert g.peak - live0 >= st["counted"]  # the staging was in the engine's count
    t.release()
    assert w.staging_bytes == 0


# ----------------------------------------------------------------------------------------------------------
# the draft's phase


def _draft_kit(cfg, rng, B: int, T: int, k: int):
    """Rows, teacher top-k, weights, tokens and masks of B windows of T for a draft's step and chain."""
    C, V = cfg.d_model, cfg.vocab_size
    tok = rng.integers(0, V, (B, T))
    valid = np.ones((B, T), bool)
    valid[1, T - 3 :] = False
    tid = np.argsort(rng.random((B, T, V)), axis=-1)[..., :k]
    tp = rng.random((B, T, k)).astype(np.float32)
    return rng.standard_normal((B, T, C)).astype(np.float32), tid, tp / tp.sum(-1, keepdims=True), tok, valid


def _heal_ops(d, kit, chain: int, stacked: bool) -> list:
    """What heal does with its draft, in order (steps, evaluation, refresh rows, a kept copy's forwards, the
    acceptance's greedy chain, the best weights out and back, the export) -> every result."""
    x, tid, tp, tok, valid = kit
    B, T, _ = x.shape
    w = valid.astype(np.float32)
    out = [d.step(x, tid, tp, w, 1e-3, 1, 1.0)]
    x2 = d.next_rows(x, tok, valid)
    kept = d.snapshot()
    for j in range(2, chain + 1):
        xs, tids, tps, ws = x2, tid, tp, w
        if stacked:  # steps 1..j stacked, only step j's rows weighted (heal's `_Chain.join`)
            xs = np.concatenate([x] + [x2] * (j - 1), axis=1)
            tids, tps, ws = (np.concatenate([np.full((B, (j - 1) * T, *a.shape[2:]), v, a.dtype), a], axis=1)
                             for a, v in ((tid, 0), (tp, 1.0), (w, 0.0)))  # fmt: skip
        c = {"chain": j} if stacked else {}
        out += [d.step(xs, tids, tps, ws, 1e-3, j, 1.0, **c), d.loss_sum(xs, tids, tps, ws, **c)]
        if stacked:
            out.append(d.next_rows(xs, tok, valid, chain=j))
    best = d.snapshot()
    with d.using(kept):
        out.append(d.next_rows(x, tok, valid))
    out.append(d.greedy_chain(None, tok, valid, chain, stacked, rows=x))
    out.append(d.step(x, tid, tp, w, 1e-3, 9, 1.0))
    d.restore(best)
    return out + [d.export()]


@pytest.mark.parametrize("mode", ["stacked", "per-step"])
def test_the_draft_phase_count_is_what_heal_allocates(gpu, monkeypatch, mode):
    """heal's draft phase after a streamed trunk pass: what the trunk leaves and what the draft and its `prepare`
    allocate equal the plan's dry count, buffer by buffer, and its peak the plan's `draft_bytes`; after `prepare`
    all heal does with the draft (`_heal_ops`) allocates nothing."""
    cfg = kinds()["hybrid"]
    m = Model(cfg, perturbed(cfg))
    B, T, k, chain, stacked = 2, 16, 6, 3, mode == "stacked"
    spec = {"k": k, "chain": chain, "stacked": stacked, "kl_form": "full"}
    rng = np.random.default_rng(5)
    made: list = []
    create = type(gpu)._create

    def counted(g, size, *a, **kw):
        made.append(size)
        return create(g, size, *a, **kw)

    gpu.drop_scratch()  # the device-wide scratch of earlier tests (the teacher's release drops it)
    gc.collect()
    live0 = gpu.live
    teacher = heal_gpu.WgpuTeacher(gpu, m.params, cfg, B, plan=heal_gpu._Shape(True, 3))
    ids = rng.integers(0, cfg.vocab_size, (3, T))
    teacher.topk_rows(ids, np.array([T, T - 4, T]), k)
    teacher.release()
    left = gpu.live - live0
    monkeypatch.setattr(type(gpu), "_create", counted)
    gpu.reset_peak()
    d = heal_gpu.WgpuDraft(gpu, m.params, cfg, None, B, "full", teacher)
    d.prepare(T, k, chain, stacked)
    peak, n = gpu.peak - live0, len(made)

    class Counting(gpumem.DryGpu):
        sizes: list = []

        def buffer(self, nbytes, label="", usage=None):
            b = super().buffer(nbytes, label)
            self.sizes.append(b.size)
            return b

    dry = Counting(gpu)
    t = heal_gpu.WgpuTeacher(dry, heal_gpu.fake_params(cfg), cfg, B, "f32", plan=heal_gpu._Shape(True, 1))
    t.input.buffers(B * T)
    t.release()
    assert dry.live == left  # the embedding, final norm, head; the draft's input projection and rows
    mark = len(dry.sizes)
    heal_gpu.WgpuDraft(dry, heal_gpu.fake_params(cfg), cfg, None, B, "full", t).prepare(T, k, chain, stacked)
    assert collections.Counter(dry.sizes[mark:]) == collections.Counter(made)
    plan = heal_gpu.plan_trunk_job(gpu, "heal", cfg, "f32", 10, T, B, None, k, draft=spec)
    assert plan.draft_bytes == dry.peak == peak
    _heal_ops(d, _draft_kit(cfg, rng, B, T, k), chain, stacked)
    assert len(made) == n and gpu.peak - live0 == peak


def test_the_draft_works_sharing_activations_give_their_own_works_bits(gpu):
    """The draft's works share their activations (`Blocks.act` with `shared_acts`, sized by the largest): every
    step, loss, refresh row, acceptance chain and exported weight equals, bit for bit, that of a draft whose works
    each hold their own."""
    cfg = kinds()["hybrid"]
    params = perturbed(cfg)
    kit = _draft_kit(cfg, np.random.default_rng(6), 2, 16, 6)
    got = {}
    for shared in (True, False):
        d = heal_gpu.WgpuDraft(gpu, params, cfg, None, 2, "full")
        if not shared:
            d.net.shared_acts = None
        d.prepare(16, 6, 3, True)
        got[shared] = _heal_ops(d, kit, 3, True)
    for a, b in zip(got[True], got[False], strict=True):
        if isinstance(a, dict):
            assert a.keys() == b.keys() and all(np.array_equal(a[n], b[n]) for n in a)
        else:
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_the_draft_rows_gathered_on_the_host_are_the_gpu_tables(gpu):
    """The trunk's release frees its untied embedding, and the draft's input rows then gather E[t] on the host, as
    the f16 table held them: the refresh's rows and the acceptance chains (stacked and per-step) equal those of a
    draft on the unreleased trunk, bit for bit."""
    cfg = replace(kinds()["hybrid"], tie_embeddings=False)
    m = Model(cfg, perturbed(cfg))
    x, _tid, _tp, tok, valid = _draft_kit(cfg, np.random.default_rng(7), 2, 16, 6)
    got = {}
    for release in (False, True):
        t = heal_gpu.WgpuTeacher(gpu, m.params, cfg, 2, "f16", plan=heal_gpu._Shape(True, 2))
        live = gpu.live
        if release:
            t.release()
            assert t.input.table is not None and gpu.live < live - cfg.vocab_size * cfg.d_model * 2
        d = heal_gpu.WgpuDraft(gpu, m.params, cfg, None, 2, "full", t)
        got[release] = [d.next_rows(x, tok, valid)] + [d.greedy_chain(None, tok, valid, 3, st, rows=x) for st in
                                                       (True, False)]  # fmt: skip
    for a, b in zip(got[False], got[True], strict=True):
        np.testing.assert_array_equal(a, b)


# ----------------------------------------------------------------------------------------------------------
# the jobs


def _plan_line(events):
    return [e["line"] for e in events if e["event"] == "plan"]


@pytest.mark.parametrize("name", ["transformer", "hybrid"])
def test_heal_streamed_writes_the_resident_plans_file(files, tmp_path, name):
    """heal with a budget below the resident plan streams the trunk (the plan says so), keeps its chain rows in a
    scratch file past --host-memory, and writes the file the resident run writes, byte for byte; the engine's
    peak stays within the plan; the scratch file is gone after."""
    model, text = files[0][name], files[1]
    cfg = HEAL if name == "transformer" else replace(HEAL, trunk_dtype="f16")
    plan_of = lambda b: backend.plan_trunk("wgpu", "heal", load_model(model).cfg, None, cfg.trunk_dtype, 25,  # noqa: E731
                                           24, cfg.batch, b, 8, draft={"k": 8, "chain": 2, "kl_form": "full",
                                           "stacked": cfg.chain_attention == "stacked"})  # fmt: skip
    budget = squeezed(plan_of)
    reports, lines = {}, {}
    gpu = backend.open_gpu(None)  # heal's device
    for label, gm, hm in (("resident", None, None), ("streamed", budget, 1024)):
        events = []
        gpu.drop_scratch()  # the device-wide scratch of earlier tests: heal's own drops it between its phases
        gc.collect()
        gpu.reset_peak()
        before = gpu.live
        reports[label] = heal.heal(model, str(text), tmp_path / f"{label}.ddlw", replace(cfg, topk=8), backend="wgpu",
                                   progress=events.append, gpu_memory=gm, host_memory=hm)  # fmt: skip
        lines[label] = _plan_line(events)
        plan, peaks = reports[label]["plan"], reports[label]["gpu_phase_peak_bytes"]
        assert gpu.peak - before <= max(plan["trunk_bytes"], plan["draft_bytes"])
        assert peaks == {"trunk": plan["trunk_bytes"], "draft": plan["draft_bytes"]}  # what it counted
        assert not hostmem.scratch_files(tmp_path / f"{label}.ddlw")
    assert "resident" in lines["resident"][0] and "streamed" in lines["streamed"][0]
    assert reports["streamed"]["plan"]["blocks"] > 1 and reports["streamed"]["scratch_bytes"] > 0
    assert reports["resident"]["scratch_bytes"] == 0
    drop = ("out", "plan", "scratch_bytes", "gpu_peak_bytes", "gpu_phase_peak_bytes")
    assert {k: v for k, v in reports["resident"].items() if k not in drop} == {
        k: v for k, v in reports["streamed"].items() if k not in drop
    }
    with open_checkpoint(tmp_path / "resident.ddlw") as a, open_checkpoint(tmp_path / "streamed.ddlw") as b:
        assert a.names() == b.names() and a.provenance == b.provenance
        for n in a.names():
            np.testing.assert_array_equal(a.tensor(n), b.tensor(n))


def test_accept_streamed_gives_the_resident_result(gpu, files, tmp_path):
    model, text = files[0]["hybrid"], str(make_text(tmp_path / "t.txt", 700))  # a trunk larger than the draft
    cfg = load_model(model).cfg
    records = accept.load_records(text, ByteTokenizer(), 2500)
    n = sum(w.size > 2 for w in accept.make_windows(records, 24, 3))
    plan_of = lambda b: backend.plan_trunk("wgpu", "accept", cfg, None, "f32", n, 24, accept.BATCH, b,  # noqa: E731
                                           draft={"k": 1, "chain": 2, "stacked": True, "kl_form": "full"})  # fmt: skip
    budget = squeezed(plan_of)
    said = []
    a = accept.accept_file(model, text, 2, 24, 2500, backend="wgpu", chain_attention="stacked")
    b = accept.accept_file(model, text, 2, 24, 2500, backend="wgpu", chain_attention="stacked", gpu_memory=budget,
                           say=said.append)  # fmt: skip
    assert a["plan"]["mode"] == "resident" and b["plan"]["mode"] == "streamed" and "streamed" in said[0]
    assert {k: v for k, v in a.items() if k != "plan"} == {k: v for k, v in b.items() if k != "plan"}


@pytest.mark.parametrize("name", ["transformer", "ddl"])
def test_eval_streamed_gives_the_resident_and_the_training_nets_numbers(gpu, files, name):
    """eval's GPU path (several batches per pass, each batch's sums over its own rows) equals the training
    net's batch-by-batch evaluation (`train.evaluate`, what eval ran before), resident and streamed."""
    from ddl_wgpu.jobs import train, trunk_eval

    model = files[0][name]
    m = load_model(model)
    ds = eval_windows(str(files[1]), tokenizer=ByteTokenizer(), seq_len=16, batch_size=3, vocab_size=256)
    want = train.evaluate(backend.make_net(m.cfg, m.params, "wgpu", None), ds, 0, spectral=True)
    budget = squeezed(lambda b: trunk_eval.plan_eval(gpu, m.cfg, 3, 16, ds.num_batches, b))
    for b in (None, budget):
        got, plan = trunk_eval.evaluate_file(model, m.cfg, ds, None, b)
        assert plan.streamed == (b is not None) and plan.block % 3 == 0
        assert got == want
    assert (want["spectral"] is not None) == (name == "ddl")


# ----------------------------------------------------------------------------------------------------------
# the command line


def test_cli_plan_line_refusal_generate_and_out_of_memory(files, tmp_path, cli, ok, user_error):
    model, text = files[0]["transformer"], files[1]
    out = tmp_path / "h.ddlw"
    args = ["heal", model, "--data", text, "--out", out, "--window", "24", "--tokens", "600", "--batch", "2",
            "--chain", "2", "--backend", "wgpu"]  # fmt: skip
    line = user_error(cli(*args, "--gpu-memory", "20KB"), "--gpu-memory 20.0 KiB is below", "two layer slots")
    assert "needs at least --gpu-memory" in line and not out.exists() and not hostmem.scratch_files(out)
    r = ok(cli("eval", model, "--data", text, "--seq-len", "16", "--batch", "3", "--backend", "wgpu",
               "--gpu-memory", "1GB", "--json"))  # fmt: skip
    assert (
        "gpu memory plan: eval trunk resident" in r.stderr
        and json.loads(r.stdout)["plan"]["mode"] == "resident"
    )
    gen = ["generate", model, "--prompt", "the", "--max-new-tokens", "2", "--backend", "wgpu"]
    user_error(
        cli(*gen, "--gpu-memory", "16KB"), "generate: the model needs at least", "--gpu-memory is 16.0 KiB"
    )
    gpumem.check_decode(load_model(model).cfg, "f32", 1 << 20)  # what fits passes
    env = {**os.environ, "DDL_WGPU_DEVICE_MEMORY": "60000"}  # a card that is full: the driver's out-of-memory
    r = subprocess.run([sys.executable, "-m", "ddl_wgpu.cli", "eval", str(model), "--data", str(text), "--seq-len",
                        "16", "--backend", "wgpu"], capture_output=True, text=True, cwd=REPO,
                       env={**env, "PYTHONPATH": str(REPO)})  # fmt: skip
    user_error(r, "the GPU is out of memory", "--gpu-memory")


def test_heal_scratch_file_goes_after_a_failure_and_after_ctrl_c(files, tmp_path, monkeypatch):
    model, text = files[0]["transformer"], str(files[1])
    out = tmp_path / "f.ddlw"

    def fail(self, events, step, plan=()):
        assert hostmem.scratch_files(out)  # the chain's rows are in it now
        raise heal.HealError("stopped here")

    monkeypatch.setattr(heal._Chain, "refresh_event", fail)
    with pytest.raises(heal.HealError, match="stopped here"):
        heal.heal(model, text, out, HEAL, backend="wgpu", host_memory=1024)
    assert not hostmem.scratch_files(out) and not out.exists()
    # Ctrl-C while the draft trains (many steps): interrupted, exit 130, the scratch file gone, no output
    out = tmp_path / "c.ddlw"
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1"}
    p = subprocess.Popen([sys.executable, "-m", "ddl_wgpu.cli", "heal", str(model), "--data", text, "--out", str(out),
                          "--window", "24", "--tokens", "600", "--batch", "2", "--chain", "2", "--epochs", "50",
                          "--backend", "wgpu", "--host-memory", "1KB"], stderr=subprocess.PIPE, text=True,
                         stdout=subprocess.DEVNULL, env=env)  # fmt: skip
    t0 = time.time()
    while not hostmem.scratch_files(out) and p.poll() is None and time.time() - t0 < 120:
        time.sleep(0.05)
    assert hostmem.scratch_files(out), p.stderr.read() if p.poll() is not None else "no scratch file"
    p.send_signal(signal.SIGINT)
    err = p.communicate(timeout=120)[1]
    assert p.returncode == 130 and "interrupted" in err and "Traceback" not in err
    assert not hostmem.scratch_files(out) and not out.exists()


def test_the_benches_smoke_runs(tmp_path):
    """`bench/heal.py --gpu-memory` (resident and streamed passes, the draft after them, its profile) and
    `bench/heal_e2e.py --smoke` (a heal command of a model on disk) run on a tiny hybrid: the streamed pass gives
    the resident bits and stays within its plan."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    a, b, c = tmp_path / "memory.json", tmp_path / "e2e.json", tmp_path / "plan.json"
    for cmd in (["bench/heal.py", "--shape", "quick-hybrid", "--gpu-memory", "4MB", "--pass-windows", "12", "--steps",
                 "1", "--chain", "2", "--profile", "--json", a],
                ["bench/heal_e2e.py", "--smoke", "--dir", tmp_path, "--out-dir", tmp_path / "out", "--json", b],
                ["bench/heal_plan.py", "--shape", "quick-hybrid", "--gpu-memory", "16MB", "--limits", "adapter",
                 "--window", "32", "--windows", "40", "--json", c]):  # fmt: skip
        r = subprocess.run(
            [sys.executable, *map(str, cmd)], capture_output=True, text=True, cwd=REPO, env=env
        )
        assert r.returncode == 0, r.stdout + r.stderr
    mem = json.loads(a.read_text())["gpu_memory"]
    assert [e["label"] for e in mem["phases"]] == ["resident", "streamed"]
    for e in mem["phases"][1:]:
        assert (
            e["same_bits"]
            and e["plan"]["mode"] == "streamed"
            and e["engine_peak_bytes"] <= e["plan"]["trunk_bytes"]
        )
    assert (
        mem["draft"]["engine_peak_bytes"] == mem["phases"][-1]["plan"]["draft_bytes"]
    )  # prepared as planned
    runs = mem["draft"]["eval_chain_runs_s"]  # the series of held-out batches, timed several times
    assert len(runs) >= 8 and min(runs) <= mem["draft"]["eval_chain_s"] <= max(runs)
    for prof in mem["draft"]["profile_ms"].values():  # every phase of a step and an evaluation, timed
        phases = {key.split("|")[0] for key, ms in prof.items() if ms > 0}
        assert {"train forward", "train head+kl", "train backward", "eval forward", "eval head+kl"} <= phases
    for top in mem["draft"]["profile_dispatches"].values():  # the largest single dispatches, largest first
        ms = [d[2] for d in top]
        assert ms == sorted(ms, reverse=True) and all(len(d[1]) == 3 for d in top) and len(top) > 0
    e2e = json.loads(b.read_text())["result"]
    assert e2e["exit"] == 0 and e2e["plan"]["mode"] == "streamed" and e2e["peak_rss_bytes"] > 0
    assert e2e["engine_peak_bytes"] == e2e["plan"]["peak_bytes"]  # each phase's as counted (stacked chains)
    assert not (tmp_path / "quick-hybrid.ddlw").exists()  # removed without --keep
    rows = {r["chain_attention"]: r for r in json.loads(c.read_text())["rows"]}
    assert rows["stacked"]["plan"]["draft_bytes"] > rows["per-step"]["plan"]["draft_bytes"] > 0
    assert all(0 < sum(n for _, n in r["draft_labels"]) <= r["plan"]["draft_bytes"] for r in rows.values())
