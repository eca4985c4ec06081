"""Issue 41 ("Nothing lost, round 5"), items 5, 10-14 and 17, as a hostile user meets them:

- 5: a NaN or infinite weight is refused in one line naming the tensor wherever a model is read for a job
  (import-hf as it converts; generate, accept, compress, eval, heal as they load; the GPU trunk as it uploads),
  while a tensor a command does not read (a block `compress --drop-layers` drops) is no obstacle;
- 10: every --gpu-memory refusal (the trunk plan, heal's draft after it, generate) names a size that the same
  plan then takes, and (nearly) the least one;
- 11: where the adapter's limits cannot hold one window, the refusal blames the limits, not the budget;
- 12: every size option and size variable is read one way by every command (generate --backend ref included);
- 13: export-hf's way out for a Qwen3.5 draft narrower than the trunk is a command that works (run here);
- 14: chain_attention_why and draft_width.why say "default: ..." when the value was defaulted, "as given" only
  when the user gave it (accept --json, heal's report, the healed file's record);
- 17: every command's options against docs/commands.md (both ways), the defaults docs/commands.md and --help
  show against the library's, and the help texts that were wrong.

Tiny models on the numpy backend, a few GPU plans counted on a `DryGpu` (nothing allocated), and two short GPU
commands on lavapipe."""

from __future__ import annotations

import dataclasses
import inspect
import json
import os
import re
import shlex
import signal
import subprocess
import sys

import numpy as np
import pytest
from conftest import REPO
from helpers import make_model, make_text, tiny_cfg

from ddl_ref.config import ARCH_MTP, MtpConfig, apply_arch
from ddl_wgpu.engine import gpumem
from ddl_wgpu.files import lazy
from ddl_wgpu.files.container import f32_to_bf16, open_checkpoint
from ddl_wgpu.files.hf import served_draft
from ddl_wgpu.files.modelfile import load_model, save_model
from ddl_wgpu.jobs import accept as accept_lib
from ddl_wgpu.jobs import generate as generate_lib
from ddl_wgpu.jobs import heal as heal_lib
from ddl_wgpu.jobs import train as train_lib
from ddl_wgpu.runtime import sizes

HEAL_ARGS = ["--window", "24", "--tokens", "600", "--batch", "2", "--chain", "2", "--epochs", "0.2",
             "--eval-every", "2", "--patience", "0"]  # fmt: skip


@pytest.fixture(scope="module")
def kit(tmp_path_factory):
    """A tiny three-block model with a draft (pre-RoPE q/k norms, as heal's tests), a text, and the same model
    with a NaN in block 1's up projection."""
    d = tmp_path_factory.mktemp("nl5b")
    model = make_model(d / "m.ddlw", tiny_cfg(n_layers=3, qk_norm="pre_rope", mtp=MtpConfig()))
    m = load_model(model)
    m.params["model.layers.1.mlp.up_proj.weight"][3, 4] = np.nan
    save_model(d / "nan.ddlw", m)
    return {"model": model, "nan": d / "nan.ddlw", "text": make_text(d / "t.txt", 400), "dir": d}


def run_in_process(monkeypatch, capsys, *args, env=None):
    """`ddl-wgpu ARGS` through the entry point's own loop (`app._main`), in this process (a refusal before any
    work costs milliseconds, not an interpreter start) -> (exit status, stdout, stderr)."""
    from ddl_wgpu.cli import app

    for k, v in (env or {}).items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(sys, "argv", ["ddl-wgpu", *map(str, args)])
    before = signal.getsignal(signal.SIGINT)
    capsys.readouterr()
    try:
        code = app._main()
    finally:
        signal.signal(signal.SIGINT, before)  # _main ignores Ctrl-C once a command is done
        for k in env or {}:
            monkeypatch.delenv(k)
    out, err = capsys.readouterr()
    return code, out, err


def one_line(code, err, *fragments) -> str:
    lines = err.strip().splitlines()
    assert code == 2 and lines and lines[-1].startswith("error: "), (code, err)
    assert "Traceback" not in err
    for f in fragments:
        assert f in lines[-1], (f, lines[-1])
    return lines[-1]


