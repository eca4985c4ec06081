"""The `ddl-wgpu` command line: a thin typer layer over library functions.

Each command parses its options into the library's dataclasses (whose defaults are the options' defaults)
and calls one function. Every command that runs a model takes `--backend auto|wgpu|ref` and says at the start
which backend it chose and why. Progress is readable lines (`--json`: JSON lines); errors a user can cause
(bad files, bad data, bad options, bad usage, no GPU) print one line `error: ...` on stderr, naming the flag
or command that gets the user further, and exit with 2; nothing a user can trigger ends in a traceback.
"""

# ruff: noqa: E402 (the Ctrl-C handler of the start is set before the other imports, which take a while)
from __future__ import annotations

import signal
import sys


def _interrupted_while_starting(*_signal) -> None:
    """Ctrl-C while the package is still importing (the first few tenths of a second): the entry point's one
    line and status 130, as anywhere later, not a KeyboardInterrupt traceback from inside some import."""
    sys.stderr.write("interrupted\n")
    raise SystemExit(130)


try:  # only the main thread may set a handler; an import from another thread leaves Ctrl-C as it is
    _STARTING_SIGINT = signal.signal(signal.SIGINT, _interrupted_while_starting)
except ValueError:
    _STARTING_SIGINT = None

import contextlib
import json
import os
import time
from dataclasses import replace
from pathlib import Path

import typer
from typer._click import exceptions as usage  # typer parses with its own copy of click
from typer._click import utils as usage_utils

from ddl_ref.config import ModelVariant, MtpConfig, parse_variants
from ddl_ref.params import init_params, param_table
from ddl_wgpu import accept as accept_lib
from ddl_wgpu import generate as generate_lib
from ddl_wgpu import heal as heal_lib
from ddl_wgpu import sweep as sweep_lib
from ddl_wgpu import train as train_lib
from ddl_wgpu.backend import choose_backend, make_net
from ddl_wgpu.cli_checks import (
    EXIT_USER_ERROR,
    batch_tokens,
    error_line,
    fail,
    fits,
    in_range,
    is_user_error,
    output_file,
    resume_backend,
    sweep_backend,
    within_context,
)
from ddl_wgpu.cli_options import (
    BackendOpt,
    ChainAttention,
    DeviceOpt,
    DevicesOpt,
    DModel,
    FfnHidden,
    ForceOpt,
    HeadDim,
    MaxSeqLen,
    NHeads,
    NKvHeads,
    NLayers,
    NormStyle,
    NoVerify,
    QkNorm,
    RayOpt,
    RopeTheta,
    TieEmbeddings,
    TrunkDtype,
    VocabSize,
    WorkersOpt,
    backend_line,
    emit,
    model_config,
    opt,
)
from ddl_wgpu.compress import CompressError, compress_file
from ddl_wgpu.console import HealConsole, TrainConsole, accept_text, fields, ranked_table, summary_text
from ddl_wgpu.data import (
    DEFAULT_MAX_TOKENS,
    DEFAULT_VAL_FRACTION,
    STDLIB_SPEC,
    data_source,
    eval_windows,
    load_source,
    tokenizer_for,
)
from ddl_wgpu.hf import export_hf_from_file, import_hf_to_file
from ddl_wgpu.inspect import describe, render_text
from ddl_wgpu.modelfile import Model, load_model, save_model
from ddl_wgpu.plots import write_plots
from ddl_wgpu.rundir import RunLock, claim_output
from ddl_wgpu.safeio import read_regular, refuse_overwrite_input
from ddl_wgpu.sweep_checks import capped_runner, check_runner

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    help="Train and heal transformer language models (baseline and Deep Delta Learning) on any "
    "Vulkan, Metal or DX12 GPU through WGSL.",
)

TRAIN = train_lib.TrainingConfig()  # the defaults of the training options
HEAL = heal_lib.HealConfig()  # the defaults of the heal options


# ---------------------------------------------------------------------------------------------------------
# devices, check, inspect


@app.command()
def devices(as_json: bool = typer.Option(False, "--json", help="Machine-readable output.")):
    """List every adapter: backend, type, driver, features and the limits that matter."""
    from ddl_wgpu import gpu as g  # the GPU layer loads wgpu: only the GPU commands import it up front

    adapters = [g.describe_adapter(a, i) for i, a in enumerate(g.enumerate_adapters())]
    if not adapters:
        fail(g.DRIVER_HINT)
    if as_json:
        typer.echo(json.dumps(adapters, indent=2))
        return
    for a in adapters:
        typer.echo(
            f"[{a['index']}] {a['name']}  backend={a['backend']}  type={a['type']}  driver={a['driver']}"
        )
        typer.echo("    features: " + ", ".join(a["features"]))
        for k, v in a["limits"].items():
            typer.echo(f"    {k:40s} {v}")
    chosen = g.describe_adapter(g.select_adapter(None))
    typer.echo(f"default adapter: {chosen['name']} ({chosen['backend']})")


