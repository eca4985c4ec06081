"""Hybrid (Qwen3.5) trunks on the GPU: the training step against transformers, the Qwen3.8-27B-shaped forward,
and the gated delta rule against its own bounds.

    python3 bench/hybrid.py train        # `small` hybrid, 8 x 1024: engine vs transformers' Qwen3_5ForCausalLM
    python3 bench/hybrid.py forward27b   # 64 layers, f16 weights, 16 x 1024 tokens: tokens/s, memory, per type
    python3 bench/hybrid.py kernel       # the gated delta rule at the 27B and small shapes vs its bounds
    python3 bench/hybrid.py all --fla-path /tmp/fla   # everything; the fla peer imports fla from that folder
    python3 bench/hybrid.py all --quick --torch cpu   # tiny shapes (lavapipe smoke test)

`train`: one step = zero grads, forward, LM head + loss, backward, global grad-norm clip 1.0, AdamW (lr 3e-4,
betas 0.9/0.95, eps 1e-5, wd 0.1) on every parameter, both sides from `ddl_ref.params.init_params(cfg, seed)`
on the same random batch; their initial losses must agree within 1e-3 (else exit 1). PyTorch peers, each in a
subprocess so that what transformers imports is settled per peer: transformers' `Qwen3_5ForCausalLM` in fp32
(TF32 off) with the flash-linear-attention Triton kernels when `--fla-path` holds them ("fla": Triton's dot
products default to TF32 inputs whatever PyTorch's TF32 switch says; "fla ieee": the same with
TRITON_F32_DEFAULT=ieee, IEEE f32 products), and without them ("eager": transformers' own PyTorch fallback of
the chunked rule and the conv). The engine's rule runs under the adapter's default chunk plan, or
DDL_WGPU_GDN_PLAN's (`kernel --sweep` prints the fastest).

`forward27b`: the Qwen3.8-27B trunk shape (hidden 5120, 64 layers, 3 Gated DeltaNet : 1 gated attention,
FFN 17408, vocabulary 248320, untied) with random f16 weights (one random tensor per distinct shape, reused by
every layer: timing does not depend on the values), an inference net whose layers share one activation set;
the forward of 16 x 1024 tokens with the evaluation loss (chunked LM head), timed by GPU timestamps; GPU memory
(our buffers, and nvidia-smi's used memory); the GPU time per layer type (every dispatch timed alone).

`kernel`: the chunked rule (`ops.gated_delta.chunk_forward` / `chunk_backward`, the engine's) alone at the
27B layer, the small hybrid's, and 27B rows of 256 and 64 tokens, under the adapter's default plan: the
forward as an inference net runs it (no checkpoints) and as a training net does (the checkpoints saved), the
backward, GPU ms per kernel, and beside them the per-token forward over the same tokens (the kernel of the
decoder and of an inference net's short rows: the line after the table says where each wins, for
`PER_TOKEN_MAX_T`). FLOPs as the kernels execute them (`chunk_flops`: full C x C squares); bytes: q, k, v read and o
written once (the backward twice, with the checkpoints); H200: 66.9 TFLOP/s fp32 FMA, 4.3 TB/s. The recurrence
itself needs 6 FLOPs per state element per token (forward), which `recurrence_flop_bound_ms` reports.
`kernel --sweep` times every plan of `sweep_plans` (or `--plans`) at each of `--sweep-shape`'s shapes and prints
the fastest as a DDL_WGPU_GDN_PLAN value and as the `PLANS` line that makes it the default. The default plan,
and every swept plan, is first checked against `ddl_ref` (float64) at a small shape on the device itself
(`check_plan`): a plan with wrong results fails the run. The GPU is kept busy before the first timed case and
between swept plans (clocks drop while the host compiles).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402  (puts the repository root on sys.path)
import numpy as np  # noqa: E402

from ddl_ref.config import ModelConfig, apply_arch, preset, qwen35_layer_types  # noqa: E402
from ddl_ref.params import init_params, num_params  # noqa: E402

LOSS_TOL = 1e-3


def qwen38_27b(n_layers: int = 64, seq: int = 1024) -> ModelConfig:
    """The Qwen3.8-27B trunk (public config, `text_config`), without its draft."""
    return ModelConfig(vocab_size=248320, d_model=5120, n_layers=n_layers, n_heads=24, n_kv_heads=4, head_dim=256,
                       ffn_hidden=17408, max_seq_len=seq, rope_theta=1e7, rms_eps=1e-6, tie_embeddings=False,
                       norm_style="offset", qk_norm="pre_rope", layer_types=qwen35_layer_types(n_layers),
                       attn_output_gate=True, rotary_dim=64, linear_k_heads=16, linear_v_heads=48, linear_k_dim=128,
                       linear_v_dim=128, linear_conv_kernel=4)  # fmt: skip


def small_hybrid(quick: bool) -> ModelConfig:
    return apply_arch(preset("tiny" if quick else "small"), "qwen3_5")


# ---------------------------------------------------------------------------------------------------------
# train


def bench_engine_train(gpu, cfg, params, ids, steps: int, warmup: int) -> dict:
    from ddl_wgpu.engine.net import Net
    from ddl_wgpu.engine.step import AdamW
    from ddl_wgpu.engine.trunk import TrunkWork

    B, T = ids.shape
    t0 = time.perf_counter()
    net = Net(gpu, cfg, params, work_class=TrunkWork)
    work = net.work(B, T)
    r = {"build_s": time.perf_counter() - t0}
    r["init_loss"] = work.step(ids).loss
    n = 0

    def upd():
        nonlocal n
        n += 1
        return AdamW(lr=3e-4, step=n, grad_clip_mode="global")

    for _ in range(warmup):
        work.step(ids, update=upd())
    gpu.wait()
    losses = []
    t1 = time.perf_counter()
    for _ in range(steps):
        losses.append(work.step(ids, update=upd()).loss)
    gpu.wait()
    r["s_per_step"] = (time.perf_counter() - t1) / steps
    r["losses"] = losses
    r["finite"] = bool(np.all(np.isfinite(losses)))
    r["gpu_mib"] = gpu.allocated / 2**20
    if "timestamp-query" in gpu.features:
        r["profile_ms"] = profile_step(gpu, net, work, upd())
    return r


def profile_step(gpu, net, work, hyper) -> dict:
    """GPU ms of one training step per (phase, shader family): every dispatch timed alone."""
    from profiler import ProfileRecorder

    rec = ProfileRecorder(gpu)
    for phase, call in (("zero", net.zero_grads_call()), ("forward", work._fwd), ("head+loss", work._head_train),
                        ("loss sum", work._sum), ("backward", work._bwd), ("optimizer", net.optimizer_call(hyper))):  # fmt: skip
        rec.phase = phase
        call.record(rec)
    rec.submit()
    out: dict[str, float] = {}
    for key, ms in rec.profile().items():
        phase, kernel = key.split("|", 1)
        k = f"{phase}|{kernel.split(':')[0].removesuffix('.wgsl')}"
        out[k] = out.get(k, 0.0) + ms
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def hf_config(cfg: ModelConfig):
    """transformers' Qwen3_5TextConfig of one of our hybrid configs."""
    from transformers import Qwen3_5TextConfig

    return Qwen3_5TextConfig(vocab_size=cfg.vocab_size, hidden_size=cfg.d_model, intermediate_size=cfg.ffn_hidden,
                             num_hidden_layers=cfg.n_layers, num_attention_heads=cfg.n_heads,
                             num_key_value_heads=cfg.n_kv_heads, head_dim=cfg.head_dim,
                             linear_num_key_heads=cfg.linear_k_heads, linear_num_value_heads=cfg.linear_v_heads,
                             linear_key_head_dim=cfg.linear_k_dim, linear_value_head_dim=cfg.linear_v_dim,
                             linear_conv_kernel_dim=cfg.linear_conv_kernel, max_position_embeddings=cfg.max_seq_len,
                             rms_norm_eps=cfg.rms_eps, tie_word_embeddings=cfg.tie_embeddings,
                             layer_types=list(cfg.layer_types),
                             rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta,
                                              "partial_rotary_factor": cfg.rope_dim / cfg.head_dim})  # fmt: skip