# ---------------------------------------------------------------------------------------------------------
# 12: one parser for every size


def size_options() -> list[tuple[str, str]]:
    """(command, option) of every option of every command that takes a size (its name ends in -memory)."""
    import typer

    from ddl_wgpu.cli.app import app

    cmd = typer.main.get_command(app)
    return [(name, o) for name, c in cmd.commands.items() for p in c.params for o in getattr(p, "opts", ())
            if o.endswith("-memory")]  # fmt: skip


def test_every_size_option_and_variable_reads_one_way(kit, monkeypatch, capsys):
    """Every size option of every command (found from the commands themselves), and DDL_WGPU_GPU_MEMORY for each
    command that takes --gpu-memory, refuses 'banana' in the same one line, on the numpy backend too (generate
    used to exit 0); what one takes ('2.5MiB') every other takes."""
    found = size_options()
    assert {c for c, o in found if o == "--gpu-memory"} == {"eval", "accept", "heal", "generate", "draft"}
    assert ("heal", "--host-memory") in found
    m, t, out = kit["model"], kit["text"], kit["dir"] / "never.ddlw"
    base = {"eval": ["eval", m, "--data", t], "accept": ["accept", m, "--data", t],
            "heal": ["heal", m, "--data", t, "--out", out], "generate": ["generate", m, "--prompt", "hi"],
            "draft": ["draft", m, "--data", t, "--out", out]}  # fmt: skip
    for command, option in found:
        code, _, err = run_in_process(
            monkeypatch, capsys, *base[command], "--backend", "ref", option, "banana"
        )
        one_line(code, err, f"error: {option} 'banana': not a size (e.g. 16GB, 512MiB, 24G)")
        if option == "--gpu-memory":
            code, _, err = run_in_process(monkeypatch, capsys, *base[command], "--backend", "ref",
                                          env={gpumem.ENV_GPU_MEMORY: "banana"})  # fmt: skip
            one_line(code, err, "error: DDL_WGPU_GPU_MEMORY 'banana': not a size")
    assert not out.exists()
    assert sizes.parse_size("2.5MiB", "--host-memory") == sizes.parse_size("2.5MiB") == int(2.5 * 2**20)
    code, _, err = run_in_process(monkeypatch, capsys, "generate", m, "--prompt", "hi", "--backend", "ref",
                                  "--max-new-tokens", "1", "--gpu-memory", "2.5MiB")  # fmt: skip
    assert code == 0, err
    # the device layer's own size variables: the same reader, one line
    r = subprocess.run([sys.executable, "-m", "ddl_wgpu.cli", "check"], capture_output=True, text=True, cwd=REPO,
                       env={**os.environ, "PYTHONPATH": str(REPO), "DDL_WGPU_MAX_BUFFER": "banana"})  # fmt: skip
    assert (
        r.returncode == 2
        and r.stderr.strip() == "error: DDL_WGPU_MAX_BUFFER 'banana': not a size (e.g. 16GB, 512MiB, 24G)"
    )


def test_size_text_reads_back_as_at_least_the_size():
    for n in (1, 1023, 1024, 1025, 7213302, 7213303, (6 << 20) + 1, 3 << 30, (5 << 30) - 1, 123456789):
        text = sizes.size_text(n)
        got = sizes.parse_size(text, least=1)
        assert n <= got <= n + n // 100 + 1, text  # two decimals of its unit, rounded up: within 1 %
    assert sizes.size_text(7213302) == "6.88MiB"


# ---------------------------------------------------------------------------------------------------------
# 10 and 11: a refusal names a size the plan then takes, or blames the limits


def as_named(line: str) -> str:
    """The size a refusal names, as it spells it (what a user copies into --gpu-memory)."""
    m = re.search(r"--gpu-memory (\d[\d.]*[KMG]iB)\b", line)
    assert m, line
    return m.group(1)


