"""The command line's checks of its options and outputs, made before any work: each refusal is one
`error: ...` line naming the flag, exit 2 (`fail`)."""

from __future__ import annotations

import contextlib
import errno
import math
import os
import signal
import sys
from collections.abc import Iterator
from pathlib import Path

import typer

from ddl_ref.config import ConfigError
from ddl_wgpu.backend import (
    BackendChoice,
    BackendError,
    UnknownBackendError,
    UnknownRuntimeError,
    choose_backend,
    require_backend,
)
from ddl_wgpu.errors import UserError
from ddl_wgpu.files.container import CheckpointError, keep_existing
from ddl_wgpu.files.container_format import (
    _stale_set_files,  # a model saved as shards: NAME-00001-of-00002.ddlw
)
from ddl_wgpu.files.hf.convert import HfError
from ddl_wgpu.files.modelfile import check_fits
from ddl_wgpu.jobs.train_config import MAX_INT  # integers are stored in msgpack headers (int64)

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


def output_file(out: Path, force: bool = True, flag: str = "--out") -> None:
    """An output file must not be a folder, its folder must be writable, and unless `force` it must not
    exist: a model file (a trained one, maybe) is never replaced unasked. `flag`: how the message names it."""
    label = f"{flag} {out}" if flag else str(out)
    if out.is_dir():
        fail(f"{label} is a folder; name the file to write (e.g. {out / 'model.ddlw'})")
    if not force and (out.exists() or out.is_symlink() or _stale_set_files(out)):
        fail(f"{label} already exists; pass --force to replace it")
    parent = out.parent if str(out.parent) else Path(".")
    if parent.exists() and not parent.is_dir():
        fail(f"{label}: {parent} is not a folder")
    if not parent.exists():
        missing = [d for d in (parent, *parent.parents) if not d.exists()]
        try:
            parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            fail(f"{label}: cannot create {parent}: {e.strerror or e}")
        CREATED.extend(missing)  # deepest first: `remove_created` takes them back when the command fails
    if not os.access(parent, os.W_OK | os.X_OK):
        fail(f"{label}: the folder {parent} is not writable")


def _identity(out: Path) -> tuple | None:
    """What stands at `out` (and the shards of a model saved as a set under its name) now: None for nothing."""
    found = []
    for p in (out, *_stale_set_files(out)):
        try:
            st = os.lstat(p)
        except OSError:
            continue
        found.append((str(p), st.st_dev, st.st_ino, st.st_mtime_ns, st.st_size))
    return tuple(found) or None


# The folders `output_file` created for a command's output, deepest first: a command that fails takes them
# back (`remove_created`), so that a refused run leaves no empty folder.
CREATED: list[Path] = []
# The outputs of `writes` blocks, each with what stood there before: a Ctrl-C that lands once the output is
# in place, anywhere up to the exit, interrupted nothing (`written_meanwhile`).
WATCHED: list[tuple[Path, tuple | None]] = []
EXIT_TERMINATED = 128 + signal.SIGTERM  # 143, as a shell reports a process that SIGTERM ended


class Terminated(KeyboardInterrupt):
    """SIGTERM (`kill`, `timeout`, a batch scheduler) inside a command that writes: raised where the command
    is, as Ctrl-C raises KeyboardInterrupt, so that every `with` and `finally` cleans up the same way (a
    partial output, heal's scratch file); the command then exits 143 (`EXIT_TERMINATED`)."""


def _terminate(*_signal) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # one clean-up, whatever more SIGTERM follows
    raise Terminated


def remove_created() -> None:
    """The folders `output_file` created, removed while empty (after a failed command)."""
    for d in CREATED:
        try:
            d.rmdir()
        except OSError:  # it holds something (not ours to remove): it and the folders above it stay
            break
    CREATED.clear()


def written_meanwhile() -> Path | None:
    """An output of a `writes` block that is in place now (something new stands at its name), or None."""
    for out, before in WATCHED:
        if _identity(out) not in (None, before):
            return out
    return None


