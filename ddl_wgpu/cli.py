"""The `ddl-wgpu` command line: a thin typer layer over library functions.

Each command parses its options into the library's dataclasses and calls one function. Errors a user can
cause (bad files, bad data, bad options, no GPU) print one line `error: ...` on stderr and exit with 2;
nothing a user can trigger ends in a traceback.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated

import typer

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    help="Train and heal transformer language models (baseline and Deep Delta Learning) on any "
    "Vulkan, Metal or DX12 GPU through WGSL.",
)

EXIT_USER_ERROR = 2


def _user_errors() -> tuple[type[BaseException], ...]:
    """The exception types that mean 'bad input', collected lazily so `--help` stays fast."""
    kinds: list[type[BaseException]] = [FileNotFoundError, IsADirectoryError, PermissionError]
    for mod, name in [
        ("ddl_wgpu.gpu", "GpuError"),
        ("ddl_wgpu.container", "CheckpointError"),
        ("ddl_wgpu.data", "DataError"),
        ("ddl_ref.config", "ConfigError"),
        ("ddl_wgpu.train", "TrainingError"),
        ("ddl_wgpu.hf", "HfError"),
        ("ddl_wgpu.heal", "HealError"),
        ("ddl_wgpu.accept", "AcceptError"),
        ("ddl_wgpu.compress", "CompressError"),
    ]:
        try:
            module = __import__(mod, fromlist=[name])
            kinds.append(getattr(module, name))
        except (ImportError, AttributeError):
            continue
    return tuple(kinds)


def fail(message: str, code: int = EXIT_USER_ERROR):
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(code)


def _emit(obj, as_json: bool, text: str):
    typer.echo(json.dumps(obj, indent=2) if as_json else text)


# ---------------------------------------------------------------------------------------------------------
# devices, check, inspect


@app.command()
def devices(as_json: bool = typer.Option(False, "--json", help="Machine-readable output.")):
    """List every adapter: backend, type, driver, features and the limits that matter."""
    from ddl_wgpu import gpu as g

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
def check(
    device: str = typer.Option(None, "--device", help="Adapter index or name substring."),
):
    """Run a small kernel on the GPU and compare it with numpy."""
    import time

    import numpy as np

    from ddl_wgpu.gpu import Gpu
    from ddl_wgpu.selftest import selftest

    t0 = time.perf_counter()
    gpu = Gpu(device)
    typer.echo(f"adapter: {gpu.name}")
    for line in selftest(gpu):
        typer.echo(line)
    typer.echo(f"ok ({time.perf_counter() - t0:.2f} s)")
    del np


@app.command()
def inspect(
    file: Path = typer.Argument(..., help="A .ddlw model, checkpoint or healed file (or one shard)."),
    as_json: bool = typer.Option(False, "--json", help="Machine-readable output."),
    verify: bool = typer.Option(False, "--verify", help="Check every tensor's hash."),
):
    """Header summary, tensor table and provenance of a checkpoint file."""
    from ddl_wgpu.inspect import describe, render_text

    desc = describe(str(file), verify=verify)
    _emit(desc, as_json, render_text(desc))


# ---------------------------------------------------------------------------------------------------------
# models: init, eval, import-hf, export-hf

MODEL_HELP = "Model options (override the preset)"


def _model_opt(kind, help_: str):
    """A model option shared by `init` and `train`: None means "the preset's value"."""
    return Annotated[kind | None, typer.Option(help=help_, rich_help_panel=MODEL_HELP)]


VocabSize = _model_opt(int, "Vocabulary size.")
DModel = _model_opt(int, "Residual width.")
NLayers = _model_opt(int, "Blocks.")
NHeads = _model_opt(int, "Query heads.")
NKvHeads = _model_opt(int, "Key/value heads (GQA).")
HeadDim = _model_opt(int, "Head dimension.")
FfnHidden = _model_opt(int, "SwiGLU hidden size.")
MaxSeqLen = _model_opt(int, "Longest sequence.")
RopeTheta = _model_opt(float, "RoPE base.")
QkNorm = _model_opt(str, "none, pre_rope or post_rope.")
NormStyle = _model_opt(str, "standard (w*x) or offset ((1+w)*x).")
TieEmbeddings = _model_opt(bool, "Tie the LM head to the embedding.")
MODEL_FIELDS = ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim", "ffn_hidden",
                "max_seq_len", "rope_theta", "qk_norm", "norm_style", "tie_embeddings")  # fmt: skip


def _model_config(preset: str, options: dict):
    """The preset with every model option the user gave (`options`: a command's locals()) applied."""
    from ddl_ref.config import preset as make_preset

    return make_preset(preset, **{k: options[k] for k in MODEL_FIELDS if options.get(k) is not None})


def _opt(default, help_: str, panel: str = MODEL_HELP, **kw):
    return typer.Option(default, help=help_, rich_help_panel=panel, **kw)


@app.command()
def init(
    variant: str = typer.Option(
        "baseline", "--variant", help="baseline, ddl, ddl-tc-noec, ddl-cc-noec, ddl-tc, ddl-cc."
    ),
    out: Path = typer.Option(..., "--out", help="Model file to write (.ddlw)."),
    preset: str = _opt("tiny", "Size preset: tiny, small (124M), medium (353M)."),
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
):
    """Write a freshly initialised model file."""
    from ddl_ref.config import ModelVariant
    from ddl_ref.params import init_params, param_table
    from ddl_wgpu.modelfile import Model, save_model

    base = _model_config(preset, locals())
    v = ModelVariant.parse(variant)
    cfg = v.resolve_config(base)
    if mtp:
        from dataclasses import replace

        from ddl_ref.config import MtpConfig

        cfg = replace(cfg, mtp=MtpConfig())
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
    seq_len: int = typer.Option(128, "--seq-len", help="Window length."),
    batch: int = typer.Option(8, "--batch", help="Windows per batch."),
    max_tokens: int = typer.Option(200_000, "--max-tokens", help="Read at most this many tokens (0: all)."),
    backend: str = typer.Option("wgpu", "--backend", help="wgpu or ref (numpy reference)."),
    device: str = typer.Option(None, "--device", help="Adapter index or name substring."),
    as_json: bool = typer.Option(False, "--json", help="Machine-readable output."),
):
    """Loss and perplexity over consecutive windows of a corpus (and spectral diagnostics for DDL models)."""
    import time

    from ddl_wgpu.data import eval_windows, tokenizer_for
    from ddl_wgpu.modelfile import load_model
    from ddl_wgpu.train import evaluate, make_net

    m = load_model(model)
    ds = eval_windows(
        data,
        tokenizer=tokenizer_for(m.tokenizer),
        seq_len=min(seq_len, m.cfg.max_seq_len),
        batch_size=batch,
        max_tokens=max_tokens or None,
        vocab_size=m.cfg.vocab_size,
    )
    t0 = time.perf_counter()
    net = make_net(m.cfg, m.params, backend, device)
    ev = evaluate(net, ds, 0, spectral=True)
    dt = time.perf_counter() - t0
    out = {
        **ev["metrics"],
        "tokens": int(ds.num_tokens),
        "predictions": int(ds.num_predictions),
        "windows": int(ds.num_windows),
        "backend": backend,
        "variant": m.variant,
        "seconds": dt,
        "tokens_per_s": ds.num_tokens / max(dt, 1e-9),
    }
    if ev["spectral"] is not None:
        out["spectral"] = ev["spectral"]
    text = (
        f"{model}: loss {out['loss']:.6f}  perplexity {out['perplexity']:.4f}  over {out['windows']} windows, "
        f"{out['tokens']} tokens ({backend}, {dt:.2f} s)"
    )
    _emit(out, as_json, text)


