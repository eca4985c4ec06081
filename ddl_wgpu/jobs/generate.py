"""Text generation from a model file: sampling, stop strings, streaming, and speculative decoding with the
model's MTP draft.

The loop drives a decoding engine (`backend.Engine`, built by `backend.make_engine`: `refnet.RefEngine` on
numpy over `ddl_ref.decode`, `decode.WgpuEngine` on the GPU) through five calls: `feed(ids, head)` runs the
trunk over new tokens with its cache and returns each row's argmax (head "argmax"), logits (head "logits"), or
logits that may be −inf outside the k most likely ids (head "top<k>", when sampling with top_k = k);
`rollback(length)` forgets positions; `draft(token, depth, head, pick)` runs the MTP draft `depth` steps from
the last fed position; `round(token, depth)` is a greedy draft and its verify in one call (one submit on the
GPU); `length` is the fed count.

Plain decoding: the prompt in one `feed`, then one token per `feed`. The token at each step is the argmax of
the trunk's logits (temperature 0) or drawn from `distribution(logits)`: top-k, then logits / temperature (any
finite temperature > 0: `distribution` says what its limits give), then top-p (the smallest set of most likely
tokens whose mass reaches p), renormalised, drawn by inverse CDF from one uniform of a generator seeded with
`seed` (same seed, same settings, same text).

Speculative decoding (`speculative=True`), one round with n tokens fed and the next token x_n chosen:

1. the draft's step-1 rows are caught up for every fed anchor a < n it has not seen (trunk hidden h_a, token
   x_{a+1}); the last (anchor n−1, token x_n) proposes d_1 for x_{n+1}; chain step σ = 2..K reads its own step
   σ−1 hidden and token at position n + σ − 2 (the "stacked" chain attention of `accept` and `heal`);
   the chain rows are then rolled back, the step-1 rows kept;
2. the trunk verifies [x_n, d_1, ..., d_K] in one `feed` (K + 1 rows, distributions P_0..P_K);
3. greedy: d_j is kept while d_j = argmax P_{j−1}; the first mismatch is replaced by the trunk's argmax, and
   after K accepted drafts the trunk's own token from P_K follows. Sampling (Leviathan et al. 2023, Chen et al.
   2023): d_j ~ Q_j (the draft's logits through the same `distribution`) is kept with probability
   min(1, P_{j−1}(d_j) / Q_j(d_j)); the first rejected one is replaced by a draw from max(0, P_{j−1} − Q_j)
   renormalised; after K kept, a draw from P_K. Every emitted token is then distributed exactly as under
   plain sampling from the trunk;
4. the trunk cache is rolled back past the rejected drafts (to n + 1 + m for m kept).

K shrinks near `max_new_tokens` and the end of the context. The caches hold the request's positions (prompt +
max_new_tokens + 1, at most max_seq_len). Stats: trunk passes, rounds, mean drafts kept per round, tokens
per trunk pass, and per depth j the fraction of rounds that drafted at least j tokens whose first j were all
kept.

Verified (tests/test_generate.py on numpy; tests/test_generate_gpu.py on the GPU engine): greedy output token
for token equal with and without speculation for all six variants at depths 1-3 (both the accept and the
reject paths taken); the draft's proposals equal `accept`'s greedy chain with the stacked attention; seeded
sampling reproducible; the first three sampled tokens of speculative rounds two drafts deep against the
trunk's exact joint distribution (chi-square over 4000 seeds; the same statistic rejects the draft's own
distribution, and fails when drafts are always kept or a rejection draws from P instead of the residual);
stop strings, streaming (no half character, nothing past a stop), the model's Hugging Face tokenizer, and
every refusal. On hybrid trunks (tests/test_generate_hybrid.py, numpy): greedy output equal with and without
speculation with a random draft, and the sampled joint against the trunk's; the loop is the same, the roll-back
to n + 1 + m being inside the verify pass, where a Gated DeltaNet's state can be recovered.

What this file deliberately does not do: batches of prompts, beam search, repetition penalties.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Sequence

import numpy as np

from ddl_wgpu.backend import Engine, make_eagle3_engine, make_engine, runtime_name
from ddl_wgpu.data import tokenizer_for
from ddl_wgpu.errors import UserError
from ddl_wgpu.files.modelfile import Model, load_model

MAX_NEW_TOKENS = 128  # default tokens generated at most
DEPTH = 3  # default draft tokens per speculative round


class GenerateError(UserError):
    """A generation request that cannot run, with one clear line; `field` names the setting it is about."""


@dataclasses.dataclass(frozen=True)
class Sampling:
    """temperature 0: greedy (argmax, ties to the lower id); else sampled with top_k (0: all) and top_p."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        if not (math.isfinite(self.temperature) and self.temperature >= 0):  # NaN fails both
            raise GenerateError(f"temperature must be a finite number >= 0, got {self.temperature}",
                                field="temperature")  # fmt: skip
        if self.top_k < 0:
            raise GenerateError(f"top_k must be >= 0 (0: no limit), got {self.top_k}", field="top_k")
        if not 0 < self.top_p <= 1:
            raise GenerateError(f"top_p must be in (0, 1], got {self.top_p}", field="top_p")
        if not (isinstance(self.seed, int) and 0 <= self.seed < 1 << 128):  # numpy seeds from non-negatives
            raise GenerateError(f"seed must be a non-negative integer, got {self.seed}", field="seed")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def distribution(logits, s: Sampling) -> np.ndarray:
    """logits (V,) -> probabilities (V,) float64 after top-k, temperature and top-p (module docstring).

    Top-k picks from the logits themselves, so it never depends on the temperature. The temperature divides the
    logits less their largest, (z - max z) / T <= 0, which cannot overflow for any finite T > 0: a T so small
    that a gap over T passes the float64 range gives that token probability 0 (as T -> 0 the distribution
    tends to the argmax, shared among exact ties), a very large T tends to uniform over the kept tokens."""
    z = np.asarray(logits, np.float64)
    if 0 < s.top_k < z.size:
        kth = np.partition(z, z.size - s.top_k)[z.size - s.top_k]
        z = np.where(z >= kth, z, -np.inf)
    with np.errstate(over="ignore"):  # a gap / T past the float64 range is -inf: probability 0
        p = np.exp((z - np.max(z)) / s.temperature)
    p /= p.sum()
    if s.top_p < 1:
        order = np.argsort(-p, kind="stable")
        mass = np.cumsum(p[order])
        keep = order[: int(np.searchsorted(mass, s.top_p)) + 1]  # the first tokens whose mass reaches top_p
        q = np.zeros_like(p)
        q[keep] = p[keep]
        p = q / q.sum()
    return p