def torch_train_peer(args) -> dict:
    """(subprocess) transformers' model trained like the engine; prints a JSON line."""
    # bench/ (this script's folder, first on sys.path) holds a kernels.py that would shadow the `kernels`
    # package transformers imports when it is installed
    here = Path(__file__).resolve().parent
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != here]
    torch, tdev = common.torch_setup(args.torch)
    if torch is None:
        return {"error": tdev}
    bypassed = False
    if args.bypass_fla_hopper_guard:
        try:  # fla refuses its gated backward on Hopper with Triton 3.4-3.7.0 (wrong results, fla #640)
            import fla.ops.common.chunk_o as chunk_o

            bypassed = not chunk_o.TRITON_ABOVE_3_7_1
            chunk_o.TRITON_ABOVE_3_7_1 = True
        except Exception:
            pass
    from transformers import Qwen3_5ForCausalLM

    cfg = small_hybrid(args.quick)
    params = init_params(cfg, args.seed)
    B, T = args.batch, args.seq
    ids = np.random.default_rng(args.seed + 1).integers(0, cfg.vocab_size, (B, T)).astype(np.int64)
    model = Qwen3_5ForCausalLM(hf_config(cfg)).to(tdev).float()
    sd = model.state_dict()
    with torch.no_grad():
        for name, a in params.items():
            t = sd[name]
            t.copy_(torch.as_tensor(a).reshape(t.shape))
    fla = "fla" in sys.modules or any(m.startswith("fla.") for m in sys.modules)
    idt = torch.as_tensor(ids, device=tdev)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), eps=1e-5, weight_decay=0.1,
                            fused=tdev == "cuda")  # fmt: skip

    def sync():
        if tdev == "cuda":
            torch.cuda.synchronize()

    def step():
        opt.zero_grad(set_to_none=True)
        loss = model(input_ids=idt, labels=idt).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        return loss

    with torch.no_grad():
        init = float(model(input_ids=idt, labels=idt).loss)
    for _ in range(args.warmup):
        step()
    sync()
    t1 = time.perf_counter()
    losses = [step() for _ in range(args.steps)]
    sync()
    r = {"s_per_step": (time.perf_counter() - t1) / args.steps, "init_loss": init,
         "losses": [float(x.detach()) for x in losses], "fla_imported": fla, "fla_guard_bypassed": bypassed}  # fmt: skip
    if tdev == "cuda":
        r["peak_mem_gib"] = torch.cuda.max_memory_allocated() / 2**30
    r["finite"] = bool(np.all(np.isfinite(r["losses"])))
    return r


def run_peer(args, kernels: str) -> dict:
    """The torch peer in a subprocess, with or without fla on its path ("fla ieee": Triton's f32 dot products
    in IEEE f32 rather than its TF32 default)."""
    env = dict(os.environ)
    path = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p != args.fla_path]
    if kernels.startswith("fla"):
        if not args.fla_path:
            return {"error": "no --fla-path: the fla peer was not run"}
        path = [args.fla_path, *path]
    if kernels == "fla ieee":
        env["TRITON_F32_DEFAULT"] = "ieee"
    env["PYTHONPATH"] = os.pathsep.join(path)
    cmd = [sys.executable, __file__, "torch-train", "--torch", args.torch, "--batch", str(args.batch), "--seq",
           str(args.seq), "--steps", str(args.steps), "--warmup", str(args.warmup), "--seed", str(args.seed)]  # fmt: skip
    if args.quick:
        cmd.append("--quick")
    if kernels.startswith("fla") and args.bypass_fla_hopper_guard:
        cmd.append("--bypass-fla-hopper-guard")
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.peer_timeout)
    lines = [line for line in p.stdout.splitlines() if line.startswith("{")]
    if p.returncode or not lines:
        return {"error": f"exit {p.returncode}: {(p.stderr or p.stdout)[-400:]}"}
    return json.loads(lines[-1])