@app.command("import-hf")
def import_hf(
    folder: Path = typer.Argument(
        ..., help="Hugging Face folder: config.json + *.safetensors (+ tokenizer.json)."
    ),
    out: Path = typer.Argument(..., help="Model file to write (.ddlw)."),
):
    """Import a Qwen3 or Llama checkpoint folder into our container."""
    from ddl_wgpu.hf import import_hf_to_file

    summary = import_hf_to_file(folder, out)
    typer.echo(json.dumps(summary, indent=2))


@app.command("export-hf")
def export_hf(
    model: Path = typer.Argument(..., help="Model file (.ddlw)."),
    folder: Path = typer.Argument(..., help="Folder to write config.json + model.safetensors into."),
):
    """Export a model as a Hugging Face folder (Qwen3/Llama for baseline models, raw tensors for DDL)."""
    from ddl_wgpu.hf import export_hf_from_file

    summary = export_hf_from_file(model, folder)
    typer.echo(json.dumps(summary, indent=2))


# ---------------------------------------------------------------------------------------------------------
# training

TRAIN_HELP = "Training options (the seed's TrainingConfig)"


def _training_config(**kw):
    from ddl_wgpu.train import TrainingConfig

    tcfg = TrainingConfig(**{k: v for k, v in kw.items() if v is not None})
    tcfg.validate()
    return tcfg