@app.command()
def check(device: DeviceOpt = None):
    """Run a small kernel on the GPU and compare it with numpy."""
    from ddl_wgpu.gpu import Gpu  # the GPU layer loads wgpu: only the GPU commands import it up front
    from ddl_wgpu.selftest import selftest

    t0 = time.perf_counter()
    gpu = Gpu(device)
    typer.echo(f"adapter: {gpu.name}")
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
    mtp: bool = typer.Option(False, "--mtp", help="Add an MTP draft block (model.mtp.*)."),
    force: ForceOpt = False,
):
    """Write a freshly initialised model file."""
    in_range("seed", seed, 0)
    base = model_config(preset, locals())
    v = ModelVariant.parse(variant)
    cfg = v.resolve_config(base)
    if mtp:
        cfg = replace(cfg, mtp=MtpConfig())
    output_file(out, force)
    fits(cfg, False, "the model")
    params = init_params(cfg, seed)
    save_model(out, Model(cfg, params, variant=v.slug, provenance={"init": {"seed": seed, "preset": preset}}))
    table = param_table(cfg)
    n = sum(s.numel for s in table)
    base_n = sum(s.numel for s in param_table(ModelVariant.parse("baseline").resolve_config(base)))
    typer.echo(f"variant {v.slug}: {n:,} parameters ({n - base_n:+,} over baseline) in {len(table)} tensors")
    typer.echo(f"wrote {out}")


@app.command("eval")
def eval_(
    model: Path = typer.Argument(..., help="Model or checkpoint file."),
    data: str = typer.Option(..., "--data", help="Data spec: file, folder, .jsonl, .bin, .npy or 'stdlib'."),
    seq_len: int = typer.Option(
        None, "--seq-len", help="Window length (default: 128, or the model's context when shorter)."
    ),
    batch: int = typer.Option(8, "--batch", help="Windows per batch."),
    max_tokens: int = typer.Option(200_000, "--max-tokens", help="Read at most this many tokens (0: all)."),
    backend: BackendOpt = "auto",
    device: DeviceOpt = None,
    no_verify: NoVerify = False,
    as_json: bool = typer.Option(False, "--json", help="Machine-readable output."),
):
    """Loss and perplexity over consecutive windows of a corpus (and spectral diagnostics for DDL models)."""
    in_range("seq-len", seq_len, 2)
    in_range("batch", batch, 1)
    in_range("max-tokens", max_tokens, 0)
    batch_tokens("batch", batch, seq_len or 128)
    choice = choose_backend(backend, device)
    typer.echo(backend_line(choice), err=as_json)
    m = load_model(model, verify=not no_verify)
    within_context("seq-len", seq_len, m.cfg)
    ds = eval_windows(
        data,
        tokenizer=tokenizer_for(m.tokenizer),
        seq_len=seq_len or min(128, m.cfg.max_seq_len),
        batch_size=batch,
        max_tokens=max_tokens or None,
        vocab_size=m.cfg.vocab_size,
    )
    t0 = time.perf_counter()
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
        "variant": m.variant,
        "seconds": dt,
        "tokens_per_s": ds.num_tokens / max(dt, 1e-9),
    }
    if ev["spectral"] is not None:
        out["spectral"] = ev["spectral"]
    text = (
        f"{model}: loss {out['loss']:.6f}  perplexity {out['perplexity']:.4f}  over {out['windows']} windows, "
        f"{out['tokens']} tokens ({choice.name}, {dt:.2f} s)"
    )
    emit(out, as_json, text)


@app.command("import-hf")
def import_hf(
    folder: Path = typer.Argument(
        ...,
        help="Hugging Face folder: config.json + *.safetensors (+ tokenizer.json and the small json files).",
    ),
    out: Path = typer.Argument(..., help="Model file to write (.ddlw)."),
    force: ForceOpt = False,
    as_json: bool = typer.Option(False, "--json", help="Machine-readable output."),
):
    """Import a Qwen3, Llama or Qwen3.5 (CausalLM or ConditionalGeneration) folder into our container."""
    output_file(out, force, flag="")
    summary = import_hf_to_file(folder, out)
    emit(summary, as_json, summary_text(summary) + f"\nwrote {out}")


