"""The long-running commands of the `ddl-wgpu` command line: `train`, `resume` and `heal`, as plain functions
with their typer options; `cli/app.py` registers them on its app (so that file stays the map of every command and
this one the jobs with their many options).

Like every command, each parses its options into the library's dataclasses and calls one library function:
`train.train_variants` / `sweep.run`, `train.resume` / `sweep.resume`, `heal.heal_file`. What they print is
`console.py`; the checks before any work are `cli/checks.py`.
"""

from __future__ import annotations

import contextlib
import json
import os
from dataclasses import replace
from pathlib import Path

import typer

from ddl_ref.config import parse_variants
from ddl_wgpu.backend import apply_precision, choose_backend, set_runtime
from ddl_wgpu.cli.checks import (
    batch_tokens,
    fail,
    fits,
    in_range,
    output_file,
    resume_backend,
    sweep_backend,
    writes,
)
from ddl_wgpu.cli.console import DraftConsole, HealConsole, TrainConsole, fields, ranked_table
from ddl_wgpu.cli.options import (
    Arch,
    BackendOpt,
    ChainAttention,
    DeviceOpt,
    DevicesOpt,
    DModel,
    DraftWidth,
    FfnHidden,
    ForceOpt,
    GpuMemory,
    HeadDim,
    HostMemory,
    MaxSeqLen,
    NHeads,
    NKvHeads,
    NLayers,
    NormStyle,
    NoVerify,
    Precision,
    QkNorm,
    RayOpt,
    RopeTheta,
    RuntimeOpt,
    TieEmbeddings,
    TrunkDtype,
    VocabSize,
    WorkersOpt,
    backend_line,
    model_config,
    opt,
)
from ddl_wgpu.cli.plots import write_plots
from ddl_wgpu.data import (
    DEFAULT_MAX_TOKENS,
    DEFAULT_VAL_FRACTION,
    STDLIB_SPEC,
    data_source,
    load_source,
)
from ddl_wgpu.engine import gpumem
from ddl_wgpu.files.safeio import refuse_overwrite_input, resolved
from ddl_wgpu.jobs import draft as draft_lib
from ddl_wgpu.jobs import heal as heal_lib
from ddl_wgpu.jobs import sweep as sweep_lib
from ddl_wgpu.jobs import train as train_lib
from ddl_wgpu.jobs.checkpoint import load_checkpoint
from ddl_wgpu.jobs.rundir import RunLock, claim_output
from ddl_wgpu.jobs.sweep_checks import capped_runner, check_runner
from ddl_wgpu.runtime.sizes import parse_size

