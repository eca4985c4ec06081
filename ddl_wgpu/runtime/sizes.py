"""Sizes in bytes as people type them, read one way everywhere: `--gpu-memory`, `--host-memory`, and the
environment's DDL_WGPU_GPU_MEMORY, DDL_WGPU_DEVICE_MEMORY, DDL_WGPU_MAX_BINDING and DDL_WGPU_MAX_BUFFER all go
through `parse_size` (and `from_env`), so a size one command takes every other takes, and a value one refuses
every other refuses, in the same words. Here, below every other layer but errors, because the device layer reads
its own size variables too.

Units are binary: 16GB, 16G and 16GiB are 16 x 2^30 bytes (a "16 GB" card holds 16 GiB); a plain number is
bytes. `size_text(n)` is the inverse a refusal names: the shortest form (two decimals of its unit) that
`parse_size` reads back as at least n bytes, so a size a message suggests is one the option then takes.
"""

from __future__ import annotations

import math
import os
import re

from ddl_wgpu.errors import UserError

_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
LEAST = 1 << 10  # the least size a budget takes (a smaller one is a typo: 16 instead of 16GB)


class SizeError(UserError):
    """A size that cannot be read, or one below what its option takes (one line naming the option)."""


def parse_size(text: str, what: str = "--gpu-memory", least: int = LEAST) -> int:
    """'16GB', '16G', '16GiB', '512MiB', '1.5TB', '17179869184' -> bytes (binary units); `what` names the option
    or variable in the refusal; `least`: the smallest size it takes."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([kKmMgGtT]?)(i?[bB])?\s*", str(text))
    if m is None:
        raise SizeError(f"{what} {text!r}: not a size (e.g. 16GB, 512MiB, 24G)", kind="size")
    n = float(m.group(1)) * _UNITS[m.group(2).lower()]
    if not math.isfinite(n) or n < least:
        raise SizeError(f"{what} {text!r}: a size of at least {size_text(least)}", kind="size")
    return int(n)


def from_env(name: str, least: int = LEAST) -> int | None:
    """The size in the environment variable `name` (`parse_size`), None when it is unset or empty."""
    value = os.environ.get(name, "").strip()
    return parse_size(value, name, least) if value else None


def size_text(n: int) -> str:
    """The shortest spelling of at least `n` bytes that `parse_size` reads back as at least `n`: a whole number
    of bytes below 1 KiB, else two decimals of KiB, MiB or GiB, rounded up (6.88 MiB needed is never said as a
    6.88MiB that reads back a few bytes short)."""
    n = int(n)
    if n < 1 << 10:
        return str(n)
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift:
            hundredths = -(-n * 100 // (1 << shift))  # ceil, in integers
            while True:
                text = f"{hundredths // 100}.{hundredths % 100:02d}{unit}"
                if parse_size(text, least=0) >= n:  # the float product can fall a byte short: one more step
                    return text
                hundredths += 1
    raise AssertionError("unreachable")