def named(line: str) -> int:
    return sizes.parse_size(as_named(line))


def test_plan_refusals_name_the_least_accepted_budget():
    """For every refused budget of a synthetic plan (the trunk phase grows with the block, a draft phase after
    it), the named size is taken by the same plan and a byte less than the least is not; the old message named
    a margin on the refused budget ("6.88 MiB is below ... about 6.88 MiB")."""

    def trunk(streamed, block):
        return (400_000 if streamed else 1_000_000) + 10_000 * block

    def weights(streamed):
        return 400_000 if streamed else 1_000_000

    for draft in (0, 300_000, 900_000):

        def plan(budget, draft=draft):
            return gpumem.plan_trunk("heal", 500, 20, budget, trunk, weights, draft_bytes=draft)

        least = gpumem.least_budget(lambda b: _accepts(plan, b), 1024)
        for budget in (1024, 300_000, least - 1, 430_000, 440_000, 600_000):
            if _accepts(plan, budget):
                continue
            with pytest.raises(gpumem.GpuBudgetError) as e:
                plan(budget)
            size = named(str(e.value))
            assert plan(size).budget_bytes == size and least <= size <= least + least // 100
        assert not _accepts(plan, least - 1) and _accepts(plan, least)


def _accepts(plan, budget) -> bool:
    try:
        plan(budget)
    except gpumem.GpuBudgetError:
        return False
    return True


def test_when_no_budget_can_hold_one_window_the_limits_are_named():
    from ddl_wgpu.runtime.gpu import GpuError

    def trunk(streamed, block):
        raise GpuError("buffer 'x' of 9999 bytes exceeds this adapter's max-buffer-size 2048")

    for budget in (None, 1 << 30):
        with pytest.raises(gpumem.GpuBudgetError, match=r"limits cannot hold the trunk.*max-buffer-size 2048.*the "
                                                        r"limits are the cause") as e:  # fmt: skip
            gpumem.plan_trunk("eval", 10, 16, budget, trunk, lambda s: 0)
        assert "needs at least" not in str(e.value)


