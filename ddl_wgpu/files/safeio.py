"""Reading untrusted inputs and protecting inputs from being overwritten, shared by every file reader.

- :func:`open_regular` opens a file for reading only when it is a regular file: a FIFO, a socket or a device
  (``/dev/zero``) is refused at once instead of blocking or growing without bound.
- :func:`load_json` parses JSON from an untrusted source into one precise error (``error(...)``, a class the
  caller names) for everything hostile JSON can do to ``json.loads``: nesting deep enough for a
  ``RecursionError`` (refused above ``MAX_JSON_DEPTH`` before parsing), integers of thousands of digits
  (``ValueError`` from the int conversion limit), lone surrogates (``\\ud800`` parses to a str that cannot be
  encoded again), duplicate keys, NaN/Infinity, invalid UTF-8.
- :func:`refuse_overwrite_input` stops a command whose output is one of its inputs, or lies inside an input
  folder, before any work (symlinks resolved, by :func:`resolved`, which turns a symbolic link loop or a name
  the file system cannot hold into one line).
- :func:`create_exclusive` is how every writer starts a file it writes: a new inode under a name of its own
  (``.NAME.<pid>.<random>.partial`` beside NAME, or another suffix), created with O_CREAT|O_EXCL|O_NOFOLLOW, so
  that it never follows a link planted under that name, never truncates what is there, and two writers of one
  output never share a file; the name is cut to fit the folder's name limit, whatever NAME's length.
  :func:`commit` renames it onto NAME: the rename decides which of two writers wins (with ``replace=False``
  the first, and the other is told NAME appeared meanwhile; else the last), and the loser's file is removed.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import secrets
import stat
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import IO, Any

__all__ = ["MAX_JSON_DEPTH", "commit", "create_exclusive", "load_json", "open_regular", "refuse_overwrite_input",
           "resolved", "is_temp_of", "temp_name", "utf8_text", "write_atomic"]  # fmt: skip

MAX_JSON_DEPTH = 64  # a config.json, an index or a data record nests a few levels; 64 keeps recursion safe


def open_regular(path: str | os.PathLike, what: str, error: type[Exception]) -> IO[bytes]:
    """Open `path` for binary reading (unbuffered); `error` with one line unless it is a regular file.

    O_NONBLOCK makes opening a FIFO return at once (a plain open waits for a writer); it changes nothing for
    a regular file. The type is checked on the opened descriptor, so a swap after a check cannot slip by."""
    p = os.fspath(path)
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_BINARY", 0)
    try:
        fd = os.open(p, flags)
    except FileNotFoundError:
        raise error(f"no such file: {p}") from None
    except IsADirectoryError:
        raise error(f"{p}: is a directory, not {what}") from None
    except OSError as e:
        raise error(f"{p}: cannot open: {e.strerror or e}") from None
    try:
        mode = os.fstat(fd).st_mode
        if stat.S_ISDIR(mode):
            raise error(f"{p}: is a directory, not {what}")
        if not stat.S_ISREG(mode):
            kind = "a FIFO" if stat.S_ISFIFO(mode) else "a socket" if stat.S_ISSOCK(mode) else "a device"
            raise error(f"{p}: is {kind}, not a regular file; {what} must be a regular file")
        if hasattr(os, "set_blocking"):
            os.set_blocking(fd, True)
        return os.fdopen(fd, "rb", buffering=0)
    except BaseException:
        os.close(fd)
        raise


def read_regular(path: str | os.PathLike, what: str, error: type[Exception], limit: int) -> bytes:
    """The bytes of a regular file of at most `limit` bytes (`error` otherwise)."""
    with open_regular(path, what, error) as f:
        size = os.fstat(f.fileno()).st_size
        if size > limit:
            raise error(f"{os.fspath(path)}: {size} bytes, more than the {limit} allowed for {what}")
        try:
            return f.read(limit + 1)[:limit]
        except OSError as e:
            raise error(f"{os.fspath(path)}: cannot read: {e.strerror or e}") from None


def utf8_text(data: bytes | bytearray | memoryview | str, where: str, error: type[Exception]) -> str:
    """The text of untrusted bytes; `error` with one line starting with `where` when they are not UTF-8 (a
    str is already text)."""
    if isinstance(data, str):
        return data
    try:
        return bytes(data).decode("utf-8")
    except UnicodeDecodeError as e:
        raise error(f"{where}: not UTF-8 text (byte {e.start})") from None


def _max_depth(text: str) -> int:
    """Deepest [/{ nesting outside strings (a linear scan: no recursion, whatever the input)."""
    depth = deepest = 0
    in_str = escaped = False
    for ch in text:
        if in_str:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_str = False
        elif ch == '"':
            in_str = True
        elif ch in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif ch in "]}":
            depth -= 1
    return deepest


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


class _DuplicateKey(Exception):
    """Raised inside `json.loads` for a key given twice: not a ValueError, so that the decoder's own error
    handling does not wrap it again (the line would name the file twice)."""


def _check_strings(v: Any, where: str, error: type[Exception]) -> None:
    """Refuse lone surrogates (valid JSON escapes, but no valid text): they would crash the first encode."""
    stack = [v]
    while stack:
        x = stack.pop()
        if isinstance(x, dict):
            stack.extend(x.keys())
            stack.extend(x.values())
        elif isinstance(x, list):
            stack.extend(x)
        elif isinstance(x, str):
            try:
                x.encode("utf-8")
            except UnicodeEncodeError:
                raise error(
                    f"{where}: JSON string {x[:40]!r} holds a lone UTF-16 surrogate (not text)"
                ) from None


def load_json(data: bytes | str, where: str, error: type[Exception], max_depth: int = MAX_JSON_DEPTH) -> Any:
    """Parse untrusted JSON; every problem raises `error` with one line that starts with `where`."""
    text = utf8_text(data, where, error)
    if _max_depth(text) > max_depth:
        raise error(f"{where}: JSON nests deeper than {max_depth} levels")

    def pairs(items: list[tuple[str, Any]]) -> dict:
        d: dict = {}
        for k, v in items:
            if k in d:
                raise _DuplicateKey(k)
            d[k] = v
        return d

    try:
        value = json.loads(text, object_pairs_hook=pairs, parse_constant=_reject_constant)
    except _DuplicateKey as e:
        raise error(f"{where}: duplicate key {e.args[0]!r} in JSON") from None
    except json.JSONDecodeError as e:
        raise error(f"{where}: invalid JSON: {e}") from None
    except RecursionError:
        raise error(f"{where}: JSON nests too deeply") from None
    except ValueError as e:  # an integer longer than Python's int conversion limit, NaN/Infinity
        msg = (str(e).splitlines() or [""])[0]
        if "digits" in msg:
            msg = "an integer has too many digits"
        raise error(f"{where}: invalid JSON: {msg}") from None
    _check_strings(value, where, error)
    return value


def resolved(path: str | os.PathLike, error: type[Exception]) -> Path:
    """`path` with every symbolic link resolved (it need not exist); `error` with one line for a symbolic link
    loop (Python before 3.13 raises a RuntimeError for it) or a name the file system cannot hold."""
    try:
        p = Path(path).resolve()
        os.lstat(p)
    except RuntimeError:
        raise error(f"{os.fspath(path)}: too many levels of symbolic links") from None
    except (FileNotFoundError, NotADirectoryError):
        pass  # a path still to be written
    except OSError as e:
        raise error(f"{os.fspath(path)}: {e.strerror or e}") from None
    return p


def refuse_overwrite_input(
    out: str | os.PathLike, inputs: Iterable[str | os.PathLike | None], error: type[Exception] = ValueError
) -> None:
    """`error` when writing `out` would destroy an input before or while it is read: `out` is one of `inputs`
    (the same file through any symlink or hard link), lies inside an input that is a folder, or is a folder
    (replaced as a whole) that holds an input. Call it before any work; `None` inputs are skipped."""
    out_p = resolved(out, error)
    for item in inputs:
        if item is None:
            continue
        inp = resolved(item, error)
        same = out_p == inp
        if not same and out_p.exists() and inp.exists():
            try:
                same = os.path.samefile(out_p, inp)
            except OSError:
                same = False
        if same:
            raise error(f"output {os.fspath(out)} is the input {os.fspath(item)}; write to another path")
        if inp in out_p.parents:
            raise error(f"output {os.fspath(out)} lies inside the input folder {os.fspath(item)}; "
                        "write it elsewhere")  # fmt: skip
        if out_p in inp.parents:
            raise error(f"output {os.fspath(out)} is a folder that holds the input {os.fspath(item)}; "
                        "write it elsewhere")  # fmt: skip


# ---------------------------------------------------------------------------------------------------------
# writing: a file of its own, then a rename

NAME_MAX = 255  # bytes of one name on every file system we write to (ext4, xfs, btrfs, tmpfs, APFS, NTFS)
_EXCLUSIVE = os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
_EXCLUSIVE |= getattr(os, "O_BINARY", 0)


def _name_max(folder: Path) -> int:
    try:
        return min(NAME_MAX, os.pathconf(folder, "PC_NAME_MAX"))
    except (OSError, ValueError, AttributeError):  # no such folder yet, or no pathconf (Windows)
        return NAME_MAX


def temp_name(final: str | os.PathLike, suffix: str = ".partial") -> Path:
    """A name of this writer's own beside `final`: ``.NAME.<pid>.<random>SUFFIX``, NAME cut (at a byte, as
    the file system counts) so that the whole fits the folder's name limit: a NAME that fits, fits with it."""
    final = Path(final)
    tail = os.fsencode(f".{os.getpid()}.{secrets.token_hex(4)}{suffix}")
    name = os.fsencode(final.name)[: max(1, _name_max(final.parent) - len(tail) - 1)]
    return final.with_name(os.fsdecode(b"." + name + tail))


def is_temp_of(name: str, final_name: str, suffix: str = ".partial") -> bool:
    """Whether `name` is a name `temp_name` gives a writer of `final_name` (a write cut short, by kill -9)."""
    m = re.fullmatch(r"\.(.+)\.\d+\.[0-9a-f]{8}" + re.escape(suffix), name, re.DOTALL)
    return m is not None and os.fsencode(final_name).startswith(os.fsencode(m.group(1)))


def create_exclusive(
    final: str | os.PathLike, suffix: str = ".partial", mode: int = 0o644
) -> tuple[int, Path]:
    """(an open read-write descriptor, its path) of a new, empty file of this writer's own beside `final`
    (`temp_name`). O_EXCL|O_NOFOLLOW: a name that exists, a symbolic link included, is never opened, so
    nothing there is followed, truncated or shared with another writer (a clash of names, one in 2^32, takes
    another)."""
    for _ in range(8):
        path = temp_name(final, suffix)
        try:
            return os.open(path, _EXCLUSIVE, mode), path
        except FileExistsError:
            continue
    raise FileExistsError(errno.EEXIST, "cannot create a file of this writer's own", os.fspath(final))


class AppearedError(FileExistsError):
    """`commit(replace=False)` found its target taken: another writer renamed its file there first."""


def commit(tmp: str | os.PathLike, final: str | os.PathLike, replace: bool = True) -> None:
    """Rename this writer's complete file `tmp` onto `final`. `replace`: whatever stands there goes (of two
    writers, the last rename wins, each output complete). Else the first wins: a hard link, which fails when
    `final` exists (atomic: no check-then-rename window), then `tmp` removed; `AppearedError` when another
    writer got there first (its file is left as it is; `tmp` stays for the caller's clean-up). A file
    system without hard links falls back to a check, then the rename."""
    if replace:
        os.replace(tmp, final)
        return
    try:
        os.link(tmp, final, follow_symlinks=False)
    except FileExistsError:
        raise AppearedError(errno.EEXIST, "another writer wrote it meanwhile", os.fspath(final)) from None
    except OSError as e:
        if e.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV, errno.EMLINK):
            raise
        if os.path.lexists(final):
            raise AppearedError(errno.EEXIST, "another writer wrote it meanwhile", os.fspath(final)) from None
        os.replace(tmp, final)
        return
    os.unlink(tmp)


def write_atomic(path: str | os.PathLike, write: Callable[[IO[bytes]], Any], replace: bool = True) -> None:
    """`write(f)` into a file of this writer's own beside `path` (`create_exclusive`), then `commit` it there;
    on any failure (a full disk, a Ctrl-C) the file is removed and `path` is as it was."""
    fd, tmp = create_exclusive(path)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
        commit(tmp, path, replace)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