def bench_train(gpu, args) -> dict:
    cfg = small_hybrid(args.quick)
    params = init_params(cfg, args.seed)
    B, T = args.batch, args.seq
    ids = np.random.default_rng(args.seed + 1).integers(0, cfg.vocab_size, (B, T)).astype(np.int64)
    out = {"params": num_params(cfg), "batch": B, "seq": T, "layer_types": list(cfg.layer_types), "runs": {}}
    print(f"train: {out['params'] / 1e6:.1f}M parameters, {B} x {T}", flush=True)
    runs = out["runs"]
    runs["ddl-wgpu"] = common.attempt(bench_engine_train, gpu, cfg, params, ids, args.steps, args.warmup)
    print(f"  ddl-wgpu: {_brief(runs['ddl-wgpu'])}", flush=True)
    from ddl_wgpu.ops.gated_delta import chunk_plan

    out["gdn_plan"] = chunk_plan(gpu, cfg.linear_k_dim, cfg.linear_v_dim).__dict__
    for kernels in ("fla", "fla ieee", "eager"):
        runs[f"transformers fp32 {kernels}"] = r = run_peer(args, kernels)
        print(f"  transformers {kernels}: {_brief(r)}", flush=True)
    wl = runs["ddl-wgpu"].get("init_loss")
    for name, r in runs.items():
        if "s_per_step" in r:
            r["tokens_per_s"] = B * T / r["s_per_step"]
        if name != "ddl-wgpu" and wl is not None and "init_loss" in r:
            r["init_loss_diff"] = abs(r["init_loss"] - wl)
    fla = runs["transformers fp32 fla"].get("tokens_per_s")
    if fla and "tokens_per_s" in runs["ddl-wgpu"]:
        runs["ddl-wgpu"]["vs_fla"] = runs["ddl-wgpu"]["tokens_per_s"] / fla
    fla_ieee = runs["transformers fp32 fla ieee"].get("tokens_per_s")
    if fla_ieee and "tokens_per_s" in runs["ddl-wgpu"]:
        runs["ddl-wgpu"]["vs_fla_ieee"] = runs["ddl-wgpu"]["tokens_per_s"] / fla_ieee
    eager = runs["transformers fp32 eager"].get("tokens_per_s")
    if eager and "tokens_per_s" in runs["ddl-wgpu"]:
        runs["ddl-wgpu"]["vs_eager"] = runs["ddl-wgpu"]["tokens_per_s"] / eager
    return out


# ---------------------------------------------------------------------------------------------------------
# forward27b


def nvidia_smi_used_mib() -> float | None:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=20).stdout  # fmt: skip
        return float(out.split()[0])
    except Exception:
        return None


def forward_profile(gpu, net, B: int, T: int, repeats: int = 1, smi0: float | None = None) -> dict:
    """The forward of B x T tokens with the evaluation loss on an inference `net` (its layers share one
    activation set): GPU ms from timestamps (best of `repeats`), tokens/s, memory, and the GPU time per layer
    type (every dispatch timed alone)."""
    from profiler import ProfileRecorder

    cfg, out = net.cfg, {}
    t0 = time.perf_counter()
    work = net.work(B, T)
    out["build_s"] = time.perf_counter() - t0
    ids = np.random.default_rng(1).integers(0, cfg.vocab_size, (B, T))
    total, count = work.loss_sum(ids)  # compiles and warms
    out["loss"] = total / count
    rec_calls = [work._fwd, work._head_eval, work._sum]
    times = []
    for _ in range(repeats):
        rec = gpu.recorder(timestamps=True)
        for c in rec_calls:
            c.record(rec)
        rec.submit()
        times.append(rec.elapsed_ms())
    out["forward_ms"] = min(times)
    out["forward_ms_all"] = times
    out["tokens_per_s"] = B * T / (out["forward_ms"] / 1e3)
    out["ours_gib"] = gpu.allocated / 2**30
    smi = nvidia_smi_used_mib()
    if smi is not None and smi0 is not None:
        out["nvidia_smi_used_gib"] = smi / 1024
        out["nvidia_smi_before_gib"] = smi0 / 1024
    # GPU time by layer type: the same Calls, every dispatch timed alone, phases by layer type
    rec = ProfileRecorder(gpu)
    rec.phase = "embedding"
    work.embed_forward(work.L[0]["x"]).record(rec)
    for i, a in enumerate(work.L):
        nxt = work.L[i + 1]["x"] if i + 1 < len(work.L) else work.xS
        rec.phase = cfg.layer_type(i)
        work.block_forward(a, nxt, f"model.layers.{i}.", False).record(rec)
    rec.phase = "head+loss"
    work.final_norm_forward().record(rec)
    work._head_eval.record(rec)
    work._sum.record(rec)
    rec.submit()
    per: dict[str, float] = {}
    fam: dict[str, float] = {}
    for key, ms in rec.profile().items():
        phase, kernel = key.split("|", 1)
        per[phase] = per.get(phase, 0.0) + ms
        k = f"{phase}|{kernel.split(':')[0].removesuffix('.wgsl')}"
        fam[k] = fam.get(k, 0.0) + ms
    out["profile_ms_by_type"] = per
    out["profile_ms_by_type_and_shader"] = dict(sorted(fam.items(), key=lambda kv: -kv[1]))
    n_type = {t: sum(1 for i in range(cfg.n_layers) if cfg.layer_type(i) == t) for t in set(cfg.layer_types)}
    out["ms_per_layer"] = {t: per.get(t, 0.0) / n for t, n in n_type.items()}
    del work
    return out


