"""The `ddl-wgpu` command line: a thin typer layer over library functions.

Each command parses its options into the library's dataclasses (whose defaults are the options' defaults)
and calls one function. Every command that runs a model takes `--backend auto|wgpu|ref` and says at the start
which backend it chose and why. Progress is readable lines (`--json`: JSON lines); errors a user can cause
(bad files, bad data, bad options, bad usage, no GPU) print one line `error: ...` on stderr, naming the flag
or command that gets the user further, and exit with 2; nothing a user can trigger ends in a traceback.
"""

# ruff: noqa: E402 (the Ctrl-C handler of the start is set before the other imports, which take a while)
from __future__ import annotations

import os
import signal
import sys
import threading


def _interrupted_while_starting(*_signal) -> None:
    """Ctrl-C while the package is still importing (the first few tenths of a second): the entry point's one
    line and status 130, as anywhere later, not a KeyboardInterrupt traceback from inside some import. The
    process ends here: nothing is written before a command runs, and an exception raised from a signal handler
    can land in an import lock's weakref callback, where Python prints it, ignores it and goes on."""
    sys.stderr.write("interrupted\n")
    sys.stderr.flush()
    os._exit(130)


# where Python prints and ignores an exception instead of raising it: a weakref callback (importlib's module
# locks have one, `cb`) and a finalizer
_SWALLOWED_IN = frozenset({"cb", "__del__"})


def _interrupt(_signum, frame) -> None:
    """Ctrl-C while a command runs: a KeyboardInterrupt, as Python's own handler raises it, except inside a
    weakref callback or a finalizer (`_SWALLOWED_IN`; a command's first imports run such callbacks), where it
    would be ignored and the command would go on (`generate` waiting for its prompt for ever): there the signal
    comes again a moment later, into whatever runs next."""
    if frame is not None and frame.f_code.co_name in _SWALLOWED_IN:
        threading.Timer(0.05, os.kill, (os.getpid(), signal.SIGINT)).start()
        return
    raise KeyboardInterrupt


try:  # only the main thread may set a handler; an import from another thread leaves Ctrl-C as it is
    _STARTING_SIGINT = signal.signal(signal.SIGINT, _interrupted_while_starting)
except ValueError:
    _STARTING_SIGINT = None

import contextlib
import json
import time
from dataclasses import replace
from pathlib import Path

import typer
from typer._click import exceptions as usage  # typer parses with its own copy of click
from typer._click import utils as usage_utils

from ddl_ref.config import ARCH_MTP, ModelVariant
from ddl_ref.params import init_params, param_table
from ddl_wgpu.backend import choose_backend, make_net
from ddl_wgpu.cli import checks as cli_checks
from ddl_wgpu.cli import jobs as cli_jobs
from ddl_wgpu.cli.checks import (
    EXIT_TERMINATED,
    EXIT_USER_ERROR,
    Terminated,
    batch_tokens,
    error_line,
    fail,
    fits,
    in_range,
    interrupted,
    is_user_error,
    output_file,
    remove_created,
    within_context,
    writes,
    written_meanwhile,
)
from ddl_wgpu.cli.console import accept_text, summary_text
from ddl_wgpu.cli.options import (
    Arch,
    BackendOpt,
    ChainAttention,
    DecodeGpuMemory,
    DeviceOpt,
    DModel,
    FfnHidden,
    ForceOpt,
    GpuMemory,
    HeadDim,
    MaxSeqLen,
    NHeads,
    NKvHeads,
    NLayers,
    NormStyle,
    NoVerify,
    QkNorm,
    RopeTheta,
    RuntimeOpt,
    TieEmbeddings,
    TrunkDtype,
    VocabSize,
    backend_line,
    emit,
    model_config,
    opt,
)
from ddl_wgpu.data import (
    eval_windows,
    tokenizer_for,
)
from ddl_wgpu.engine import gpumem
from ddl_wgpu.files.hf.convert import export_hf_from_file, import_hf_to_file
from ddl_wgpu.files.inspect import describe, render_text
from ddl_wgpu.files.modelfile import Model, load_model, save_model
from ddl_wgpu.files.safeio import read_regular, refuse_overwrite_input
from ddl_wgpu.jobs import accept as accept_lib
from ddl_wgpu.jobs import draft as draft_lib
from ddl_wgpu.jobs import generate as generate_lib
from ddl_wgpu.jobs import train as train_lib
from ddl_wgpu.jobs.compress import CompressError, compress_file