TRAIN = train_lib.TrainingConfig()  # the defaults of the training options
HEAL = heal_lib.HealConfig()  # the defaults of the heal options
HEAL_HELP = "Heal options"


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
    arch: Arch = "transformer",
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
    mtp: bool = opt(
        False,
        "Add an MTP draft block (model.mtp.*) trained jointly with the trunk (--arch qwen3_5: in Qwen3.5's "
        "layout, post-norm hiddens).",
    ),
    mtp_weight: float = opt(
        TRAIN.mtp_weight, "Weight of the draft's loss in joint MTP training.", TRAIN_HELP
    ),
    precision: Precision = "auto",
    loss_scale: float = opt(TRAIN.loss_scale, "mixed: the first loss scale (a power of two).", TRAIN_HELP),
    loss_scale_interval: int = opt(
        TRAIN.loss_scale_interval, "mixed: good steps in a row before the loss scale doubles.", TRAIN_HELP
    ),
    save_interval: int = typer.Option(
        0, "--save-interval", help="Save a checkpoint every N steps (0: at the end)."
    ),
    stop_after: int = typer.Option(
        0, "--stop-after", help="Stop after N steps with a resumable checkpoint (0: run to the end)."
    ),
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
    runtime: RuntimeOpt = None,
):
    """Train a sweep of variants on the same data and budget; write reports, checkpoints and plots."""
    in_range("save-interval", save_interval, 0)
    in_range("stop-after", stop_after, 0)
    in_range("max-tokens", max_tokens, 0)
    in_range("val-fraction", val_fraction, 0.0, 1.0)
    base = model_config(preset, locals(), mtp, arch)
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
        precision=precision,
        loss_scale=loss_scale,
        loss_scale_interval=loss_scale_interval,
    )
    tcfg.validate()
    if seq_len > base.max_seq_len:
        fail(f"--seq-len {seq_len} exceeds the model's max_seq_len {base.max_seq_len} (see --max-seq-len)")
    batch_tokens("batch-size", batch_size, seq_len)
    vs = parse_variants(variants)
    for v in vs:
        fits(v.resolve_config(base), True, f"variant {v.slug}")
    choice = choose_backend(backend, device, runtime)
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
    prec = apply_precision(tcfg.precision, choice.name, device)
    tcfg = replace(tcfg, precision=prec.name)
    typer.echo("resolved configuration:")
    typer.echo("  model:    " + fields(base.to_dict()))
    typer.echo("  training: " + fields(tcfg.to_dict()))
    typer.echo(f"  precision: {prec.name} ({prec.reason})")
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
    save_interval: int = typer.Option(
        0, "--save-interval", help="Save a checkpoint every N steps (0: at the end)."
    ),
    stop_after: int = typer.Option(0, "--stop-after", help="Stop again after N steps (0: run to the end)."),
    devices: DevicesOpt = None,
    workers: WorkersOpt = 0,
    ray: RayOpt = None,
    backend: BackendOpt = "auto",
    device: DeviceOpt = None,
    runtime: RuntimeOpt = None,
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
    if checkpoint.is_file() and draft_lib.is_run_file(checkpoint):  # a stopped `draft` run
        return resume_draft(checkpoint, stop_after, no_verify)
    set_runtime(runtime)
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
    ck = load_checkpoint(checkpoint, verify=not no_verify)
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
    typer.echo(f"  precision: {tr.get('precision', 'f32')} (the run's)")
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
    err = train_lib.TrainingError
    elsewhere = out is not None and resolved(out, err) != resolved(checkpoint.parent, err)
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
    draft_width: DraftWidth = HEAL.draft_width,
    kl_form: str = opt(
        HEAL.kl_form,
        "Top-k KL: full (the draft's full-vocabulary log-softmax, as the reference heal tool) or topk "
        "(the draft renormalised over the teacher's k ids).",
        HEAL_HELP,
    ),
    backend: BackendOpt = "auto",
    device: DeviceOpt = None,
    runtime: RuntimeOpt = None,
    gpu_memory: GpuMemory = None,
    host_memory: HostMemory = None,
    force: ForceOpt = False,
    draft: Path = typer.Option(
        None,
        "--draft",
        help="Heal this EAGLE-3 draft file on MODEL instead of the MTP draft (`draft`'s trainer; OUT a draft file).",
    ),
    aux_layers: str = opt(
        None,
        "--draft: the three layer inputs of MODEL the draft reads (default: mapped from its target).",
        HEAL_HELP,
    ),
    no_verify: NoVerify = False,
    as_json: bool = typer.Option(False, "--json", help="JSON progress lines and the report as JSON."),
):
    """Retrain the MTP draft head on its own trunk by top-k KL self-distillation; write it back into OUT. With
    --draft, retrain an EAGLE-3 draft file on MODEL instead (its weights and vocabulary kept as the start)."""
    if draft is not None:
        return _heal_eagle3(model, data, out, draft, locals())
    if aux_layers is not None:
        fail("--aux-layers names the layers an EAGLE-3 draft reads: it goes with --draft")
    for flag, value, lo in (("chain", chain, 1), ("refresh", refresh, 0), ("tokens", tokens, 1), ("window", window, 2),
                            ("topk", topk, 1), ("batch", batch, 1), ("eval-every", eval_every, 1),
                            ("patience", patience, 0), ("seed", seed, 0)):  # fmt: skip
        in_range(flag, value, lo)
    in_range("epochs", epochs, 0.0, 1e6)
    batch_tokens("batch", batch, window, "window")
    refuse_overwrite_input(out, [model, init], heal_lib.HealError)
    output_file(out, force)
    budget = gpumem.budget(gpu_memory)
    host_budget = parse_size(host_memory, "--host-memory") if host_memory not in (None, "") else None
    cfg = heal_lib.HealConfig(chain=chain, refresh=refresh, tokens=tokens, window=window, epochs=epochs, lr=lr,
                              topk=topk, batch=batch, eval_every=eval_every, patience=patience, seed=seed,
                              trunk_dtype=trunk_dtype, chain_attention=chain_attention, draft_width=draft_width,
                              kl_form=kl_form)  # fmt: skip
    # shown resolved; heal gets `cfg` as the user gave it, so its report and the healed file's record say which
    # values were defaulted (heal resolves them again, the same way)
    resolved, why = heal_lib.resolve_file(model, cfg)
    choice = choose_backend(backend, device, runtime)
    typer.echo("resolved configuration:", err=as_json)
    typer.echo("  heal:     " + fields(resolved.to_dict()), err=as_json)
    for key, flag in (("chain_attention", "--chain-attention"), ("draft_width", "--draft-width")):
        reason = flag if why[key] == "as given" else why[key]
        typer.echo(f"  {key.replace('_', ' ')}: {getattr(resolved, key)} ({reason})", err=as_json)
    typer.echo("  " + backend_line(choice), err=as_json)
    with writes(out, replace=force):
        rep = heal_lib.heal(model, data, out, cfg, init_path=init, backend=choice.name,
                            progress=HealConsole(as_json), device=device, verify=not no_verify,
                            gpu_memory=budget, host_memory=host_budget)  # fmt: skip
        if as_json:
            typer.echo(json.dumps(rep, indent=2, default=str))
        else:
            typer.echo(
                f"healed {rep['steps']} steps (best step {rep['best_step']}): held-out KL "
                f"{rep['heldout_kl_start']:.4f} -> {rep['heldout_kl_best']:.4f}; wrote {out}"
            )