@app.command("export-hf")
def export_hf(
    model: Path = typer.Argument(..., help="Model file (.ddlw)."),
    folder: Path = typer.Argument(..., help="Folder to write config.json + model.safetensors into."),
    raw: bool = typer.Option(
        None,
        "--raw/--no-raw",
        help="Raw tensors under our names (default for models Qwen3/Llama cannot hold).",
    ),
    force: bool = typer.Option(False, "--force", help="Replace the files of a non-empty FOLDER."),
    no_verify: NoVerify = False,
    as_json: bool = typer.Option(False, "--json", help="Machine-readable output."),
):
    """Export a model as a Hugging Face folder (Qwen3/Llama for baseline models, Qwen3.5 in the layout it came
    from for hybrid trunks, raw tensors for DDL)."""
    summary = export_hf_from_file(model, folder, raw=raw, overwrite=force, verify=not no_verify)
    emit(summary, as_json, summary_text(summary) + f"\nwrote {folder}")


# ---------------------------------------------------------------------------------------------------------
# training

TRAIN_HELP = "Training options"


def _run(fn, con: TrainConsole):
    """Run a training function with the console; Ctrl-C exits 130 saying what was saved (the library saves
    the last completed step: `train_lib.TrainingInterrupted`)."""
    try:
        return fn()
    except train_lib.TrainingInterrupted as e:
        con.close()
        typer.echo(e.message, err=True)
        raise typer.Exit(130) from None
    except KeyboardInterrupt:
        # Not the library's TrainingInterrupted: the Ctrl-C came before the run began or, since the library
        # holds Ctrl-C back until its reports and checkpoints are written, after its last write
        con.close()
        typer.echo("interrupted after training completed: its reports and checkpoints are saved" if con.started
                   else "interrupted before training started: nothing saved", err=True)  # fmt: skip
        raise typer.Exit(130) from None
    finally:
        con.close()