def _load_data(data, val_data, val_fraction, seq_len, batch_size, max_tokens, vocab_size, seed):
    from ddl_wgpu.data import ByteTokenizer, load_datasets

    return load_datasets(
        data,
        tokenizer=ByteTokenizer(),
        seq_len=seq_len,
        batch_size=batch_size,
        val_spec=val_data,
        val_fraction=val_fraction,
        max_tokens=max_tokens or None,
        vocab_size=vocab_size,
        seed=seed,
    )


class _Console:
    """Progress for long runs: one rich progress bar per variant (step, loss, lr, tokens/s, ETA)."""

    def __init__(self):
        from rich.console import Console

        self.console = Console(stderr=True)
        self.bar = None

    def __call__(self, ev: dict):
        from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

        kind = ev["event"]
        if kind == "start":
            self.console.print(f"[bold]{ev['variant']}[/bold]: {ev['num_params']:,} parameters")
        elif kind == "eval" and ev["step"] == 0:
            v = ev.get("validation")
            vtxt = f", validation {v['loss']:.4f}" if v else ""
            self.console.print(
                f"  initial evaluation: train {ev['train']['loss']:.4f}{vtxt} ({ev['seconds']:.1f} s)"
            )
        elif kind == "step":
            if self.bar is None:
                self.bar = Progress(
                    TextColumn("  {task.description}"),
                    BarColumn(),
                    TextColumn("{task.completed}/{task.total}"),
                    TextColumn("{task.fields[info]}"),
                    TimeRemainingColumn(),
                    console=self.console,
                )
                self.bar.start()
                self.task = self.bar.add_task(ev["variant"], total=ev["total"], info="")
            info = f"loss {ev['loss']:.4f}  lr {ev['lr']:.2e}  {ev['tokens_per_s']:,.0f} tok/s  {ev['s_per_step']:.3f} s/step"
            if ev.get("loss_mtp") == ev.get("loss_mtp"):  # not NaN: joint MTP training
                info += f"  (trunk {ev['loss_main']:.4f}, draft {ev['loss_mtp']:.4f})"
            if ev.get("validation"):
                info += f"  val {ev['validation']['loss']:.4f}"
            self.bar.update(self.task, completed=ev["step"], info=info)
        elif kind == "done":
            self.close()

    def close(self):
        if self.bar is not None:
            self.bar.stop()
            self.bar = None