# EAGLE-3 drafts: heal's option -> the draft job's setting (`_heal_eagle3`)
HEAL_AS_DRAFT = {"chain": "ttt", "tokens": "tokens", "window": "seq_len", "epochs": "epochs", "lr": "learning_rate",
                 "topk": "teacher_k", "batch": "batch_size", "eval_every": "eval_interval", "seed": "seed"}  # fmt: skip
# heal's options that only the MTP draft's heal reads, with the value that means "not given"
MTP_ONLY = {"init": None, "refresh": HEAL.refresh, "patience": HEAL.patience, "trunk_dtype": HEAL.trunk_dtype,
            "chain_attention": HEAL.chain_attention, "draft_width": HEAL.draft_width, "kl_form": HEAL.kl_form,
            "host_memory": None}  # fmt: skip


# heal --draft's options for the settings that shrink a draft run (`draft.plan_memory`; the vocabulary is the
# start's: not named)
HEAL_DRAFT_FLAGS = {"seq_len": "--window", "batch_size": "--batch", "ttt": "--chain"}


def _draft_plan(target: Path, cfg, backend: str, device, budget: int | None, flags: dict, as_json: bool):
    """The draft run's GPU memory plan, shown with the resolved configuration; a budget it does not fit is
    refused here, in one line, before the target's weights or the data are read (`draft.plan_memory`)."""
    plan = draft_lib.plan_memory(target, cfg, backend, device, budget, flags)
    if plan is not None:
        typer.echo("  " + plan.line(), err=as_json)
    return plan


def _heal_eagle3(model: Path, data: str, out: Path, draft_file: Path, given: dict):
    """`heal MODEL --draft DRAFT`: the `draft` job started from DRAFT (`draft.DraftConfig.start`), heal's options
    mapped to its settings (`HEAL_AS_DRAFT`: the chain is the TTT unroll, the window the sequence length, the
    top-k the teacher's); an option only the MTP heal reads is refused, naming `draft --init` for the rest."""
    for name, unset in MTP_ONLY.items():
        if given[name] != unset:
            fail(f"--{name.replace('_', '-')} is the MTP draft's heal; with --draft (an EAGLE-3 draft) leave it out, "
                 f"or use `ddl-wgpu draft MODEL --init {draft_file}` for all of the draft trainer's options")  # fmt: skip
    for flag, lo in (("chain", 1), ("tokens", 1), ("window", 2), ("topk", 1), ("batch", 1), ("eval_every", 1),
                     ("seed", 0)):  # fmt: skip
        in_range(flag.replace("_", "-"), given[flag], lo)
    in_range("epochs", given["epochs"], 0.0, 1e6)
    refuse_overwrite_input(out, [model, draft_file], draft_lib.DraftError)
    output_file(out, given["force"])
    budget = gpumem.budget(given["gpu_memory"])
    settings = {to: given[frm] for frm, to in HEAL_AS_DRAFT.items()}
    cfg = draft_lib.DraftConfig(
        **settings, start=os.fspath(draft_file), aux_layers=parse_aux_layers(given["aux_layers"])
    )
    choice = choose_backend(given["backend"], given["device"], given["runtime"])
    as_json = given["as_json"]
    typer.echo("resolved configuration:", err=as_json)
    typer.echo(f"  heal:     the EAGLE-3 draft {draft_file} on {model} (the `draft` job's trainer from its weights)",
               err=as_json)  # fmt: skip
    typer.echo("  draft:    " + fields(cfg.to_dict()), err=as_json)
    typer.echo("  " + backend_line(choice), err=as_json)
    plan = _draft_plan(model, cfg, choice.name, given["device"], budget, HEAL_DRAFT_FLAGS, as_json)
    with writes(out):
        rep = _draft_run(lambda: draft_lib.train_draft(model, data, out, cfg, backend=choice.name,
                                                       progress=DraftConsole(as_json), device=given["device"],
                                                       verify=not given["no_verify"],
                                                       streamed=plan is not None and plan.streamed), out)  # fmt: skip
        _draft_report(rep, as_json)


