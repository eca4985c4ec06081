"""The `ddl_ref.model` decoder written in PyTorch, for the training-step benchmark's peer (bench only).

Same architecture and parameter names as `ddl_ref` (Hugging Face names from `ddl_ref.params.param_table`):
pre-norm RMSNorm ("standard" w·x̂ or "offset" (1+w)·x̂), RoPE rotate-half, q/k RMSNorm over head_dim
(pre- or post-RoPE), causal attention through `F.scaled_dot_product_attention` (GQA by repeating kv heads),
SwiGLU MLP, tied or untied head, and the mean cross-entropy over positions p < min(length-1, T-1).

Residual "add" (baseline) or "delta" with d_v = 1 (docs/model.md#the-delta-residual, `ddl_ref.delta`): per
sublayer c = norm(x), u = sublayer(c), k = u/√(‖u‖²+ε²), β = 2σ(w_β·c + b_β), v = s·σ(w_v·x + b_v),
x ← x + β(v − k·x)k.

What this does not do: d_v > 1 (compressors, EC), MTP, KV caching, dropout.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn


def rope_tables(T: int, D: int, theta: float, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) (T, D) in float64 then cast to float32, as the engine uploads them."""
    inv = 1.0 / (float(theta) ** (np.arange(0, D, 2, dtype=np.float64) / D))
    emb = np.outer(np.arange(T, dtype=np.float64), inv)
    emb = np.concatenate([emb, emb], axis=-1)
    return (torch.tensor(np.cos(emb), dtype=torch.float32, device=device),
            torch.tensor(np.sin(emb), dtype=torch.float32, device=device))  # fmt: skip


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    h = x.shape[-1] // 2
    return torch.cat([-x[..., h:], x[..., :h]], dim=-1)


class TorchLM(nn.Module):
    """A decoder with the parameters of `ddl_ref.params` (a {name: array} dict), fp32 master weights."""

    def __init__(self, cfg, params: dict, device="cpu"):
        super().__init__()
        if cfg.residual == "delta" and cfg.ddl_dv != 1:
            raise ValueError("the PyTorch peer implements the baseline and DDL d_v = 1 only")
        if cfg.mtp is not None:
            raise ValueError("MTP draft blocks are not implemented in the PyTorch peer")
        self.cfg = cfg
        self.names = list(params)
        self.plist = nn.ParameterList(
            [nn.Parameter(torch.tensor(np.asarray(params[n], np.float32), device=device)) for n in self.names]
        )
        self.cos, self.sin = rope_tables(cfg.max_seq_len, cfg.head_dim, cfg.rope_theta, device)

    def P(self, name: str) -> torch.Tensor:
        return self.plist[self._index[name]]

    @property
    def _index(self) -> dict:
        if not hasattr(self, "_idx"):
            self._idx = {n: i for i, n in enumerate(self.names)}
        return self._idx

    def norm(self, x: torch.Tensor, name: str) -> torch.Tensor:
        w = self.P(name)
        if self.cfg.norm_style == "offset":
            w = 1.0 + w
        return F.rms_norm(x, (x.shape[-1],), w.to(x.dtype), self.cfg.rms_eps)

    def attn(self, h: torch.Tensor, p: str) -> torch.Tensor:
        cfg = self.cfg
        B, T, _ = h.shape
        H, K, D = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        q = F.linear(h, self.P(p + "self_attn.q_proj.weight")).view(B, T, H, D)
        k = F.linear(h, self.P(p + "self_attn.k_proj.weight")).view(B, T, K, D)
        v = F.linear(h, self.P(p + "self_attn.v_proj.weight")).view(B, T, K, D)
        if cfg.qk_norm == "pre_rope":
            q, k = self.norm(q, p + "self_attn.q_norm.weight"), self.norm(k, p + "self_attn.k_norm.weight")
        cos, sin = self.cos[None, :T, None, :], self.sin[None, :T, None, :]
        q = q * cos.to(q.dtype) + rotate_half(q) * sin.to(q.dtype)
        k = k * cos.to(k.dtype) + rotate_half(k) * sin.to(k.dtype)
        if cfg.qk_norm == "post_rope":
            q, k = self.norm(q, p + "self_attn.q_norm.weight"), self.norm(k, p + "self_attn.k_norm.weight")
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, heads, T, D)
        if H != K:
            k, v = k.repeat_interleave(H // K, dim=1), v.repeat_interleave(H // K, dim=1)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # scale D^-0.5
        return F.linear(a.transpose(1, 2).reshape(B, T, H * D), self.P(p + "self_attn.o_proj.weight"))

    def mlp(self, h: torch.Tensor, p: str) -> torch.Tensor:
        gate = F.linear(h, self.P(p + "mlp.gate_proj.weight"))
        up = F.linear(h, self.P(p + "mlp.up_proj.weight"))
        return F.linear(F.silu(gate) * up, self.P(p + "mlp.down_proj.weight"))

    def delta(self, x: torch.Tensor, u: torch.Tensor, c: torch.Tensor, q: str) -> torch.Tensor:
        """x + β(v − k·x)k for d_v = 1 (the v input is the stream x itself)."""
        cfg = self.cfg
        k = u * torch.rsqrt((u * u).sum(-1, keepdim=True) + cfg.ddl_k_eps**2)
        beta = 2.0 * torch.sigmoid(
            F.linear(c, self.P(q + "beta_proj.weight")[None, :], self.P(q + "beta_proj.bias"))
        )
        v = cfg.ddl_v_scale * torch.sigmoid(
            F.linear(x, self.P(q + "v_proj.weight"), self.P(q + "v_proj.bias"))
        )
        proj = (x * k).sum(-1, keepdim=True)
        return x + k * (beta * (v - proj))

    def hidden(self, ids: torch.Tensor) -> torch.Tensor:
        """ids (B, T) -> final normed hidden (B, T, C)."""
        cfg = self.cfg
        x = F.embedding(ids, self.P("model.embed_tokens.weight"))
        for i in range(cfg.n_layers):
            p = f"model.layers.{i}."
            if cfg.residual == "delta":
                c = self.norm(x, p + "input_layernorm.weight")
                x = self.delta(x, self.attn(c, p), c, p + "ddl_attn.")
                c = self.norm(x, p + "post_attention_layernorm.weight")
                x = self.delta(x, self.mlp(c, p), c, p + "ddl_mlp.")
            else:
                x = x + self.attn(self.norm(x, p + "input_layernorm.weight"), p)
                x = x + self.mlp(self.norm(x, p + "post_attention_layernorm.weight"), p)
        return self.norm(x, "model.norm.weight")

    def forward(self, ids: torch.Tensor, lengths: torch.Tensor | None = None) -> torch.Tensor:
        """Mean next-token cross-entropy over the valid predictions (as `ddl_ref.ops.lm_loss_forward`)."""
        B, T = ids.shape
        xf = self.hidden(ids)
        head = "model.embed_tokens.weight" if self.cfg.tie_embeddings else "lm_head.weight"
        logits = F.linear(xf, self.P(head))  # (B, T, V)
        if lengths is None:
            lengths = torch.full((B,), T, device=ids.device)
        limit = torch.clamp(lengths - 1, max=T - 1)
        valid = torch.arange(T - 1, device=ids.device)[None, :] < limit[:, None]  # (B, T-1)
        nll = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(), ids[:, 1:].reshape(-1),
                              reduction="none")  # fmt: skip
        w = valid.reshape(-1).float()
        return (nll * w).sum() / w.sum().clamp(min=1.0)
