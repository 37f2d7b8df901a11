"""A tiny Llama-shaped decoder in plain torch for the serve-bench agreement tests (tests/ is on sys.path): Hugging
Face Llama's parameter names (``model.embed_tokens``, ``model.layers.N.self_attn.q_proj``, ``input_layernorm``,
``model.norm``, ``lm_head``), RMSNorm, rotary attention with grouped KV heads, SiLU-and-mul MLP. Faster to
import than transformers; what the recipe of ``tunekit.evidence.serve_bench.weights`` reads is the same.

``forward(ids, merged=True)`` computes the same function in another order (q/k/v and gate/up as one matmul each,
the norm's gain applied before 1/rms, the softmax by hand): a correct arm. ``forced_record`` runs a model
teacher-forced and returns what the runner records (``tunekit.evidence.serve_bench.forced``).
"""

from __future__ import annotations

import torch
from torch import nn


class TinyRMSNorm(nn.Module):
    def __init__(self, n: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n))
        self.eps = eps

    def forward(self, x: torch.Tensor, merged: bool = False) -> torch.Tensor:
        if merged:
            return (x * self.weight) * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def _rotate(x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    freq = 1.0 / (10000.0 ** (torch.arange(half, dtype=torch.float32) / half))
    ang = pos[:, None].float() * freq[None, :]
    cos, sin = ang.cos(), ang.sin()
    a, b = x[..., :half], x[..., half:]
    return torch.cat([a * cos - b * sin, a * sin + b * cos], dim=-1)


class TinyAttention(nn.Module):
    def __init__(self, d: int, heads: int, kv_heads: int) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.hd = heads, kv_heads, d // heads
        self.q_proj = nn.Linear(d, heads * self.hd, bias=False)
        self.k_proj = nn.Linear(d, kv_heads * self.hd, bias=False)
        self.v_proj = nn.Linear(d, kv_heads * self.hd, bias=False)
        self.o_proj = nn.Linear(heads * self.hd, d, bias=False)

    def forward(self, x: torch.Tensor, merged: bool = False) -> torch.Tensor:
        b, t, _ = x.shape
        if merged:
            w = torch.cat([self.q_proj.weight, self.k_proj.weight, self.v_proj.weight])
            q, k, v = (x @ w.T).split([self.q_proj.out_features, self.k_proj.out_features,
                                       self.v_proj.out_features], dim=-1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        pos = torch.arange(t)
        q = _rotate(q.view(b, t, self.heads, self.hd).transpose(1, 2), pos)
        k = _rotate(k.view(b, t, self.kv_heads, self.hd).transpose(1, 2), pos)
        v = v.view(b, t, self.kv_heads, self.hd).transpose(1, 2)
        rep = self.heads // self.kv_heads
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        scores = (q @ k.transpose(-1, -2)) / self.hd ** 0.5
        scores = scores.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
        if merged:
            e = torch.exp(scores - scores.amax(-1, keepdim=True))
            attn = e / e.sum(-1, keepdim=True)
        else:
            attn = torch.softmax(scores, dim=-1)
        return self.o_proj((attn @ v).transpose(1, 2).reshape(b, t, -1))


class TinyMLP(nn.Module):
    def __init__(self, d: int, inter: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(d, inter, bias=False)
        self.up_proj = nn.Linear(d, inter, bias=False)
        self.down_proj = nn.Linear(inter, d, bias=False)

    def forward(self, x: torch.Tensor, merged: bool = False) -> torch.Tensor:
        if merged:
            g, u = (x @ torch.cat([self.gate_proj.weight, self.up_proj.weight]).T).chunk(2, dim=-1)
            return self.down_proj(g * torch.sigmoid(g) * u)
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class TinyLayer(nn.Module):
    def __init__(self, d: int, heads: int, kv_heads: int, inter: int) -> None:
        super().__init__()
        self.self_attn = TinyAttention(d, heads, kv_heads)
        self.mlp = TinyMLP(d, inter)
        self.input_layernorm = TinyRMSNorm(d)
        self.post_attention_layernorm = TinyRMSNorm(d)

    def forward(self, x: torch.Tensor, merged: bool = False) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x, merged), merged)
        return x + self.mlp(self.post_attention_layernorm(x, merged), merged)


class TinyBody(nn.Module):
    def __init__(self, vocab: int, d: int, layers: int, heads: int, kv_heads: int, inter: int) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList(TinyLayer(d, heads, kv_heads, inter) for _ in range(layers))
        self.norm = TinyRMSNorm(d)


class TinyLlama(nn.Module):
    def __init__(self, vocab: int = 512, d: int = 64, layers: int = 2, heads: int = 4, kv_heads: int = 2,
                 inter: int = 128, tied: bool = False) -> None:
        super().__init__()
        self.model = TinyBody(vocab, d, layers, heads, kv_heads, inter)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        if tied:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, ids: torch.Tensor, merged: bool = False) -> torch.Tensor:
        x = self.model.embed_tokens(ids)
        for layer in self.model.layers:
            x = layer(x, merged)
        return self.lm_head(self.model.norm(x, merged))


@torch.no_grad()
def greedy(model: nn.Module, prompt: list[int], steps: int) -> list[int]:
    ids = list(prompt)
    for _ in range(steps):
        ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
    return ids[len(prompt):]


@torch.no_grad()
def forced_record(model: nn.Module, prompts: list[list[int]], forced: list[list[int]], topk: int,
                  merged: bool = False) -> dict:
    """The runner's ``forced`` record of ``model`` decoding ``forced`` after ``prompts`` (one forward each)."""
    requests = []
    for prompt, toks in zip(prompts, forced, strict=True):
        logits = model(torch.tensor([prompt + toks[:-1]]), merged)[0, len(prompt) - 1:]
        lp = torch.log_softmax(logits.double(), dim=-1)
        vals, idx = lp.topk(topk, dim=-1)
        requests.append({"forced": list(toks), "forced_from": "test", "prefill_steps": [0],
                         "top": [[[int(i), float(v)] for i, v in zip(ix, vs, strict=True)]
                                 for ix, vs in zip(idx.tolist(), vals.tolist(), strict=True)]})
    return {"steps": len(forced[0]), "topk": topk, "rounds": 1, "requests": requests}