# ---------------------------------------------------------------------------------------------------------
# generate


# ---------------------------------------------------------------------------------------------------------
# draft: a new EAGLE-3 draft for a target

DRAFT = draft_lib.DraftConfig()  # the defaults of the draft options
DRAFT_HELP = "Draft options"


def parse_aux_layers(text: str | None):
    if text is None:
        return None
    try:
        ids = tuple(int(t) for t in text.split(","))
    except ValueError:
        fail(f"--aux-layers takes three comma-separated layer ids (e.g. 2,16,29), got {text!r}")
    if len(ids) != 3:
        fail(f"--aux-layers takes three layer ids, got {len(ids)}")
    return ids


def _draft_run(fn, out: Path):
    """Run a draft job; Ctrl-C (or --stop-after) exits 130 (0 for --stop-after) naming the run file."""
    try:
        return fn()
    except draft_lib.DraftInterrupted as e:
        typer.echo(e.message, err=True)
        raise typer.Exit(130 if e.message.startswith("interrupted") else 0) from None


def draft(
    target: Path = typer.Argument(..., help="The target model file (.ddlw) the draft speculates for."),
    data: str = typer.Option(..., "--data", help="Data spec (as train and heal)."),
    out: Path = typer.Option(..., "--out", help="The draft file to write (.ddlw)."),
    kind: str = opt(DRAFT.kind, "The draft's kind (eagle3, the only one for now).", DRAFT_HELP),
    draft_vocab: int = opt(
        DRAFT.draft_vocab,
        "Draft vocabulary size, capped at the target's; the data's most frequent tokens.",
        DRAFT_HELP,
    ),
    aux_layers: str = opt(
        None,
        "Three target layers whose inputs the draft reads, e.g. 2,16,29 (default 2,L//2,L-3).",
        DRAFT_HELP,
    ),
    ttt: int = opt(DRAFT.ttt, "Training-time-test unroll depth (7, as SpecForge).", DRAFT_HELP),
    tokens: int = opt(DRAFT.tokens, "Token budget of all windows (as heal counts it).", DRAFT_HELP),
    seq_len: int = opt(DRAFT.seq_len, "Window length.", DRAFT_HELP),
    batch_size: int = opt(DRAFT.batch_size, "Windows per step.", DRAFT_HELP),
    epochs: float = opt(DRAFT.epochs, "Passes over the training windows; fractional allowed.", DRAFT_HELP),
    learning_rate: float = opt(DRAFT.learning_rate, "Peak learning rate (AdamW).", DRAFT_HELP),
    warmup_steps: int = opt(None, "Linear warm-up steps (default: 10 % of the steps).", DRAFT_HELP),
    eval_interval: int = opt(DRAFT.eval_interval, "Steps between held-out evaluations.", DRAFT_HELP),
    seed: int = opt(DRAFT.seed, "Seed of the draft's init and of the batch order.", DRAFT_HELP),
    init: str = opt(
        DRAFT.init,
        "lm_head from the target's head rows (target) or random; or an EAGLE-3 draft file to start from (a heal).",
        DRAFT_HELP,
    ),
    regenerate: bool = opt(
        False, "Train on the target's own greedy continuations of the data's windows.", DRAFT_HELP
    ),
    prompt_len: int = opt(DRAFT.prompt_len, "--regenerate: prompt tokens kept from each window.", DRAFT_HELP),
    eval_windows: int = opt(DRAFT.eval_windows, "Held-out windows each evaluation reads.", DRAFT_HELP),
    teacher_k: int = opt(
        None, "Teacher top-k over the draft vocabulary (default: numpy 0 = full logits, GPU 64).", DRAFT_HELP
    ),
    stop_after: int = typer.Option(0, "--stop-after", help="Stop after N steps, saving the run to resume."),
    backend: BackendOpt = "auto",
    device: DeviceOpt = None,
    gpu_memory: GpuMemory = None,
    force: ForceOpt = False,
    no_verify: NoVerify = False,
    as_json: bool = typer.Option(False, "--json", help="JSON progress lines and the report as JSON."),
):
    """Train a new EAGLE-3 draft for TARGET (vLLM/SGLang serve it after `export-hf`); Ctrl-C saves the run."""
    for flag, value, lo in (("draft-vocab", draft_vocab, 1), ("ttt", ttt, 1), ("tokens", tokens, 1),
                            ("seq-len", seq_len, 2), ("batch-size", batch_size, 1), ("eval-interval", eval_interval, 1),
                            ("seed", seed, 0), ("warmup-steps", warmup_steps, 0), ("prompt-len", prompt_len, 1),
                            ("stop-after", stop_after, 0), ("eval-windows", eval_windows, 1),
                            ("teacher-k", teacher_k, 0)):  # fmt: skip
        in_range(flag, value, lo)
    in_range("epochs", epochs, 0.0, 1e6)
    refuse_overwrite_input(out, [target], draft_lib.DraftError)
    output_file(out, force)
    budget = gpumem.budget(gpu_memory)  # on the GPU the run is planned within it (`_draft_plan`)
    start = None
    if init not in draft_lib.INITS:  # a draft file to start from: a heal with every option of the trainer
        if not Path(init).is_file():
            fail(f"--init takes {', '.join(draft_lib.INITS)} or an EAGLE-3 draft file to start from; {init!r} is "
                 "none of these")  # fmt: skip
        start, init = os.fspath(init), DRAFT.init
        refuse_overwrite_input(out, [start], draft_lib.DraftError)
    cfg = draft_lib.DraftConfig(start=start, kind=kind, draft_vocab=draft_vocab, aux_layers=parse_aux_layers(aux_layers), ttt=ttt,
                                tokens=tokens, seq_len=seq_len, batch_size=batch_size, epochs=epochs,
                                learning_rate=learning_rate, warmup_steps=warmup_steps, eval_interval=eval_interval,
                                seed=seed, init=init, regenerate=regenerate, prompt_len=prompt_len,
                                eval_windows=eval_windows, teacher_k=teacher_k)  # fmt: skip
    choice = choose_backend(backend, device)
    typer.echo("resolved configuration:", err=as_json)
    typer.echo("  draft:    " + fields(cfg.to_dict()), err=as_json)
    typer.echo("  " + backend_line(choice), err=as_json)
    plan = _draft_plan(target, cfg, choice.name, device, budget, draft_lib.DRAFT_FLAGS, as_json)
    with writes(out):
        rep = _draft_run(lambda: draft_lib.train_draft(target, data, out, cfg, backend=choice.name,
                                                       progress=DraftConsole(as_json), device=device,
                                                       verify=not no_verify, stop_after=stop_after or None,
                                                       streamed=plan is not None and plan.streamed), out)  # fmt: skip
        _draft_report(rep, as_json)


def _draft_report(rep: dict, as_json: bool) -> None:
    if as_json:
        typer.echo(json.dumps(rep, indent=2, default=str))
        return
    acc, before = rep["acceptance"], rep.get("acceptance_start")
    tau = f"{acc['acceptance_length']:.4f}"
    if before is not None:  # a heal: the start draft's τ on the same windows first
        tau = f"{before['acceptance_length']:.4f} -> {tau}"
    typer.echo(f"{'healed' if rep.get('start') else 'trained'} {rep['steps']} steps: held-out TTT loss "
               f"{rep['heldout_loss_start']:.4f} -> {rep['heldout_loss_end']:.4f}, τ at depth {acc['depth']} {tau}; "
               f"wrote {rep['out']}")  # fmt: skip


def resume_draft(run_file: Path, stop_after: int, no_verify: bool, as_json: bool = False):
    """`resume DRAFT.run.ddlw`: continue a stopped draft run (`draft.resume`)."""
    typer.echo(f"resolved configuration:\n  draft run: {run_file}")
    rep = _draft_run(lambda: draft_lib.resume(run_file, DraftConsole(as_json), not no_verify, stop_after or None),
                     run_file)  # fmt: skip
    _draft_report(rep, as_json)
