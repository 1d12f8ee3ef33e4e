"""Small reference models for tests, benchmarks and the demo.

Every model returns a scalar loss from ``forward`` when given targets, so that a plan covers the
whole training step. Initialization draws only from torch's global generator, so
``torch.manual_seed(s)`` before construction gives the same weights every time. Every model
traces with ``torch.export.export(model, args, strict=False)``.

``build_model(name, seed)`` and ``example_batch(name, batch_size, seed)`` give a model and a
matching batch by name (``MODEL_NAMES``). Shapes are chosen to divide evenly on meshes of up to
8 devices: channel and hidden counts divide by 4, and batches in the examples by 8.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from autopar.errors import ConfigError, InputError

__all__ = [
    "MLP",
    "GPT",
    "CausalSelfAttention",
    "GPTBlock",
    "AttentionBlock",
    "MLPBlock",
    "WithMSELoss",
    "SmallCNN",
    "Llama",
    "LLAMA_SHAPES",
    "Experts",
    "SparseMoE",
    "MoE",
    "MOE_SHAPES",
    "MODEL_NAMES",
    "DEFAULT_CONFIGS",
    "build_model",
    "example_batch",
]


class MLP(nn.Module):
    """``depth`` hidden layers of Linear + GELU, then a Linear head; forward returns the MSE loss.

    Parameters: ``layers.{i}.weight/bias`` for the hidden layers and ``head.weight/bias``.
    """

    def __init__(self, d_in: int = 32, d_hidden: int = 128, d_out: int = 32, depth: int = 2):
        super().__init__()
        if depth < 1:
            raise ConfigError(f"MLP depth must be at least 1, got {depth}")
        self.config = dict(d_in=d_in, d_hidden=d_hidden, d_out=d_out, depth=depth)
        widths = [d_in] + [d_hidden] * depth
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(widths[:-1], widths[1:]))
        self.head = nn.Linear(d_hidden, d_out)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = F.gelu(layer(x))
        return F.mse_loss(self.head(x), y)


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention, as in nanoGPT.

    With ``fused_qkv`` one Linear ``c_attn`` makes q, k and v, which are then split; otherwise
    there are three Linears ``q_proj``, ``k_proj`` and ``v_proj``. ``c_proj`` is the output.
    """

    def __init__(self, n_embd: int, n_head: int, fused_qkv: bool = False, bias: bool = True, causal: bool = True):
        super().__init__()
        if n_embd % n_head != 0:
            raise ConfigError(f"n_embd ({n_embd}) must divide by n_head ({n_head})")
        self.n_embd, self.n_head, self.fused_qkv, self.causal = n_embd, n_head, fused_qkv, causal
        if fused_qkv:
            self.c_attn = nn.Linear(n_embd, 3 * n_embd, bias=bias)
        else:
            self.q_proj = nn.Linear(n_embd, n_embd, bias=bias)
            self.k_proj = nn.Linear(n_embd, n_embd, bias=bias)
            self.v_proj = nn.Linear(n_embd, n_embd, bias=bias)
        self.c_proj = nn.Linear(n_embd, n_embd, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, n_embd = x.shape
        if self.fused_qkv:
            q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        head_dim = n_embd // self.n_head
        # (batch, seq, n_embd) -> (batch, n_head, seq, head_dim)
        q = q.view(batch, seq, self.n_head, head_dim).transpose(1, 2)
        k = k.view(batch, seq, self.n_head, head_dim).transpose(1, 2)
        v = v.view(batch, seq, self.n_head, head_dim).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)
        y = y.transpose(1, 2).contiguous().view(batch, seq, n_embd)
        return self.c_proj(y)