def bench_forward27b(gpu, args) -> dict:
    from ddl_wgpu.engine.inference import InferenceWork
    from ddl_wgpu.engine.net import Net

    B, T = (2, 32) if args.quick else (16, 1024)
    cfg = (
        apply_arch(preset("tiny", n_layers=4, tie_embeddings=False), "qwen3_5")
        if args.quick
        else qwen38_27b(seq=T)
    )
    out = {"params": num_params(cfg), "batch": B, "seq": T, "n_layers": cfg.n_layers}
    print(f"forward27b: {out['params'] / 1e9:.2f}B parameters, {B} x {T}", flush=True)
    smi0 = nvidia_smi_used_mib()
    t0 = time.perf_counter()
    net = Net(
        gpu, cfg, common.RandomWeights(cfg, f16=True), inference=True, dtype="f16", work_class=InferenceWork
    )
    out["load_s"] = time.perf_counter() - t0
    out["weights_gib"] = sum(s.nbytes for s in net.slots.values()) / 2**30
    out.update(forward_profile(gpu, net, B, T, args.repeats, smi0))
    del net
    return out


# ---------------------------------------------------------------------------------------------------------
# kernel


KERNEL_SHAPES = {  # B, T, Hk, Hv, Dk, Dv
    "27b": (16, 1024, 16, 48, 128, 128),  # the Qwen3.8-27B layer
    "small": (8, 1024, 6, 6, 128, 128),  # the `small` hybrid's
    "27b-256": (16, 256, 16, 48, 128, 128),  # shorter rows: where the per-token forward stops winning
    "27b-short": (16, 64, 16, 48, 128, 128),  # one chunk per row: where the per-token form might still win
}
QUICK_SHAPES = {"quick": (2, 40, 1, 2, 16, 16)}