def _ranked_table(comp: dict) -> str:
    rows = []
    order = comp.get("final_validation_loss_ranking") or comp.get("final_train_loss_ranking") or []
    by = {r["variant"]: r for r in comp["reports"]}
    rows.append(
        f"{'rank':<5}{'variant':<14}{'final train':>12}{'final val':>11}{'best val':>10}{'ppl':>9}{'params':>13}{'tok/s':>10}"
    )
    for i, v in enumerate(order, 1):
        r = by[v]
        fv = r.get("final_validation") or {}
        bv = r.get("best_validation") or {}
        ppl = (fv or r["final_train"])["perplexity"]
        tps = r.get("throughput", {}).get("tokens_per_s", float("nan"))
        rows.append(
            f"{i:<5}{v:<14}{r['final_train']['loss']:>12.4f}{fv.get('loss', float('nan')):>11.4f}"
            f"{bv.get('loss', float('nan')):>10.4f}{ppl:>9.2f}{r['num_params']:>13,}{tps:>10,.0f}"
        )
    return "\n".join(rows)


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
        0.05, "--val-fraction", help="Fraction of windows held out when no --val-data."
    ),
    max_tokens: int = typer.Option(
        2_000_000, "--max-tokens", help="Read at most this many tokens per spec (0: all)."
    ),
    preset: str = _opt("tiny", "Size preset: tiny, small, medium."),
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
    max_steps: int = _opt(32, "Optimizer steps.", TRAIN_HELP),
    eval_interval: int = _opt(4, "Evaluate every N steps (and the last).", TRAIN_HELP),
    learning_rate: float = _opt(1e-3, "Peak learning rate.", TRAIN_HELP),
    min_learning_rate: float = _opt(0.0, "Cosine floor.", TRAIN_HELP),
    warmup_steps: int = _opt(0, "Linear warm-up steps.", TRAIN_HELP),
    weight_decay: float = _opt(0.1, "AdamW decoupled weight decay.", TRAIN_HELP),
    beta1: float = _opt(0.9, "AdamW beta1.", TRAIN_HELP),
    beta2: float = _opt(0.95, "AdamW beta2.", TRAIN_HELP),
    epsilon: float = _opt(1e-5, "AdamW epsilon.", TRAIN_HELP),
    grad_clip: float = _opt(1.0, "Global gradient-norm clip.", TRAIN_HELP),
    batch_size: int = _opt(8, "Rows per step.", TRAIN_HELP),
    seq_len: int = _opt(128, "Tokens per row.", TRAIN_HELP),
    seed: int = _opt(0, "Init and data-order seed.", TRAIN_HELP),
    eval_batches: int = _opt(16, "Batches per evaluation (0: the whole dataset).", TRAIN_HELP),
    mtp: bool = _opt(False, "Add an MTP draft block (model.mtp.*) trained jointly with the trunk."),
    mtp_weight: float = _opt(0.3, "Weight of the draft's loss in joint MTP training.", TRAIN_HELP),
    save_interval: int = typer.Option(
        0, "--save-interval", help="Save a checkpoint every N steps (0: at the end)."
    ),
    stop_after: int = typer.Option(0, "--stop-after", help="Stop after N steps with a resumable checkpoint."),
    plots: bool = typer.Option(True, "--plots/--no-plots", help="Write PNG plots (needs matplotlib)."),
    backend: str = typer.Option("wgpu", "--backend", help="wgpu or ref (numpy reference)."),
    device: str = typer.Option(None, "--device", help="Adapter index or name substring."),
):
    """Train a sweep of variants on the same data and budget; write reports, checkpoints and plots."""
    from ddl_ref.config import parse_variants
    from ddl_wgpu.train import RunOptions, train_variants

    base = _model_config(preset, locals())
    if mtp:
        from dataclasses import replace

        from ddl_ref.config import MtpConfig

        base = replace(base, mtp=MtpConfig())
    tcfg = _training_config(
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
        batch_size=batch_size,
        seq_len=seq_len,
        seed=seed,
        eval_batches=eval_batches,
        mtp_weight=mtp_weight,
    )
    if seq_len > base.max_seq_len:
        fail(f"--seq-len {seq_len} exceeds the model's max_seq_len {base.max_seq_len}")
    vs = parse_variants(variants)
    trn, val = _load_data(
        data, val_data, val_fraction, seq_len, batch_size, max_tokens, base.vocab_size, seed
    )
    typer.echo("resolved configuration:")
    typer.echo("  model:    " + json.dumps(base.to_dict()))
    typer.echo("  training: " + json.dumps(tcfg.to_dict()))
    typer.echo(f"  variants: {', '.join(v.slug for v in vs)}   backend: {backend}")
    typer.echo(f"  data:     {json.dumps(trn.summary())}")
    if val is not None:
        typer.echo(f"  val:      {json.dumps(val.summary())}")
    typer.echo(f"  tokens per step: {batch_size * seq_len:,}")
    con = _Console()
    opts = RunOptions(
        backend=backend, device=device, save_interval=save_interval, stop_after=stop_after, progress=con
    )
    try:
        comp = train_variants(base, vs, trn, val, tcfg, out, opts)
    except KeyboardInterrupt:
        con.close()
        typer.echo(f"interrupted: resumable checkpoint saved under {out}/", err=True)
        raise typer.Exit(130) from None
    finally:
        con.close()
    _after_training(comp, out, plots)


