"""The command line's checks of its options and outputs, made before any work: each refusal is one
`error: ...` line naming the flag, exit 2 (`fail`)."""

from __future__ import annotations

import errno
import math
import os
import sys
from pathlib import Path

import typer

from ddl_ref.config import ConfigError
from ddl_wgpu.backend import BackendError, UnknownBackendError
from ddl_wgpu.container import CheckpointError
from ddl_wgpu.errors import UserError
from ddl_wgpu.hf import HfError
from ddl_wgpu.modelfile import check_fits
from ddl_wgpu.train import MAX_INT  # integers are stored in msgpack headers (int64)

EXIT_USER_ERROR = 2
MAX_BATCH_TOKENS = 1 << 31  # rows x tokens of one batch: the engine indexes a batch with 32-bit integers


def fail(message: str, code: int = EXIT_USER_ERROR):
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(code)


def in_range(flag: str, value, lo, hi=MAX_INT) -> None:
    """One `error:` line unless lo <= `value` <= hi (None: the option was not given)."""
    if value is None:
        return
    if isinstance(value, float) and not math.isfinite(value):
        fail(f"--{flag} must be a finite number, got {value}")
    if not lo <= value <= hi:
        top = "2^63-1" if hi == MAX_INT else f"{hi:g}" if isinstance(hi, float) else f"{hi}"
        fail(f"--{flag} must be between {lo} and {top}, got {value}")


def batch_tokens(batch_flag: str, batch: int, length: int, length_flag: str = "seq-len") -> None:
    if batch * length > MAX_BATCH_TOKENS:
        fail(
            f"--{batch_flag} {batch} x --{length_flag} {length} tokens per batch is more than the 2^31 allowed"
        )


def output_file(out: Path) -> None:
    """An output file must not be a folder and its folder must be writable."""
    if out.is_dir():
        fail(f"--out {out} is a folder; name the file to write (e.g. {out / 'model.ddlw'})")
    parent = out.parent if str(out.parent) else Path(".")
    if parent.exists() and not parent.is_dir():
        fail(f"--out {out}: {parent} is not a folder")
    if not parent.exists():
        try:
            parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            fail(f"--out {out}: cannot create {parent}: {e.strerror or e}")
    if not os.access(parent, os.W_OK | os.X_OK):
        fail(f"--out {out}: the folder {parent} is not writable")


def fits(cfg, training: bool, what: str) -> None:
    """One `error:` line unless the model of `cfg` fits in memory (`modelfile.check_fits`)."""
    try:
        check_fits(cfg, training, what)
    except ConfigError as e:
        fail(f"{e} (see the model options, e.g. --d-model, --n-layers, --vocab-size)")


# ---------------------------------------------------------------------------------------------------------
# errors: one line each

# What gets the user further, by the library's `UserError.kind`.
HINTS = {
    "run_completed": "train a new phase with `resume CHECKPOINT --steps N`",
    "phase_unfinished": "finish it first with `resume CHECKPOINT` (no --steps)",
    "needs_phase": "pass --steps N to train a new phase with other options",
    "non_finite": "try a lower --learning-rate",
    "split_too_small": "give more data (--data, --max-tokens), validation data (--val-data) or --val-fraction 0",
    "trunk_needs_wgpu": "use --backend wgpu or --trunk-dtype f32",
    "one_method": "pass exactly one of --drop-layers LIST and --ffn-keep F",
    "too_few_windows": "give more data (--data) or a larger --tokens, or a smaller --batch",
    "run_exists": "pass --overwrite to replace it, or continue it with `resume DIR/VARIANT/checkpoint.ddlw`",
    "locked": "wait for it to end, or write to another --out",
    "not_writable": "write to another --out",
    "out_not_folder": "--out names a folder to create",
}

# OS errors a user causes through the files they name: one line, not a traceback.
USER_ERRNOS = {errno.ENOSPC: "no space left on the device", errno.EROFS: "read-only file system",
               errno.EDQUOT: "disk quota exceeded", errno.EACCES: "permission denied",
               errno.ENOTDIR: "not a folder", errno.EEXIST: "already exists"}  # fmt: skip


def hint(e: BaseException) -> str:
    if isinstance(e, UnknownBackendError):
        return " (--backend)"
    if isinstance(e, BackendError) and "needs the wgpu backend" in str(e):
        return f"; {HINTS['trunk_needs_wgpu']}"
    kind, field = getattr(e, "kind", None), getattr(e, "field", None)
    if kind in HINTS:
        return f"; {HINTS[kind]}"
    if field:
        return f" (--{field.replace('_', '-')})"
    return ""


def is_user_error(e: BaseException) -> bool:
    if isinstance(e, UserError | BackendError | ConfigError | CheckpointError | HfError | FileNotFoundError
                  | IsADirectoryError
                  | PermissionError):  # fmt: skip
        return True
    if isinstance(e, OSError) and e.errno in USER_ERRNOS:
        return True
    gpu_mod = sys.modules.get("ddl_wgpu.gpu")  # only a loaded GPU layer can have raised its errors
    return gpu_mod is not None and isinstance(e, gpu_mod.GpuError)


def error_line(e: BaseException) -> str:
    if isinstance(e, OSError) and e.errno in USER_ERRNOS:
        where = e.filename if e.filename is not None else "writing"
        return f"error: {where}: {USER_ERRNOS[e.errno]} ({e.strerror or e})"
    msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return f"error: {msg}{hint(e)}"