@app.command()
def train(
    data: str = typer.Option(
        ..., "--data", help="Training data spec ('stdlib', .txt, folder, .jsonl, .bin, .npy)."
    ),
    out: Path = typer.Option(
        ..., "--out", help="Output folder: report.json, VARIANT/report.json, checkpoints, plots."
    ),
    variants: str = typer.Option("baseline,ddl", "--variants", help="Comma list or 'all'."),
    val_data: str = typer.Option(None, "--val-data", help="Validation data spec (else --val-fraction)."),
    val_fraction: float = typer.Option(
        DEFAULT_VAL_FRACTION, "--val-fraction", help="Fraction of windows held out when no --val-data."
    ),
    max_tokens: int = typer.Option(
        DEFAULT_MAX_TOKENS, "--max-tokens", help="Read at most this many tokens per spec (0: all)."
    ),
    preset: str = opt("tiny", "Size preset: tiny, small, medium."),
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
    max_steps: int = opt(TRAIN.max_steps, "Optimizer steps.", TRAIN_HELP),
    eval_interval: int = opt(TRAIN.eval_interval, "Evaluate every N steps (and the last).", TRAIN_HELP),
    learning_rate: float = opt(TRAIN.learning_rate, "Peak learning rate.", TRAIN_HELP),
    min_learning_rate: float = opt(TRAIN.min_learning_rate, "Cosine floor.", TRAIN_HELP),
    warmup_steps: int = opt(TRAIN.warmup_steps, "Linear warm-up steps.", TRAIN_HELP),
    weight_decay: float = opt(TRAIN.weight_decay, "AdamW decoupled weight decay.", TRAIN_HELP),
    beta1: float = opt(TRAIN.beta1, "AdamW beta1.", TRAIN_HELP),
    beta2: float = opt(TRAIN.beta2, "AdamW beta2.", TRAIN_HELP),
    epsilon: float = opt(TRAIN.epsilon, "AdamW epsilon.", TRAIN_HELP),
    grad_clip: float = opt(TRAIN.grad_clip, "Gradient-norm clip.", TRAIN_HELP),
    grad_clip_mode: str = opt(
        TRAIN.grad_clip_mode,
        "per-tensor (each tensor by its own norm, the reference trainer's) or global (one norm for all).",
        TRAIN_HELP,
    ),
    batch_size: int = opt(TRAIN.batch_size, "Rows per step.", TRAIN_HELP),
    seq_len: int = opt(TRAIN.seq_len, "Tokens per row.", TRAIN_HELP),
    seed: int = opt(TRAIN.seed, "Init and data-order seed.", TRAIN_HELP),
    eval_batches: int = opt(
        TRAIN.eval_batches, "Cap each evaluation at N batches (0: the whole split).", TRAIN_HELP
    ),
    mtp: bool = opt(False, "Add an MTP draft block (model.mtp.*) trained jointly with the trunk."),
    mtp_weight: float = opt(
        TRAIN.mtp_weight, "Weight of the draft's loss in joint MTP training.", TRAIN_HELP
    ),
    save_interval: int = typer.Option(
        0, "--save-interval", help="Save a checkpoint every N steps (0: at the end)."
    ),
    stop_after: int = typer.Option(0, "--stop-after", help="Stop after N steps with a resumable checkpoint."),
    plots: bool = typer.Option(True, "--plots/--no-plots", help="Write PNG plots (needs matplotlib)."),
    overwrite: bool = typer.Option(
        False, "--overwrite", help="Train into an --out folder that holds another run, replacing it."
    ),
    seeds: str = typer.Option(
        None,
        "--seeds",
        help="Comma list of seeds: one job per (variant, seed), in OUT/VARIANT/seed-S/ (overrides --seed).",
        rich_help_panel="Sweep",
    ),
    devices: DevicesOpt = None,
    workers: WorkersOpt = 0,
    ray: RayOpt = None,
    backend: BackendOpt = "auto",
    device: DeviceOpt = None,
):
    """Train a sweep of variants on the same data and budget; write reports, checkpoints and plots."""
    in_range("save-interval", save_interval, 0)
    in_range("stop-after", stop_after, 0)
    in_range("max-tokens", max_tokens, 0)
    in_range("val-fraction", val_fraction, 0.0, 1.0)
    base = model_config(preset, locals(), mtp)
    tcfg = train_lib.TrainingConfig(
        max_steps=max_steps,
        eval_interval=eval_interval,
        learning_rate=learning_rate,
        min_learning_rate=min_learning_rate,
        warmup_steps=warmup_steps,
        weight_decay=weight_decay,
        beta1=beta1,
        beta2=beta2,
        epsilon=epsilon,
        grad_clip=grad_clip,
        grad_clip_mode=grad_clip_mode,
        batch_size=batch_size,
        seq_len=seq_len,
        seed=seed,
        eval_batches=eval_batches,
        mtp_weight=mtp_weight,
    )
    tcfg.validate()
    if seq_len > base.max_seq_len:
        fail(f"--seq-len {seq_len} exceeds the model's max_seq_len {base.max_seq_len} (see --max-seq-len)")
    batch_tokens("batch-size", batch_size, seq_len)
    vs = parse_variants(variants)
    for v in vs:
        fits(v.resolve_config(base), True, f"variant {v.slug}")
    choice = choose_backend(backend, device)
    source = data_source(data, val_data, val_fraction, max_tokens)
    sweep = seeds is not None or devices is not None or workers or ray is not None
    if sweep:  # every check a job would make, before the folder is claimed and any job starts
        in_range("workers", workers, 0)
        seed_list = sweep_lib.parse_seeds(seeds) if seeds is not None else [seed]
        sw = sweep_lib.Sweep(base.to_dict(), replace(tcfg, seed=seed_list[0]).to_dict(), [v.slug for v in vs],
                             seed_list, source, choice.name, save_interval, plots=plots)  # fmt: skip
        runner, capped = capped_runner(choice.name, devices, workers, ray, device, len(sw.jobs()))
        check_runner(runner, choice.name, device)
    with claim_output(out, overwrite):
        if sweep:
            typer.echo(f"resolved configuration:\n  model:    {fields(base.to_dict())}\n  training: "
                       f"{fields(sw.training)}\n  data:     {fields(source)}\n  {backend_line(choice)}\n"
                       f"  sweep:    {len(sw.jobs())} jobs ({len(vs)} variants x {len(seed_list)} seeds), "
                       f"{runner.describe()}{capped}")  # fmt: skip
            return _sweep(lambda: sweep_lib.run(sw, out, runner, stop_after), out, plots)
        _train_into(out, base, vs, tcfg, choice, device, source, save_interval, stop_after, plots)


def _train_into(out, base, vs, tcfg, choice, device, source, save_interval, stop_after, plots):
    """`train` once its options are checked and its output folder claimed."""
    batch_size, seq_len = tcfg.batch_size, tcfg.seq_len
    trn, val = load_source(source, seq_len, batch_size, base.vocab_size, tcfg.seed)
    typer.echo("resolved configuration:")
    typer.echo("  model:    " + fields(base.to_dict()))
    typer.echo("  training: " + fields(tcfg.to_dict()))
    if tcfg.eval_batches:
        typer.echo(f"  evaluation: the first {tcfg.eval_batches} batches of each split (not the whole split)")
    typer.echo(f"  variants: {', '.join(v.slug for v in vs)}")
    typer.echo("  " + backend_line(choice))
    typer.echo(f"  data:     {fields(trn.summary())}")
    if val is not None:
        typer.echo(f"  val:      {fields(val.summary())}")
    typer.echo(f"  tokens per step: {batch_size * seq_len:,}")
    con = TrainConsole()
    opts = train_lib.RunOptions(backend=choice.name, device=device, save_interval=save_interval,
                                stop_after=stop_after, progress=con, data=source)  # fmt: skip
    comp = _run(lambda: train_lib.train_variants(base, vs, trn, val, tcfg, out, opts), con)
    try:
        _finish_train(comp, out, tcfg, plots)
    except KeyboardInterrupt:  # the training is done and saved; only the table or the plots were cut short
        typer.echo(
            f"interrupted after training completed: its reports and checkpoints are saved in {out}", err=True
        )
        raise typer.Exit(130) from None