class GPTMLP(nn.Module):
    def __init__(self, n_embd: int, bias: bool = True):
        super().__init__()
        self.c_fc = nn.Linear(n_embd, 4 * n_embd, bias=bias)
        self.c_proj = nn.Linear(4 * n_embd, n_embd, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(F.gelu(self.c_fc(x)))


class GPTBlock(nn.Module):
    """Pre-LayerNorm transformer block: ``x + attn(ln_1(x))``, then ``x + mlp(ln_2(x))``."""

    def __init__(self, n_embd: int, n_head: int, fused_qkv: bool = False, bias: bool = True):
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd, bias=bias)
        self.attn = CausalSelfAttention(n_embd, n_head, fused_qkv=fused_qkv, bias=bias)
        self.ln_2 = nn.LayerNorm(n_embd, bias=bias)
        self.mlp = GPTMLP(n_embd, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """nanoGPT without dropout. ``forward(idx, targets=None)``: the loss if targets, else logits.

    Parameter names follow nanoGPT: ``transformer.wte``, ``transformer.wpe``,
    ``transformer.h.{i}.{ln_1,attn,ln_2,mlp}``, ``transformer.ln_f`` and ``lm_head``. With
    ``tied`` (the default) ``lm_head.weight`` *is* ``transformer.wte.weight``, so
    ``named_parameters()`` lists it once, as ``transformer.wte.weight``, while ``state_dict()``
    holds both names.
    """

    def __init__(
        self,
        vocab_size: int = 256,
        block_size: int = 32,
        n_layer: int = 2,
        n_head: int = 4,
        n_embd: int = 64,
        tied: bool = True,
        fused_qkv: bool = False,
        bias: bool = True,
    ):
        super().__init__()
        self.config = dict(
            vocab_size=vocab_size,
            block_size=block_size,
            n_layer=n_layer,
            n_head=n_head,
            n_embd=n_embd,
            tied=tied,
            fused_qkv=fused_qkv,
            bias=bias,
        )
        self.block_size = block_size
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(vocab_size, n_embd),
                wpe=nn.Embedding(block_size, n_embd),
                h=nn.ModuleList(GPTBlock(n_embd, n_head, fused_qkv, bias) for _ in range(n_layer)),
                ln_f=nn.LayerNorm(n_embd, bias=bias),
            )
        )
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        if tied:
            self.lm_head.weight = self.transformer.wte.weight
        self.apply(self._init_weights)
        # GPT-2's scaled init of the projections into the residual stream.
        for name, param in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(param, mean=0.0, std=0.02 / math.sqrt(2 * n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        batch, seq = idx.shape
        if seq > self.block_size:
            raise InputError(
                f"sequence length {seq} exceeds block_size {self.block_size}: pass shorter sequences, or a larger block_size"
            )
        pos = torch.arange(seq, dtype=torch.long, device=idx.device)
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)
        for block in self.transformer.h:
            x = block(x)
        logits = self.lm_head(self.transformer.ln_f(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


class AttentionBlock(nn.Module):
    """Causal self-attention alone (separate q/k/v, output projection), for golden-plan tests.

    Under tensor parallelism Megatron splits ``attn.q_proj``/``k_proj``/``v_proj`` by columns
    (heads) and ``attn.c_proj`` by rows, with one all-reduce at the end.
    """

    def __init__(self, n_embd: int = 64, n_head: int = 8, bias: bool = True):
        super().__init__()
        self.config = dict(n_embd=n_embd, n_head=n_head, bias=bias)
        self.attn = CausalSelfAttention(n_embd, n_head, fused_qkv=False, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.attn(x)


class MLPBlock(nn.Module):
    """``fc2(gelu(fc1(x)))``, for golden-plan tests: Megatron splits fc1 by columns, fc2 by rows."""

    def __init__(self, d: int = 64, hidden: int = 256, bias: bool = True):
        super().__init__()
        self.config = dict(d=d, hidden=hidden, bias=bias)
        self.fc1 = nn.Linear(d, hidden, bias=bias)
        self.fc2 = nn.Linear(hidden, d, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class WithMSELoss(nn.Module):
    """``forward(x, target)`` returns ``mse_loss(module(x), target)``; parameters keep their names
    under the prefix ``module.``."""

    def __init__(self, module: nn.Module):
        super().__init__()
        self.module = module

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(self.module(x), target)


class SmallCNN(nn.Module):
    """conv → BatchNorm → relu → max-pool → conv → BatchNorm → relu → global avg-pool → linear.

    ``forward(x, y)`` returns the cross-entropy loss. In training mode BatchNorm updates its
    running statistics, so the exported graph mutates buffers.
    """

    def __init__(self, num_classes: int = 10, in_channels: int = 3, channels: int = 16):
        super().__init__()
        self.config = dict(num_classes=num_classes, in_channels=in_channels, channels=channels)
        # No conv biases: BatchNorm subtracts the mean right after, so a bias there is cancelled
        # and its gradient is exactly zero (as in ResNets).
        self.conv1 = nn.Conv2d(in_channels, channels, kernel_size=3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, 2 * channels, kernel_size=3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(2 * channels)
        self.fc = nn.Linear(2 * channels, num_classes)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.bn1(self.conv1(x))), 2)
        x = F.relu(self.bn2(self.conv2(x)))
        x = torch.flatten(F.adaptive_avg_pool2d(x, 1), 1)
        return F.cross_entropy(self.fc(x), y)


class RMSNorm(nn.Module):
    """``x / sqrt(mean(x²) + eps) * weight``, written out so that it traces to plain ATen ops."""

    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


class LlamaAttention(nn.Module):
    """Grouped-query attention with rotary position embeddings, as in LLaMA 2/3.

    ``n_kv_head`` key/value heads serve ``n_head`` query heads (``n_head % n_kv_head == 0``);
    the key/value heads are repeated (``expand`` + ``reshape``, as Hugging Face's ``repeat_kv``).
    """

    def __init__(self, n_embd: int, n_head: int, n_kv_head: int):
        super().__init__()
        if n_embd % n_head or n_head % n_kv_head:
            raise ConfigError(f"n_embd ({n_embd}) must divide by n_head ({n_head}), and n_head by n_kv_head ({n_kv_head})")
        self.n_head, self.n_kv_head, self.head_dim = n_head, n_kv_head, n_embd // n_head
        self.q_proj = nn.Linear(n_embd, n_head * self.head_dim, bias=False)
        self.k_proj = nn.Linear(n_embd, n_kv_head * self.head_dim, bias=False)
        self.v_proj = nn.Linear(n_embd, n_kv_head * self.head_dim, bias=False)
        self.o_proj = nn.Linear(n_head * self.head_dim, n_embd, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        q = self.q_proj(x).view(batch, seq, self.n_head, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(batch, seq, self.n_kv_head, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(batch, seq, self.n_kv_head, self.head_dim).transpose(1, 2)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        groups = self.n_head // self.n_kv_head
        if groups > 1:
            shape = (batch, self.n_kv_head, groups, seq, self.head_dim)
            k = k[:, :, None].expand(shape).reshape(batch, self.n_head, seq, self.head_dim)
            v = v[:, :, None].expand(shape).reshape(batch, self.n_head, seq, self.head_dim)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(batch, seq, self.n_head * self.head_dim))


class LlamaMLP(nn.Module):
    """SwiGLU: ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, n_embd: int, hidden: int):
        super().__init__()
        self.gate_proj = nn.Linear(n_embd, hidden, bias=False)
        self.up_proj = nn.Linear(n_embd, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, n_embd, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaBlock(nn.Module):
    def __init__(self, n_embd: int, n_head: int, n_kv_head: int, hidden: int, eps: float):
        super().__init__()
        self.input_layernorm = RMSNorm(n_embd, eps)
        self.self_attn = LlamaAttention(n_embd, n_head, n_kv_head)
        self.post_attention_layernorm = RMSNorm(n_embd, eps)
        self.mlp = LlamaMLP(n_embd, hidden)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class Llama(nn.Module):
    """A LLaMA-shaped decoder (RMSNorm, RoPE, grouped-query attention, SwiGLU, untied head).

    Parameter names follow Hugging Face's ``LlamaForCausalLM``: ``model.embed_tokens``,
    ``model.layers.{i}.{input_layernorm,self_attn,post_attention_layernorm,mlp}``,
    ``model.norm`` and ``lm_head``. ``forward(idx, targets=None)``: the loss if targets, else
    logits. The rotary tables are computed in forward from the positions, so a model built on
    the meta device holds no real tensors at all. ``LLAMA_SHAPES`` has the published sizes
    (``build_model("llama", **LLAMA_SHAPES["llama-3-8b"])``).
    """

    def __init__(
        self,
        vocab_size: int = 256,
        n_layer: int = 2,
        n_head: int = 4,
        n_kv_head: int = 2,
        n_embd: int = 64,
        hidden: int = 128,
        rope_theta: float = 10000.0,
        eps: float = 1e-5,
    ):
        super().__init__()
        self.config = dict(
            vocab_size=vocab_size,
            n_layer=n_layer,
            n_head=n_head,
            n_kv_head=n_kv_head,
            n_embd=n_embd,
            hidden=hidden,
            rope_theta=rope_theta,
            eps=eps,
        )
        self.head_dim, self.rope_theta = n_embd // n_head, rope_theta
        self.model = nn.ModuleDict(
            dict(
                embed_tokens=nn.Embedding(vocab_size, n_embd),
                layers=nn.ModuleList(LlamaBlock(n_embd, n_head, n_kv_head, hidden, eps) for _ in range(n_layer)),
                norm=RMSNorm(n_embd, eps),
            )
        )
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def rotary(self, seq: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        exponents = torch.arange(0, self.head_dim, 2, dtype=torch.float32, device=device) / self.head_dim
        inv_freq = 1.0 / (self.rope_theta**exponents)
        angles = torch.arange(seq, dtype=torch.float32, device=device)[:, None] * inv_freq[None, :]
        angles = torch.cat((angles, angles), dim=-1)
        return angles.cos(), angles.sin()

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        x = self.model.embed_tokens(idx)
        cos, sin = self.rotary(idx.shape[1], idx.device)
        cos, sin = cos.to(x.dtype), sin.to(x.dtype)
        for layer in self.model.layers:
            x = layer(x, cos, sin)
        logits = self.lm_head(self.model.norm(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


# ---------------------------------------------------------------------------------------------
# Mixture of experts


class Experts(nn.Module):
    """Stacked experts, laid out as Hugging Face's (``MixtralExperts``): ``gate_up_proj``
    [E, 2·I, H] (gate rows, then up rows) and ``down_proj`` [E, H, I]; each token copy runs
    its expert's SwiGLU MLP. ``forward(hidden_states [T, H], top_k_index [T, k],
    top_k_weights [T, k])`` sums the weighted outputs of each token's k experts."""

    def __init__(self, num_experts: int, n_embd: int, hidden: int):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.randn(num_experts, 2 * hidden, n_embd) * 0.02)
        self.down_proj = nn.Parameter(torch.randn(num_experts, n_embd, hidden) * 0.02)
        self.act_fn = nn.SiLU()

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(hidden_states)
        for expert in range(self.gate_up_proj.shape[0]):
            token, slot = torch.where(top_k_index == expert)
            gate, up = F.linear(hidden_states[token], self.gate_up_proj[expert]).chunk(2, dim=-1)
            y = F.linear(self.act_fn(gate) * up, self.down_proj[expert])
            out = out.index_add(0, token, y * top_k_weights[token, slot, None])
        return out


class SparseMoE(nn.Module):
    """A router (linear, softmax, top-k, renormalized weights) and ``Experts``, as Mixtral's."""

    def __init__(self, n_embd: int, hidden: int, num_experts: int, top_k: int):
        super().__init__()
        self.top_k = top_k
        self.gate = nn.Linear(n_embd, num_experts, bias=False)
        self.experts = Experts(num_experts, n_embd, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        tokens = x.reshape(-1, shape[-1])
        probs = F.softmax(self.gate(tokens), dim=-1)
        weights, index = torch.topk(probs, self.top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        return self.experts(tokens, index, weights).reshape(shape)


class MoEBlock(nn.Module):
    def __init__(self, n_embd: int, n_head: int, n_kv_head: int, hidden: int, num_experts: int, top_k: int, eps: float):
        super().__init__()
        self.input_layernorm = RMSNorm(n_embd, eps)
        self.self_attn = LlamaAttention(n_embd, n_head, n_kv_head)
        self.post_attention_layernorm = RMSNorm(n_embd, eps)
        self.mlp = SparseMoE(n_embd, hidden, num_experts, top_k)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class MoE(Llama):
    """A Mixtral-shaped decoder: ``Llama`` with every MLP a ``SparseMoE`` (a router choosing
    ``top_k`` of ``num_experts`` stacked experts per token). Parameter names follow Hugging
    Face's ``MixtralForCausalLM`` (``model.layers.{i}.mlp.gate``, ``...mlp.experts.gate_up_proj``,
    ``...mlp.experts.down_proj``).

    Routing takes the top k of a softmax: with random weights, ties between router scores have
    probability zero, so the choice is the same in eager and in any parallel run."""

    def __init__(
        self,
        vocab_size: int = 256,
        n_layer: int = 2,
        n_head: int = 4,
        n_kv_head: int = 2,
        n_embd: int = 64,
        hidden: int = 64,
        num_experts: int = 4,
        top_k: int = 2,
        rope_theta: float = 10000.0,
        eps: float = 1e-5,
    ):
        super().__init__(vocab_size, n_layer, n_head, n_kv_head, n_embd, hidden, rope_theta, eps)
        self.config.update(num_experts=num_experts, top_k=top_k)
        self.model.layers = nn.ModuleList(
            MoEBlock(n_embd, n_head, n_kv_head, hidden, num_experts, top_k, eps) for _ in range(n_layer)
        )
        for module in self.model.layers.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)


# Mixtral-8x7B's published sizes (Hugging Face config): 8 experts, top-2, SwiGLU width 14336.
MOE_SHAPES: dict[str, dict[str, Any]] = {
    "mixtral-8x7b": dict(
        vocab_size=32000, n_layer=32, n_head=32, n_kv_head=8, n_embd=4096, hidden=14336, num_experts=8, top_k=2, rope_theta=1e6
    ),
}


# Published LLaMA sizes (vocabulary, depth, heads, key/value heads, width, SwiGLU hidden width).
LLAMA_SHAPES: dict[str, dict[str, Any]] = {
    "llama-2-7b": dict(vocab_size=32000, n_layer=32, n_head=32, n_kv_head=32, n_embd=4096, hidden=11008),
    "llama-2-70b": dict(vocab_size=32000, n_layer=80, n_head=64, n_kv_head=8, n_embd=8192, hidden=28672),
    "llama-3-8b": dict(vocab_size=128256, n_layer=32, n_head=32, n_kv_head=8, n_embd=4096, hidden=14336, rope_theta=500000.0),
    "llama-3-70b": dict(vocab_size=128256, n_layer=80, n_head=64, n_kv_head=8, n_embd=8192, hidden=28672, rope_theta=500000.0),
    "llama-3.1-405b": dict(
        vocab_size=128256, n_layer=126, n_head=128, n_kv_head=8, n_embd=16384, hidden=53248, rope_theta=500000.0
    ),
}


# ---------------------------------------------------------------------------------------------
# By name

DEFAULT_CONFIGS: dict[str, dict[str, Any]] = {
    "mlp": dict(d_in=32, d_hidden=128, d_out=32, depth=2),
    "gpt": dict(vocab_size=256, block_size=32, n_layer=2, n_head=4, n_embd=64, tied=True, fused_qkv=False, bias=True),
    "attention": dict(n_embd=64, n_head=8, bias=True),
    "mlp_block": dict(d=64, hidden=256, bias=True),
    "cnn": dict(num_classes=10, in_channels=3, channels=16),
    "llama": dict(vocab_size=256, n_layer=2, n_head=4, n_kv_head=2, n_embd=64, hidden=128, rope_theta=10000.0, eps=1e-5),
    "moe": dict(
        vocab_size=256,
        n_layer=2,
        n_head=4,
        n_kv_head=2,
        n_embd=64,
        hidden=64,
        num_experts=4,
        top_k=2,
        rope_theta=10000.0,
        eps=1e-5,
    ),
}
MODEL_NAMES = tuple(DEFAULT_CONFIGS)

# Extra batch settings per model, not constructor arguments.
_BATCH_DEFAULTS: dict[str, dict[str, int]] = {
    "gpt": dict(seq_len=0),  # 0: the model's block_size
    "attention": dict(seq_len=16),
    "cnn": dict(image_size=16),
    "llama": dict(seq_len=16),
    "moe": dict(seq_len=16),
}


def _check_name(name: str) -> None:
    if name not in DEFAULT_CONFIGS:
        raise ConfigError(f"unknown model {name!r}; expected one of {list(MODEL_NAMES)}")


def build_model(name: str, seed: int = 0, **config: Any) -> nn.Module:
    """The model ``name`` with ``DEFAULT_CONFIGS[name]`` updated by ``config``, seeded with ``seed``.

    ``attention`` and ``mlp_block`` come wrapped in ``WithMSELoss``, so that forward(x, target)
    returns a loss and parameters are named ``module.attn.q_proj.weight``, ``module.fc1.weight``.
    """
    _check_name(name)
    unknown = set(config) - set(DEFAULT_CONFIGS[name])
    if unknown:
        raise ConfigError(f"unknown config for {name!r}: {sorted(unknown)}; expected some of {sorted(DEFAULT_CONFIGS[name])}")
    kwargs = {**DEFAULT_CONFIGS[name], **config}
    torch.manual_seed(seed)
    if name == "mlp":
        return MLP(**kwargs)
    if name == "gpt":
        return GPT(**kwargs)
    if name == "attention":
        return WithMSELoss(AttentionBlock(**kwargs))
    if name == "mlp_block":
        return WithMSELoss(MLPBlock(**kwargs))
    if name == "llama":
        return Llama(**kwargs)
    if name == "moe":
        return MoE(**kwargs)
    return SmallCNN(**kwargs)


def example_batch(name: str, batch_size: int = 8, seed: int = 0, **config: Any) -> tuple:
    """Positional inputs for ``build_model(name, **config)``'s forward, including the targets.

    ``config`` takes the same keys as ``build_model`` (only the shape-related ones matter) plus
    ``seq_len`` for ``gpt`` (default: ``block_size``), ``llama`` and ``moe`` (default 16) and ``attention``
    (default 16), and
    ``image_size`` for ``cnn`` (default 16). Draws from a private generator, so the global
    random state is left alone.
    """
    _check_name(name)
    allowed = set(DEFAULT_CONFIGS[name]) | set(_BATCH_DEFAULTS.get(name, {}))
    unknown = set(config) - allowed
    if unknown:
        raise ConfigError(f"unknown config for {name!r}: {sorted(unknown)}; expected some of {sorted(allowed)}")
    cfg = {**DEFAULT_CONFIGS[name], **_BATCH_DEFAULTS.get(name, {}), **config}
    gen = torch.Generator().manual_seed(seed)
    if name == "mlp":
        return (torch.randn(batch_size, cfg["d_in"], generator=gen), torch.randn(batch_size, cfg["d_out"], generator=gen))
    if name in ("gpt", "llama", "moe"):
        seq_len = cfg["seq_len"] or cfg["block_size"]
        tokens = torch.randint(0, cfg["vocab_size"], (batch_size, seq_len + 1), generator=gen)
        return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    if name == "attention":
        shape = (batch_size, cfg["seq_len"], cfg["n_embd"])
        return torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
    if name == "mlp_block":
        return (torch.randn(batch_size, cfg["d"], generator=gen), torch.randn(batch_size, cfg["d"], generator=gen))
    size = cfg["image_size"]
    return (
        torch.randn(batch_size, cfg["in_channels"], size, size, generator=gen),
        torch.randint(0, cfg["num_classes"], (batch_size,), generator=gen),
    )
