"""Which layers of a model an EAGLE-3 draft reads (docs/eagle3.md#a-draft-on-a-compressed-target).

A draft taps its target's residual stream at the inputs of three layers (`Eagle3Config.aux_layers`), numbered
as its target numbers them. `compress --drop-layers` renumbers the kept blocks 0..L'−1, so the same ids name
other rows of a compressed target. `plan_aux` says which ids the draft reads on a given model:

- its own target (the recorded identity matches): the ids as they are;
- `--aux-layers` given: those ids, checked against the model's layers (the user says what the rows are);
- a model that `compress` made from the draft's target: each id mapped through `provenance.compress` (newest
  record first, `previous` the older ones). The chain is followed back until a record's `source` identity (what
  `compress` records of its input) is the draft's target, or, for a record that predates `source`, until the
  layer count before it is the draft's target's. A `drop_layers` record maps new layer i to its input's
  `kept_layers[i]`; `ffn_keep` keeps the numbering. The input of old layer j is then the input of the first
  kept layer at or after j: new id = the number of kept layers below j. A dropped j thus reads the input of
  the next kept layer (the same point of the stream, now that j is gone), which the plan's notes say; an id
  that would land on the embedding (0) or past the last layer has no tap, and is refused naming --aux-layers;
- a draft imported without a target identity (a published folder): checked by its shapes, unless the model
  is a `drop_layers` product, whose numbering the draft cannot know: refused naming --aux-layers;
- anything else (another model): refused in one line naming `ddl-wgpu draft` and --aux-layers.

Every refusal is a `CheckpointError` line naming the draft file and the model.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field

from ddl_wgpu.files.container import CheckpointError, open_checkpoint
from ddl_wgpu.files.eagle3file import Eagle3Draft, identity_of

AS_IS, GIVEN, MAPPED, SHAPES = "its own target", "as given (--aux-layers)", "mapped", "checked by its shapes"
MAX_CHAIN = 64  # compress records followed back at most (a hostile provenance could nest without end)


@dataclass(frozen=True)
class AuxPlan:
    """The aux layer ids a draft reads on one model, and why: `how` one of AS_IS, GIVEN, MAPPED, SHAPES;
    `notes` one line per tapped layer that was dropped; `original` the draft's own ids."""

    aux_layers: tuple[int, int, int]
    how: str
    original: tuple[int, int, int]
    notes: list[str] = field(default_factory=list)

    def line(self) -> str:
        """What the commands print: the ids and how they were found."""
        if self.how == MAPPED:
            return (f"aux layers {list(self.aux_layers)} (the draft's {list(self.original)} mapped through the "
                    f"model's compress provenance)")  # fmt: skip
        return f"aux layers {list(self.aux_layers)} ({self.how})"

    def to_dict(self) -> dict:
        return {"aux_layers": list(self.aux_layers), "how": self.how, "original": list(self.original),
                "notes": list(self.notes)}  # fmt: skip


def compress_records(provenance) -> list[dict]:
    """provenance.compress and its `previous` records, newest first (only the maps; at most MAX_CHAIN)."""
    out, rec = [], (provenance or {}).get("compress") if isinstance(provenance, dict) else None
    while isinstance(rec, dict) and len(out) < MAX_CHAIN:
        out.append(rec)
        rec = rec.get("previous")
    return out


def _same(identity: dict, want: dict) -> bool:
    return bool(want.get("config_hash")) and all(identity.get(k) == want.get(k)
                                                 for k in ("config_hash", "tensors_hash"))  # fmt: skip


def layer_origin(records: list[dict], n_layers: int, target: dict) -> list[int] | None:
    """For each layer of the model (its `n_layers`), its index in the draft's target (`target`: the identity
    the draft records), followed back through the compress records (newest first), or None when they do not
    lead to that target."""
    origin, L = list(range(n_layers)), n_layers
    want_L = target.get("n_layers")
    for rec in records:
        src = rec.get("source")
        by_identity = isinstance(src, dict) and bool(target.get("config_hash"))
        if by_identity and _same(src, target):
            return _through(rec, origin)
        origin = _through(rec, origin)
        if origin is None:
            return None
        if rec.get("method") == "drop_layers":
            L = rec.get("n_layers_before")
        if not by_identity and isinstance(want_L, int) and want_L == L:
            return origin  # no identity to compare (an older record, an unbound draft): the layer count
    return None


def _through(rec: dict, origin: list[int] | None) -> list[int] | None:
    """`origin` (new layer -> index in this record's output) taken back through the record to its input."""
    if origin is None or rec.get("method") != "drop_layers":
        return origin  # ffn_keep (and any method that keeps the blocks) keeps the numbering
    kept = rec.get("kept_layers")
    if not (isinstance(kept, list) and all(isinstance(k, int) and not isinstance(k, bool) for k in kept)):
        return None
    if any(i >= len(kept) for i in origin):
        return None
    return [kept[i] for i in origin]