def test_gpu_refusals_name_a_size_the_command_then_takes(kit, gpu, tmp_path, cli, ok, user_error):
    """On lavapipe: heal's refusal (the trunk and the draft planned on the real engine's dry counts), eval's and
    generate's each name a size; the plan (heal), the command (eval, generate) then take it. The adapter's
    limits lowered below one window: the limits are named whatever the budget."""
    from ddl_wgpu.engine.heal_gpu import plan_trunk_job

    model, text = kit["model"], kit["text"]
    cfg = load_model(model).cfg
    draft = {"k": 32, "chain": 2, "stacked": False, "kl_form": "full"}

    def heal_plan(budget):
        return plan_trunk_job(gpu, "heal", cfg, "f32", 20, 24, 2, budget, 32, True, draft)

    line = user_error(cli("heal", model, "--data", text, "--out", tmp_path / "h.ddlw", *HEAL_ARGS, "--backend",
                          "wgpu", "--gpu-memory", "20KB"), "--gpu-memory 20.0 KiB is below")  # fmt: skip
    assert heal_plan(named(line)).budget_bytes == named(line)  # the plan the command would run by
    drafts = []  # below the least, but above what the streamed trunk needs: the draft's refusal
    for budget in (named(line) * k // 100 for k in range(98, 50, -4)):
        with pytest.raises(gpumem.GpuBudgetError) as e:
            heal_plan(budget)
        if "draft after the trunk" in str(e.value):
            drafts.append(named(str(e.value)))
    assert drafts and all(heal_plan(n).draft_bytes > 0 for n in drafts), drafts
    ev = [
        "eval",
        model,
        "--data",
        text,
        "--seq-len",
        "16",
        "--batch",
        "3",
        "--max-tokens",
        "300",
        "--backend",
        "wgpu",
    ]
    line = user_error(cli(*ev, "--gpu-memory", "8KB"), "needs at least --gpu-memory")
    r = ok(cli(*ev, "--gpu-memory", as_named(line), "--json"))
    assert json.loads(r.stdout)["plan"]["budget_bytes"] == named(line)
    gen = ["generate", model, "--prompt", "the", "--max-new-tokens", "2", "--backend", "wgpu"]
    line = user_error(cli(*gen, "--gpu-memory", "16KB"), "generate: the model needs at least --gpu-memory")
    ok(cli(*gen, "--gpu-memory", as_named(line)))
    with pytest.raises(gpumem.GpuBudgetError):
        gpumem.check_decode(cfg, "f32", named(line) - 1024)
    r = subprocess.run([sys.executable, "-m", "ddl_wgpu.cli", *map(str, ev), "--gpu-memory", "1GB"],
                       capture_output=True, text=True, cwd=REPO,
                       env={**os.environ, "PYTHONPATH": str(REPO), "DDL_WGPU_MAX_BUFFER": "2048"})  # fmt: skip
    user_error(r, "limits cannot hold the trunk", "the limits are the cause, not --gpu-memory 1.00 GiB")


# ---------------------------------------------------------------------------------------------------------
# 5: non-finite weights


@pytest.mark.parametrize("dtype", ["f16", "bf16", "f32", "f64"])
def test_a_non_finite_value_is_found_in_every_float_dtype(dtype):
    for bad in (np.nan, np.inf, -np.inf):
        a = np.linspace(-3, 3, 600, dtype=np.float32).reshape(20, 30)
        a[17, 29] = bad
        stored = f32_to_bf16(a) if dtype == "bf16" else a.astype({"f16": np.float16, "f32": np.float32,
                                                                     "f64": np.float64}[dtype])  # fmt: skip
        with pytest.raises(lazy.NonFiniteError, match=r"^here: tensor w holds (nan|inf|-inf) "):
            lazy.finite(lazy.from_array(stored, dtype), "w", "here").array()
        big = np.full(5, 1e30, np.float64)  # finite: passes, in pieces too
        assert lazy.refuse_non_finite(big, "f64", "w", "here") is big


def test_non_finite_weights_are_refused_by_every_job_naming_the_tensor(kit, tmp_path, monkeypatch, capsys):
    """generate, accept, eval, heal (their loads) and compress (its pieces), on the numpy backend: one line naming
    the file and the tensor, exit 2, nothing written; before, generate emitted token 0 forever, accept reported
    tau 1.0 and compress wrote the model. compress --drop-layers of the bad block never reads it: it works."""
    bad, text = kit["nan"], kit["text"]
    want = f"error: {bad}: tensor model.layers.1.mlp.up_proj.weight holds nan"
    out = tmp_path / "o.ddlw"
    for args in (["generate", bad, "--prompt", "the", "--backend", "ref"],
                 ["accept", bad, "--data", text, "--window", "16", "--backend", "ref"],
                 ["eval", bad, "--data", text, "--backend", "ref"],
                 ["heal", bad, "--data", text, "--out", out, *HEAL_ARGS, "--backend", "ref"],
                 ["compress", bad, "--out", out, "--ffn-keep", "0.5"]):  # fmt: skip
        code, _, err = run_in_process(monkeypatch, capsys, *args)
        one_line(code, err, want)
        assert not out.exists() and not list(tmp_path.iterdir()), args
    code, _, err = run_in_process(monkeypatch, capsys, "compress", bad, "--out", out, "--drop-layers", "1")
    assert code == 0, err
    assert load_model(out).cfg.n_layers == 2  # and every tensor it holds is finite (read and checked here)


def test_non_finite_weights_on_the_gpu_trunk_and_in_import_hf(kit, tmp_path, cli, user_error):
    """The GPU trunk reads its tensors itself (the whole model is never loaded): its upload refuses the NaN; and
    import-hf refuses a folder whose tensor is NaN as it converts it, naming the folder's tensor, writing nothing."""
    from safetensors.numpy import load_file, save_file

    from ddl_wgpu.files.hf.convert import export_hf_from_file

    bad, text = kit["nan"], kit["text"]
    user_error(cli("eval", bad, "--data", text, "--seq-len", "16", "--max-tokens", "300", "--backend", "wgpu"),
               f"{bad}: tensor model.layers.1.mlp.up_proj.weight holds nan")  # fmt: skip
    folder = tmp_path / "hf"
    export_hf_from_file(kit["model"], folder)
    st = folder / "model.safetensors"
    tensors = load_file(st)
    name = "model.layers.2.self_attn.o_proj.weight"
    tensors[name] = tensors[name].copy()
    tensors[name][0, 1] = -np.inf
    save_file(tensors, st, metadata={"format": "pt"})
    out = tmp_path / "i.ddlw"
    user_error(cli("import-hf", folder, out), f"{folder}: tensor {name} holds -inf")
    assert not out.exists()


# ---------------------------------------------------------------------------------------------------------
# 13: the way out of a draft narrower than the trunk


def test_export_hf_names_a_command_that_serves_a_narrow_draft(tmp_path, heal_kit, cli, ok, user_error):
    """A Qwen3.5 model whose trunk is 48 wide and whose draft was healed at 24 (`--draft-width init` from a
    narrower draft): export-hf refuses it; the command its refusal names is run as written (WIDE: a model with a
    48-wide draft) and the export then passes vLLM's and SGLang's shapes; `--raw` works too. Before, the refusal
    named `heal --draft-width model` alone, which refuses a draft it would have to widen."""
    text = heal_kit.make_text(tmp_path / "t.txt", 300)
    narrow_src = heal_kit.make_model(tmp_path / "n24.ddlw", apply_arch(heal_kit.tiny_cfg(mtp=ARCH_MTP["qwen3_5"]),
                                                                       "qwen3_5"))  # fmt: skip
    wide_cfg = dataclasses.replace(
        apply_arch(heal_kit.tiny_cfg(mtp=ARCH_MTP["qwen3_5"]), "qwen3_5"), ffn_hidden=48
    )
    wide = heal_kit.make_model(tmp_path / "w48.ddlw", wide_cfg)
    run = ["--data", text, "--window", "24", "--tokens", "600", "--chain", "2", "--batch", "2", "--epochs", "0.2",
           "--backend", "ref"]  # fmt: skip
    ok(cli("heal", wide, "--out", tmp_path / "h.ddlw", "--draft-width", "init", "--init", narrow_src, *run))
    assert load_model(tmp_path / "h.ddlw").cfg.mtp.ffn_hidden == 24
    line = user_error(cli("export-hf", tmp_path / "h.ddlw", tmp_path / "out"), "a draft cannot be widened")
    assert not (tmp_path / "out").exists()
    named_cmd = re.search(r"`ddl-wgpu (heal [^`]*)`", line).group(1)
    assert "--init WIDE.ddlw" in named_cmd and "--draft-width model" in named_cmd
    args = shlex.split(named_cmd.replace("MODEL", str(tmp_path / "h.ddlw")).replace("SPEC", str(text))
                       .replace("OUT", str(tmp_path / "fixed.ddlw")).replace("WIDE.ddlw", str(wide)))  # fmt: skip
    ok(cli(*args, *run[2:]))
    ok(cli("export-hf", tmp_path / "fixed.ddlw", tmp_path / "out"))
    assert served_draft.check_folder(tmp_path / "out").ok
    assert "`export-hf --raw`" in line
    ok(cli("export-hf", tmp_path / "h.ddlw", tmp_path / "raw", "--raw"))


# ---------------------------------------------------------------------------------------------------------
# 14: defaulted or given


def report(stdout: str) -> dict:
    """heal --json's report: the object that starts a line of its own (progress lines come before it)."""
    return json.loads(stdout[re.search(r"(?m)^\{$", stdout).start() :])


def test_why_says_defaulted_when_it_was(kit, tmp_path, cli, ok):
    model, text = kit["model"], kit["text"]
    acc = ["accept", model, "--data", text, "--depth", "2", "--window", "16", "--tokens", "300", "--backend", "ref",
           "--json"]  # fmt: skip
    a = json.loads(ok(cli(*acc)).stdout)
    assert a["chain_attention_why"].startswith("default: the draft is in the reference heal tool's layout")
    assert (
        json.loads(ok(cli(*acc, "--chain-attention", "per-step")).stdout)["chain_attention_why"] == "as given"
    )
    out = tmp_path / "h.ddlw"
    r = ok(cli("heal", model, "--data", text, "--out", out, *HEAL_ARGS, "--backend", "ref", "--json"))
    rep = report(r.stdout)
    with open_checkpoint(out) as ck:
        record = ck.provenance["mtp_heal"]
    for got in (rep, record):
        assert got["chain_attention_why"].startswith("default: ") and got["draft_width"]["why"].startswith(
            "default: not a Qwen3.5-layout model"
        ), got
    r = ok(cli("heal", model, "--data", text, "--out", tmp_path / "g.ddlw", *HEAL_ARGS, "--backend", "ref",
               "--json", "--chain-attention", "per-step"))  # fmt: skip
    rep = report(r.stdout)
    assert rep["chain_attention_why"] == "as given" and rep["draft_width"]["why"].startswith("default: ")


# ---------------------------------------------------------------------------------------------------------
# 17: the help texts and docs/commands.md say what the code does


def commands():
    import typer

    from ddl_wgpu.cli.app import app

    return typer.main.get_command(app).commands


def options_of(c) -> dict[str, object]:
    """Every option of a command (both spellings of a --x/--no-x flag) -> its parameter."""
    return {o: p for p in c.params if p.param_type_name == "option" for o in (*p.opts, *p.secondary_opts)}


def synopsis() -> dict[str, str]:
    """docs/commands.md's synopsis: command -> its entries' text (continuation lines included), with the named
    groups of options (a line `[model options]: ...`) expanded where an entry names them."""
    block = (REPO / "docs" / "commands.md").read_text().split("## Synopsis", 1)[1].split("```", 2)[1]
    texts: dict[str, str] = {}
    key = None
    for line in block.splitlines():
        head = re.match(r"ddl-wgpu ([a-z-]+)\b(.*)|(\[[a-z ]+\]):(.*)", line)
        if head:
            key = head.group(1) or head.group(3)
            texts[key] = texts.get(key, "") + " " + (head.group(2) or head.group(4) or "")
        elif line.startswith(" ") and key is not None:
            texts[key] += " " + line
    groups = {k: v for k, v in texts.items() if k.startswith("[")}
    out = {}
    for cmd, text in texts.items():
        text = re.sub(r"`[^`]*`", "", text)  # a description's quoted command is not this command's option
        if not cmd.startswith("["):
            for g, opts in groups.items():
                text = text.replace(g, opts)
            out[cmd] = text
    return out


# defaults that are the library's: the CLI option (by parameter name) -> where the library keeps its default
LIBRARY = {
    "train": train_lib.TrainingConfig(),
    "heal": heal_lib.HealConfig(),
    "generate": (generate_lib.Sampling(), generate_lib.generate),
    "accept": accept_lib.accept_file,
}


def library_default(command: str, name: str):
    """The default the library uses for option `name` of `command` when the option is absent, or
    inspect.Parameter.empty where the CLI alone holds it (the backend: the CLI's is `auto`, chosen once per
    command and passed down; a library call's is the numpy reference; likewise `--precision auto`, resolved to
    f32 or mixed once the backend is known, `backend.apply_precision`)."""
    if name in ("backend", "device", "precision"):
        return inspect.Parameter.empty
    for src in (
        LIBRARY.get(command, ()) if isinstance(LIBRARY.get(command), tuple) else [LIBRARY.get(command)]
    ):
        if src is None:
            continue
        if dataclasses.is_dataclass(src) and name in {f.name for f in dataclasses.fields(src)}:
            return getattr(src, name)
        if callable(src):
            p = inspect.signature(src).parameters.get(name)
            if p is not None and p.default is not inspect.Parameter.empty:
                return p.default
    if command == "train" and name in ("val_fraction", "max_tokens"):
        from ddl_wgpu import data

        return {"val_fraction": data.DEFAULT_VAL_FRACTION, "max_tokens": data.DEFAULT_MAX_TOKENS}[name]
    return inspect.Parameter.empty


def test_every_option_is_in_the_synopsis_and_every_synopsis_option_exists():
    doc = synopsis()
    cmds = commands()
    assert set(doc) == set(cmds), set(doc) ^ set(cmds)
    for name, c in cmds.items():
        have = set(options_of(c)) - {"--help"}
        listed = set(re.findall(r"(?<![\w-])--[a-z0-9][a-z0-9-]*", doc[name]))
        assert listed - have == set(), (name, "in docs/commands.md, not an option", listed - have)
        assert have - listed == set(), (name, "an option docs/commands.md leaves out", have - listed)


def test_defaults_in_the_synopsis_help_and_library_agree(monkeypatch, capsys):
    """A number after an option in the synopsis is its default; each option's default is the library's where the
    library has one; and --help shows every option's default as the code has it."""
    doc = synopsis()
    checked = 0
    for name, c in commands().items():
        opts = options_of(c)
        for opt, value in re.findall(r"(--[a-z0-9-]+) (-?\d[\d.]*(?:e-?\d+)?)(?![\w,-])", doc[name]):
            assert float(opts[opt].default) == float(value), (name, opt, value, opts[opt].default)
            checked += 1
        for p in c.params:
            want = library_default(name, p.name)
            if want is not inspect.Parameter.empty:
                assert p.default == want, (name, p.name, p.default, want)
                checked += 1
        help_ = run_in_process(monkeypatch, capsys, name, "--help", env={"COLUMNS": "400"})[1]
        flat = re.sub(r"\s*[│╭╰─╮╯]+\s*", " ", help_)
        marks = list(
            re.finditer(r"(--[a-z0-9-]+)(?:\s*/?\s*--[a-z0-9-]+)?\s+<\w+>\s", flat)
        )  # an entry: name <type>
        entries = {m.group(1): flat[m.end() : (marks[i + 1].start() if i + 1 < len(marks) else len(flat))]
                   for i, m in enumerate(marks)}  # fmt: skip
        for p in c.params:
            if p.param_type_name != "option" or p.default is None or (p.is_flag and not p.secondary_opts
                                                                        and p.default is False):  # fmt: skip
                continue
            shown = re.search(r"\[default: ([^\]]+)\]", entries[p.opts[0]])
            assert shown, (name, p.opts[0], entries[p.opts[0]])
            want = p.default if not p.is_flag else (p.opts if p.default else p.secondary_opts)[0].lstrip("-")
            assert shown.group(1) == str(want), (name, p.opts[0], shown.group(1), want)
            checked += 1
    assert checked > 100


def test_help_texts_that_said_what_the_code_does_not(monkeypatch, capsys):
    """generate --gpu-memory never streams (it refuses a model past the budget); eval's prose default is the
    one it uses; the zeros of resume's --save-interval and --stop-after say what they mean."""
    from ddl_wgpu.cli import app

    cmds = commands()
    gen = options_of(cmds["generate"])["--gpu-memory"].help
    assert "stream" not in gen.replace("nothing streams", "") and "refused" in gen
    assert f"default: {app.EVAL_SEQ_LEN}" in options_of(cmds["eval"])["--seq-len"].help
    assert f"default: {accept_lib.WINDOW}" in options_of(cmds["accept"])["--window"].help
    for opt in ("--save-interval", "--stop-after"):
        for command in ("train", "resume"):
            assert "(0: " in options_of(cmds[command])[opt].help, (command, opt)
    assert "half" in options_of(cmds["heal"])["--host-memory"].help
    from ddl_wgpu.files import hostmem

    assert hostmem.HOST_FRACTION == 0.5