def _finish_train(comp: dict, out: Path, tcfg, plots: bool) -> None:
    """What `train` prints once its sweep returned: the ranked table, the report's path, the plots."""
    if comp.get("status") == "stopped":
        last = comp["reports"][-1]
        typer.echo(f"stopped after step {last['steps_completed']}: continue with "
                   f"`ddl-wgpu resume {out / last['variant'] / train_lib.CHECKPOINT}`")  # fmt: skip
        return
    typer.echo("")
    typer.echo(ranked_table(comp))
    if tcfg.eval_batches:
        typer.echo(f"evaluation: the first {tcfg.eval_batches} batches of each split (--eval-batches)")
    typer.echo(f"\nreport: {out / train_lib.REPORT}")
    if plots:
        try:
            for p in write_plots(comp, out):
                typer.echo(f"plot: {p}")
        except ImportError:
            typer.echo("plots skipped: matplotlib not installed (pip install 'ddl-wgpu[plot]')")
    failed = [r["variant"] for r in comp["reports"] if r.get("status") == "failed"]
    if failed:
        fail(
            f"{len(failed)} of {len(comp['reports'])} variants failed: {', '.join(failed)} (see their reports)"
        )


def _sweep(fn, out: Path, plots: bool):
    """Run or resume a sweep (`sweep.run`): its table, report and plots; Ctrl-C leaves every job resumable."""
    try:
        comp = fn()
    except KeyboardInterrupt:
        typer.echo(f"interrupted: every job saved a resumable checkpoint; continue with `ddl-wgpu resume {out}`",
                   err=True)  # fmt: skip
        raise typer.Exit(130) from None
    if comp.get("status") == "stopped":
        typer.echo(f"stopped: continue every job with `ddl-wgpu resume {out}`")
        return
    many = "seed_summary" in comp
    typer.echo("\n" + (sweep_lib.table(comp) if many else ranked_table(comp)))
    typer.echo(f"\nreport: {out / train_lib.REPORT}")
    if plots and comp["reports"]:
        try:
            for p in write_plots(comp, out):
                typer.echo(f"plot: {p}")
        except ImportError:
            typer.echo("plots skipped: matplotlib not installed (pip install 'ddl-wgpu[plot]')")
    failed = [j["job"] for j in comp["jobs"] if j["status"] != "completed"]
    if failed:
        fail(
            f"{len(failed)} of {len(comp['jobs'])} jobs failed ({', '.join(failed)}); the report ranks the rest; "
            f"`ddl-wgpu resume {out}` runs them again"
        )


def _recorded_source(ck: dict) -> dict:
    """How the checkpoint's run loaded its data: recorded by `train`; for an older checkpoint, what its report
    says (the training spec and the validation split) with the default token cap."""
    if ck["data"] is not None:
        return ck["data"]
    rep = ck["report"]
    vs = rep["validation_dataset"] or {}
    split = vs.get("split", "")
    fraction = float(split.split(":")[1]) if split.startswith("val:") else 0.0
    return {
        "data": rep["train_dataset"].get("source") or None,
        "val_data": vs.get("source") if split == "val" else None,
        "val_fraction": fraction,
        "max_tokens": DEFAULT_MAX_TOKENS,
    }


def _spec(given: str | None, recorded: str | None) -> str | None:
    """A data spec for resume: the run's own when not given or when it names the same file (the spec is part
    of the dataset summary the resume checks compare), else as given."""
    if given is None:
        return recorded
    same = (
        recorded is not None and given != STDLIB_SPEC and os.path.abspath(given) == os.path.abspath(recorded)
    )
    return recorded if same else given


