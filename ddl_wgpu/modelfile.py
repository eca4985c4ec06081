"""Model files: a `ModelConfig` plus its parameters (and optionally a tokenizer) in the `.ddlw` container.

The header's `config` is `ModelConfig.to_dict()`; `metadata["model.variant"]` names the variant;
`provenance` records which tools made or changed the file. Tensors are written in parameter-table order,
so a model file, the engine's arenas and the gradient report all list parameters the same way.

Loading checks the config and that the tensors are exactly the table's (names and shapes); an extra or
missing tensor is an error that names it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ddl_ref.config import ConfigError, ModelConfig
from ddl_ref.params import param_table
from ddl_wgpu.container import CheckpointError, open_checkpoint, save


@dataclass
class Model:
    cfg: ModelConfig
    params: dict[str, np.ndarray]  # float32, table order
    variant: str = "baseline"
    tokenizer: bytes | None = None
    provenance: dict = field(default_factory=dict)
    metadata: dict = field(default_factory=dict)


def save_model(path, model: Model, dtype: str = "f32") -> Path:
    """Write `model` atomically (`NAME.partial`, then rename). `dtype` 'f32' or 'f16' or 'bf16' storage."""
    table = param_table(model.cfg)
    missing = [s.name for s in table if s.name not in model.params]
    if missing:
        raise CheckpointError(f"{path}: model is missing parameter(s) {missing[:5]}")
    meta = dict(model.metadata)
    meta["model.variant"] = model.variant
    meta["model.num_params"] = int(sum(s.numel for s in table))

    def tensors():
        for s in table:
            a = np.asarray(model.params[s.name], np.float32)
            if dtype == "f16":
                yield s.name, a.astype(np.float16)
            elif dtype == "bf16":
                from ddl_wgpu.container import f32_to_bf16

                yield s.name, f32_to_bf16(a), "bf16"
            else:
                yield s.name, a

    save(
        path,
        tensors(),
        config=model.cfg.to_dict(),
        metadata=meta,
        provenance=model.provenance,
        tokenizer=model.tokenizer,
    )
    return Path(path)


def load_model(path, names: set[str] | None = None) -> Model:
    """Read a model file (any float storage, returned as float32). `names` limits which tensors are read
    (the rest stay on disk: the reader maps lazily)."""
    with open_checkpoint(path) as ck:
        if not ck.config:
            raise CheckpointError(f"{path}: no model config in the header (not a model file?)")
        try:
            cfg = ModelConfig.from_dict(dict(ck.config))
        except (ConfigError, TypeError, ValueError) as e:
            raise CheckpointError(f"{path}: bad model config: {e}") from e
        table = param_table(cfg)
        want = {s.name: s for s in table}
        have = set(ck.names())
        missing = [n for n in want if n not in have]
        if missing:
            raise CheckpointError(
                f"{path}: missing tensor {missing[0]}"
                + (f" (+{len(missing) - 1} more)" if len(missing) > 1 else "")
            )
        params = {}
        for name, spec in want.items():
            if names is not None and name not in names:
                continue
            info = ck.info(name)
            if tuple(info.shape) != tuple(spec.shape):
                raise CheckpointError(
                    f"{path}: tensor {name} has shape {tuple(info.shape)}, config needs {spec.shape}"
                )
            params[name] = np.asarray(ck.tensor_f32(name), np.float32)
        meta = dict(ck.metadata or {})
        return Model(
            cfg=cfg,
            params=params,
            variant=str(meta.get("model.variant", "baseline")),
            tokenizer=ck.tokenizer,
            provenance=dict(ck.provenance or {}),
            metadata=meta,
        )