EVAL_SEQ_LEN = 128  # eval's window when --seq-len is not given (or the model's context when shorter)

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    help="Train and heal transformer language models (baseline and Deep Delta Learning) on any "
    "Vulkan, Metal or DX12 GPU through WGSL.",
)


# ---------------------------------------------------------------------------------------------------------
# devices, check, inspect


@app.command()
def devices(as_json: bool = typer.Option(False, "--json", help="Machine-readable output.")):
    """List every adapter of both WebGPU runtimes (wgpu-native, Dawn): backend, type, driver, features, the
    limits that matter, Dawn's subgroup-matrix configurations and toggles, and what --runtime auto picks."""
    from ddl_wgpu.runtime import gpu as g
    from ddl_wgpu.runtime import runtimes

    adapters, problems = [], {}
    for name in ("native", "dawn"):
        try:
            rt = runtimes.load(name)
        except runtimes.RuntimeUnavailable as e:
            problems[name] = str(e)
            continue
        found = g.enumerate_adapters(rt)
        if not found:
            problems[name] = g.DAWN_HINT if name == "dawn" else g.DRIVER_HINT
        for i, a in enumerate(found):
            d = g.describe_adapter(a, i, rt)
            d["toggles"] = g.runtime_toggles(rt)
            adapters.append(d)
    if not adapters:
        fail(g.DRIVER_HINT)
    try:
        rt, reason = g.resolve(None, None, g.select_adapter)
        auto = {"runtime": rt.name, "reason": reason}
    except g.GpuError as e:
        auto = {"runtime": None, "reason": str(e).splitlines()[0]}
    if as_json:
        typer.echo(json.dumps(adapters, indent=2))
        return
    for a in adapters:
        typer.echo(
            f"[{a['index']}] {a['name']}  runtime={a['runtime']}  backend={a['backend']}  type={a['type']}  "
            f"driver={a['driver']}"
        )
        typer.echo("    features: " + ", ".join(a["features"]))
        for k, v in a["limits"].items():
            typer.echo(f"    {k:40s} {v}")
        if a["runtime"] == "dawn":
            configs = ", ".join(f"{m}x{n}x{k} {t}->{r}" for m, n, k, t, r in a["subgroup_matrix_configs"])
            typer.echo(f"    subgroup matrices: {configs or 'none'}")
            typer.echo(f"    toggles: {', '.join(a['toggles'])}")
    for name, why in problems.items():
        typer.echo(f"{name}: {why}")
    chosen = g.describe_adapter(g.select_adapter(None))
    typer.echo(f"default adapter: {chosen['name']} ({chosen['backend']})")
    typer.echo(f"runtime: {auto['runtime']} ({auto['reason']})")


@app.command()
def check(device: DeviceOpt = None, runtime: RuntimeOpt = None):
    """Run a small kernel on the GPU and compare it with numpy."""
    from ddl_wgpu.backend import set_runtime
    from ddl_wgpu.runtime.gpu import Gpu  # the GPU layer loads wgpu: only the GPU commands import it up front
    from ddl_wgpu.runtime.selftest import selftest

    t0 = time.perf_counter()
    set_runtime(runtime)
    gpu = Gpu(device)
    typer.echo(f"adapter: {gpu.name}")
    typer.echo(f"runtime: {gpu.runtime_name} ({gpu.runtime_reason})")
    for line in selftest(gpu):
        typer.echo(line)
    typer.echo(f"ok ({time.perf_counter() - t0:.2f} s)")


@app.command()
def inspect(
    file: Path = typer.Argument(..., help="A .ddlw model, checkpoint or healed file (or one shard)."),
    as_json: bool = typer.Option(False, "--json", help="Machine-readable output."),
    verify: bool = typer.Option(False, "--verify", help="Check every tensor's hash."),
):
    """Header summary, tensor table and provenance of a checkpoint file."""
    desc = describe(str(file), verify=verify)
    emit(desc, as_json, render_text(desc))


# ---------------------------------------------------------------------------------------------------------
# models: init, eval, import-hf, export-hf


