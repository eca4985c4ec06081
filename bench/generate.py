"""Generation speed at batch 1: prefill tokens/s and decode tokens/s of `ddl-wgpu generate`'s GPU engine, with
and without speculative decoding, against PyTorch eager on the same GPU running the same model with a KV cache.

    python3 bench/generate.py                         # the `small` preset (f32) and a Qwen-like shape (f16)
    python3 bench/generate.py --shapes small          # one shape
    python3 bench/generate.py --model demo.ddlw       # a trained model file (its own draft and acceptance)
    python3 bench/generate.py --model m.ddlw --prompt-data stdlib   # ... prompted with real text
    python3 bench/generate.py --model m.ddlw --prompt-data stdlib --prompts 16   # ... and 16 short continuations
    python3 bench/generate.py --quick                 # d 64, vocab 512, 2 layers (lavapipe smoke test)
    python3 bench/generate.py --shapes small-hybrid,qwen38-27b,qwen38-27b-4l --fla-path /tmp/fla   # hybrids

Shapes: `small` (the DDL paper's small model: d 768, 12 layers, 6 x 128 heads, vocab 50304, f32) and `qwen`
(Qwen3-1.7B-like: d 2048, 28 layers, 16 x 128 heads over 8 kv heads, ffn 6144, vocab 151936, tied, pre-RoPE
q/k norm, theta 1e6, the trunk's big matrices in f16); both with a one-layer MTP draft. Weights come from
`ddl_ref.params.init_params` (--seed) unless --model is given: a random draft agrees with a random trunk
about 1/V of the time, so the speculative row of a synthetic model measures the cost of speculation at
(almost) zero acceptance; a model trained with `--mtp` (and healed) gives the real acceptance and speed-up.

What is timed (wall clock, `time.perf_counter`, every call ends with a read-back, so it is synchronised):
- prefill: `WgpuEngine.feed(prompt, "argmax", last_only=True)` of --prompt tokens on an empty cache (one
  pass: the training kernels; the head on the last row; the next token read back), as `generate` runs it. Tokens/s = prompt / s. Median of --repeats after a warm-up.
- decode: `generate.run` greedy for --new tokens after the prompt, its decode time (first token excluded);
  plain, plain with the greedy run-ahead off (`plain_not_ahead`: what running the next token ahead saves),
  then with the draft --depth deep (`speculative`). Tokens/s = (new − 1) / s, and ms per token against the
  weight-read bound; the speculative row adds the mean accepted drafts per round, tokens per trunk pass and
  the acceptance per depth from the run (and how many rounds ran from a recording made while the round
  before ran: `WgpuEngine.round`).
- one decode step (`profile_step`): its dispatch count, the host's ms to record it, its GPU ms (timestamps),
  and every dispatch timed alone (`bench/profiler.py`), summed by kernel or launch label, with each
  matrix-vector product's GB/s; printed as a table per shape, kept in the JSON (`wgpu.step`).
- peer: PyTorch eager, same weights (f32; f16 for an f16 shape), a plain greedy loop with a KV cache
  (`torch_prefill`/`torch_step` below: one forward of the prompt, then one token per step, argmax on the
  GPU, `.item()` per token); CUDA-synchronised wall clock. PyTorch here implements the baseline and DDL
  d_v = 1 trunks (bench/torch_model.py), no draft: its row is plain decoding.

Hybrid (Qwen3.5-family) shapes: `small-hybrid` (`small` built as `qwen3_5`, f32), `qwen38-27b` (the Qwen3.8-27B
trunk, 64 layers, f16 weights, with its gated full-attention draft; random weights from `common.RandomWeights`:
its float32 init does not fit the host) and `qwen38-27b-4l` (the same shape cut to 4 layers, 3 Gated DeltaNet
+ 1 gated attention). Their peer is transformers' own `Qwen3_5ForCausalLM` with the same weights (bf16 for an
f16 shape, fp32 otherwise) and its cache, a greedy loop of one token per forward; with `--fla-path` it imports
flash-linear-attention's kernels from that folder, else transformers' PyTorch fallback ("fla" / "eager" in the
JSON). The peer runs only where its weights fit beside ours: not at the 64-layer shape (`--hf-max-layers`). The
weight-read bound of a decoded token (every f16 weight read once, at 4.3 TB/s) is in the JSON and the table.

A model whose context (max_seq_len) is shorter than --prompt + --new (the demo's models: 128) is measured at
fewer tokens, at most half its context new and the rest prompt (`fit_context`): the run prints the counts and
the JSON records them; otherwise generation would stop at the context and time fewer tokens than asked.

Check (same run): the wgpu engine's greedy tokens with and without speculation are identical (exit 1 if
not); with --quick also equal to the numpy engine's; the peer's tokens agreeing with ours is reported
(f16 near-ties may differ), not required.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402  (puts the repository root on sys.path)
import numpy as np  # noqa: E402

from ddl_ref.config import ModelConfig, MtpConfig, preset  # noqa: E402
from ddl_ref.params import init_params  # noqa: E402
from ddl_wgpu.engine.refnet import RefEngine  # noqa: E402
from ddl_wgpu.files.modelfile import Model, load_model  # noqa: E402
from ddl_wgpu.jobs.generate import run  # noqa: E402

SHAPES = {
    "small": (lambda: preset("small", mtp=MtpConfig()), "f32"),
    "qwen": (
        lambda: ModelConfig(
            vocab_size=151936,
            d_model=2048,
            n_layers=28,
            n_heads=16,
            n_kv_heads=8,
            head_dim=128,
            ffn_hidden=6144,
            max_seq_len=4096,
            rope_theta=1e6,
            rms_eps=1e-6,
            qk_norm="pre_rope",
            mtp=MtpConfig(),
        ),  # fmt: skip
        "f16",
    ),
    "small-hybrid": (lambda: _hybrid("small-hybrid"), "f32"),
    "qwen38-27b": (lambda: _hybrid("qwen38-27b"), "f16"),
    "qwen38-27b-4l": (lambda: _hybrid("qwen38-27b-4l"), "f16"),
    "quick-hybrid": (lambda: _hybrid("quick-hybrid"), "f32"),
    "quick": (
        lambda: ModelConfig(
            vocab_size=512,
            d_model=64,
            n_layers=2,
            n_heads=2,
            n_kv_heads=2,
            head_dim=32,
            ffn_hidden=128,
            max_seq_len=256,
            mtp=MtpConfig(),
        ),  # fmt: skip
        "f32",
    ),
}


def _hybrid(shape: str) -> ModelConfig:
    """The hybrid shapes (module docstring), each with its Qwen3.5 draft (post-norm hiddens)."""
    from hybrid import qwen38_27b

    from ddl_ref.config import apply_arch, qwen35_layer_types

    draft = MtpConfig(trunk_hidden="post_norm", chain_hidden="post_norm")
    if shape in ("small-hybrid", "quick-hybrid"):
        base = (
            preset("small")
            if shape == "small-hybrid"
            else preset("tiny", n_layers=4, vocab_size=512, max_seq_len=256)
        )
        return dataclasses.replace(
            apply_arch(base, "qwen3_5"), mtp=draft, tie_embeddings=shape == "small-hybrid"
        )
    n = 64 if shape == "qwen38-27b" else 4
    cfg = dataclasses.replace(qwen38_27b(n, 4096), mtp=draft)
    return dataclasses.replace(cfg, layer_types=qwen35_layer_types(n))


def weight_bound_ms(model: Model, dtype: str) -> float:
    """ms to read every weight a decoded token reads once (the trunk's matrices in the net's dtype, the head,
    one embedding row) at the H200's measured 4.3 TB/s: decode's memory bound at batch 1."""
    from ddl_wgpu.engine.layout import is_f16_matrix

    total = 0
    for name, spec in _specs(model.cfg):
        if (
            name.startswith("model.mtp.")
            or name == "model.embed_tokens.weight"
            and not model.cfg.tie_embeddings
        ):
            continue
        itemsize = 2 if dtype == "f16" and is_f16_matrix(name, spec.shape) else 4
        total += spec.numel * itemsize
    return total / (common.H200_HBM_GBS * 1e6)


def _specs(cfg):
    from ddl_ref.params import param_table

    return [(s.name, s) for s in param_table(cfg)]


def bench_hf(
    torch, dev, model: Model, prompt, new: int, dtype: str, repeats: int, fla_path: str | None
) -> dict:
    """transformers' Qwen3_5ForCausalLM with the same weights, greedy with its cache (module docstring)."""
    if fla_path and fla_path not in sys.path:
        sys.path.insert(0, fla_path)
    from hybrid import hf_config
    from transformers import Qwen3_5ForCausalLM

    cfg = dataclasses.replace(model.cfg, mtp=None)
    tdt = torch.bfloat16 if dtype == "f16" else torch.float32
    # built in its dtype (the 27B shape in float32 would be 108 GB) and filled on the GPU: the host sends each
    # array as it is and copy_ converts there
    default = torch.get_default_dtype()
    torch.set_default_dtype(tdt)
    try:
        with torch.device(dev):
            hm = Qwen3_5ForCausalLM(hf_config(cfg))
    finally:
        torch.set_default_dtype(default)
    sd = hm.state_dict()
    with torch.no_grad():
        for name, t in sd.items():
            if name in model.params:
                t.copy_(torch.as_tensor(np.asarray(model.params[name])).to(dev).reshape(t.shape))
    kernels = "fla" if any(m == "fla" or m.startswith("fla.") for m in sys.modules) else "eager"
    ids = torch.tensor(np.asarray(prompt)[None], device=dev)

    def sync():
        if dev == "cuda":
            torch.cuda.synchronize()

    def gen():
        with torch.no_grad():
            t0 = time.perf_counter()
            o = hm(input_ids=ids, use_cache=True)
            tok = o.logits[:, -1].argmax(-1, keepdim=True)
            cache, out = o.past_key_values, [int(tok.item())]
            t1 = time.perf_counter()
            while len(out) < new:
                o = hm(input_ids=tok, past_key_values=cache, use_cache=True)
                tok = o.logits[:, -1].argmax(-1, keepdim=True)
                cache = o.past_key_values
                out.append(int(tok.item()))
            sync()
            return out, t1 - t0, time.perf_counter() - t1

    gen()
    runs = [gen() for _ in range(repeats)]
    pre, dec = statistics.median(r[1] for r in runs), statistics.median(r[2] for r in runs)
    hm = sd = None  # the next shape's runs get the GPU's memory
    common.torch_free(torch, dev)
    return {"tokens": runs[0][0], "prefill_tokens_per_s": len(prompt) / pre, "decode_tokens_per_s": (new - 1) / dec,
            "kernels": kernels, "dtype": str(tdt)}  # fmt: skip


