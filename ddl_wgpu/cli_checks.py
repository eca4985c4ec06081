"""The command line's checks of its options and outputs, made before any work: each refusal is one
`error: ...` line naming the flag, exit 2 (`fail`)."""

from __future__ import annotations

import math
import os
from pathlib import Path

import typer

from ddl_ref.config import ConfigError
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