@app.command()
def init(
    variant: str = typer.Option(
        "baseline", "--variant", help="baseline, ddl, ddl-tc-noec, ddl-cc-noec, ddl-tc, ddl-cc."
    ),
    out: Path = typer.Option(..., "--out", help="Model file to write (.ddlw)."),
    preset: str = opt("tiny", "Size preset: tiny, small (124M), medium (353M)."),
    arch: Arch = "transformer",
    seed: int = typer.Option(0, "--seed", help="Initialisation seed."),
    vocab_size: VocabSize = None,
    d_model: DModel = None,
    n_layers: NLayers = None,
    n_heads: NHeads = None,
    n_kv_heads: NKvHeads = None,
    head_dim: HeadDim = None,
    ffn_hidden: FfnHidden = None,
    max_seq_len: MaxSeqLen = None,
    rope_theta: RopeTheta = None,
    qk_norm: QkNorm = None,
    norm_style: NormStyle = None,
    tie_embeddings: TieEmbeddings = None,
    mtp: bool = typer.Option(
        False,
        "--mtp",
        help="Add an MTP draft block (model.mtp.*; --arch qwen3_5: Qwen3.5's layout, post-norm hiddens).",
    ),
    force: ForceOpt = False,
):
    """Write a freshly initialised model file."""
    in_range("seed", seed, 0)
    base = model_config(preset, locals(), arch=arch)
    v = ModelVariant.parse(variant)
    cfg = v.resolve_config(base)
    if mtp:
        cfg = replace(cfg, mtp=ARCH_MTP[arch])
    output_file(out, force)
    fits(cfg, False, "the model")
    params = init_params(cfg, seed)
    prov = {"init": {"seed": seed, "preset": preset, "arch": arch}}
    with writes(out, replace=force):
        save_model(out, Model(cfg, params, variant=v.slug, provenance=prov))
        table = param_table(cfg)
        n = sum(s.numel for s in table)
        base_n = sum(s.numel for s in param_table(ModelVariant.parse("baseline").resolve_config(base)))
        typer.echo(
            f"variant {v.slug}: {n:,} parameters ({n - base_n:+,} over baseline) in {len(table)} tensors"
        )
        typer.echo(f"wrote {out}")


@app.command("eval")
def eval_(
    model: Path = typer.Argument(..., help="Model or checkpoint file."),
    data: str = typer.Option(..., "--data", help="Data spec: file, folder, .jsonl, .bin, .npy or 'stdlib'."),
    seq_len: int = typer.Option(
        None,
        "--seq-len",
        help=f"Window length (default: {EVAL_SEQ_LEN}, or the model's context when shorter).",
    ),
    batch: int = typer.Option(8, "--batch", help="Windows per batch."),
    max_tokens: int = typer.Option(200_000, "--max-tokens", help="Read at most this many tokens (0: all)."),
    backend: BackendOpt = "auto",
    device: DeviceOpt = None,
    runtime: RuntimeOpt = None,
    gpu_memory: GpuMemory = None,
    no_verify: NoVerify = False,
    as_json: bool = typer.Option(False, "--json", help="Machine-readable output."),
):
    """Loss and perplexity over consecutive windows of a corpus (and spectral diagnostics for DDL models)."""
    in_range("seq-len", seq_len, 2)
    in_range("batch", batch, 1)
    in_range("max-tokens", max_tokens, 0)
    batch_tokens("batch", batch, seq_len or EVAL_SEQ_LEN)
    budget = gpumem.budget(gpu_memory)
    choice = choose_backend(backend, device, runtime)
    typer.echo(backend_line(choice), err=as_json)
    on_gpu = choice.name == "wgpu"  # the GPU trunk reads its tensors from the file as it needs them
    m = load_model(model, verify=not no_verify, names=(lambda n: False) if on_gpu else None,
                   check_memory=not on_gpu)  # fmt: skip
    within_context("seq-len", seq_len, m.cfg)
    ds = eval_windows(
        data,
        tokenizer=tokenizer_for(m.tokenizer),
        seq_len=seq_len or min(EVAL_SEQ_LEN, m.cfg.max_seq_len),
        batch_size=batch,
        max_tokens=max_tokens or None,
        vocab_size=m.cfg.vocab_size,
    )
    t0 = time.perf_counter()
    plan = None
    if on_gpu:
        from ddl_wgpu.jobs import trunk_eval

        ev, plan = trunk_eval.evaluate_file(model, m.cfg, ds, device, budget, not no_verify,
                                            say=lambda line: typer.echo(line, err=as_json))  # fmt: skip
    else:
        net = make_net(m.cfg, m.params, choice.name, device)
        ev = train_lib.evaluate(net, ds, 0, spectral=True)
    dt = time.perf_counter() - t0
    out = {
        **ev["metrics"],
        "tokens": int(ds.num_tokens),
        "predictions": int(ds.num_predictions),
        "windows": int(ds.num_windows),
        "backend": choice.name,
        "backend_reason": choice.reason,
        "runtime": choice.runtime,
        "runtime_reason": choice.runtime_reason,
        "variant": m.variant,
        "seconds": dt,
        "tokens_per_s": ds.num_tokens / max(dt, 1e-9),
        "plan": plan.to_dict() if plan is not None else None,
    }
    if ev["spectral"] is not None:
        out["spectral"] = ev["spectral"]
    text = (
        f"{model}: loss {out['loss']:.6f}  perplexity {out['perplexity']:.4f}  over {out['windows']} windows, "
        f"{out['tokens']} tokens ({choice.name}, {dt:.2f} s)"
    )
    emit(out, as_json, text)