def interrupted(e: KeyboardInterrupt) -> int:
    """The line and exit status of a Ctrl-C or SIGTERM that reached the entry point: success when the
    command's output was already in place (it was the last thing the command did), else an interruption."""
    out = written_meanwhile()
    what = "SIGTERM" if isinstance(e, Terminated) else "Ctrl-C"
    if out is not None:
        typer.echo(f"wrote {out} (complete: the {what} came after it was written)", err=True)
        return 0
    typer.echo("terminated" if isinstance(e, Terminated) else "interrupted", err=True)
    return EXIT_TERMINATED if isinstance(e, Terminated) else 130


@contextlib.contextmanager
def writes(out: Path, replace: bool = True) -> Iterator[None]:
    """Around the part of a command that writes `out` and says so. Outputs are written under a temporary name
    and renamed into place only when complete, so a Ctrl-C that lands once something new stands at `out`
    (after the rename, before the command said "wrote", or later, up to the exit: `interrupted`) interrupted
    nothing: the command says that `out` was written and exits 0, instead of "interrupted" over a complete
    output that a re-run would then find "already exists". A Ctrl-C before the rename is an interruption as
    anywhere (nothing was written). SIGTERM inside the block is handled as Ctrl-C (`Terminated`, exit 143).
    `replace` False (no --force): the rename never replaces a file that appeared at `out` meanwhile
    (another run's: `container.keep_existing`); that run's file stays and this one fails with one line."""
    before = _identity(out)
    WATCHED.append((out, before))
    with contextlib.suppress(ValueError):  # only the main thread may set a handler
        signal.signal(signal.SIGTERM, _terminate)
    try:
        with contextlib.nullcontext() if replace else keep_existing(out):
            yield
    except KeyboardInterrupt as e:
        if _identity(out) in (None, before):
            raise
        what = "SIGTERM" if isinstance(e, Terminated) else "Ctrl-C"
        typer.echo(f"wrote {out} (complete: the {what} came after it was written)", err=True)
        raise typer.Exit(0) from None
    except BaseException:
        WATCHED.remove((out, before))  # it failed: what stands at `out` now is not this command's
        raise


def within_context(flag: str, value: int | None, cfg) -> None:
    """One `error:` line when a window of `value` tokens (None: the default, fitted to the model) is longer
    than the model's context: it would silently be cut to it (as `train` and `heal` refuse)."""
    if value is not None and value > cfg.max_seq_len:
        fail(f"--{flag} {value} exceeds the model's context (max_seq_len {cfg.max_seq_len})")


def fits(cfg, training: bool, what: str) -> None:
    """One `error:` line unless the model of `cfg` fits in memory (`modelfile.check_fits`)."""
    try:
        check_fits(cfg, training, what)
    except ConfigError as e:
        fail(f"{e} (see the model options, e.g. --d-model, --n-layers, --vocab-size)")


# ---------------------------------------------------------------------------------------------------------
# the backend of a resumed run


def resume_backend(recorded: dict | None, requested: str, device: str | None,
                   new_phase: bool) -> tuple[BackendChoice, str | None, str | None]:  # fmt: skip
    """The backend of `resume CHECKPOINT` -> (choice, the device to open, a line to print or None).

    An exact resume continues where the run trained (`train.backend`: backend and adapter kind), since another
    backend takes another float path and the history would diverge from the first resumed step: `auto` means
    the recorded backend, and another one, or a recorded one this machine cannot run, is refused naming
    --backend. A new phase (`--steps N`) may switch, and says so. A checkpoint from before the backend was
    recorded resumes as before (`auto` chooses)."""
    if recorded is None:
        return choose_backend(requested, device), device, None
    was, kind = recorded["backend"], recorded["device"]
    trained = f"the run trained on the {was} backend ({kind})"
    if new_phase and requested != "auto":
        choice = choose_backend(requested, device)
    else:
        if requested not in ("auto", was):
            fail(f"{trained}; an exact resume continues it there, bit for bit: pass --backend {was} (or no "
                 f"--backend), or train a new phase on {requested} with --steps N")  # fmt: skip
        try:
            choice, device = require_backend(was, device, kind)
        except BackendError as e:
            if not new_phase:
                fail(f"{trained}, which this machine cannot run ({e}); an exact resume continues it there: "
                     "train a new phase on another backend with --steps N --backend ref")  # fmt: skip
            choice = choose_backend("auto", device)
    if choice.name != was:
        return choice, device, f"  backend switch: {trained}; this new phase runs on {choice.name}"
    if choice.adapter is not None and choice.adapter != kind:
        return choice, device, (f"  note: the run trained on {kind}; it continues on {choice.adapter} (the "
                                "same backend on another adapter: the last bits may differ)")  # fmt: skip
    return choice, device, None


