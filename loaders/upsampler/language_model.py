"""Mistral-Small-3.x as the language model that writes text (prompt upsampling): the decoder with a KV cache,
and the generation loop, in plain torch.

The modules mirror transformers' MistralForCausalLM and its state-dict keys (the host's names the encoder loader
maps every layout to), so one plan's weights load into it as they are. Linear and embedding layers come from
`operations`, as in the host's own models: torch.nn for dense weights, or the host's packed operations
(host/ops.py), which keep fp8, NVFP4 and GGUF weights packed and dequantize one layer at a time. The numbers
follow transformers' (float32 norms and rotary angles, the same casts), so greedy generation gives its tokens."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..models.variants import MistralEncoderGeometry


class RMSNorm(torch.nn.Module):
    def __init__(self, width: int, eps: float, device=None, dtype=None):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.empty(width, device=device, dtype=dtype), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight.to(device=x.device, dtype=x.dtype) * h.to(x.dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class KVCache:
    """Keys and values of every layer, for a sequence of at most `length` tokens (batch 1)."""

    def __init__(self, layers: int, kv_heads: int, length: int, head_dim: int, device, dtype):
        self.keys = torch.empty(layers, 1, kv_heads, length, head_dim, device=device, dtype=dtype)
        self.values = torch.empty_like(self.keys)

    def extend(self, layer: int, k: torch.Tensor, v: torch.Tensor, start: int):
        """Store positions start.. of one layer; its keys and values of positions 0.. up to them."""
        end = start + k.shape[2]
        self.keys[layer, :, :, start:end] = k
        self.values[layer, :, :, start:end] = v
        return self.keys[layer, :, :, :end], self.values[layer, :, :, :end]


class Attention(torch.nn.Module):
    def __init__(self, g: MistralEncoderGeometry, operations, device, dtype):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = g.heads, g.kv_heads, g.head_dim
        self.q_proj = operations.Linear(g.width, g.heads * g.head_dim, bias=False, device=device, dtype=dtype)
        self.k_proj = operations.Linear(g.width, g.kv_heads * g.head_dim, bias=False, device=device, dtype=dtype)
        self.v_proj = operations.Linear(g.width, g.kv_heads * g.head_dim, bias=False, device=device, dtype=dtype)
        self.o_proj = operations.Linear(g.heads * g.head_dim, g.width, bias=False, device=device, dtype=dtype)

    def forward(self, x, rotary, cache: KVCache, layer: int, start: int):
        n = x.shape[1]
        q = self.q_proj(x).view(1, n, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(1, n, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(1, n, self.kv_heads, self.head_dim).transpose(1, 2)
        cos, sin = rotary
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        keys, values = cache.extend(layer, k, v, start)
        groups = self.heads // self.kv_heads
        if n == 1:
            # One new token sees every cached one: the query heads of a key/value head go side by side as its
            # queries, so the cache is read as it is stored, without repeating it per query head.
            out = F.scaled_dot_product_attention(q.view(1, self.kv_heads, groups, self.head_dim), keys, values)
        else:
            if start:
                raise ValueError("a prompt is read in one piece, from position 0")
            keys, values = keys.repeat_interleave(groups, dim=1), values.repeat_interleave(groups, dim=1)
            out = F.scaled_dot_product_attention(q, keys, values, is_causal=True)
        return self.o_proj(out.reshape(1, self.heads, n, self.head_dim).transpose(1, 2).reshape(1, n, -1))


class MLP(torch.nn.Module):
    def __init__(self, g: MistralEncoderGeometry, operations, device, dtype):
        super().__init__()
        self.gate_proj = operations.Linear(g.width, g.mlp, bias=False, device=device, dtype=dtype)
        self.up_proj = operations.Linear(g.width, g.mlp, bias=False, device=device, dtype=dtype)
        self.down_proj = operations.Linear(g.mlp, g.width, bias=False, device=device, dtype=dtype)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(torch.nn.Module):
    def __init__(self, g: MistralEncoderGeometry, operations, device, dtype):
        super().__init__()
        self.self_attn = Attention(g, operations, device, dtype)
        self.mlp = MLP(g, operations, device, dtype)
        self.input_layernorm = RMSNorm(g.width, g.rms_norm_eps, device, dtype)
        self.post_attention_layernorm = RMSNorm(g.width, g.rms_norm_eps, device, dtype)

    def forward(self, x, rotary, cache, layer, start):
        x = x + self.self_attn(self.input_layernorm(x), rotary, cache, layer, start)
        return x + self.mlp(self.post_attention_layernorm(x))


class Decoder(torch.nn.Module):
    def __init__(self, g: MistralEncoderGeometry, layers: int, operations, device, dtype):
        super().__init__()
        self.embed_tokens = operations.Embedding(g.vocab, g.width, device=device, dtype=dtype)
        self.layers = torch.nn.ModuleList(DecoderLayer(g, operations, device, dtype) for _ in range(layers))
        self.norm = RMSNorm(g.width, g.rms_norm_eps, device, dtype)


class MistralLM(torch.nn.Module):
    """Mistral-Small's language model, in MistralForCausalLM's state-dict keys."""

    def __init__(self, geometry: MistralEncoderGeometry, layers: int, rope_theta: float, operations=torch.nn,
                 device=None, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.geometry, self.dtype = geometry, dtype
        self.host_operations = operations is not torch.nn  # comfy.ops style: Embedding takes out_dtype
        self.model = Decoder(geometry, layers, operations, device, dtype)
        self.lm_head = operations.Linear(geometry.width, geometry.vocab, bias=False, device=device, dtype=dtype)
        d = geometry.head_dim
        # As transformers computes it: in float32 (in bfloat16, theta 1e9 would lose the slow frequencies).
        self.inv_freq = 1.0 / (rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """The input embeddings of token ids [1, n]."""
        if self.host_operations:  # the host's embedding casts only the rows it gathers, not the whole table
            return self.model.embed_tokens(ids, out_dtype=self.dtype)
        return self.model.embed_tokens(ids).to(self.dtype)

    def new_cache(self, length: int, device) -> KVCache:
        g = self.geometry
        return KVCache(len(self.model.layers), g.kv_heads, length, g.head_dim, device, self.dtype)

    def _rotary(self, start: int, n: int, device):
        positions = torch.arange(start, start + n, device=device, dtype=torch.float32)
        freqs = positions[:, None] * self.inv_freq.to(device)[None, :]
        angles = torch.cat((freqs, freqs), dim=-1)
        return angles.cos().to(self.dtype)[None, None], angles.sin().to(self.dtype)[None, None]

    def forward(self, embeds: torch.Tensor, cache: KVCache, start: int) -> torch.Tensor:
        """The next-token logits (float32, [vocab]) after input embeddings [1, n, width] at positions start..;
        their keys and values go into the cache."""
        x = embeds.to(self.dtype)
        rotary = self._rotary(start, x.shape[1], x.device)
        for i, layer in enumerate(self.model.layers):
            x = layer(x, rotary, cache, i, start)
        last = self.model.norm(x[:, -1:])
        return self.lm_head(last)[0, -1].float()


@dataclass(frozen=True)
class Sampling:
    """How the next token is chosen: greedy at temperature 0, else sampled as transformers' generate samples
    (logits / temperature, the top_k most likely kept, softmax), from a generator seeded with `seed`."""

    temperature: float = 0.15
    seed: int = 0
    top_k: int = 50  # transformers' default, which the reference runs with

    def choose(self, logits: torch.Tensor, generator: torch.Generator) -> int:
        if self.temperature == 0:
            return int(torch.argmax(logits))
        scores = logits.cpu() / self.temperature
        if 0 < self.top_k < scores.numel():
            scores = scores.masked_fill(scores < torch.topk(scores, self.top_k).values[-1], float("-inf"))
        return int(torch.multinomial(torch.softmax(scores, dim=-1), 1, generator=generator))


def generate(model: MistralLM, embeds: torch.Tensor, *, max_new_tokens: int, sampling: Sampling, eos_id: int,
             on_token: Callable[[int, int], None] | None = None) -> list[int]:
    """The ids the model writes after the prompt's input embeddings [1, n, width], ending with `eos_id` when it
    stops by itself. on_token(count, id) is called after each token (progress; it may raise to cancel)."""
    n = embeds.shape[1]
    cache = model.new_cache(n + max_new_tokens, embeds.device)
    generator = torch.Generator().manual_seed(sampling.seed)
    written: list[int] = []
    with torch.inference_mode():
        logits = model(embeds, cache, 0)
        while True:
            token = sampling.choose(logits, generator)
            written.append(token)
            if on_token is not None:
                on_token(len(written), token)
            if token == eos_id or len(written) == max_new_tokens:
                return written
            ids = torch.tensor([[token]], device=embeds.device)
            logits = model(model.embed(ids), cache, n + len(written) - 1)