def _say(line: str) -> None:
    """A long file command's progress, on standard error (standard output holds its summary, maybe JSON)."""
    typer.echo(line, err=True)


@app.command("import-hf")
def import_hf(
    folder: Path = typer.Argument(
        ...,
        help="Hugging Face folder: config.json + *.safetensors (+ tokenizer.json and the small json files).",
    ),
    out: Path = typer.Argument(..., help="Model file to write (.ddlw)."),
    target: Path = typer.Option(
        None,
        "--target",
        help="EAGLE-3 draft folders: the target model (default aux layer ids; a folder naming none is bound to it).",
    ),
    force: ForceOpt = False,
    as_json: bool = typer.Option(False, "--json", help="Machine-readable output."),
):
    """Import a Qwen3, Llama or Qwen3.5 (CausalLM or ConditionalGeneration) folder into our container, or an
    EAGLE-3 draft folder (LlamaForCausalLMEagle3) into a draft file."""
    output_file(out, force, flag="")
    with writes(out, replace=force):
        summary = import_hf_to_file(folder, out, say=_say, target=target)
        emit(summary, as_json, summary_text(summary) + f"\nwrote {out}")


@app.command("export-hf")
def export_hf(
    model: Path = typer.Argument(..., help="Model file (.ddlw)."),
    folder: Path = typer.Argument(..., help="Folder to write config.json + model.safetensors into."),
    raw: bool = typer.Option(
        None,
        "--raw/--no-raw",
        help="Raw tensors under our names (the default for Deep Delta models, which no transformers class holds; "
        "else Qwen3/Llama, or Qwen3.5 for a hybrid trunk).",
    ),
    force: bool = typer.Option(False, "--force", help="Replace the files of a non-empty FOLDER."),
    dtype: str = typer.Option(
        None, "--dtype", help="EAGLE-3 drafts: bf16 (default, as published drafts), f16 or f32."
    ),
    no_verify: NoVerify = False,
    as_json: bool = typer.Option(False, "--json", help="Machine-readable output."),
):
    """Export a model as a Hugging Face folder (Qwen3/Llama for baseline models, Qwen3.5 in the layout it came
    from for hybrid trunks, raw tensors for DDL), or an EAGLE-3 draft file as the folder vLLM and SGLang load."""
    with writes(folder):
        summary = export_hf_from_file(model, folder, raw=raw, overwrite=force, verify=not no_verify, say=_say,
                                      dtype=dtype)  # fmt: skip
        emit(summary, as_json, summary_text(summary) + f"\nwrote {folder}")


app.command()(cli_jobs.train)
app.command()(cli_jobs.resume)


# ---------------------------------------------------------------------------------------------------------
# MTP draft: compress, accept, heal