@app.command()
def resume(
    checkpoint: Path = typer.Argument(
        ..., help="A training checkpoint (DIR/VARIANT/checkpoint.ddlw), or a sweep's folder (its every job)."
    ),
    data: str = typer.Option(None, "--data", help="The run's training data spec (default: the run's own)."),
    val_data: str = typer.Option(None, "--val-data", help="The run's validation spec (default: the run's)."),
    val_fraction: float = typer.Option(None, "--val-fraction", help="Default: the run's."),
    max_tokens: int = typer.Option(None, "--max-tokens", help="Default: the run's."),
    steps: int = typer.Option(
        None, "--steps", help="Train a new phase of N steps (default: finish the run)."
    ),
    restart_data: bool = typer.Option(
        False, "--restart-data", help="New phase: start the data order at its first batch (the reference's)."
    ),
    learning_rate: float = opt(None, "New phase: peak learning rate.", TRAIN_HELP),
    min_learning_rate: float = opt(None, "New phase: cosine floor.", TRAIN_HELP),
    eval_interval: int = opt(None, "New phase: evaluation interval.", TRAIN_HELP),
    weight_decay: float = opt(None, "New phase: weight decay.", TRAIN_HELP),
    grad_clip: float = opt(None, "New phase: gradient clip.", TRAIN_HELP),
    warmup_steps: int = opt(None, "New phase: warm-up steps (a later phase never warms up).", TRAIN_HELP),
    beta1: float = opt(None, "New phase: AdamW beta1.", TRAIN_HELP),
    beta2: float = opt(None, "New phase: AdamW beta2.", TRAIN_HELP),
    epsilon: float = opt(None, "New phase: AdamW epsilon.", TRAIN_HELP),
    eval_batches: int = opt(
        None, "New phase: cap each evaluation at N batches (0: whole split).", TRAIN_HELP
    ),
    mtp_weight: float = opt(None, "New phase: weight of the draft's loss (joint MTP training).", TRAIN_HELP),
    grad_clip_mode: str = opt(None, "New phase: per-tensor or global clipping.", TRAIN_HELP),
    out: Path = typer.Option(None, "--out", help="Write here instead of the checkpoint's folder."),
    overwrite: bool = typer.Option(
        False, "--overwrite", help="Write into an --out folder that holds another run, replacing it."
    ),
    save_interval: int = typer.Option(0, "--save-interval", help="Save a checkpoint every N steps."),
    stop_after: int = typer.Option(0, "--stop-after", help="Stop again after N steps."),
    devices: DevicesOpt = None,
    workers: WorkersOpt = 0,
    ray: RayOpt = None,
    backend: BackendOpt = "auto",
    device: DeviceOpt = None,
    no_verify: NoVerify = False,
):
    """Continue an interrupted run, or train a new phase (--steps N) from a checkpoint; continue a sweep."""
    in_range("save-interval", save_interval, 0)
    in_range("stop-after", stop_after, 0)
    in_range("max-tokens", max_tokens, 0)
    in_range("val-fraction", val_fraction, 0.0, 1.0)
    in_range("steps", steps, 1)
    in_range("eval-interval", eval_interval, 1)
    if restart_data and steps is None:
        fail("--restart-data restarts the data order of a new phase: pass --steps N")
    in_range("workers", workers, 0)
    if checkpoint.is_dir():  # a sweep: by default where and on what backend it ran
        sw = sweep_lib.Sweep.load(checkpoint, say=lambda line: typer.echo(line, err=True))
        back = sweep_backend(sw.backend, backend, device)
        runner = None
        if devices is not None or workers or ray is not None:
            runner, _ = capped_runner(back, devices, workers, ray, device, len(sw.jobs()))
            check_runner(runner, back, device)
        with RunLock(checkpoint):
            return _sweep(
                lambda: sweep_lib.resume(checkpoint, runner, back, stop_after), checkpoint, sw.plots
            )
    ck = train_lib.load_checkpoint(checkpoint, verify=not no_verify)
    tr = ck["report"]["training"]
    recorded = _recorded_source(ck)
    source = {
        "data": _spec(data, recorded["data"]),
        "val_data": _spec(val_data, recorded["val_data"]),
        "val_fraction": val_fraction if val_fraction is not None else recorded["val_fraction"],
        "max_tokens": max_tokens if max_tokens is not None else recorded["max_tokens"],
    }
    if source["data"] is None:
        fail(f"{checkpoint} does not record its training data: pass --data SPEC")
    choice, device, switch = resume_backend(ck["backend"], backend, device, steps is not None)
    trn, val = load_source(source, tr["seq_len"], tr["batch_size"], ck["cfg"].vocab_size, tr["seed"])
    typer.echo("resolved configuration:")
    typer.echo(
        f"  checkpoint: {checkpoint} ({ck['report']['variant']}, {ck['report']['steps_completed']} steps)"
    )
    typer.echo("  data:     " + fields(source))
    typer.echo("  " + backend_line(choice))
    if switch:
        typer.echo(switch)
    over = {
        k: v
        for k, v in dict(
            learning_rate=learning_rate,
            min_learning_rate=min_learning_rate,
            eval_interval=eval_interval,
            weight_decay=weight_decay,
            grad_clip=grad_clip,
            warmup_steps=warmup_steps,
            beta1=beta1,
            beta2=beta2,
            epsilon=epsilon,
            eval_batches=eval_batches,
            mtp_weight=mtp_weight,
            grad_clip_mode=grad_clip_mode,
        ).items()
        if v is not None
    }
    if steps is not None:
        restart = ", data order from its first batch (--restart-data)" if restart_data else ""
        typer.echo(f"  new phase: {steps} steps" + (", " + fields(over) if over else "") + restart)
    con = TrainConsole()
    opts = train_lib.RunOptions(backend=choice.name, device=device, save_interval=save_interval,
                                stop_after=stop_after, progress=con, data=source)  # fmt: skip
    where = out or checkpoint.parent
    sweep_dir = checkpoint.parent.parent if ck["sweep"] and out is None and steps is None else None
    elsewhere = out is not None and out.resolve() != checkpoint.parent.resolve()
    if elsewhere:  # --overwrite would clear the very checkpoint the run continues from
        refuse_overwrite_input(out, [checkpoint], train_lib.TrainingError)
    # another --out is claimed as `train` claims its own: a new phase never writes over another run
    with contextlib.ExitStack() as locks:
        locks.enter_context(claim_output(where, overwrite) if elsewhere else RunLock(where))
        if sweep_dir is not None:  # finishing the sweep writes its other variants and its report
            locks.enter_context(RunLock(sweep_dir))
        phase = dict(out_dir=out, steps=steps, overrides=over, restart_data=restart_data)
        rep = _run(lambda: train_lib.resume(checkpoint, trn, val, opts, **phase), con)
    fv = rep.get("final_validation") or {}
    typer.echo(
        f"{rep['variant']}: {rep['steps_completed']} steps, status {rep.get('status')}, "
        f"final train {((rep.get('final_train') or {}).get('loss', float('nan'))):.4f}, "
        f"final val {fv.get('loss', float('nan')):.4f}; report {where / train_lib.REPORT}"
    )
    if sweep_dir is not None and (sweep_dir / train_lib.REPORT).is_file():
        typer.echo(f"sweep report: {sweep_dir / train_lib.REPORT}")
    if rep.get("status") == "failed":
        f = rep["failure"]
        fail(f"{rep['variant']} failed at step {f['step']}: {f['reason']}")