def _after_training(comp: dict, out: Path, plots: bool):
    if comp.get("status") == "stopped":
        last = comp["reports"][-1]
        typer.echo(
            f"stopped after step {last['steps_completed']}: resume with "
            f"`ddl-wgpu resume {out / last['variant'] / 'checkpoint.ddlw'} --data ...`"
        )
        return
    typer.echo("")
    typer.echo(_ranked_table(comp))
    typer.echo(f"\nreport: {out / 'report.json'}")
    if plots:
        try:
            from ddl_wgpu.plots import write_plots

            for p in write_plots(comp, out):
                typer.echo(f"plot: {p}")
        except ImportError:
            typer.echo("plots skipped: matplotlib not installed (pip install 'ddl-wgpu[plot]')")


@app.command()
def resume(
    checkpoint: Path = typer.Argument(..., help="A training checkpoint (DIR/VARIANT/checkpoint.ddlw)."),
    data: str = typer.Option(..., "--data", help="The training data spec of the run."),
    val_data: str = typer.Option(
        None, "--val-data", help="The run's validation spec (else its --val-fraction)."
    ),
    val_fraction: float = typer.Option(None, "--val-fraction", help="Defaults to the run's."),
    max_tokens: int = typer.Option(2_000_000, "--max-tokens", help="As given to train."),
    steps: int = typer.Option(
        None, "--steps", help="Train a new phase of N steps (default: finish the run)."
    ),
    learning_rate: float = _opt(None, "New phase: peak learning rate.", TRAIN_HELP),
    min_learning_rate: float = _opt(None, "New phase: cosine floor.", TRAIN_HELP),
    eval_interval: int = _opt(None, "New phase: evaluation interval.", TRAIN_HELP),
    weight_decay: float = _opt(None, "New phase: weight decay.", TRAIN_HELP),
    grad_clip: float = _opt(None, "New phase: gradient clip.", TRAIN_HELP),
    out: Path = typer.Option(None, "--out", help="Write here instead of the checkpoint's folder."),
    save_interval: int = typer.Option(0, "--save-interval", help="Save a checkpoint every N steps."),
    stop_after: int = typer.Option(0, "--stop-after", help="Stop again after N steps."),
    backend: str = typer.Option("wgpu", "--backend", help="wgpu or ref."),
    device: str = typer.Option(None, "--device", help="Adapter index or name substring."),
):
    """Continue an interrupted run, or train a new phase (--steps N) from a checkpoint."""
    from ddl_wgpu.train import RunOptions, load_checkpoint
    from ddl_wgpu.train import resume as do_resume

    ck = load_checkpoint(checkpoint)
    tr = ck["report"]["training"]
    vs = ck["report"]["validation_dataset"]
    if val_fraction is None:
        split = (vs or {}).get("split", "")
        val_fraction = float(split.split(":")[1]) if split.startswith("val:") else 0.0
    trn, val = _load_data(
        data,
        val_data,
        val_fraction,
        tr["seq_len"],
        tr["batch_size"],
        max_tokens,
        ck["cfg"].vocab_size,
        tr["seed"],
    )
    over = {
        k: v
        for k, v in dict(
            learning_rate=learning_rate,
            min_learning_rate=min_learning_rate,
            eval_interval=eval_interval,
            weight_decay=weight_decay,
            grad_clip=grad_clip,
        ).items()
        if v is not None
    }
    con = _Console()
    opts = RunOptions(
        backend=backend, device=device, save_interval=save_interval, stop_after=stop_after, progress=con
    )
    try:
        rep = do_resume(checkpoint, trn, val, opts, out_dir=out, steps=steps, overrides=over)
    except KeyboardInterrupt:
        con.close()
        typer.echo("interrupted: resumable checkpoint saved", err=True)
        raise typer.Exit(130) from None
    finally:
        con.close()
    where = out or checkpoint.parent
    fv = rep.get("final_validation") or {}
    typer.echo(
        f"{rep['variant']}: {rep['steps_completed']} steps, status {rep.get('status')}, "
        f"final train {((rep.get('final_train') or {}).get('loss', float('nan'))):.4f}, "
        f"final val {fv.get('loss', float('nan')):.4f}; report {where / 'report.json'}"
    )


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
):
    """Structural compress: drop whole blocks, or keep the most important SwiGLU channels."""
    from ddl_wgpu.compress import compress_file

    prov = compress_file(model, out, drop=drop_layers, keep=ffn_keep)
    typer.echo(json.dumps(prov, indent=2))
    typer.echo(f"wrote {out}")


