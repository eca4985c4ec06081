"""Model files: a `ModelConfig` plus its parameters (and optionally a tokenizer) in the `.ddlw` container.

The header's `config` is `ModelConfig.to_dict()`; `metadata["model.variant"]` names the variant;
`provenance` records which tools made or changed the file. Tensors are written in parameter-table order,
so a model file, the engine's arenas and the gradient report all list parameters the same way.

Reading a model file checks, before any tensor is read: the config (valid, finite, and small enough for
this machine: :func:`estimate_bytes`), then every tensor the config expects (present, the expected shape, a
float dtype); token ids in the metadata must lie inside the vocabulary. Tensors the config does not expect
(a training checkpoint's `best.`/`optim.` copies, or anything else) are never read. Each tensor read is
checked against its hash unless the caller passes `verify=False` (see `ddl_wgpu.files.container`), and finite
as it is read, piece by piece where it streams (`lazy.refuse_non_finite`: a NaN or infinite weight is refused in
one line naming the tensor, whatever `verify` says; tensors a command does not read, such as the blocks
`compress --drop-layers` drops, are not checked).
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ddl_ref.config import ConfigError, ModelConfig, select_layers
from ddl_ref.params import param_table
from ddl_wgpu.files.container import Checkpoint, CheckpointError, open_checkpoint, save
from ddl_wgpu.files.lazy import Lazy, Progress, finite, from_array, refuse_non_finite

__all__ = [
    "EXTRA_PREFIXES",
    "LazyModel",
    "Model",
    "available_bytes",
    "check_fits",
    "check_model_tensors",
    "estimate_bytes",
    "load_config",
    "load_model",
    "open_model",
    "param_count",
    "read_f32",
    "read_params",
    "save_model",
    "write_model",
]

FLOAT_DTYPES = ("f32", "f16", "bf16", "f64")
# Host float32 copies a command keeps per parameter: the weights to run; to train, also the gradients, the two
# AdamW moments and the best-validation copy.
COPIES_INFERENCE = 1
COPIES_TRAINING = 5
ABSURD_BYTES = 1 << 50  # 1 PiB: refused on any machine, even where the available memory is unknown


@dataclass
class Model:
    cfg: ModelConfig
    params: dict[str, np.ndarray]  # float32, table order
    variant: str = "baseline"
    tokenizer: bytes | None = None
    provenance: dict = field(default_factory=dict)
    metadata: dict = field(default_factory=dict)
    # the storage dtype of a parameter where known ("f32", "f16", "bf16"): the file's, or on import the Hugging
    # Face folder's; `save_model(..., dtype=model.dtypes)` keeps it
    dtypes: dict[str, str] = field(default_factory=dict)
    # tensors outside the parameter table that travel with the model, under EXTRA_PREFIXES: what an imported
    # folder held that we do not run (a vision tower, byte for byte) and its small files (docs/container.md)
    extra: dict[str, np.ndarray] = field(default_factory=dict)

    def lazy(self, dtype: str | Mapping[str, str] | None = None) -> LazyModel:
        """This model as a LazyModel whose parameters are stored as `dtype` ('f32', 'f16', 'bf16' or 'f64'; a
        mapping gives each parameter's, 'f32' for those it leaves out; None: `self.dtypes`), converted piece by
        piece when they are written."""
        dtype = self.dtypes if dtype is None else dtype
        tensors = {}
        for s in param_table(self.cfg):
            if s.name not in self.params:
                raise CheckpointError(f"model is missing parameter {s.name}")
            dt = dtype.get(s.name, "f32") if isinstance(dtype, Mapping) else dtype
            if dt not in FLOAT_DTYPES:
                raise CheckpointError(
                    f"cannot store parameter {s.name} as {dt!r} ({', '.join(FLOAT_DTYPES)})"
                )
            tensors[s.name] = from_array(np.asarray(self.params[s.name], np.float32)).to(dt)
        return LazyModel(cfg=self.cfg, tensors=tensors, variant=self.variant, tokenizer=self.tokenizer,
                         provenance=self.provenance, metadata=self.metadata,
                         extra={n: from_array(a) for n, a in self.extra.items()})  # fmt: skip


@dataclass
class LazyModel:
    """A model whose tensors are read, transformed and written a piece at a time (`ddl_wgpu.files.lazy`): what the file
    commands carry from input to output, so their memory does not grow with the model. `tensors` holds the
    parameters in table order, each in its storage dtype; `extra` the tensors under EXTRA_PREFIXES, as stored.
    From a file: `open_model`; from a Model: `Model.lazy`; back to a Model: `load`; to a file: `write_model`."""

    cfg: ModelConfig
    tensors: dict[str, Lazy]
    variant: str = "baseline"
    tokenizer: bytes | None = None
    provenance: dict = field(default_factory=dict)
    metadata: dict = field(default_factory=dict)
    extra: dict[str, Lazy] = field(default_factory=dict)

    def load(self) -> Model:
        """The whole model in memory: float32 parameters with their storage dtypes, the extra tensors as stored."""
        return Model(cfg=self.cfg, params={n: t.to("f32").array() for n, t in self.tensors.items()},
                     variant=self.variant, tokenizer=self.tokenizer, provenance=self.provenance,
                     metadata=self.metadata, dtypes={n: t.dtype for n, t in self.tensors.items()},
                     extra={n: t.array() for n, t in self.extra.items()})  # fmt: skip


# A model file's tensors outside the parameter table that `load_model(extra=True)` reads and `save_model` writes:
# the Hugging Face folder's tensors kept byte for byte and its small files (ddl_wgpu.files.hf.qwen35).
EXTRA_PREFIXES = ("hf.keep.", "hf.file.")


# ------------------------------------------------------------------------------------------------ sizes


def param_count(cfg: ModelConfig) -> int:
    """Number of parameters, in closed form: per kind of block (full or linear attention), the tables of a
    one-block and a two-block model of that kind give its per-block count, so an absurd `n_layers` costs
    nothing (building its table would take minutes)."""
    kinds = ["full_attention"] if cfg.layer_types is None else list(dict.fromkeys(cfg.layer_types))
    total = None
    for kind in kinds:
        i = 0 if cfg.layer_types is None else cfg.layer_types.index(kind)  # a block of this kind
        one = sum(s.numel for s in param_table(select_layers(cfg, [i])))
        two = sum(s.numel for s in param_table(select_layers(cfg, [i, i])))
        if total is None:  # everything outside the blocks, counted once
            total = one - (two - one)
        n = cfg.n_layers if cfg.layer_types is None else cfg.layer_types.count(kind)
        total += n * (two - one)
    return total


def estimate_bytes(cfg: ModelConfig, training: bool) -> int:
    """Host memory a model of `cfg` needs, in bytes: float32 copies of every parameter (the weights; to train
    also gradients, AdamW's two moments and the best-validation copy) plus the RoPE tables. Activations,
    which grow with batch size and sequence length, come on top."""
    copies = COPIES_TRAINING if training else COPIES_INFERENCE
    rope = 2 * cfg.max_seq_len * cfg.head_dim * 4  # cos and sin, float32
    return copies * 4 * param_count(cfg) + rope


def available_bytes() -> int | None:
    """Memory this process could still get: MemAvailable on Linux, else the physical memory; None if
    unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, OSError, ValueError):
        return None


def _gib(n: int) -> str:
    return f"{n / (1 << 30):.3g} GiB"


def check_finite(cfg: ModelConfig, what: str = "the model") -> None:
    """ConfigError (one line) unless every float setting of `cfg` is finite."""
    for name in ("rope_theta", "rms_eps", "ddl_k_eps", "ddl_v_scale", "ddl_beta_init"):
        if not math.isfinite(getattr(cfg, name)):
            raise ConfigError(f"{what}: {name} is {getattr(cfg, name)}, not a finite number")


def check_fits(cfg: ModelConfig, training: bool, what: str = "the model", resident: bool = True) -> int:
    """ConfigError (one line) unless `cfg`'s settings are finite and its model fits in memory
    (:func:`estimate_bytes`); -> the estimate. `resident=False`, for a command that goes tensor by tensor
    (`import-hf`, `export-hf`, `compress`, the GPU trunk read from the file's map): only a model beyond any
    machine (ABSURD_BYTES) is refused."""
    check_finite(cfg, what)
    need = estimate_bytes(cfg, training)
    have = available_bytes() if resident else None
    use = "to train" if training else "to load"
    if need > ABSURD_BYTES or (have is not None and need > have):
        n = param_count(cfg)
        room = f"this machine has {_gib(have)} available" if have is not None else "which no machine has"
        raise ConfigError(
            f"{what} needs about {_gib(need)} of memory {use} ({n:,} parameters: vocab_size "
            f"{cfg.vocab_size}, d_model {cfg.d_model}, n_layers {cfg.n_layers}, ffn_hidden {cfg.ffn_hidden}, "
            f"max_seq_len {cfg.max_seq_len}); {room}"
        )
    return need


# ------------------------------------------------------------------------------------------------ writing


def save_model(path, model: Model, dtype: str | Mapping[str, str] = "f32") -> Path:
    """Write `model` atomically (`NAME.partial`, then rename): its parameters in table order, stored as `dtype`
    ('f32', 'f16' or 'bf16'; a mapping gives each parameter's, 'f32' for those it leaves out), then its
    `extra` tensors as they are."""
    missing = [s.name for s in param_table(model.cfg) if s.name not in model.params]
    if missing:
        raise CheckpointError(f"{path}: model is missing parameter(s) {missing[:5]}")
    for s in param_table(model.cfg):
        dt = dtype.get(s.name, "f32") if isinstance(dtype, Mapping) else dtype
        if dt not in ("f32", "f16", "bf16"):
            raise CheckpointError(f"{path}: cannot store parameter {s.name} as {dt!r} (f32, f16 or bf16)")
    return write_model(path, model.lazy(dtype))


def write_model(path, model: LazyModel, say: Callable[[str], None] | None = None) -> Path:
    """Write a LazyModel atomically, tensor by tensor and piece by piece: its parameters in table order, then its
    `extra` tensors. The header is what `save_model` writes (it writes through here). `say`: where a long write
    says its progress (`lazy.Progress`)."""
    table = param_table(model.cfg)
    if list(model.tensors) != [s.name for s in table]:
        missing = [s.name for s in table if s.name not in model.tensors]
        raise CheckpointError(f"{path}: model is missing parameter(s) {missing[:5]}" if missing else
                              f"{path}: the model's tensors are not its parameter table")  # fmt: skip
    for s in table:
        t = model.tensors[s.name]
        if tuple(t.shape) != tuple(s.shape):
            raise CheckpointError(
                f"{path}: parameter {s.name} has shape {tuple(t.shape)}, the config needs {s.shape}"
            )
    stray = [n for n in model.extra if not n.startswith(EXTRA_PREFIXES) or n in model.tensors]
    if stray:
        raise CheckpointError(f"{path}: extra tensor {stray[0]!r} is not under {list(EXTRA_PREFIXES)}")
    meta = dict(model.metadata)
    meta["model.variant"] = model.variant
    meta["model.num_params"] = int(sum(s.numel for s in table))
    tensors = [*model.tensors.items(), *model.extra.items()]
    progress = Progress(f"writing {path}", [t for _, t in tensors], say)
    save(path, [(n, progress.wrap(t)) for n, t in tensors], config=model.cfg.to_dict(), metadata=meta,
         provenance=model.provenance, tokenizer=model.tokenizer)  # fmt: skip
    return Path(path)


# ------------------------------------------------------------------------------------------------ reading


def _config(ck: Checkpoint, path, training: bool, resident: bool = True) -> ModelConfig:
    if not ck.config:
        raise CheckpointError(f"{path}: no model config in the header (not a model file?)")
    try:
        cfg = ModelConfig.from_dict(dict(ck.config))
    except (ConfigError, TypeError, ValueError) as e:
        raise CheckpointError(f"{path}: bad model config: {e}") from None
    try:
        check_fits(cfg, training, f"{path}: the model", resident)
    except ConfigError as e:
        raise CheckpointError(str(e)) from None
    n = param_count(cfg)
    if not resident and 2 * n > ck.nbytes:  # before any table is built: a parameter takes at least 2 bytes
        raise CheckpointError(f"{path}: its config describes {n:,} parameters (at least {2 * n:,} bytes as bf16), "
                              f"but the file holds {ck.nbytes:,} bytes of tensors")  # fmt: skip
    return cfg


def check_model_tensors(
    ck: Checkpoint, cfg: ModelConfig, path, prefix: str = "", require_all: bool = True
) -> list[str]:
    """CheckpointError unless `ck` holds every parameter of `cfg` under `prefix` (e.g. "optim.m."; with
    `require_all=False` the present ones) with the expected shape and a float dtype; under a non-empty
    prefix, a tensor that is no parameter of `cfg` (renamed, or of another config) is an error too. Reads no
    tensor data; -> the parameter names found, in table order."""
    table = param_table(cfg)
    if require_all:
        missing = [s.name for s in table if prefix + s.name not in ck]
        if missing:
            more = f" (+{len(missing) - 1} more)" if len(missing) > 1 else ""
            raise CheckpointError(
                f"{path}: missing tensor {prefix}{missing[0]}{more} that the config expects"
            )
    if prefix:
        known = {prefix + s.name for s in table}
        stray = [n for n in ck.names() if n.startswith(prefix) and n not in known]
        if stray:
            raise CheckpointError(f"{path}: tensor {stray[0]} is not a parameter of the model's config")
    found = []
    for s in table:
        if prefix + s.name not in ck:
            continue
        info = ck.info(prefix + s.name)
        if tuple(info.shape) != tuple(s.shape):
            raise CheckpointError(
                f"{path}: tensor {info.name} has shape {tuple(info.shape)}, the config needs {s.shape}"
            )
        if info.dtype not in FLOAT_DTYPES:
            raise CheckpointError(
                f"{path}: tensor {info.name} has dtype {info.dtype}; parameters must be float "
                f"({', '.join(FLOAT_DTYPES)})"
            )
        found.append(s.name)
    return found


def read_params(
    ck: Checkpoint,
    cfg: ModelConfig,
    path,
    prefix: str = "",
    names: set[str] | None = None,
    require_all: bool = True,
) -> dict[str, np.ndarray]:
    """The parameters of `cfg` under `prefix` as float32 arrays (name without the prefix -> array), checked
    first (:func:`check_model_tensors`); `names` (a set, or a predicate on names) limits which are read. No
    other tensor of the file is read."""
    found = check_model_tensors(ck, cfg, path, prefix, require_all)
    wanted = names if callable(names) else (lambda n: names is None or n in names)
    return {n: read_f32(ck, prefix + n, path) for n in found if wanted(n)}


def read_f32(ck: Checkpoint, name: str, path) -> np.ndarray:
    """Tensor `name` of `ck` as float32, checked finite (`lazy.refuse_non_finite`: a NaN or infinite weight is one
    NonFiniteError line naming it, not a model that silently computes NaN)."""
    return refuse_non_finite(np.asarray(ck.tensor_f32(name), np.float32), "f32", name, path)


def _check_token_ids(meta: dict, cfg: ModelConfig, path) -> None:
    for key in ("hf.bos_token_id", "hf.eos_token_id"):
        v = meta.get(key)
        if v is not None and not (isinstance(v, int) and not isinstance(v, bool) and 0 <= v < cfg.vocab_size):
            raise CheckpointError(f"{path}: metadata {key} = {v!r} is not a token id of the vocabulary "
                                  f"(vocab_size {cfg.vocab_size})")  # fmt: skip


def load_model(
    path,
    names: set[str] | None = None,
    verify: bool = True,
    training: bool = False,
    extra: bool = False,
    check_memory: bool = True,
) -> Model:
    """Read a model file (any float storage, returned as float32), checked as the module docstring says.
    `names` limits which tensors are read; `verify=False` skips the hash check (trusted input);
    `training=True` sizes the memory check for training rather than inference; `extra=True` also reads the
    tensors under EXTRA_PREFIXES (as stored), which a command that writes the model again must carry;
    `check_memory=False` skips the check that the whole model fits in memory (a reader that never holds it
    whole: a streamed trunk, `stream.WeightSource`)."""
    with open_checkpoint(path, verify=verify) as ck:
        cfg = _config(ck, path, training, check_memory)
        meta = dict(ck.metadata or {})
        _check_token_ids(meta, cfg, path)
        params = read_params(ck, cfg, path, names=names)
        extras = {}
        if extra:
            extras = {n: np.asarray(ck.tensor(n)) for n in ck.names() if n.startswith(EXTRA_PREFIXES)}
        return Model(
            cfg=cfg,
            params=params,
            variant=str(meta.get("model.variant", "baseline")),
            tokenizer=ck.tokenizer,
            provenance=dict(ck.provenance or {}),
            metadata=meta,
            dtypes={n: ck.info(n).dtype for n in params},
            extra=extras,
        )


def load_config(ck: Checkpoint, path, training: bool = False, resident: bool = True) -> ModelConfig:
    """The checked config of an opened checkpoint (valid, and fits in memory; `resident=False`: only not absurd,
    for a reader that goes tensor by tensor); for readers such as resume that go on with :func:`read_params`
    per tensor group."""
    cfg = _config(ck, path, training, resident)
    _check_token_ids(dict(ck.metadata or {}), cfg, path)
    return cfg


@contextlib.contextmanager
def open_model(path, verify: bool = True) -> Iterator[LazyModel]:
    """A model file as a LazyModel, checked as `load_model` checks it (but for the memory: nothing is held
    whole), its tensors read piece by piece while the block runs; `verify=False` skips the hash check."""
    with open_checkpoint(path, verify=verify) as ck:
        cfg = load_config(ck, path, resident=False)
        meta = dict(ck.metadata or {})
        names = check_model_tensors(ck, cfg, path)
        yield LazyModel(cfg=cfg, tensors={n: finite(ck.lazy(n), n, path) for n in names}, variant=str(meta.get("model.variant", "baseline")),
                        tokenizer=ck.tokenizer, provenance=dict(ck.provenance or {}), metadata=meta,
                        extra={n: ck.lazy(n) for n in ck.names() if n.startswith(EXTRA_PREFIXES)})  # fmt: skip