# ---------------------------------------------------------------------------------------------------------
# MTP draft: compress, accept, heal

HEAL_HELP = "Heal options"


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
    prov = compress_file(model, out, drop=drop_layers, keep=ffn_keep, verify=not no_verify)
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
    trunk_dtype: TrunkDtype = "f32",
    chain_attention: ChainAttention = accept_lib.DEFAULT_CHAIN_ATTENTION,
    no_verify: NoVerify = False,
    as_json: bool = typer.Option(False, "--json", help="Machine-readable output."),
):
    """Greedy speculative acceptance of the draft chained K deep: A_j, α_j, τ (all and on-policy anchors)."""
    in_range("depth", depth, 1)
    in_range("window", window, depth + 1)
    in_range("tokens", tokens, 0)
    if window is None and depth + 1 > accept_lib.WINDOW:
        fail(f"--depth {depth} needs windows of at least {depth + 1} tokens: pass --window")
    choice = choose_backend(backend, device)
    typer.echo(backend_line(choice), err=as_json)
    r = accept_lib.accept_file(model, data, depth=depth, window=window, tokens=tokens or None,
                               backend=choice.name, probe_conventions=probe_conventions, device=device,
                               trunk_dtype=trunk_dtype, chain_attention=chain_attention,
                               verify=not no_verify)  # fmt: skip
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