@app.command()
def compress(
    model: Path = typer.Argument(..., help="Model file (.ddlw)."),
    out: Path = typer.Option(..., "--out", help="Compressed model file to write."),
    drop_layers: str = typer.Option(None, "--drop-layers", help="Blocks to drop, e.g. '1,3-5'."),
    ffn_keep: float = typer.Option(
        None, "--ffn-keep", help="Fraction of each SwiGLU's channels to keep (0, 1]."
    ),
    force: ForceOpt = False,
    no_verify: NoVerify = False,
    as_json: bool = typer.Option(False, "--json", help="Machine-readable output."),
):
    """Structural compress: drop whole blocks, or keep the most important SwiGLU channels."""
    refuse_overwrite_input(out, [model], CompressError)  # "is the input" says more than "exists"
    output_file(out, force)
    with writes(out, replace=force):
        prov = compress_file(model, out, drop=drop_layers, keep=ffn_keep, verify=not no_verify, say=_say)
        emit(prov, as_json, summary_text(prov) + f"\nwrote {out}")


@app.command()
def accept(
    model: Path = typer.Argument(..., help="Model file with an MTP draft (model.mtp.*)."),
    data: str = typer.Option(..., "--data", help="Data spec."),
    depth: int = typer.Option(accept_lib.DEPTH, "--depth", help="Draft chain depth K."),
    window: int = typer.Option(
        None,
        "--window",
        help=f"Window length (default: {accept_lib.WINDOW}, or the model's context when shorter).",
    ),
    tokens: int = typer.Option(accept_lib.TOKENS, "--tokens", help="Tokens to measure on (0: all)."),
    probe_conventions: bool = typer.Option(
        False, "--probe-conventions", help="Also measure the other concat order and hidden conventions."
    ),
    backend: BackendOpt = "auto",
    device: DeviceOpt = None,
    runtime: RuntimeOpt = None,
    trunk_dtype: TrunkDtype = "f32",
    chain_attention: ChainAttention = None,
    gpu_memory: GpuMemory = None,
    draft: Path = typer.Option(
        None, "--draft", help="Measure this EAGLE-3 draft file instead of the MTP draft."
    ),
    aux_layers: str = typer.Option(
        None,
        "--aux-layers",
        help="--draft: the three layer inputs the draft reads (default: mapped from its target).",
    ),
    no_verify: NoVerify = False,
    as_json: bool = typer.Option(False, "--json", help="Machine-readable output."),
):
    """Greedy speculative acceptance of the draft chained K deep: A_j, α_j, τ (all and on-policy anchors)."""
    in_range("depth", depth, 1)
    in_range("window", window, depth + 1)
    in_range("tokens", tokens, 0)
    if window is None and depth + 1 > accept_lib.WINDOW:
        fail(f"--depth {depth} needs windows of at least {depth + 1} tokens: pass --window")
    budget = gpumem.budget(gpu_memory)
    choice = choose_backend(backend, device, runtime)
    typer.echo(backend_line(choice), err=as_json)
    if draft is not None:  # an EAGLE-3 draft file (`jobs/draft.py`), its layers found on MODEL (`eagle3_aux`)
        r = draft_lib.accept_file(model, draft, data, depth=depth, window=window, tokens=tokens or None,
                                  backend=choice.name, device=device, verify=not no_verify,
                                  aux_layers=cli_jobs.parse_aux_layers(aux_layers),
                                  say=lambda line: typer.echo(line, err=True))  # fmt: skip
        emit(r, as_json, accept_text(r))
        return
    if aux_layers is not None:
        fail("--aux-layers names the layers an EAGLE-3 draft reads: it goes with --draft")
    shown, why = accept_lib.chain_attention_of(model, chain_attention)
    typer.echo(f"chain attention: {shown} ({'--chain-attention' if why == 'as given' else why})", err=as_json)
    # the option as the user gave it (None: defaulted), so the result's chain_attention_why says which it was
    r = accept_lib.accept_file(model, data, depth=depth, window=window, tokens=tokens or None,
                               backend=choice.name, probe_conventions=probe_conventions, device=device,
                               trunk_dtype=trunk_dtype, chain_attention=chain_attention,
                               verify=not no_verify, gpu_memory=budget,
                               say=lambda line: typer.echo(line, err=as_json))  # fmt: skip
    emit(r, as_json, accept_text(r))