def chunk_flops(shape, C: int) -> dict[str, float]:
    """FLOPs the chunked kernels execute (full C x C squares, as they compute them) per pass, with n chunks
    of (batch row, value head) and nk of (batch row, key head): the prep nk 4C²Dk ([K; Q] Kᵀ) + n 2C²Dk (W)
    (+ n 2C²Dv, U, in the forward); the forward n (6CDkDv + 2C²Dv) (the recurrence's [W; Q] S and K̃ᵀΔ, then
    P Δ); the backward the prep again, the state pass n (6CDkDv + 2C²Dv) and the gradients
    n (6CDkDv + 6C²Dv + 8C²Dk)."""
    B, T, Hk, Hv, Dk, Dv = shape
    nck = -(-T // C)
    n, nk = B * Hv * nck, B * Hk * nck
    prep_f = nk * 4 * C * C * Dk + n * (2 * C * C * Dk + 2 * C * C * Dv)
    prep_b = nk * 4 * C * C * Dk + n * 2 * C * C * Dk
    fwd = prep_f + n * (6 * C * Dk * Dv + 2 * C * C * Dv)
    bwd = (
        prep_b
        + n * (6 * C * Dk * Dv + 2 * C * C * Dv)
        + n * (6 * C * Dk * Dv + 6 * C * C * Dv + 8 * C * C * Dk)
    )
    return {"forward": fwd, "backward": bwd, "recurrence": 6 * B * T * Hv * Dk * Dv}


def _kernel_inputs(gpu, shape, rng):
    """Buffers of one shape: qkgb (q, k normalised, gates), v, do, and every output of both forms."""
    from ddl_wgpu.ops import gated_delta as kg

    B, T, Hk, Hv, Dk, Dv = shape
    N = B * T
    k_off, gb_off = kg.qkgb_offsets(N, Hk, Dk)
    qkgb = np.zeros(kg.qkgb_floats(N, Hk, Hv, Dk), np.float32)
    q = rng.standard_normal((N, Hk, Dk)).astype(np.float32)
    k = rng.standard_normal((N, Hk, Dk)).astype(np.float32)
    qkgb[: q.size] = (q / np.linalg.norm(q, axis=-1, keepdims=True) / np.sqrt(Dk)).reshape(-1)
    qkgb[k_off : k_off + k.size] = (k / np.linalg.norm(k, axis=-1, keepdims=True)).reshape(-1)
    gb = np.stack([-rng.uniform(0.01, 2, (N, Hv)), rng.uniform(0.05, 0.95, (N, Hv))], -1)
    qkgb[gb_off:] = gb.astype(np.float32).reshape(-1)
    g = gpu
    return dict(qkgb=g.upload(qkgb), v=g.upload(rng.standard_normal(N * Hv * Dv).astype(np.float32)),
                do=g.upload(rng.standard_normal(N * Hv * Dv).astype(np.float32)), o=g.buffer(4 * N * Hv * Dv),
                delta=g.buffer(4 * N * Hv * Dv), dqk=g.buffer(4 * kg.qk_floats(N, Hv, Dk)),
                dv=g.buffer(4 * N * Hv * Dv))  # fmt: skip


CHECK_SHAPE = (2, 130, 2, 6, 128, 128)  # B, T, Hk, Hv, Dk, Dv: a short last chunk, 3 value heads per key head
CHECK_SHAPE_QUICK = (1, 40, 1, 3, 16, 16)


def reference_case(shape=CHECK_SHAPE, seed: int = 7) -> dict:
    """Inputs of one small shape and `ddl_ref`'s recurrence on them in float64 (forward and backward): what
    every timed plan is checked against on the device itself."""
    from ddl_ref import gdn as ref

    B, T, Hk, Hv, Dk, Dv = shape
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((B, T, Hk, Dk))
    k = rng.standard_normal((B, T, Hk, Dk))
    q /= np.linalg.norm(q, axis=-1, keepdims=True) * np.sqrt(Dk)
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    x = [a.astype(np.float32) for a in (q, k, rng.standard_normal((B, T, Hv, Dv)), -rng.uniform(0.02, 1.5, (B, T, Hv)),
                                        rng.uniform(0.05, 0.95, (B, T, Hv)))]  # fmt: skip
    do = rng.standard_normal((B, T, Hv, Dv)).astype(np.float32)
    o, _, cache = ref.gated_delta_forward(*(a.astype(np.float64) for a in x))
    grads = ref.gated_delta_backward(do.astype(np.float64), cache)[:5]
    return {"shape": shape, "x": x, "do": do, "o": o, "grads": grads}


def check_plan(gpu, plan, case: dict) -> dict:
    """The chunked forward and backward under `plan` at the case's shape against `ddl_ref` (the tolerances of
    tests/test_kernel_gated_delta.py): {"ok": bool, "error": first failure, "max_abs": per output}."""
    from ddl_ref.check import check
    from ddl_wgpu.ops import gated_delta as kg
    from ddl_wgpu.ops.gdn_inputs import align_floats, qk_floats

    B, T, Hk, Hv, Dk, Dv = case["shape"]
    N, G = B * T, Hv // Hk
    q, k, v, g, beta = case["x"]
    k_off, gb_off = kg.qkgb_offsets(N, Hk, Dk)
    qkgb = np.zeros(kg.qkgb_floats(N, Hk, Hv, Dk), np.float32)
    qkgb[: q.size], qkgb[k_off : k_off + k.size] = q.reshape(-1), k.reshape(-1)
    qkgb[gb_off:] = np.stack([g.reshape(N, Hv), beta.reshape(N, Hv)], axis=-1).reshape(-1)
    qb, vb, dob = gpu.upload(qkgb), gpu.upload(v.reshape(-1)), gpu.upload(case["do"].reshape(-1))
    o, d = gpu.buffer(4 * N * Hv * Dv), gpu.buffer(4 * N * Hv * Dv)
    st = gpu.buffer(4 * kg.states_floats(B, Hv, Dk, Dv, T, plan.chunk))
    scr = gpu.buffer(4 * kg.chunk_scratch_floats(gpu, B, T, Hv, Dk, Dv, True, plan))
    dqk, dv = gpu.buffer(4 * qk_floats(N, Hv, Dk)), gpu.buffer(4 * N * Hv * Dv)
    shape = (B, T, Hk, Hv, Dk, Dv)
    (kg.chunk_forward(gpu, o, d, st, scr, qb, vb, *shape, plan=plan)
     + kg.chunk_backward(gpu, dqk, dv, scr, st, d, qb, vb, dob, *shape, plan=plan)).run(gpu)  # fmt: skip
    got = gpu.download(dqk, np.float32)
    half = N * Hv * Dk
    buf, off, _ = kg.chunk_dg_view(gpu, scr, B, T, Hv, Dk, Dv, plan)
    gb = gpu.download(buf, np.float32)[off // 4 :][: 2 * N * Hv].reshape(B, T, Hv, 2)
    dq_ref, dk_ref, dv_ref, dg_ref, db_ref = case["grads"]
    outs = {
        "o": (gpu.read(o, (B, T, Hv, Dv)), case["o"], "norm"),
        "dq": (got[:half].reshape(B, T, Hk, G, Dk).sum(3), dq_ref, "attention"),
        "dk": (got[align_floats(half) :][:half].reshape(B, T, Hk, G, Dk).sum(3), dk_ref, "attention"),
        "dv": (gpu.read(dv, (B, T, Hv, Dv)), dv_ref, "attention"),
        "dg": (gb[..., 0], dg_ref, "attention"),
        "dbeta": (gb[..., 1], db_ref, "attention"),
    }
    r = {"ok": True, "max_abs": {}}
    for name, (a, b, kind) in outs.items():
        r["max_abs"][name] = float(np.abs(a - b).max())
        try:
            check(name, a, b, kind)
        except AssertionError as e:
            r["ok"] = False
            r.setdefault("error", str(e)[:300])
    return r


def time_chunked(
    gpu,
    shape,
    bufs,
    plan,
    target_ms: float = 40.0,
    repeats: int = 3,
    profile: bool = False,
    warm_s: float = 0.0,
) -> dict:
    """GPU ms of the chunked forward (an inference net's: no checkpoints; and a training net's: the
    checkpoints saved) and of the backward, under `plan`; with `profile`, GPU ms per kernel. The kernels are
    compiled and run once first, then the GPU kept busy for `warm_s` seconds (clocks drop while the host
    compiles)."""
    from ddl_wgpu.ops import gated_delta as kg

    B, T, Hk, Hv, Dk, Dv = shape
    st = gpu.buffer(4 * kg.states_floats(B, Hv, Dk, Dv, T, plan.chunk))
    scr = gpu.buffer(4 * kg.chunk_scratch_floats(gpu, B, T, Hv, Dk, Dv, True, plan))
    b = bufs
    infer = kg.chunk_forward(
        gpu, b["o"], b["delta"], None, scr, b["qkgb"], b["v"], *shape, plan=plan, save_ckpt=False
    )
    train = kg.chunk_forward(gpu, b["o"], b["delta"], st, scr, b["qkgb"], b["v"], *shape, plan=plan)
    bwd = kg.chunk_backward(
        gpu, b["dqk"], b["dv"], scr, st, b["delta"], b["qkgb"], b["v"], b["do"], *shape, plan=plan
    )
    train.run(gpu)
    bwd.run(gpu)
    gpu.wait()
    common.warm_up(gpu, warm_s)
    limit = gpu.limits.get("max-compute-workgroup-storage-size", 16 << 10)
    row = {"plan": plan.__dict__, "shared_bytes": plan.shared_bytes(Dk, Dv, limit),
           "rows_per_call": kg.chunk_rows(gpu, B, T, Hv, Dk, Dv, plan, True)}  # fmt: skip
    for name, call in (("forward", infer), ("forward_train", train), ("backward", bwd)):
        row[name + "_ms"] = common.gpu_time_ms(gpu, [call], target_ms=target_ms, repeats=repeats)["ms"]
    if profile and "timestamp-query" in gpu.features:
        from profiler import ProfileRecorder

        rec = ProfileRecorder(gpu)
        for phase, call in (("forward", infer), ("backward", bwd)):
            rec.phase = phase
            call.record(rec)
        rec.submit()
        row["profile_ms"] = {k.replace("gated_delta.wgsl:", ""): v for k, v in rec.profile().items()}
    del st, scr
    return row


def bench_kernel(gpu, args) -> dict:
    """The chunked rule (the engine's) at each shape under the adapter's default plan, against its FLOP and
    byte bounds, beside the per-token forward (the kernel an inference net's short rows and the decoder
    run); `--sweep`: every plan of `sweep_plans` at each of `--sweep-shape`'s shapes."""
    from ddl_wgpu.ops import gated_delta as kg

    shapes = QUICK_SHAPES if args.quick else KERNEL_SHAPES
    out = {"per_token_max_t": kg.per_token_max_t()}
    rng = np.random.default_rng(0)
    cs = CHECK_SHAPE_QUICK if args.quick else CHECK_SHAPE
    case = reference_case(cs)
    d = kg.chunk_plan(gpu, cs[4], cs[5])
    out["check"] = common.attempt(check_plan, gpu, d, case)
    print(f"  check {d.text()} at {cs} against ddl_ref: "
          + ("ok" if out["check"].get("ok") else f"FAILED {out['check'].get('error')}"), flush=True)  # fmt: skip
    args._case = case
    common.warm_up(gpu, 0.0 if args.quick else args.warm_up_s)
    for name, shape in shapes.items():
        B, T, Hk, Hv, Dk, Dv = shape
        N = B * T
        bufs = _kernel_inputs(gpu, shape, rng)
        plan = kg.chunk_plan(gpu, Dk, Dv)
        row = {"shape": list(shape), **time_chunked(gpu, shape, bufs, plan, profile=True)}
        # the per-token forward over whole rows (nothing saved but the final state)
        fin = gpu.buffer(4 * kg.states_floats(B, Hv, Dk, Dv, T, T))
        tok = kg.gated_delta_forward(gpu, bufs["o"], bufs["delta"], fin, bufs["qkgb"], bufs["v"], *shape, tc=T,
                                     save_ckpt=False, save_final=True)  # fmt: skip
        row["per_token_forward_ms"] = common.gpu_time_ms(gpu, [tok], repeats=3)["ms"]
        fl = chunk_flops(shape, plan.chunk)
        nbytes = 4 * (2 * N * Hv * Dk + 2 * N * Hv * Dv)  # q, k read per value head, v read, o written
        ckpt = 4 * B * Hv * (-(-T // plan.chunk) + 1) * Dk * Dv
        for part, ms, flop, nb in (("forward", row["forward_ms"], fl["forward"], nbytes),
                                   ("backward", row["backward_ms"], fl["backward"], 2 * nbytes + 2 * ckpt)):  # fmt: skip
            flop_ms = flop / (common.H200_FP32_TFLOPS * 1e9)
            byte_ms = nb / (common.H200_HBM_GBS * 1e6)
            row[part] = {"tflops": flop / ms / 1e9, "gbs": nb / ms / 1e6, "flop_bound_ms": flop_ms,
                         "byte_bound_ms": byte_ms, "binds": "flops" if flop_ms >= byte_ms else "bytes",
                         "x_of_bound": ms / max(flop_ms, byte_ms),
                         "recurrence_flop_bound_ms": fl["recurrence"] * (3 if part == "backward" else 1)
                         / (common.H200_FP32_TFLOPS * 1e9)}  # fmt: skip
        out[name] = row
        print(f"  kernel {name} {plan.text()}: forward {row['forward_ms']:.2f} ms (training "
              f"{row['forward_train_ms']:.2f}), backward {row['backward_ms']:.2f} ms; per-token forward "
              f"{row['per_token_forward_ms']:.2f} ms", flush=True)  # fmt: skip
        del bufs, fin
    if args.sweep:
        names = ["quick"] if args.quick else [x.strip() for x in args.sweep_shape.split(",") if x.strip()]
        out["sweep"] = {name: common.attempt(sweep, gpu, args, name) for name in names}
    return out


def sweep_plans(gpu, Dk: int, Dv: int) -> list:
    """The plans `--sweep` times (those that fit the adapter): the default, then single changes of it (value
    columns and threads of the sequential kernels, slab depth, Tm's blocks, the per-chunk kernels' threads)
    and a few plans of chunk 32."""
    from dataclasses import replace

    from ddl_wgpu.ops import gated_delta as kg
    from ddl_wgpu.runtime.gpu import GpuError

    first = kg.chunk_plan(gpu, Dk, Dv)
    plans = [first] + [replace(first, **kw) for kw in (
        dict(bv=16), dict(bv=64), dict(bv=64, threads=256), dict(bv=16, threads=64), dict(threads=64),
        dict(threads=256), dict(bk=8), dict(tb=8), dict(tb=32), dict(pthreads=128), dict(pthreads=512),
        dict(chunk=32), dict(chunk=32, bv=16), dict(chunk=32, bv=16, threads=64), dict(chunk=32, bv=64, threads=256),
        dict(chunk=32, bk=8, pthreads=128))]  # fmt: skip
    ok, seen = [], set()
    for p in plans:
        try:
            p.check(gpu, Dk, Dv)
        except GpuError:
            continue
        if p not in seen:
            seen.add(p)
            ok.append(p)
    return ok


def sweep(gpu, args, name: str) -> dict:
    """Time every plan (`--plans`, else `sweep_plans`) at shape `name`: a table by forward + backward time,
    the winner as a DDL_WGPU_GDN_PLAN value and as the line that makes it the default."""
    from ddl_wgpu.ops import gated_delta as kg

    shape = {**KERNEL_SHAPES, **QUICK_SHAPES}[name]
    Dk, Dv = shape[4], shape[5]
    plans = [kg.parse_plan(x) for x in args.plans.split(";")] if args.plans else sweep_plans(gpu, Dk, Dv)
    bufs = _kernel_inputs(gpu, shape, np.random.default_rng(0))
    rows = []
    print(f"sweep: {len(plans)} plans at {name} {shape}", flush=True)
    common.warm_up(gpu, 0.0 if args.quick else args.warm_up_s)
    warm = 0.0 if args.quick else 0.5
    for i, plan in enumerate(plans):
        t0 = time.perf_counter()
        r = common.attempt(time_chunked, gpu, shape, bufs, plan, 10.0, 2, False, warm)
        r.setdefault("plan", plan.__dict__)
        if "error" not in r and getattr(args, "_case", None) is not None:
            r["check"] = common.attempt(check_plan, gpu, plan, args._case)
            if not r["check"].get("ok"):
                r["error"] = f"wrong results: {r['check'].get('error')}"
        r["wall_s"] = time.perf_counter() - t0
        rows.append(r)
        print(f"  [{i + 1}/{len(plans)}] {plan.text()}: " + (
            f"forward {r['forward_ms']:.2f} ms, backward {r['backward_ms']:.2f} ms" if "error" not in r
            else f"ERROR {r['error'][:200]}") + f" ({r['wall_s']:.1f} s)", flush=True)  # fmt: skip
    good = sorted((r for r in rows if "error" not in r), key=lambda r: r["forward_ms"] + r["backward_ms"])
    table = [[kg.ChunkPlan(**r["plan"]).text(), f"{r['forward_ms']:.2f}", f"{r['forward_train_ms']:.2f}",
              f"{r['backward_ms']:.2f}", f"{r['forward_ms'] + r['backward_ms']:.2f}"] for r in good]  # fmt: skip
    print(common.table(["plan (DDL_WGPU_GDN_PLAN)", "forward ms", "training forward ms", "backward ms", "fwd + bwd"],
                       table, f"gated delta rule plans at {name} {tuple(shape)}"))  # fmt: skip
    out = {"shape": list(shape), "name": name, "rows": rows, "best": None}
    if good:
        best = kg.ChunkPlan(**good[0]["plan"])
        fwd = kg.ChunkPlan(**min(good, key=lambda r: r["forward_ms"])["plan"])
        out |= {"best": best.text(), "best_forward": fwd.text()}
        print(
            f"fastest at {name} (forward + backward): DDL_WGPU_GDN_PLAN={best.text()}; fastest forward: "
            f"{fwd.text()}\n  to make it the default, put first in PLANS (ddl_wgpu/ops/gated_delta.py): {best!r},"
        )
    return out


# ---------------------------------------------------------------------------------------------------------


def _brief(r: dict) -> str:
    if "error" in r:
        return "ERROR " + r["error"][:300]
    return f"{r['s_per_step'] * 1e3:.1f} ms/step, init loss {r.get('init_loss', float('nan')):.5f}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("what", choices=["train", "forward27b", "kernel", "all", "torch-train"])
    ap.add_argument("--quick", action="store_true", help="tiny shapes (lavapipe smoke test)")
    ap.add_argument("--batch", type=int, default=None, help="train: default 8 (2 with --quick)")
    ap.add_argument("--seq", type=int, default=None, help="train: default 1024 (32 with --quick)")
    ap.add_argument("--steps", type=int, default=None, help="train: timed steps (default 6)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3, help="forward27b: timed forwards")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--torch", default="auto", choices=["auto", "cuda", "cpu", "none"])
    ap.add_argument(
        "--fla-path", default=None, help="a folder holding flash-linear-attention (fla) for the fla peer"
    )
    ap.add_argument("--peer-timeout", type=float, default=400.0)
    ap.add_argument("--bypass-fla-hopper-guard", action="store_true",
                    help="time fla's kernels even where fla refuses its gated backward (Hopper with Triton 3.4 to "
                    "3.7.0: fla #640, wrong gradients); its throughput only, its losses are not compared")  # fmt: skip
    ap.add_argument("--sweep", action="store_true", help="kernel: also time every chunk plan at some shapes")
    ap.add_argument("--sweep-shape", default="27b",
                    help=f"kernel --sweep: the shapes, comma-separated, of {', '.join(KERNEL_SHAPES)}")  # fmt: skip
    ap.add_argument("--plans", default=None,
                    help='kernel --sweep: the plans to time, "chunk=64,bv=32,threads=128;chunk=32,..."')  # fmt: skip
    ap.add_argument("--warm-up-s", type=float, default=2.0,
                    help="kernel: seconds of GEMMs before the first timed case (clocks ramp up)")  # fmt: skip
    ap.add_argument("--device", default=None)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    bad = [x for x in args.sweep_shape.split(",") if x.strip() and x.strip() not in KERNEL_SHAPES]
    if bad:
        ap.error(f"--sweep-shape: unknown shape {bad[0]!r}; use {', '.join(KERNEL_SHAPES)}")
    args.batch = args.batch or (2 if args.quick else 8)
    args.seq = args.seq or (32 if args.quick else 1024)
    args.steps = args.steps or (2 if args.quick else 6)
    if args.what == "torch-train":
        print(json.dumps(torch_train_peer(args)))
        return 0
    t0 = time.perf_counter()
    gpu = common.open_gpu(args.device)
    print(f"adapter: {common.adapter_line(gpu)}", flush=True)
    data = {"bench": "hybrid", "date": common.now_iso(), "command": " ".join(["python3", "bench/hybrid.py", *sys.argv[1:]]),
            "adapter": common.adapter_line(gpu), "host": common.host_info()}  # fmt: skip
    parts = ["kernel", "train", "forward27b"] if args.what == "all" else [args.what]
    for part in parts:
        fn = {"train": bench_train, "forward27b": bench_forward27b, "kernel": bench_kernel}[part]
        data[part] = common.attempt(fn, gpu, args)
        if "error" in data[part]:
            print(f"{part}: ERROR {data[part]['error']}\n{data[part].get('traceback', '')}", flush=True)
    data["wall_s"] = time.perf_counter() - t0
    common.write_json(common.json_path(args.json, "hybrid.json"), data)
    failed = _summary(data)
    return 1 if failed else 0


def _summary(data: dict) -> list[str]:
    failed = []
    tr = data.get("train")
    if tr and "runs" in tr:
        rows = []
        for name, r in tr["runs"].items():
            if "error" in r:
                rows.append([name, "-", "-", "-", r["error"][:60]])
                if name == "ddl-wgpu":
                    failed.append(f"train/{name}: {r['error'][:120]}")
                continue
            diff = r.get("init_loss_diff")
            if diff is not None and diff > LOSS_TOL:
                failed.append(f"train/{name}: initial loss differs by {diff:.2e}")
            rows.append([name, f"{r['s_per_step'] * 1e3:.1f}", f"{r['tokens_per_s'] / 1e3:.2f}K",
                         common.fmt(r.get("init_loss"), ".5f"), common.fmt(diff, ".1e")])  # fmt: skip
        print(common.table(["implementation", "ms/step", "tokens/s", "init loss", "|Δ init|"], rows,
                           f"hybrid training step ({tr['params'] / 1e6:.1f}M, {tr['batch']} x {tr['seq']})"))  # fmt: skip
        prof = tr["runs"].get("ddl-wgpu", {}).get("profile_ms")
        if prof:
            top = list(prof.items())[:14]
            print(common.table(["phase|shader", "GPU ms"], [[k, f"{v:.2f}"] for k, v in top],
                               f"ddl-wgpu step by phase and shader (all {sum(prof.values()):.1f} ms)"))  # fmt: skip
        dw = tr["runs"].get("ddl-wgpu", {})
        print(f"ddl-wgpu vs fla (TF32 dots): {common.fmt(dw.get('vs_fla'), '.2f')}x, vs fla (TRITON_F32_DEFAULT=ieee): "
              f"{common.fmt(dw.get('vs_fla_ieee'), '.2f')}x, vs eager: {common.fmt(dw.get('vs_eager'), '.2f')}x; "
              f"rule plan {tr.get('gdn_plan')}")  # fmt: skip
    fw = data.get("forward27b")
    if fw and "forward_ms" in fw:
        print(f"forward ({fw['params'] / 1e9:.2f}B, {fw['batch']} x {fw['seq']}): {fw['forward_ms']:.1f} ms, "
              f"{fw['tokens_per_s'] / 1e3:.2f}K tokens/s; weights {fw['weights_gib']:.1f} GiB, our buffers "
              f"{fw['ours_gib']:.1f} GiB, nvidia-smi {common.fmt(fw.get('nvidia_smi_used_gib'), '.1f')} GiB; "
              f"ms per layer {', '.join(f'{k} {v:.2f}' for k, v in fw['ms_per_layer'].items())}")  # fmt: skip
    elif fw:
        failed.append(f"forward27b: {fw.get('error', '?')[:120]}")
    kr = data.get("kernel")
    if kr and "error" not in kr:
        shapes = {k: v for k, v in kr.items() if isinstance(v, dict) and k not in ("sweep", "check")}
        if not kr.get("check", {}).get("ok"):
            failed.append(f"kernel check against ddl_ref: {kr.get('check', {}).get('error', '?')[:200]}")
        rows = []
        for name, row in shapes.items():
            if "error" in row:
                failed.append(f"kernel {name}: {row['error'][:120]}")
                continue
            for part in ("forward", "backward"):
                x = row[part]
                rows.append([name, part, f"{row[part + '_ms']:.2f}", f"{x['tflops']:.1f}", f"{x['gbs']:.0f}",
                             x["binds"], f"{x['x_of_bound']:.2f}",
                             f"{row['per_token_forward_ms']:.2f}" if part == "forward" else "-"])  # fmt: skip
        print(common.table(["shape", "pass", "ms", "TFLOP/s", "GB/s", "bound", "x bound", "per-token fwd ms"], rows,
                           "gated delta rule, chunked (the engine's), beside the per-token forward"))  # fmt: skip
        for name, row in shapes.items():
            if "profile_ms" in row:
                print(
                    f"  {name} per kernel (GPU ms): "
                    + ", ".join(f"{k} {v:.2f}" for k, v in row["profile_ms"].items())
                )
        # the per-token forward's threshold: the longest rows (of the shapes timed) where it won
        wins = [row["shape"][1] for row in shapes.values() if "error" not in row
                and row["per_token_forward_ms"] < row["forward_ms"]]  # fmt: skip
        loses = [row["shape"][1] for row in shapes.values() if "error" not in row
                 and row["per_token_forward_ms"] >= row["forward_ms"]]  # fmt: skip
        print(f"per-token forward faster at T = {sorted(set(wins)) or 'none'}, chunked at T = {sorted(set(loses)) or 'none'}; "
              f"inference runs per token up to T = {kr.get('per_token_max_t')} (PER_TOKEN_MAX_T in "
              "ddl_wgpu/ops/gated_delta.py, env DDL_WGPU_GDN_PER_TOKEN_T)")  # fmt: skip
        for name, sw in (kr.get("sweep") or {}).items():
            if "error" in sw:
                failed.append(f"kernel sweep {name}: {sw['error'][:120]}")
                continue
            wrong = [r["plan"] for r in sw["rows"] if "check" in r and not r["check"].get("ok")]
            if wrong:
                failed.append(f"kernel sweep {name}: {len(wrong)} plans give wrong results, first {wrong[0]}")
            elif sw.get("best"):
                print(
                    f"sweep {name}: fastest (forward + backward) {sw['best']}; fastest forward {sw['best_forward']}"
                )
    elif kr:
        failed.append(f"kernel: {kr['error'][:120]}")
    print(
        f"total {data['wall_s']:.0f}s; {'all checks passed' if not failed else 'FAILED: ' + '; '.join(failed)}"
    )
    return failed


if __name__ == "__main__":
    sys.exit(main())