@app.command()
def heal(
    model: Path = typer.Argument(..., help="Model file whose MTP draft no longer agrees with its trunk."),
    data: str = typer.Option(..., "--data", help="Data spec."),
    out: Path = typer.Option(..., "--out", help="Healed model file to write."),
    init: Path = typer.Option(
        None, "--init", help="Start the draft from this model's draft (e.g. the source)."
    ),
    chain: int = opt(HEAL.chain, "Chain steps trained (the runtime drafts 3-5 deep).", HEAL_HELP),
    refresh: int = opt(
        HEAL.refresh, "Steps between rebuilds of chain steps 2.. from the draft (0: never).", HEAL_HELP
    ),
    tokens: int = opt(HEAL.tokens, "Token budget of all windows.", HEAL_HELP),
    window: int = opt(HEAL.window, "Window length.", HEAL_HELP),
    epochs: float = opt(
        HEAL.epochs, "Passes over the (batch, chain step) jobs; fractional allowed.", HEAL_HELP
    ),
    lr: float = opt(HEAL.lr, "Peak learning rate.", HEAL_HELP),
    topk: int = opt(HEAL.topk, "Width of the trunk's stored next-token distribution.", HEAL_HELP),
    batch: int = opt(HEAL.batch, "Windows per step.", HEAL_HELP),
    eval_every: int = opt(HEAL.eval_every, "Steps between held-out evaluations.", HEAL_HELP),
    patience: int = opt(
        HEAL.patience, "Evaluations without a new best before stopping (0: never).", HEAL_HELP
    ),
    seed: int = opt(HEAL.seed, "Job-order seed.", HEAL_HELP),
    trunk_dtype: TrunkDtype = HEAL.trunk_dtype,
    chain_attention: ChainAttention = HEAL.chain_attention,
    kl_form: str = opt(
        HEAL.kl_form,
        "Top-k KL: full (the draft's full-vocabulary log-softmax, as the reference heal tool) or topk "
        "(the draft renormalised over the teacher's k ids).",
        HEAL_HELP,
    ),
    backend: BackendOpt = "auto",
    device: DeviceOpt = None,
    force: ForceOpt = False,
    no_verify: NoVerify = False,
    as_json: bool = typer.Option(False, "--json", help="JSON progress lines and the report as JSON."),
):
    """Retrain the MTP draft head on its own trunk by top-k KL self-distillation; write it back into OUT."""
    for flag, value, lo in (("chain", chain, 1), ("refresh", refresh, 0), ("tokens", tokens, 1), ("window", window, 2),
                            ("topk", topk, 1), ("batch", batch, 1), ("eval-every", eval_every, 1),
                            ("patience", patience, 0), ("seed", seed, 0)):  # fmt: skip
        in_range(flag, value, lo)
    in_range("epochs", epochs, 0.0, 1e6)
    if chain >= window:
        fail(f"--chain {chain} needs windows longer than the chain: --window {window} is too short")
    batch_tokens("batch", batch, window, "window")
    refuse_overwrite_input(out, [model, init], heal_lib.HealError)
    output_file(out, force)
    cfg = heal_lib.HealConfig(chain=chain, refresh=refresh, tokens=tokens, window=window, epochs=epochs, lr=lr,
                              topk=topk, batch=batch, eval_every=eval_every, patience=patience, seed=seed,
                              trunk_dtype=trunk_dtype, chain_attention=chain_attention,
                              kl_form=kl_form)  # fmt: skip
    choice = choose_backend(backend, device)
    typer.echo("resolved configuration:", err=as_json)
    typer.echo("  heal:     " + fields(cfg.to_dict()), err=as_json)
    typer.echo("  " + backend_line(choice), err=as_json)
    rep = heal_lib.heal(model, data, out, cfg, init_path=init, backend=choice.name,
                        progress=HealConsole(as_json), device=device, verify=not no_verify)  # fmt: skip
    if as_json:
        typer.echo(json.dumps(rep, indent=2, default=str))
    else:
        typer.echo(
            f"healed {rep['steps']} steps (best step {rep['best_step']}): held-out KL "
            f"{rep['heldout_kl_start']:.4f} -> {rep['heldout_kl_best']:.4f}; wrote {out}"
        )


# ---------------------------------------------------------------------------------------------------------
# generate


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
    backend: BackendOpt = "auto",
    device: DeviceOpt = None,
    trunk_dtype: TrunkDtype = "f32",
    as_json: bool = typer.Option(False, "--json", help="Print the text, token ids and timings as JSON."),
):
    """Continue a prompt: the text streamed as it is produced (greedy, or sampled), optionally speculating with
    the model's MTP draft; a summary line (tokens/s, the draft's acceptance) on standard error."""
    in_range("seed", seed, 0)
    in_range("depth", depth, 1)
    sampling = generate_lib.Sampling(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
    choice = choose_backend(backend, device)
    m = load_model(model)
    if speculative:  # a round drafts within the model's context (and sizes its cache by the depth)
        in_range("depth", depth, 1, m.cfg.max_seq_len - 1)
    text = _prompt_of(prompt, prompt_file, m)
    typer.echo(backend_line(choice), err=True)
    r = generate_lib.generate(m, text, max_new_tokens=max_new_tokens, sampling=sampling, stops=stop or (),
                              speculative=speculative, depth=depth, backend=choice.name, device=device,
                              on_text=None if as_json else _write_now, dtype=trunk_dtype)  # fmt: skip
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
    try:
        code = _main()
    except KeyboardInterrupt:  # in the last instants of `_main`, as it returned
        code = 130
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
    if sys.stdout is None:  # started with standard output closed (`>&-`): where would the results go?
        typer.echo("error: standard output is closed; redirect it instead (e.g. > /dev/null)", err=True)
        return EXIT_USER_ERROR
    try:
        code = _invoke()
        # the command is done: a Ctrl-C from now on has nothing left to interrupt (and must not turn the exit
        # into a death by SIGINT)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
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
    except (typer.Abort, KeyboardInterrupt, EOFError):
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