@app.command("accept-table")
def accept_table(
    results: list[str] = typer.Argument(..., help="LABEL=FILE.json of saved `accept --json` results."),
):
    """One table of saved acceptance results side by side: prefix acceptance per depth and τ."""
    rows = []
    for arg in results:
        label, sep, path = arg.partition("=")
        if not sep:
            fail(f"accept-table: expected LABEL=FILE.json, got {arg!r}")
        rows.append((label, accept_lib.load_result(path)))
    typer.echo(accept_lib.table(rows))


app.command()(cli_jobs.heal)
app.command()(cli_jobs.draft)


def _prompt_of(prompt: str | None, prompt_file: Path | None, m: Model) -> bytes:
    """--prompt TEXT (the bytes typed), --prompt-file FILE (a regular file's bytes), else standard input (its
    bytes); none longer than a prompt of the model can be (`generate.prompt_limit`), read no further."""
    if prompt is not None and prompt_file is not None:
        fail("give --prompt or --prompt-file, not both")
    limit = generate_lib.prompt_limit(m)
    what = f"a prompt of this model (its context is {m.cfg.max_seq_len} tokens)"
    if prompt is not None:
        try:  # the arguments' own bytes: invalid UTF-8 reaches the tokenizer as the bytes it was
            return prompt.encode("utf-8", "surrogateescape")
        except UnicodeEncodeError:
            fail("--prompt holds a lone UTF-16 surrogate, which is not text")
    if prompt_file is not None:
        return read_regular(prompt_file, what, generate_lib.GenerateError, limit)
    if sys.stdin is None or sys.stdin.isatty():
        fail("no prompt: give --prompt TEXT, --prompt-file FILE, or the text on standard input")
    text = sys.stdin.buffer.read(limit + 1)
    if len(text) > limit:
        fail(f"standard input holds more than the {limit} bytes allowed for {what}")
    return text