def _draft_backend(backend: str | None) -> str:
    """`--backend` of accept/heal: as given, else "wgpu" when an adapter is present, else "ref"."""
    if backend is not None:
        return backend
    try:
        from ddl_wgpu import gpu as g

        return "wgpu" if g.enumerate_adapters() else "ref"
    except Exception:  # no wgpu / no driver: the numpy reference still works
        return "ref"


def _accept_text(r: dict) -> str:
    lines = [
        f"depth {r['depth']}: acceptance length τ = {r['acceptance_length']:.4f} over {r['anchors']} anchors"
    ]
    for j, (a, c) in enumerate(zip(r["prefix_acceptance"], r["conditional_acceptance"], strict=True), 1):
        lines.append(f"  depth {j}: prefix A_{j} = {a:.4f}   conditional α_{j} = {c:.4f}")
    op = r.get("on_policy")
    if op:
        lines.append(
            f"  on-policy anchors: τ = {op.get('acceptance_length', float('nan')):.4f}, "
            f"A = {[round(float(x), 4) for x in op.get('prefix_acceptance', [])]}"
        )
    return "\n".join(lines)


@app.command()
def accept(
    model: Path = typer.Argument(..., help="Model file with an MTP draft (model.mtp.*)."),
    data: str = typer.Option(..., "--data", help="Data spec."),
    depth: int = typer.Option(3, "--depth", help="Draft chain depth K."),
    window: int = typer.Option(128, "--window", help="Window length."),
    tokens: int = typer.Option(20_000, "--tokens", help="Tokens to measure on (0: all)."),
    probe_conventions: bool = typer.Option(
        False, "--probe-conventions", help="Also measure the other concat order and hidden conventions."
    ),
    backend: str = typer.Option(
        None, "--backend", help="wgpu or ref (numpy). Default: wgpu when a GPU adapter is present."
    ),
    device: str = typer.Option(None, "--device", help="Adapter index or name substring."),
    trunk_dtype: str = typer.Option(
        "f32", "--trunk-dtype", help="wgpu: the trunk's big matrices in f32, or f16 (needs shader-f16)."
    ),
    chain_attention: str = typer.Option(
        "per-step",
        "--chain-attention",
        help="Attention of chain steps: per-step (default; each step its own causal pass, as the reference "
        "heal tool) or stacked (steps 1..j stacked with the runtime's diagonal mask).",
    ),
    as_json: bool = typer.Option(False, "--json", help="Machine-readable output."),
):
    """Greedy speculative acceptance of the draft chained K deep: A_j, α_j, τ (all and on-policy anchors)."""
    from ddl_wgpu.accept import accept_file

    r = accept_file(
        model,
        data,
        depth=depth,
        window=window,
        tokens=tokens or None,
        backend=_draft_backend(backend),
        probe_conventions=probe_conventions,
        device=device,
        trunk_dtype=trunk_dtype,
        chain_attention=chain_attention,
    )
    _emit(r, as_json, _accept_text(r))