def map_ids(aux, origin: list[int]) -> tuple[tuple[int, int, int] | None, list[str]]:
    """The draft's ids (inputs of its target's layers) on a model whose layer i is the target's `origin[i]`
    -> (the model's ids, or None when one has no tap there; a note per id that moved to another layer)."""
    out, notes = [], []
    for j in aux:
        new = sum(1 for k in origin if k < j)
        if new < 1 or new >= len(origin):
            return None, [f"the input of layer {j} has no layer input of the model to read (it would be "
                          f"{'the embedding' if new < 1 else 'the final stream'})"]  # fmt: skip
        if j not in origin:
            notes.append(f"aux layer {j} was dropped: reading the input of the next kept layer "
                         f"{origin[new]} (now layer {new}), the same point of the stream")  # fmt: skip
        out.append(new)
    return (out[0], out[1], out[2]), notes


def plan_aux(draft: Eagle3Draft, draft_path, model_path, given=None) -> AuxPlan:
    """The aux ids `draft` reads on the model file at `model_path` (module docstring); `given`: --aux-layers.
    Also checks the shapes that must agree whatever the ids (width, vocabulary)."""
    with open_checkpoint(model_path, verify=False) as ck:
        ident, mcfg, prov = identity_of(ck), dict(ck.config or {}), dict(ck.provenance or {})
    where, cfg, orig = os.fspath(draft_path), draft.cfg, tuple(draft.cfg.aux_layers)
    for key, mine, what in (("d_model", cfg.hidden, "hidden size"), ("vocab_size", cfg.vocab, "vocabulary")):
        if mcfg.get(key) != mine:
            raise CheckpointError(f"{where}: the draft's {what} is {mine}, the model {model_path}'s "
                                  f"{mcfg.get(key)}: it cannot read this model")  # fmt: skip
    L = mcfg.get("n_layers")
    if not isinstance(L, int) or L < 2:
        raise CheckpointError(f"{model_path}: a model of {L} layers has no layer input for an EAGLE-3 draft")
    if given is not None:
        ids = tuple(int(j) for j in given)
        if len(ids) != 3 or not all(1 <= j < L for j in ids):
            raise CheckpointError(f"--aux-layers {list(ids)} must be three layer inputs 1..{L - 1} of "
                                  f"{model_path} ({L} layers)")  # fmt: skip
        return AuxPlan(ids, GIVEN, orig)  # type: ignore[arg-type]
    target = draft.target
    records = compress_records(prov)
    if _same(ident, target):
        return AuxPlan(orig, AS_IS, orig)
    origin = (
        layer_origin(records, L, target) if (target.get("config_hash") or target.get("n_layers")) else None
    )
    if origin is not None:
        ids, notes = map_ids(orig, origin)
        if ids is None:
            raise CheckpointError(f"{where}: on {model_path}, {notes[0]}: give the layers to read with "
                                  f"--aux-layers a,b,c (inputs 1..{L - 1})")  # fmt: skip
        return AuxPlan(ids, MAPPED, orig, notes)
    trained = target.get("path") or "another model"
    if target.get("config_hash"):
        raise CheckpointError(
            f"{where}: this EAGLE-3 draft was trained for {trained} (config {target.get('config_hash')}, "
            f"tensors {target.get('tensors_hash')}), not for {model_path} (config {ident['config_hash']}, "
            f"tensors {ident['tensors_hash']}), and no compress record links the two: train one for it with "
            f"`ddl-wgpu draft`, or give the layers it reads with --aux-layers a,b,c"
        )
    if any(r.get("method") == "drop_layers" for r in records):
        raise CheckpointError(f"{where}: a draft that records no target, and {model_path} had blocks dropped "
                              f"(compress --drop-layers): which of its layers the draft's {list(orig)} are cannot "
                              f"be known; give them with --aux-layers a,b,c (inputs 1..{L - 1})")  # fmt: skip
    if max(orig) >= L:
        raise CheckpointError(f"{where}: the draft reads the inputs of target layers {list(orig)}, and "
                              f"{model_path} has {L} layers: give the layers with --aux-layers a,b,c")  # fmt: skip
    return AuxPlan(orig, SHAPES, orig)


def on_model(draft: Eagle3Draft, plan: AuxPlan) -> Eagle3Draft:
    """The draft as it runs on the planned model: its config's aux ids the plan's."""
    cfg = dataclasses.replace(draft.cfg, aux_layers=tuple(plan.aux_layers))
    return dataclasses.replace(draft, cfg=cfg)