def _write_now(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()


@app.command()
def generate(
    model: Path = typer.Argument(..., help="Model file (.ddlw)."),
    prompt: str = typer.Option(
        None, "--prompt", help="The prompt (else --prompt-file, else standard input)."
    ),
    prompt_file: Path = typer.Option(None, "--prompt-file", help="Read the prompt from this file."),
    max_new_tokens: int = typer.Option(
        generate_lib.MAX_NEW_TOKENS, "--max-new-tokens", help="Tokens at most."
    ),
    temperature: float = typer.Option(0.0, "--temperature", help="0: greedy; > 0: sampling."),
    top_k: int = typer.Option(0, "--top-k", help="Sample among the k most likely tokens (0: all)."),
    top_p: float = typer.Option(1.0, "--top-p", help="Sample among the most likely tokens of mass p."),
    seed: int = typer.Option(0, "--seed", help="Sampling seed: same seed, same text."),
    stop: list[str] = typer.Option(None, "--stop", help="Stop before this text (repeatable)."),
    speculative: bool = typer.Option(
        False, "--speculative", help="Speculative decoding with the model's MTP draft (the same greedy text)."
    ),
    depth: int = typer.Option(generate_lib.DEPTH, "--depth", help="Draft tokens per speculative round."),
    draft: Path = typer.Option(
        None,
        "--draft",
        help="Speculate with this EAGLE-3 draft file (`ddl-wgpu draft`) instead of an MTP draft.",
    ),
    backend: BackendOpt = "auto",
    device: DeviceOpt = None,
    runtime: RuntimeOpt = None,
    trunk_dtype: TrunkDtype = "f32",
    gpu_memory: DecodeGpuMemory = None,
    as_json: bool = typer.Option(False, "--json", help="Print the text, token ids and timings as JSON."),
):
    """Continue a prompt: the text streamed as it is produced (greedy, or sampled), optionally speculating with
    the model's MTP draft; a summary line (tokens/s, the draft's acceptance) on standard error."""
    in_range("seed", seed, 0)
    in_range("depth", depth, 1)
    sampling = generate_lib.Sampling(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
    budget = gpumem.budget(
        gpu_memory
    )  # read whatever the backend: a size no command takes is refused here too
    choice = choose_backend(backend, device, runtime)
    m = load_model(model)
    eagle = None
    # an EAGLE-3 draft's layers found on MODEL (`eagle3_aux`: its own target's, or mapped through compress)
    if draft is not None:
        eagle, plan = draft_lib.plan_for(model, draft)
        for line in (plan.line(), *plan.notes):
            typer.echo(line, err=True)
    if speculative:  # a round drafts within the model's context (and sizes its cache by the depth)
        in_range("depth", depth, 1, m.cfg.max_seq_len - 1)
    if choice.name == "wgpu":  # decoding reads every weight per token: a model past the budget is refused
        gpumem.check_decode(m.cfg, trunk_dtype, budget, speculative)
    text = _prompt_of(prompt, prompt_file, m)
    typer.echo(backend_line(choice), err=True)
    r = generate_lib.generate(m, text, max_new_tokens=max_new_tokens, sampling=sampling, stops=stop or (),
                              speculative=speculative, depth=depth, backend=choice.name, device=device,
                              on_text=None if as_json else _write_now, dtype=trunk_dtype, draft=eagle)  # fmt: skip
    if as_json:
        typer.echo(json.dumps(r, indent=2))
    else:
        typer.echo()
        typer.echo(generate_lib.summary_line(r), err=True)


# ---------------------------------------------------------------------------------------------------------
# errors


if _STARTING_SIGINT is not None:  # the package is imported: Ctrl-C is a KeyboardInterrupt again
    signal.signal(signal.SIGINT, _STARTING_SIGINT)


def main():
    """Console-script entry point: run the app; user errors and usage errors become one line and exit 2, a
    Ctrl-C one line (what was saved, where a command knows) and exit 130."""
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:  # not where a caller ignores Ctrl-C
        signal.signal(signal.SIGINT, _interrupt)
    try:
        code = _main()
    except KeyboardInterrupt as e:  # in the last instants of `_main`, as it returned
        code = 0 if written_meanwhile() is not None else EXIT_TERMINATED if isinstance(e, Terminated) else 130
    sys.exit(code)


def _invoke() -> int:
    """Run the app as typer's `app()` does, but let a KeyboardInterrupt through: typer turns it into a
    silent exit 130, before `_main` can say what was interrupted."""
    command = typer.main.get_command(app)
    try:
        with command.make_context(usage_utils._detect_program_name(), sys.argv[1:]) as ctx:
            code = command.invoke(ctx)
    except typer.Exit as e:
        code = e.exit_code
    return code if isinstance(code, int) else 0


def _main() -> int:
    """`_run`, after which a command that failed takes back the folders it created for its output (a refused
    command leaves no empty folder behind)."""
    cli_checks.WATCHED.clear()
    cli_checks.CREATED.clear()
    code = 1
    try:
        code = _run()
    finally:
        if code != 0:
            remove_created()
    return code


def _run() -> int:
    if sys.stdout is None:  # started with standard output closed (`>&-`): where would the results go?
        typer.echo("error: standard output is closed; redirect it instead (e.g. > /dev/null)", err=True)
        return EXIT_USER_ERROR
    try:
        code = _invoke()
        # the command is done: a Ctrl-C from now on has nothing left to interrupt (and must not turn the exit
        # into a death by SIGINT)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    except usage.NoArgsIsHelpError as e:
        e.show()
        return e.exit_code
    except usage.UsageError as e:
        command = f" (see `ddl-wgpu {e.ctx.info_name} --help`)" if e.ctx is not None and e.ctx.parent else ""
        typer.echo(f"error: {' '.join(e.format_message().split())}{command}", err=True)
        return EXIT_USER_ERROR
    except usage.ClickException as e:
        typer.echo(f"error: {' '.join(e.format_message().split())}", err=True)
        return EXIT_USER_ERROR
    except BrokenPipeError:  # the reader of standard output went away (`| head`): nothing more to say
        with contextlib.suppress(OSError, ValueError):  # the exit's own flush must not fail again
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except KeyboardInterrupt as e:  # Ctrl-C, or SIGTERM inside a command that writes (`checks.Terminated`)
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # one line, whatever more Ctrl-C follows
        return interrupted(e)
    except (typer.Abort, EOFError):
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # one line, whatever more Ctrl-C follows
        typer.echo("interrupted", err=True)
        return 130
    except Exception as e:
        if not is_user_error(e):
            raise
        typer.echo(error_line(e), err=True)
        return EXIT_USER_ERROR
    return code


if __name__ == "__main__":
    main()