@app.command()
def heal(
    model: Path = typer.Argument(..., help="Model file whose MTP draft no longer agrees with its trunk."),
    data: str = typer.Option(..., "--data", help="Data spec."),
    out: Path = typer.Option(..., "--out", help="Healed model file to write."),
    init: Path = typer.Option(
        None, "--init", help="Start the draft from this model's draft (e.g. the source)."
    ),
    chain: int = _opt(3, "Chain steps trained (the runtime drafts 3-5 deep).", HEAL_HELP),
    refresh: int = _opt(50, "Steps between rebuilds of chain steps 2.. from the current draft.", HEAL_HELP),
    tokens: int = _opt(200_000, "Token budget of all windows.", HEAL_HELP),
    window: int = _opt(128, "Window length.", HEAL_HELP),
    epochs: float = _opt(1.0, "Passes over the (batch, chain step) jobs; fractional allowed.", HEAL_HELP),
    lr: float = _opt(5e-5, "Peak learning rate.", HEAL_HELP),
    topk: int = _opt(32, "Width of the trunk's stored next-token distribution.", HEAL_HELP),
    batch: int = _opt(4, "Windows per step.", HEAL_HELP),
    eval_every: int = _opt(50, "Steps between held-out evaluations.", HEAL_HELP),
    patience: int = _opt(3, "Evaluations without a new best before stopping (0: never).", HEAL_HELP),
    seed: int = _opt(0, "Job-order seed.", HEAL_HELP),
    trunk_dtype: str = typer.Option(
        "f32",
        "--trunk-dtype",
        help="The GPU trunk's big matrices: f32, or f16 (half the memory; needs the adapter's shader-f16).",
        rich_help_panel=HEAL_HELP,
    ),
    chain_attention: str = typer.Option(
        "per-step",
        "--chain-attention",
        help="Attention of chain steps: per-step (default; each step its own causal pass, as the reference "
        "heal tool) or stacked (steps 1..j stacked with the runtime's diagonal mask).",
        rich_help_panel=HEAL_HELP,
    ),
    backend: str = typer.Option(
        None, "--backend", help="wgpu or ref (numpy). Default: wgpu when a GPU adapter is present."
    ),
    device: str = typer.Option(None, "--device", help="Adapter index or name substring."),
    as_json: bool = typer.Option(False, "--json", help="Print the report as JSON."),
):
    """Retrain the MTP draft head on its own trunk by top-k KL self-distillation; write it back into OUT."""
    from ddl_wgpu.heal import HealConfig
    from ddl_wgpu.heal import heal as do_heal

    cfg = HealConfig(
        chain=chain,
        refresh=refresh,
        tokens=tokens,
        window=window,
        epochs=epochs,
        lr=lr,
        topk=topk,
        batch=batch,
        eval_every=eval_every,
        patience=patience,
        seed=seed,
        trunk_dtype=trunk_dtype,
        chain_attention=chain_attention,
    )
    typer.echo("resolved configuration: " + json.dumps(cfg.__dict__), err=as_json)

    import time

    t0 = time.perf_counter()
    seen: dict = {}

    def progress(ev: dict):
        kind, dt = ev.get("event"), time.perf_counter() - t0
        if kind == "step":
            if ev["step"] % 10 == 0 or ev["step"] == ev["total"]:
                eta = dt / ev["step"] * (ev["total"] - ev["step"])
                typer.echo(
                    f"  step {ev['step']}/{ev['total']}  loss {ev['loss']:.4f}  lr {ev['lr']:.2e}  "
                    f"{dt / ev['step']:.2f} s/step  ETA {eta:.0f} s",
                    err=True,
                )
        elif kind == "trunk":  # about every quarter of the windows, and the last
            quarter = 4 * ev["done"] // ev["windows"]
            if quarter != seen.get("trunk") or ev["done"] == ev["windows"]:
                seen["trunk"] = quarter
                typer.echo(f"  trunk: {ev['done']}/{ev['windows']} windows ({dt:.1f} s)", err=True)
        elif kind == "refresh":
            pass
        else:
            typer.echo("  " + json.dumps(ev, default=str), err=True)

    backend = _draft_backend(backend)
    typer.echo(f"backend: {backend}", err=as_json)
    rep = do_heal(model, data, out, cfg, init_path=init, backend=backend, progress=progress, device=device)
    if as_json:
        typer.echo(json.dumps(rep, indent=2, default=str))
    else:
        typer.echo(
            f"healed {rep.get('steps')} steps (best step {rep.get('best_step')}): held-out KL "
            f"{rep.get('heldout_kl_start', float('nan')):.4f} -> {rep.get('heldout_kl_best', float('nan')):.4f}; "
            f"wrote {out}"
        )


def main():
    """Console-script entry point: run the app, turning user errors into one line and exit code 2."""
    kinds = _user_errors()
    try:
        app()
    except kinds as e:  # noqa: B030 - a tuple of exception classes built at run time
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        typer.echo(f"error: {msg}", err=True)
        sys.exit(EXIT_USER_ERROR)
    except KeyboardInterrupt:
        typer.echo("interrupted", err=True)
        sys.exit(130)


if __name__ == "__main__":
    main()