def sweep_backend(recorded: str, requested: str, device: str | None) -> str:
    """The backend of `resume DIR`: the sweep's own (its jobs' checkpoints continue bit for bit there only),
    refused naming --backend when another is asked for or this machine cannot run it."""
    trained = f"the sweep trained on the {recorded} backend"
    if requested not in ("auto", recorded):
        fail(f"{trained}; resume finishes its jobs there, bit for bit: pass --backend {recorded} (or no "
             "--backend)")  # fmt: skip
    try:
        require_backend(recorded, device)
    except BackendError as e:
        fail(f"{trained}, which this machine cannot run ({e}); resume it where it can run (--backend, "
             "--device)")  # fmt: skip
    return recorded


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
    "run_exists": "pass --overwrite to replace it, or continue it with `resume` (a sweep's folder, or the "
    "checkpoint)",
    "locked": "wait for it to end, or write to another --out",
    "not_writable": "write to another --out",
    "out_not_folder": "--out names a folder to create",
    "gpu_memory": "heal, accept and eval plan within --gpu-memory SIZE (what the card has free), streaming the "
    "trunk layer by layer when it does not fit",
}

# OS errors a user causes through the files they name: one line, not a traceback. (A name of more than 255
# bytes, or a symbolic link that leads back to itself, fails at the first look at the path, wherever that is.)
USER_ERRNOS = {errno.ENOSPC: "no space left on the device", errno.EROFS: "read-only file system",
               errno.EDQUOT: "disk quota exceeded", errno.EACCES: "permission denied",
               errno.ENOTDIR: "not a folder", errno.EEXIST: "already exists",
               errno.ENAMETOOLONG: "file name too long", errno.EFBIG: "file too large",
               errno.ELOOP: "too many levels of symbolic links"}  # fmt: skip
# Python before 3.13 reports a symbolic link loop met by `Path.resolve()` as this RuntimeError (3.13: ELOOP)
SYMLINK_LOOP = "Symlink loop from "


def hint(e: BaseException) -> str:
    if isinstance(e, UnknownBackendError):
        return " (--backend)"
    if isinstance(e, UnknownRuntimeError):
        return " (--runtime)"
    if isinstance(e, BackendError) and "needs the wgpu backend" in str(e):
        return f"; {HINTS['trunk_needs_wgpu']}"
    kind, field = getattr(e, "kind", None), getattr(e, "field", None)
    if kind in HINTS:
        return f"; {HINTS[kind]}"
    if field:
        return f" (--{field.replace('_', '-')})"
    return ""


def _symlink_loop(e: BaseException) -> bool:
    return type(e) is RuntimeError and str(e).startswith(SYMLINK_LOOP)


def is_user_error(e: BaseException) -> bool:
    if _symlink_loop(e):
        return True
    if isinstance(e, UserError | BackendError | ConfigError | CheckpointError | HfError | FileNotFoundError
                  | IsADirectoryError
                  | PermissionError):  # fmt: skip
        return True
    if isinstance(e, OSError) and e.errno in USER_ERRNOS:
        return True
    gpu_mod = sys.modules.get("ddl_wgpu.runtime.gpu")  # only a loaded GPU layer can have raised its errors
    return gpu_mod is not None and isinstance(e, gpu_mod.GpuError)


def error_line(e: BaseException) -> str:
    if _symlink_loop(e):  # "Symlink loop from '/x/y'": the path, as an OSError names it
        return f"error: {str(e)[len(SYMLINK_LOOP) :].strip(chr(39))}: {USER_ERRNOS[errno.ELOOP]}"
    if isinstance(e, OSError) and e.errno in USER_ERRNOS:
        where = e.filename if e.filename is not None else "writing"
        why, detail = USER_ERRNOS[e.errno], e.strerror or str(e)
        return f"error: {where}: {why}" + ("" if detail.lower() == why else f" ({detail})")
    msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return f"error: {msg}{hint(e)}"