# ---------------------------------------------------------------------------------------------------------
# the PyTorch peer: TorchLM's weights and ops, with a KV cache


def torch_prefill(tm, torch, ids):
    """-> (next token, cache [(k, v)] per layer, length): one forward of the prompt."""
    return _torch_rows(tm, torch, ids, [], 0)


def torch_step(tm, torch, token, cache, start):
    return _torch_rows(tm, torch, token, cache, start)


def _torch_rows(tm, torch, ids, cache, start):
    import torch.nn.functional as F
    from torch_model import rotate_half

    cfg = tm.cfg
    H, K, D = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    n = ids.shape[1]
    x = F.embedding(ids, tm.P("model.embed_tokens.weight"))
    cos, sin = (
        tm.cos[None, start : start + n, None, :].to(x.dtype),
        tm.sin[None, start : start + n, None, :].to(x.dtype),
    )
    new_cache = []
    for i in range(cfg.n_layers):
        p = f"model.layers.{i}."

        def attn(h, i=i, p=p):
            q = F.linear(h, tm.P(p + "self_attn.q_proj.weight")).view(1, n, H, D)
            k = F.linear(h, tm.P(p + "self_attn.k_proj.weight")).view(1, n, K, D)
            v = F.linear(h, tm.P(p + "self_attn.v_proj.weight")).view(1, n, K, D)
            if cfg.qk_norm == "pre_rope":
                q, k = tm.norm(q, p + "self_attn.q_norm.weight"), tm.norm(k, p + "self_attn.k_norm.weight")
            q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
            if cfg.qk_norm == "post_rope":
                q, k = tm.norm(q, p + "self_attn.q_norm.weight"), tm.norm(k, p + "self_attn.k_norm.weight")
            k, v = k.transpose(1, 2), v.transpose(1, 2)
            if cache:
                k, v = torch.cat([cache[i][0], k], dim=2), torch.cat([cache[i][1], v], dim=2)
            new_cache.append((k, v))
            kk, vv = (
                (k.repeat_interleave(H // K, dim=1), v.repeat_interleave(H // K, dim=1)) if H != K else (k, v)
            )
            a = F.scaled_dot_product_attention(q.transpose(1, 2), kk, vv, is_causal=n > 1)
            return F.linear(a.transpose(1, 2).reshape(1, n, H * D), tm.P(p + "self_attn.o_proj.weight"))

        if cfg.residual == "delta":
            c = tm.norm(x, p + "input_layernorm.weight")
            x = tm.delta(x, attn(c), c, p + "ddl_attn.")
            c = tm.norm(x, p + "post_attention_layernorm.weight")
            x = tm.delta(x, tm.mlp(c, p), c, p + "ddl_mlp.")
        else:
            x = x + attn(tm.norm(x, p + "input_layernorm.weight"))
            x = x + tm.mlp(tm.norm(x, p + "post_attention_layernorm.weight"), p)
    xf = tm.norm(x[:, -1:], "model.norm.weight")
    head = "model.embed_tokens.weight" if cfg.tie_embeddings else "lm_head.weight"
    return F.linear(xf, tm.P(head)).argmax(-1), new_cache, start + n


def bench_torch(torch, dev, model: Model, prompt, new: int, dtype: str, repeats: int) -> dict:
    from torch_model import TorchLM

    cfg = dataclasses.replace(model.cfg, mtp=None)
    trunk = {k: v for k, v in model.params.items() if not k.startswith("model.mtp.")}
    tm = TorchLM(cfg, trunk, dev)
    if dtype == "f16":
        tm = tm.half()
        tm.cos, tm.sin = tm.cos.half(), tm.sin.half()
    ids = torch.tensor(np.asarray(prompt)[None], device=dev)

    def sync():
        if dev == "cuda":
            torch.cuda.synchronize()

    def gen():
        with torch.no_grad():
            t0 = time.perf_counter()
            tok, cache, L = torch_prefill(tm, torch, ids)
            out = [int(tok.item())]
            t1 = time.perf_counter()
            while len(out) < new:
                tok, cache, L = torch_step(tm, torch, tok, cache, L)
                out.append(int(tok.item()))
            sync()
            return out, t1 - t0, time.perf_counter() - t1

    gen()  # warm-up
    runs = [gen() for _ in range(repeats)]
    pre = statistics.median(r[1] for r in runs)
    dec = statistics.median(r[2] for r in runs)
    tm.to("cpu")  # the next shape's peer gets the GPU's memory
    common.torch_free(torch, dev)
    return {
        "tokens": runs[0][0],
        "prefill_tokens_per_s": len(prompt) / pre,
        "decode_tokens_per_s": (new - 1) / dec,
    }


# ---------------------------------------------------------------------------------------------------------
# ours


def bench_ours(gpu, model: Model, prompt, new: int, depth: int, dtype: str, repeats: int) -> dict:
    from ddl_wgpu.engine.decode import WgpuEngine

    out: dict = {}
    engine = WgpuEngine(gpu, model, depth, dtype)
    times = []
    for _ in range(repeats + 1):  # the first builds and compiles
        engine.rollback(0)
        t0 = time.perf_counter()
        engine.feed(prompt, "argmax", last_only=True)
        times.append(time.perf_counter() - t0)
    out["prefill_tokens_per_s"] = len(prompt) / statistics.median(times[1:])
    cap = model.cfg.max_seq_len
    default_spin = engine._rings[0].spin
    other = "block" if default_spin else "spin"
    runs = [("plain", 0, default_spin), ("plain_not_ahead", 0, default_spin), ("speculative", depth, default_spin),
            (f"plain_{other}", 0, not default_spin), (f"plain_not_ahead_{other}", 0, not default_spin)]  # fmt: skip
    out["wait"] = "spin" if default_spin else "block"
    for name, k, spin in runs:
        res = []
        eng = _NotAhead(engine) if name.startswith("plain_not_ahead") else engine
        _set_wait(engine, spin)
        for _ in range(repeats + 1):
            engine.rollback(0)
            before = engine.rounds_ahead
            res.append(run(eng, _Quiet(), prompt, cap, new, depth=k))
            res[-1]["rounds_recorded_ahead"] = engine.rounds_ahead - before
        out[name] = {
            "tokens": res[-1]["token_ids"],
            "decode_tokens_per_s": statistics.median(r["decode_tokens_per_s"] for r in res[1:]),
            "decode_ms_per_token": statistics.median(1e3 / r["decode_tokens_per_s"] for r in res[1:]),
            **{
                key: res[-1][key]
                for key in (
                    "trunk_passes",
                    "mean_accepted",
                    "tokens_per_pass",
                    "acceptance_per_depth",
                    "rounds",
                    "rounds_recorded_ahead",
                )
                if key in res[-1]
            },  # fmt: skip
        }
    _set_wait(engine, default_spin)
    out["step"] = profile_step(gpu, engine)
    return out


def _set_wait(engine, spin: bool) -> None:
    """How the engine's read-backs wait for the GPU (`ddl_wgpu.runtime.readback.Readback`: spin or block)."""
    for rb in (*engine._rings, engine._readback):
        rb.spin = spin


def sync_probe(gpu, n: int = 200) -> dict:
    """The host's round trip of a token's shape at no GPU cost: one tiny dispatch and a 16-byte copy into a
    read-back buffer, submitted and read, median µs over n (after 20 warm-ups), through wgpu-py's own map
    (`map_sync`: its poll thread, what the decoder used before), and `Readback.read` blocking and spinning."""
    import wgpu

    from ddl_wgpu.ops import elementwise as k_ew

    buf = gpu.buffer(256, label="probe")
    fill = k_ew.fill(gpu, buf, 16, 1.0)
    rb = gpu.readback(64, "probe_readback")
    legacy = gpu.device.create_buffer(size=64, usage=wgpu.BufferUsage.MAP_READ | wgpu.BufferUsage.COPY_DST)

    def once(how: str) -> float:
        rec = gpu.recorder()
        fill.record(rec)
        rec.copy(buf, 0, legacy if how == "wgpu-py map_sync" else rb.buffer, 0, 16)
        cb = rec.finish()
        t0 = time.perf_counter()
        index = gpu.submit_indexed(cb)
        if how == "wgpu-py map_sync":
            legacy.map_sync("READ_NOSYNC", 0, 16)
            legacy.read_mapped(0, 16)
            legacy.unmap()
        else:
            rb.spin = how == "spin"
            rb.read(np.float32, 4, 0, index)
        return (time.perf_counter() - t0) * 1e6

    out = {}
    for how in ("wgpu-py map_sync", "block", "spin"):
        times = [once(how) for _ in range(20 + n)][20:]
        out[how] = {"median_us": statistics.median(times), "p90_us": float(np.percentile(times, 90))}
    return out


def profile_step(gpu, engine) -> dict:
    """One greedy decode step (the one-row trunk pass and its argmax at the engine's length) measured three
    ways: the host's time to record it (what `WgpuEngine` overlaps with the GPU running the token before);
    its GPU time (timestamps around the step); and each dispatch on its own (`profiler.ProfileRecorder`:
    one timed pass per dispatch, so the sum exceeds the step a little), summed by kernel or launch label,
    with the matrix-vector products' GB/s. The engine is reset afterwards (the steps moved its state)."""
    import re

    from profiler import ProfileRecorder

    rows, start = engine._get("trunk", 1), max(1, engine.length)
    host = []
    for _ in range(5):
        t0 = time.perf_counter()
        engine._record_step(rows, start, "argmax")
        host.append((time.perf_counter() - t0) * 1e3)
    out = {"dispatches": len(rows._fwd.dispatches) + len(rows._topk_call(1)[0].dispatches),
           "host_record_ms": statistics.median(host)}  # fmt: skip
    if "timestamp-query" not in gpu.features:
        engine.rollback(0)
        return {**out, "gpu": "no timestamp-query on this adapter"}
    steps = []
    for _ in range(5):
        rec = gpu.recorder(timestamps=True)
        engine._at(rec, engine.trunk, start)
        rows._fwd.record(rec)
        engine._record_head(rows, "argmax", rec)
        rec.submit()
        steps.append(rec.elapsed_ms())
    out["gpu_step_ms"] = min(steps)
    prof = ProfileRecorder(gpu)
    engine._at(prof, engine.trunk, start)
    rows._fwd.record(prof)
    engine._record_head(rows, "argmax", prof)
    prof.submit()
    per = prof.profile()
    counts: dict = {}
    for name in prof.names:
        counts[name] = counts.get(name, 0) + 1
    kernels = []
    for name, ms in sorted(per.items(), key=lambda kv: -kv[1]):
        k = {"name": name, "count": counts[name], "ms": ms}
        m = re.search(r"wbytes=(\d+)", name)
        if m:
            k["gbs"] = counts[name] * int(m.group(1)) / ms / 1e6
        kernels.append(k)
    out.update(profile_sum_ms=sum(per.values()), kernels=kernels)
    engine.rollback(0)
    return out


def profile_table(name: str, p: dict) -> str:
    rows = [[k["name"][:70], k["count"], f"{k['ms']:.3f}", f"{100 * k['ms'] / p['profile_sum_ms']:.1f}%",
             common.fmt(k.get("gbs"), ".0f")] for k in p["kernels"][:16]]  # fmt: skip
    title = (f"{name}: one decode step, {p['dispatches']} dispatches: GPU {p['gpu_step_ms']:.3f} ms (timestamps), "
             f"sum of dispatches timed alone {p['profile_sum_ms']:.3f} ms, host recording {p['host_record_ms']:.3f} ms")  # fmt: skip
    return common.table(["kernel / launch", "count", "ms", "% of sum", "GB/s"], rows, title)


def bench_prompts(gpu, model: Model, prompts: list, new: int, depth: int, dtype: str) -> dict:
    """Greedy decoding of `new` tokens after each of several prompts, plain and with the draft, once each
    (after one warm-up run): decode tokens/s over all prompts (their new tokens / their decode seconds), and
    the draft's acceptance pooled over the rounds of every prompt. A trained model's greedy text tends to fall
    into repeats after a while, which a draft predicts easily; many short continuations of different real
    prompts measure the draft on text more like what a user asks for than one long continuation."""
    from ddl_wgpu.engine.decode import WgpuEngine

    engine = WgpuEngine(gpu, model, depth, dtype)
    cap = model.cfg.max_seq_len
    out: dict = {"prompts": len(prompts)}
    tokens = {}
    for name, k in (("plain", 0), ("speculative", depth)):
        engine.rollback(0)
        run(engine, _Quiet(), prompts[0], cap, new, depth=k)  # warm-up: builds and compiles
        res = []
        for p in prompts:
            engine.rollback(0)
            res.append(run(engine, _Quiet(), p, cap, new, depth=k))
        tokens[name] = [r["token_ids"] for r in res]
        dec = sum(r["decode_s"] for r in res)
        entry = {"decode_tokens_per_s": sum(len(r["token_ids"]) - 1 for r in res) / dec}
        if k:
            rounds = sum(r["rounds"] for r in res)
            entry["mean_accepted"] = sum(r["mean_accepted"] * r["rounds"] for r in res) / rounds
            entry["acceptance_per_depth"] = [
                sum(r["acceptance_per_depth"][j] * r["rounds"] for r in res) / rounds for j in range(k)
            ]
            entry["tokens_per_pass"] = sum(len(r["token_ids"]) for r in res) / sum(
                r["trunk_passes"] for r in res
            )
        out[name] = entry
    out["same_tokens"] = tokens["plain"] == tokens["speculative"]
    return out


def _other_wait(ours: dict) -> str:
    """The table's cell for the read-backs' other wait (`_set_wait`): "block: ms/token, not run ahead"."""
    other = "block" if ours["wait"] == "spin" else "spin"
    a, b = ours[f"plain_{other}"], ours[f"plain_not_ahead_{other}"]
    return f"{other}: {a['decode_ms_per_token']:.3f}, {b['decode_ms_per_token']:.3f}"


class _NotAhead:
    """The engine with greedy steps not run ahead (`WgpuEngine.feed`'s `ahead` dropped): what that saves."""

    def __init__(self, engine):
        self.engine = engine

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def feed(self, ids, head, last_only=False, ahead=False):
        return self.engine.feed(ids, head, last_only)


class _Quiet:
    """A tokenizer whose text is never needed: the bench's ids may lie outside any real vocabulary."""

    def decode(self, ids):
        return ""


def data_prompts(spec: str, model: Model, n: int, count: int = 1) -> list[list[int]]:
    """The first n tokens of each of the last `count` documents of `spec` with more than n tokens (through the
    model's own tokenizer): real text, so a trained model's draft is measured on what it was trained for. The
    last documents hold the validation split's windows."""
    from ddl_wgpu.data import load_records, tokenizer_for

    records = load_records(spec, tokenizer_for(model.tokenizer))
    docs = [r for r in reversed(records) if r.size > n][:count]
    if len(docs) < count:
        raise SystemExit(f"--prompt-data {spec}: fewer than {count} documents longer than {n} tokens")
    return [[int(t) for t in d[:n]] for d in docs]


def fit_context(prompt: int, new: int, context: int, name: str) -> tuple[int, int]:
    """-> (prompt, new) within a model of `context` positions. A sequence longer than the context would stop
    generating early (`generate.run` ends at the context), so the decode rates would time fewer tokens than
    the table says, or none: then half the context goes to the prompt and half to the new tokens (at most the
    requested counts), and the clamp is printed and recorded in the JSON (its `prompt` and `new`)."""
    if prompt < 1 or new < 2:
        raise SystemExit(f"--prompt must be at least 1 and --new at least 2 (got {prompt}, {new})")
    if prompt + new <= context:
        return prompt, new
    if context < 3:
        raise SystemExit(f"{name}: max_seq_len {context} leaves no room for a prompt and 2 new tokens")
    new_fit = min(new, max(2, context // 2))
    prompt_fit = min(prompt, context - new_fit)
    print(
        f"{name}: --prompt {prompt} + --new {new} exceed its max_seq_len {context}; "
        f"measuring prompt {prompt_fit} + {new_fit} new instead"
    )
    return prompt_fit, new_fit


def synthetic(shape: str, seed: int) -> tuple[Model, str]:
    make, dtype = SHAPES[shape]
    cfg = make()
    big = shape.startswith("qwen38")  # its float32 init would not fit the host
    params = common.RandomWeights(cfg, seed, f16=dtype == "f16") if big else init_params(cfg, seed)
    return Model(cfg=cfg, params=params, variant="baseline"), dtype


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="small,qwen", help="comma-separated: small, qwen")
    ap.add_argument("--model", help="a .ddlw model file instead of the synthetic shapes")
    ap.add_argument("--trunk-dtype", choices=("f32", "f16"), help="for --model (default f32)")
    ap.add_argument("--prompt", type=int, default=128, help="prompt tokens")
    ap.add_argument(
        "--prompt-data", help="take the prompt from this data spec (e.g. stdlib) instead of random ids"
    )
    ap.add_argument(
        "--prompts", type=int, default=0,
        help="with --prompt-data: also decode --short-new tokens after each of this many documents' openings",
    )  # fmt: skip
    ap.add_argument("--short-new", type=int, default=64, help="new tokens per prompt of --prompts")
    ap.add_argument("--new", type=int, default=128, help="tokens generated")
    ap.add_argument("--depth", type=int, default=3, help="speculative draft depth")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default=None)
    ap.add_argument("--torch", default="auto", choices=("auto", "cuda", "cpu", "none"))
    ap.add_argument("--quick", action="store_true", help="a tiny shape, few tokens (lavapipe smoke test)")
    ap.add_argument(
        "--fla-path", default=None, help="a folder holding flash-linear-attention for the hybrid peer"
    )
    ap.add_argument(
        "--hf-max-layers", type=int, default=16, help="the hybrid peer runs up to this many layers"
    )
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if args.quick:
        args.shapes = "quick" if args.shapes == "small,qwen" else args.shapes
        args.prompt, args.new, args.repeats = 16, 12, 1
    gpu = common.open_gpu(args.device)
    torch, dev = common.torch_setup(args.torch)
    print(common.adapter_line(gpu))
    probe = sync_probe(gpu, 50 if args.quick else 200)
    print("submit + read-back round trip (a tiny dispatch), median / p90 µs: "
          + "; ".join(f"{k} {v['median_us']:.0f} / {v['p90_us']:.0f}" for k, v in probe.items()))  # fmt: skip
    cases = []
    if args.model:
        m = load_model(args.model)
        cases.append((Path(args.model).name, m, args.trunk_dtype or "f32"))
    else:
        for s in args.shapes.split(","):
            m, dt = synthetic(s.strip(), args.seed)
            cases.append((s.strip(), m, dt))
    results, rows, profiles, failed = [], [], [], False
    rng = np.random.default_rng(args.seed)
    for name, model, dtype in cases:
        n_prompt, n_new = fit_context(args.prompt, args.new, model.cfg.max_seq_len, name)
        prompt = (
            data_prompts(args.prompt_data, model, n_prompt)[0]
            if args.prompt_data
            else [int(t) for t in rng.integers(0, model.cfg.vocab_size, n_prompt)]
        )
        entry = {"shape": name, "config": model.cfg.to_dict(), "dtype": dtype, "prompt": n_prompt,
                 "new": n_new, "depth": args.depth, "prompt_data": args.prompt_data}  # fmt: skip
        try:
            ours = bench_ours(gpu, model, prompt, n_new, args.depth, dtype, args.repeats)
            entry["wgpu"] = ours
            same = all(
                ours[k]["tokens"] == ours["plain"]["tokens"] for k in ours if k.startswith(("plain", "spec"))
            )
            entry["check_speculative_equal"] = same
            failed |= not same
            if args.prompts and args.prompt_data:
                short = min(args.short_new, n_new)
                many = data_prompts(args.prompt_data, model, n_prompt, args.prompts)
                entry["wgpu_prompts"] = bench_prompts(gpu, model, many, short, args.depth, dtype)
                entry["wgpu_prompts"]["new"] = short
                failed |= not entry["wgpu_prompts"]["same_tokens"]
            if args.quick and not model.cfg.has_linear:  # the numpy engine decodes hybrids once ddl_ref can
                ref = run(RefEngine(model), _Quiet(), prompt, model.cfg.max_seq_len, n_new)["token_ids"]
                entry["check_numpy_equal"] = ref == ours["plain"]["tokens"]
                failed |= not entry["check_numpy_equal"]
        except Exception as e:
            traceback.print_exc()
            entry["error"] = f"{e.__class__.__name__}: {e}"
            failed = True
            ours = None
        peer = None
        entry["weight_bound_ms_per_token"] = weight_bound_ms(model, dtype)
        if ours is not None:
            entry["decode_vs_weight_bound"] = (
                1e3 / ours["plain"]["decode_tokens_per_s"] / entry["weight_bound_ms_per_token"]
            )
            entry["pct_of_weight_bound"] = 100.0 / entry["decode_vs_weight_bound"]
        hybrid = model.cfg.layer_types is not None
        if torch is not None and hybrid and model.cfg.n_layers > args.hf_max_layers:
            entry["torch"] = {"skipped": f"{model.cfg.n_layers} layers: its weights do not fit beside ours"}
        elif torch is not None:
            try:
                if hybrid:
                    peer = bench_hf(torch, dev, model, prompt, n_new, dtype, args.repeats, args.fla_path)
                else:
                    peer = bench_torch(torch, dev, model, prompt, n_new, dtype, args.repeats)
                if ours is not None:
                    peer["tokens_agree"] = float(
                        np.mean(np.array(peer["tokens"]) == np.array(ours["plain"]["tokens"]))
                    )
                entry["torch"] = {**peer, **common.torch_info(torch, dev)}
            except Exception as e:
                entry["torch"] = {"error": f"{e.__class__.__name__}: {e}"}
        elif "torch" not in entry:
            entry["torch"] = {"skipped": dev}
        results.append(entry)
        if ours is not None:
            sp = ours["speculative"]
            rows.append([name, dtype, common.fmt(ours["prefill_tokens_per_s"], ".0f"),
                         common.fmt(ours["plain"]["decode_tokens_per_s"], ".1f"),
                         common.fmt(ours["plain"]["decode_ms_per_token"], ".3f"),
                         common.fmt(ours["plain_not_ahead"]["decode_ms_per_token"], ".3f"),
                         _other_wait(ours),
                         common.fmt(entry["weight_bound_ms_per_token"], ".3f"),
                         common.fmt(entry.get("pct_of_weight_bound"), ".1f"),
                         common.fmt(sp["decode_tokens_per_s"], ".1f"), common.fmt(sp.get("mean_accepted"), ".2f"),
                         " ".join(f"{a:.2f}" for a in sp.get("acceptance_per_depth", [])),
                         common.fmt(peer and peer.get("prefill_tokens_per_s"), ".0f"),
                         common.fmt(peer and peer.get("decode_tokens_per_s"), ".1f")])  # fmt: skip
            step = ours.get("step", {})
            if "kernels" in step:
                profiles.append(profile_table(name, step))
            many = entry.get("wgpu_prompts")
            if many:
                sp = many["speculative"]
                rows.append([f"{name}, {many['prompts']} prompts x {many['new']} new", dtype, "-",
                             common.fmt(many["plain"]["decode_tokens_per_s"], ".1f"), "-", "-", "-", "-", "-",
                             common.fmt(sp["decode_tokens_per_s"], ".1f"), common.fmt(sp["mean_accepted"], ".2f"),
                             " ".join(f"{a:.2f}" for a in sp["acceptance_per_depth"]), "-", "-"])  # fmt: skip
    for p in profiles:
        print(p)
    print(common.table(["shape", "dtype", "prefill tok/s", "decode tok/s", "ms/token", "not run ahead",
                        "other wait: ms/token, not ahead", "weight-read bound ms",
                        "% of bound", f"spec K={args.depth} tok/s", "accepted/round", "acceptance per depth",
                        "torch prefill", "torch decode"], rows,
                       f"batch 1, prompt {args.prompt}, {args.new} new tokens (fewer where a model's context "
                       "is shorter: the JSON's prompt and new), greedy"))  # fmt: skip
    common.write_json(common.json_path(args.json, "generate.json"),
                      {"when": common.now_iso(), "adapter": common.adapter_line(gpu), "host": common.host_info(),
                       "sync_probe": probe, "results": results})  # fmt: skip
    if failed:
        print("FAILED: see the JSON", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
