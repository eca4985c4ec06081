"""Shared fixtures: one GPU device for the whole test session (device creation and the first pipeline cost
~0.5 s on lavapipe); the words of the CLI tests' corpus; and `heal_kit`, the tiny models, texts and heal
settings the heal, accept and chain-attention tests share; heal's eager refresh (the oracle of the lazy one)
and the bench's count of refresh forwards. The plain helpers (the one tiny-config factory `tiny_cfg`, the
tiny models) are in `helpers.py`."""

import importlib.util
import os
import subprocess
import sys
from functools import partial
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from helpers import make_model, make_text, perturbed, tiny_cfg

from ddl_ref.config import MtpConfig
from ddl_wgpu.jobs import heal
from ddl_wgpu.jobs.heal import HealConfig

REPO = Path(__file__).resolve().parents[1]
CORPUS_WORDS = ["the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "pack", "my", "box", "with",
                "five", "dozen", "liquor", "jugs", "and", "then", "a", "cat", "sat", "on", "mat"]  # fmt: skip


def _dawn_problem() -> str | None:
    """Why the session's runtime, Dawn (DDL_WGPU_RUNTIME=dawn: `make test`'s second pass), cannot run here, or
    None: wgpudawn missing or broken, or no adapter Dawn accepts (a lavapipe older than Mesa 25)."""
    if os.environ.get("DDL_WGPU_RUNTIME", "").strip().lower() != "dawn":
        return None
    from ddl_wgpu.runtime import gpu as g

    try:
        g.resolve("dawn", os.environ.get(g.ENV_ADAPTER) or None, g.select_adapter)
    except g.GpuError as e:
        return str(e).splitlines()[0]
    return None


def pytest_collection_modifyitems(config, items):
    """Under DDL_WGPU_RUNTIME=dawn where Dawn cannot run, every test skips with the reason, printed once."""
    problem = _dawn_problem()
    if problem is None:
        return
    reason = f"DDL_WGPU_RUNTIME=dawn, but Dawn cannot run here: {problem}"
    print(f"\n{reason}: every test of this session skips", file=sys.stderr)
    for item in items:
        item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture(scope="session")
def gpu():
    from ddl_wgpu.runtime.gpu import Gpu  # the GPU layer loads wgpu: only GPU tests pay for it

    return Gpu()


@pytest.fixture(autouse=True)
def _products_back_to_simt():
    """Where a test's job routed the backend's shared device to the matrix units (an f16 trunk, `--precision
    auto` or `mixed` on a GPU that lists a subgroup matrix; `Gpu.products`, the device's switch), the tests after
    it start from the SIMT products again instead of inheriting them."""
    yield
    backend = sys.modules.get("ddl_wgpu.backend")
    for g in getattr(backend, "_GPU", {}).values():
        g.products = "simt"


@pytest.fixture
def rng():
    return np.random.default_rng(1234)


@pytest.fixture(scope="session")
def corpus_words() -> list[str]:
    return CORPUS_WORDS


@pytest.fixture(scope="session")
def heal_kit():
    """tiny_cfg (the default shape with an MTP draft and pre-RoPE q/k norm), perturbed, make_text,
    make_model (a model with a perturbed draft, of that config unless given) and SMALL (a short heal that
    both backends run)."""
    heal_cfg = partial(tiny_cfg, qk_norm="pre_rope", mtp=MtpConfig())
    small = HealConfig(chain=2, window=24, tokens=1200, batch=2, eval_every=4, patience=0, lr=3e-3, epochs=0.3,
                       refresh=5)  # fmt: skip

    def make(path, cfg=None, seed=0):
        return make_model(path, cfg or heal_cfg(), seed)

    return SimpleNamespace(tiny_cfg=heal_cfg, perturbed=perturbed, make_text=make_text, make_model=make,
                           SMALL=small)  # fmt: skip


# ---------------------------------------------------------------------------------------------------------
# the command line, run as a user runs it (a subprocess of `python -m ddl_wgpu.cli`, which goes through main())


def cli(*args, cwd=None, timeout=300) -> subprocess.CompletedProcess:
    # this checkout's package also when the command runs in another folder
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "COLUMNS": "200", "PYTHONPATH": path}
    return subprocess.run(
        [sys.executable, "-m", "ddl_wgpu.cli", *map(str, args)],
        capture_output=True,
        text=True,
        cwd=cwd,
        env=env,
        timeout=timeout,
    )


def ok(r: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert r.returncode == 0, f"exit {r.returncode}\nstdout:\n{r.stdout}\nstderr:\n{r.stderr}"
    return r


def user_error(r: subprocess.CompletedProcess, *fragments: str) -> str:
    """Exit code 2, exactly one line on stderr starting with 'error:', no traceback; returns the line."""
    assert r.returncode == 2, f"exit {r.returncode}\nstdout:\n{r.stdout}\nstderr:\n{r.stderr}"
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith("error: "), r.stderr
    assert "Traceback" not in r.stderr + r.stdout
    for f in fragments:
        assert f in lines[0], (f, lines[0])
    return lines[0]


@pytest.fixture(scope="session", name="cli")
def cli_fixture():
    """cli(*args, cwd=None, timeout=300) -> the finished process."""
    return cli


@pytest.fixture(scope="session", name="ok")
def ok_fixture():
    """ok(process): asserts exit 0, returns the process."""
    return ok


@pytest.fixture(scope="session", name="user_error")
def user_error_fixture():
    """user_error(process, *fragments): asserts one `error: ...` line and exit 2, returns the line."""
    return user_error


# ---------------------------------------------------------------------------------------------------------
# heal's refresh: the eager oracle the lazy rebuild must equal, and the bench's count of its forwards


class _EagerChain(heal._Chain):
    """heal's chain with every window's chain rows rebuilt from the current draft at each refresh, step by step
    and batch by batch (what the lazy rebuild must reproduce bit for bit)."""

    def refresh(self, plan=()) -> int:
        if self.chain < 2:
            return 0
        for j in range(2, self.chain + 1):
            xj = np.zeros((self.N, self.T, self.mcfg.d_model), np.float16)
            for sel in self.members:
                xj[sel] = self._next_rows(sel, j)
            self.cache.x[j] = xj
        done, self.period_forwards = self.period_forwards, 0
        return done


@pytest.fixture
def eager_refresh(monkeypatch):
    """eager_refresh(True): heal rebuilds every window at each refresh from here on; (False): lazily again."""

    lazy = heal._Chain

    def use(eager: bool) -> None:
        monkeypatch.setattr(heal, "_Chain", _EagerChain if eager else lazy)

    return use


@pytest.fixture(scope="session")
def heal_count():
    """`bench/heal_count.py` (its `refresh_forwards` is the count bench/heal.py's estimate rests on)."""
    spec = importlib.util.spec_from_file_location("heal_count", REPO / "bench" / "heal_count.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
