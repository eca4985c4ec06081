"""What vLLM and SGLang build of a Qwen3.5 MTP draft from an exported folder's `config.json`, and the check that
the folder's `mtp.*` tensors have exactly those shapes (docs/heal.md#which-runtime-serves-the-draft).

A serving runtime does not size the draft from its tensors: it builds the draft's modules from `config.json`
and loads the tensors into them. Where a tensor is wider than the module, the loaders of the fused projections
narrow it instead of refusing it (vLLM's `MergedColumnParallelLinear.weight_loader` for `gate_proj`/`up_proj`
and `RowParallelLinear.weight_loader` for `down_proj`, `vllm/model_executor/layers/linear.py`; SGLang's
`python/sglang/srt/layers/linear.py` likewise): a draft whose SwiGLU is wider than `intermediate_size` is then
served on its first channels, silently. So `export-hf` checks every `mtp.*` tensor it writes against the shapes
derived here and refuses a mismatch (`refuse_unservable`), and the tests run `check_folder` on every Qwen3.5
export path.

The rules (from the text config: `text_config` when the folder has one, else the top level, as vLLM's
`hf_text_config` and SGLang's `Qwen3_5ForCausalLMMTP` read it; a missing key takes `Qwen3_5TextConfig`'s
default, `TEXT_DEFAULTS`), with H `hidden_size`, I `intermediate_size`, n `num_attention_heads`, k
`num_key_value_heads`, D = `head_dim` (or H // n when null or 0: both runtimes' `config.head_dim or hidden_size //
num_heads`), g = 2 when `attn_output_gate` (default true; the query rows carry the gate) else 1:

    mtp.fc.weight                                  (H, 2H)   vLLM Qwen3_5MultiTokenPredictor.fc; SGLang .fc
    mtp.pre_fc_norm_embedding.weight, mtp.pre_fc_norm_hidden.weight, mtp.norm.weight      (H,)
    mtp.layers.{i}.input_layernorm.weight, .post_attention_layernorm.weight              (H,)
    mtp.layers.{i}.self_attn.q_proj.weight         (g·n·D, H)  the fused qkv_proj's q shard
    mtp.layers.{i}.self_attn.{k,v}_proj.weight     (k·D, H)
    mtp.layers.{i}.self_attn.o_proj.weight         (H, n·D)
    mtp.layers.{i}.self_attn.{q,k}_norm.weight     (D,)
    mtp.layers.{i}.mlp.{gate,up}_proj.weight       (I, H)    the fused gate_up_proj's shards
    mtp.layers.{i}.mlp.down_proj.weight            (H, I)

Layers: vLLM builds i = 0 .. `mtp_num_hidden_layers` − 1 (default 1; `vllm/model_executor/models/qwen3_5_mtp.py`,
its block `Qwen3_5DecoderLayer(layer_type="full_attention")` from `qwen3_5.py`, attention `Qwen3NextAttention`
and MLP `Qwen2MoeMLP(intermediate_size=config.intermediate_size)` from `qwen3_next.py`/`qwen2_moe.py`); SGLang
builds one (`python/sglang/srt/models/qwen3_5_mtp.py`: a `Qwen3_5ForCausalLM` with `num_hidden_layers = 1`, its
`Qwen3_5AttentionDecoderLayer` in `models/qwen3_5.py`). The embedding and the head are the trunk's (not `mtp.*`).

What this file deliberately does not do: check the trunk's tensors (transformers loads those and refuses a
wrong shape itself), or the draft's hidden conventions (those are not shapes; the export's summary says when
they are not the runtimes', `hf._mtp_export_summary`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ddl_wgpu.files.hf.folder import HfError, Weights, read_json

RUNTIMES = ("vLLM", "SGLang")
# Qwen3_5TextConfig's defaults (transformers' and vLLM's copies agree) for the keys the draft's shapes read
TEXT_DEFAULTS = {"hidden_size": 4096, "intermediate_size": 12288, "num_attention_heads": 16,
                 "num_key_value_heads": 4, "head_dim": 256}  # fmt: skip
FFN = ("mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight")
WAY_OUT = ("heal the draft at the model's FFN width first (`ddl-wgpu heal MODEL --data SPEC --out OUT --draft-width "
           "model`, docs/heal.md), or write our own names with `export-hf --raw`")  # fmt: skip
RAW_WAY_OUT = "or write our own names with `export-hf --raw`"


def narrow_way_out(width: int, intermediate: int) -> str:
    """What gets a draft narrower than intermediate_size served: heal cannot widen a draft (`heal --draft-width
    model` on it alone is refused), but it narrows a wider one, so a draft healed from one at least
    `intermediate` wide (--init), or our own names."""
    return (f"a draft cannot be widened ({width} to {intermediate} channels): heal one from a draft at least "
            f"{intermediate} wide (`ddl-wgpu heal MODEL --data SPEC --out OUT --draft-width model --init WIDE.ddlw`, "
            f"WIDE a model whose draft has at least {intermediate} SwiGLU channels, such as the model this file was "
            f"healed from; docs/heal.md), {RAW_WAY_OUT}")  # fmt: skip


def text_config(config: Mapping) -> tuple[dict, str]:
    """(the dict holding the text model's keys, how messages name it): `text_config` when present."""
    text = config.get("text_config")
    if isinstance(text, dict):
        return text, "config.json text_config"
    return dict(config), "config.json"


def _size(text: dict, key: str, where: str, zero_ok: bool = False) -> int:
    v = text.get(key, TEXT_DEFAULTS.get(key))
    if zero_ok and v in (None, 0):
        return 0
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise HfError(f"{where}: {key} must be a positive integer to size the MTP draft, got {v!r:.40}")
    return v


def layer_shapes(text: dict, where: str = "config.json") -> dict[str, tuple[int, ...]]:
    """One draft layer's tensors (names under `mtp.layers.{i}.`) and their shapes, as both runtimes build them."""
    H, n = _size(text, "hidden_size", where), _size(text, "num_attention_heads", where)
    k, I = _size(text, "num_key_value_heads", where), _size(text, "intermediate_size", where)
    D = (
        _size(text, "head_dim", where, zero_ok=True) or H // n
    )  # `config.head_dim or hidden_size // num_heads`
    gate = text.get("attn_output_gate", True)
    if not isinstance(gate, bool):
        raise HfError(f"{where}: attn_output_gate must be true or false, got {gate!r:.40}")
    g = 2 if gate else 1
    return {
        "input_layernorm.weight": (H,),
        "post_attention_layernorm.weight": (H,),
        "self_attn.q_proj.weight": (g * n * D, H),
        "self_attn.k_proj.weight": (k * D, H),
        "self_attn.v_proj.weight": (k * D, H),
        "self_attn.o_proj.weight": (H, n * D),
        "self_attn.q_norm.weight": (D,),
        "self_attn.k_norm.weight": (D,),
        "mlp.gate_proj.weight": (I, H),
        "mlp.up_proj.weight": (I, H),
        "mlp.down_proj.weight": (H, I),
    }


def served_shapes(config: Mapping) -> dict[str, dict[str, tuple[int, ...]]]:
    """runtime -> {`mtp.*` name: shape} that runtime builds from this config.json."""
    text, where = text_config(config)
    H = _size(text, "hidden_size", where)
    layers = text.get("mtp_num_hidden_layers", 1)
    if isinstance(layers, bool) or not isinstance(layers, int) or layers < 0:
        raise HfError(f"{where}: mtp_num_hidden_layers must be a non-negative integer, got {layers!r:.40}")
    outer = {"mtp.fc.weight": (H, 2 * H), "mtp.pre_fc_norm_embedding.weight": (H,),
             "mtp.pre_fc_norm_hidden.weight": (H,), "mtp.norm.weight": (H,)}  # fmt: skip
    one = layer_shapes(text, where)

    def with_layers(count: int) -> dict[str, tuple[int, ...]]:
        return {**outer, **{f"mtp.layers.{i}.{n}": s for i in range(count) for n, s in one.items()}}

    return {"vLLM": with_layers(layers), "SGLang": with_layers(1)}


@dataclass
class DraftCheck:
    """The written `mtp.*` tensors against what each runtime builds: `problems` (one line each, empty when both
    runtimes build every written tensor at its shape and nothing is missing), `tensors` checked."""

    draft: bool  # the folder holds mtp.* tensors
    tensors: int = 0
    problems: list[str] = field(default_factory=list)
    truncated: bool = False  # a SwiGLU tensor wider than intermediate_size: served on its first channels
    narrower: tuple[int, int] | None = (
        None  # (the draft's SwiGLU width, intermediate_size) when it is narrower
    )

    @property
    def ok(self) -> bool:
        return not self.problems

    def summary(self) -> str:
        if not self.draft:
            return "no mtp.* tensors: nothing for vLLM or SGLang to draft with"
        if self.ok:
            return f"vLLM and SGLang build all {self.tensors} mtp.* tensors at the written shapes"
        more = f" (+{len(self.problems) - 3} more)" if len(self.problems) > 3 else ""
        return "; ".join(self.problems[:3]) + more

    def to_dict(self) -> dict[str, Any]:
        return {"draft": self.draft, "tensors": self.tensors, "ok": self.ok, "problems": list(self.problems),
                "summary": self.summary()}  # fmt: skip


def _runtimes(names: list[str]) -> str:
    return " and ".join(names)


def check_shapes(config: Mapping, written: Mapping[str, tuple[int, ...]]) -> DraftCheck:
    """`written` (every tensor name of the folder -> shape; only `mtp.*` ones are read) against `served_shapes`."""
    mine = {n: tuple(s) for n, s in written.items() if n.startswith("mtp.")}
    if not mine:
        return DraftCheck(False)
    want = served_shapes(config)
    out = DraftCheck(True, len(mine))
    text, _ = text_config(config)
    for name in sorted(set(mine) | {n for w in want.values() for n in w}):
        built = {rt: want[rt].get(name) for rt in RUNTIMES}
        have = mine.get(name)
        differ = [rt for rt in RUNTIMES if built[rt] != have]
        if not differ:
            continue
        if have is None:
            out.problems.append(f"{name} is missing ({_runtimes(differ)} build {built[differ[0]]})")
            continue
        if all(built[rt] is None for rt in differ):
            out.problems.append(f"{name} {have} is not a tensor {_runtimes(differ)} build")
            continue
        shapes = sorted({built[rt] for rt in differ if built[rt] is not None})
        line = f"{name} is {have}, {_runtimes(differ)} build {' / '.join(map(str, shapes))}"
        if name.endswith(FFN) and len(have) == 2:
            I = text.get("intermediate_size", TEXT_DEFAULTS["intermediate_size"])
            width = have[1] if name.endswith(FFN[2]) else have[0]
            if width > I:
                out.truncated = True
                line += f" (intermediate_size {I}: their loaders keep the first {I} of its {width} channels)"
            elif width < I:
                out.narrower = (width, I)
        out.problems.append(line)
    return out


def check_folder(folder) -> DraftCheck:
    """`check_shapes` on an exported folder: its config.json and the shapes in its safetensors headers."""
    folder = Path(folder)
    config = read_json(folder / "config.json")
    if not isinstance(config, dict):
        raise HfError(f"{folder / 'config.json'}: not a JSON object")
    w = Weights(folder)
    return check_shapes(config, {n: w.shape(n) for n in w.names()})


def refuse_unservable(config: Mapping, written: Mapping[str, tuple[int, ...]]) -> DraftCheck:
    """`check_shapes`, raising one HfError that names the first mismatches and the way out unless it passes."""
    check = check_shapes(config, written)
    if not check.ok:
        why = "they would serve a truncated draft" if check.truncated else "they would not load it as written"
        # a narrower draft: `heal --draft-width model` alone would refuse it (it cannot widen), so name what works
        way = narrow_way_out(*check.narrower) if check.narrower and not check.truncated else WAY_OUT
        raise HfError(f"export-hf: the draft's mtp.* tensors are not what config.json makes vLLM and SGLang build "
                      f"({check.summary()}): {why}; {way}")  # fmt: skip
    return check