def draw(p, rng: np.random.Generator) -> int:
    """One token from probabilities p by inverse CDF (one uniform per token)."""
    c = np.cumsum(p)
    return int(min(np.searchsorted(c, rng.random() * c[-1], side="right"), p.size - 1))


# ----------------------------------------------------------------------------------------------------------
# streaming text and stop strings


class TextStream:
    """Decoded text of the generated ids, handed to `on_text` as it becomes final: never half a UTF-8
    character, never text that could still become the start of a stop string."""

    def __init__(self, tokenizer, stops: Sequence[str], on_text: Callable[[str], None] | None):
        self.tok, self.stops, self.on_text = tokenizer, [s for s in stops if s], on_text
        self.ids: list[int] = []
        self.text = ""
        self.sent = 0
        self.stopped = False

    def add(self, token: int) -> bool:
        """Append one token; True when a stop string has appeared (the text is cut before it)."""
        self.ids.append(int(token))
        self.text = self.tok.decode(self.ids)
        cut = min((i for i in (self.text.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            self.text, self.stopped = self.text[:cut], True
            self._send(len(self.text))
            return True
        safe = len(self.text)
        while safe > self.sent and self.text[safe - 1] == "\ufffd":  # maybe an unfinished multi-byte char
            safe -= 1
        for s in self.stops:  # hold back a tail that is a proper prefix of a stop string
            for k in range(min(len(s) - 1, safe - self.sent), 0, -1):
                if self.text[safe - k : safe] == s[:k]:
                    safe -= k
                    break
        self._send(safe)
        return False

    def finish(self) -> None:
        self._send(len(self.text))

    def _send(self, upto: int) -> None:
        if upto > self.sent and self.on_text is not None:
            self.on_text(self.text[self.sent : upto])
        self.sent = max(self.sent, upto)


# ----------------------------------------------------------------------------------------------------------
# the loop


@dataclasses.dataclass
class Stats:
    depth: int = 0
    rounds: int = 0
    trunk_passes: int = 0
    drafted: np.ndarray | None = None  # rounds that drafted at least j tokens, per depth j
    kept: np.ndarray | None = None  # of those, rounds whose first j drafts were all kept

    def result(self, tokens: int) -> dict:
        out = {"trunk_passes": self.trunk_passes}
        if self.depth:
            acc = [float(k) / float(d) if d else 0.0 for k, d in zip(self.kept, self.drafted, strict=True)]
            out.update(depth=self.depth, rounds=self.rounds, acceptance_per_depth=acc,
                       mean_accepted=float(self.kept.sum()) / self.rounds if self.rounds else 0.0,
                       tokens_per_pass=tokens / self.trunk_passes if self.trunk_passes else 0.0)  # fmt: skip
        return out


class _Chooser:
    """Greedy or seeded sampling of the trunk's next token, and the speculative acceptance test."""

    def __init__(self, s: Sampling):
        self.s = s
        self.rng = np.random.default_rng(s.seed)
        # top-k sampling reads back k ids and probabilities per row from a GPU engine (its top-k kernel
        # holds k <= 64), not the logits
        self.head = "argmax" if s.greedy else f"top{s.top_k}" if 0 < s.top_k <= 64 else "logits"

    def token(self, row) -> int:
        return int(row) if self.s.greedy else draw(distribution(row, self.s), self.rng)

    def draft_pick(self, logits) -> int:
        return draw(distribution(logits, self.s), self.rng)

    def verify(self, drafts, qrows, prows) -> tuple[int, int]:
        """-> (m kept drafts, the token after them) from the verify rows P_0..P_K."""
        for j, d in enumerate(drafts):
            if self.s.greedy:
                if int(prows[j]) != d:
                    return j, int(prows[j])
                continue
            p, q = distribution(prows[j], self.s), distribution(qrows[j], self.s)
            if self.rng.random() * q[d] >= p[d]:  # rejected: u >= p/q
                resid = np.maximum(p - q, 0.0)
                return j, draw(resid / resid.sum(), self.rng)
        return len(drafts), self.token(prows[len(drafts)])


def run(engine: Engine, tokenizer, prompt_ids, context: int, max_new_tokens: int = 64,
        sampling: Sampling = Sampling(), stops: Sequence[str] = (), on_text=None, depth: int = 0) -> dict:  # fmt: skip
    """Generate after `prompt_ids` with `engine`, the sequence at most `context` tokens (the engine's cache
    capacity, at most the model's max_seq_len); `depth` > 0 speculates with the draft `depth` deep."""
    ch = _Chooser(sampling)
    stream = TextStream(tokenizer, stops, on_text)
    stats = Stats(depth, drafted=np.zeros(depth, np.int64), kept=np.zeros(depth, np.int64))
    prompt = [int(t) for t in prompt_ids]
    t0 = time.perf_counter()
    rows = engine.feed(prompt, ch.head, last_only=True)
    stats.trunk_passes += 1
    nxt = ch.token(rows[-1])
    t1 = time.perf_counter()
    new: list[int] = []

    def emit(tokens) -> str | None:
        for tok in tokens:
            if len(new) >= max_new_tokens:
                return "length"
            if len(prompt) + len(new) >= context:
                return "context"
            new.append(tok)
            if stream.add(tok):
                return "stop"
        return None

    finish = emit([nxt])
    while finish is None:
        n = engine.length  # == len(prompt) + len(new) − 1: every emitted token but the last is fed
        remaining, room = max_new_tokens - len(new), context - n - 1  # room: positions after x_n
        if remaining <= 0 or room <= 0:
            finish = "length" if remaining <= 0 else "context"
            break
        k = min(depth, remaining - 1, room)
        if k <= 0:
            # greedy: the argmax goes straight back in, so a GPU engine may run the next token ahead
            rows = engine.feed([nxt], ch.head, ahead=sampling.greedy)
            stats.trunk_passes += 1
            nxt = ch.token(rows[-1])
            finish = emit([nxt])
            continue
        if sampling.greedy:  # the GPU engine runs draft and verify in one submit
            drafts, prows = engine.round(nxt, k)
            qrows = None
        else:
            drafts, qrows = engine.draft(nxt, k, ch.head, ch.draft_pick)
            prows = engine.feed([nxt, *drafts], ch.head)
        stats.trunk_passes += 1
        m, nxt = ch.verify(drafts, qrows, prows)
        engine.rollback(n + 1 + m)
        stats.rounds += 1
        stats.drafted[:k] += 1
        stats.kept[:m] += 1
        finish = emit([*drafts[:m], nxt])
    stream.finish()
    t2 = time.perf_counter()
    decode_s = t2 - t1
    return {
        "text": stream.text,
        "prompt_tokens": len(prompt),
        "new_tokens": len(new),
        "token_ids": new,
        "finish_reason": finish,
        "prefill_s": t1 - t0,
        "decode_s": decode_s,
        "prefill_tokens_per_s": len(prompt) / (t1 - t0) if t1 > t0 else 0.0,
        "decode_tokens_per_s": (len(new) - 1) / decode_s if decode_s > 0 and len(new) > 1 else 0.0,
        **stats.result(len(new)),
    }


# ----------------------------------------------------------------------------------------------------------
# the entry point


# The longest prompt worth reading: the prompt must leave room in the model's context, and no token of a
# Hugging Face vocabulary is near this many bytes (a byte token is one); reading more (a 5 GB file,
# /dev/zero on standard input) would only fill the memory before the refusal.
MAX_TOKEN_BYTES = 64


def prompt_limit(model: Model) -> int:
    """The most bytes a prompt for `model` can take (its context, at the longest a token can be)."""
    return model.cfg.max_seq_len * (
        1 if model.tokenizer is None or len(model.tokenizer) == 0 else MAX_TOKEN_BYTES
    )


def encode_prompt(model: Model, prompt: str | bytes, tokenizer=None) -> np.ndarray:
    tok = tokenizer if tokenizer is not None else tokenizer_for(model.tokenizer)
    if isinstance(prompt, str):
        try:
            prompt.encode("utf-8")
        except UnicodeEncodeError:
            raise GenerateError(
                "the prompt holds a lone UTF-16 surrogate, which is not text", field="prompt"
            ) from None
    ids = tok.encode_bytes(prompt) if isinstance(prompt, bytes) else tok.encode(prompt)
    if ids.size == 0:
        raise GenerateError("empty prompt: give at least one character of text", field="prompt")
    if int(ids.max()) >= model.cfg.vocab_size:
        raise GenerateError(f"the prompt has token id {int(ids.max())} >= the model's vocab_size "
                            f"{model.cfg.vocab_size}")  # fmt: skip
    if ids.size >= model.cfg.max_seq_len:
        raise GenerateError(f"the prompt is {ids.size} tokens; the model's context (max_seq_len) is "
                            f"{model.cfg.max_seq_len}, which leaves no room to generate",
                            field="prompt")  # fmt: skip
    return ids


def generate(model: Model | str, prompt: str | bytes, max_new_tokens: int = MAX_NEW_TOKENS,
             sampling: Sampling = Sampling(), stops: Sequence[str] = (), speculative: bool = False,
             depth: int = DEPTH, backend: str = "auto",
             device: str | None = None, on_text: Callable[[str], None] | None = None,
             dtype: str = "f32", draft=None) -> dict:  # fmt: skip
    """Generate a continuation of `prompt` (text, or raw bytes) with the model (a `Model` or a `.ddlw` path).

    -> {"text", "token_ids", "prompt_tokens", "new_tokens", "finish_reason" ("length", "stop", "context"),
    timings, "backend", "speculative", and with speculation the draft's statistics}. `on_text` receives the
    text as it becomes final (`TextStream`). `dtype` "f16" keeps the GPU's big matrices in f16 (wgpu only).
    `backend` is the command's choice ("wgpu" or "ref", from `backend.choose_backend`), handed to
    `backend.make_engine` (which resolves "auto" itself for a caller that has not chosen)."""
    if not isinstance(model, Model):
        from ddl_wgpu.files.container import CheckpointError

        try:
            model = load_model(model)
        except (CheckpointError, OSError) as e:
            raise GenerateError(str(e)) from e
    if dtype not in ("f32", "f16"):
        raise GenerateError(f"trunk dtype must be f32 or f16, got {dtype!r}", field="trunk_dtype")
    if max_new_tokens < 1:
        raise GenerateError(
            f"max_new_tokens must be at least 1, got {max_new_tokens}", field="max_new_tokens"
        )
    if draft is not None and not speculative:
        raise GenerateError("a draft is for speculative decoding: pass --speculative with --draft",
                            field="speculative")  # fmt: skip
    if speculative:
        if model.cfg.mtp is None and draft is None:
            raise GenerateError("speculative decoding needs the model's MTP draft, and this model has none "
                                "(no model.mtp.* tensors: a model trained with a draft, or healed, has them)",
                                field="speculative")  # fmt: skip
        if not 1 <= depth < model.cfg.max_seq_len:  # a round drafts within the context (and sizes its cache)
            raise GenerateError(f"depth must be between 1 and the model's context less one, "
                                f"{model.cfg.max_seq_len - 1}, got {depth}", field="depth")  # fmt: skip
    tokenizer = tokenizer_for(model.tokenizer)
    ids = encode_prompt(model, prompt, tokenizer)
    # The caches hold what this request can reach, not the model's whole context (a 40k-token Qwen3 context
    # would take gigabytes of keys and values for a short answer).
    context = min(model.cfg.max_seq_len, ids.size + max_new_tokens + 1)
    if draft is not None:  # an EAGLE-3 draft file (`files.eagle3file.Eagle3Draft`) instead of the MTP draft
        engine = make_eagle3_engine(backend, model, draft, depth, device, context, dtype)
    else:
        engine = make_engine(backend, model, depth if speculative else 0, device, dtype, context)
    out = run(engine, tokenizer, ids, context, max_new_tokens, sampling, stops, on_text,
              depth if speculative else 0)  # fmt: skip
    out.update(
        backend=engine.backend, runtime=runtime_name(engine.backend, device), speculative=bool(speculative)
    )
    return out


def summary_line(r: dict) -> str:
    """One line about a `generate` result: tokens, why it stopped, speeds, the backend and the draft's numbers."""
    line = (f"[{r['new_tokens']} tokens ({r['finish_reason']}); prefill {r['prompt_tokens']} tokens at "
            f"{r['prefill_tokens_per_s']:.0f} tok/s; decode {r['decode_tokens_per_s']:.1f} tok/s on {r['backend']}")  # fmt: skip
    if r.get("speculative") and r.get("rounds"):
        acc = " ".join(f"{a:.2f}" for a in r["acceptance_per_depth"])
        line += (f"; draft depth {r['depth']}: {r['mean_accepted']:.2f} drafts kept per round, "
                 f"{r['tokens_per_pass']:.2f} tokens per trunk pass, acceptance per depth {acc}")  # fmt: skip
    return line + "]"
