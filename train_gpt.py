"""Train the skip-middle gated Transformer (Lawson & Aitchison, 2025) on FineWeb shards, and
as further depth routers DLO (Tan et al. 2024), Mixture-of-Depths (Raposo et al. 2024) and
Mixture-of-Recursions (Bae et al. 2025).

    python train_gpt.py --preset=smoke                         # CPU, embedded sample, ~3 min
    torchrun --standalone --nproc_per_node=8 train_gpt.py      # the paper's configuration

Every field of Hyperparameters (the run's) and Job (one job's) is also --field=value (--help).
This file is the paper's path, read top to bottom, its banners in dependency order; README.md
names the modules beside it. Importing it has no side effects.

Deviations from Llama 3 (the paper's base model, Section 3.1): sandwich norm x +
Norm(Module(Norm(x))) (Section 2.3; `sandwich_norm=False`: pre-norm); an RMSNorm after the
embedding as well as before the untied head; SwiGLU hidden ffn_mult * dim, 3072 at 768, as the
authors' models (Table 2's ffn_dim_multiplier 4 and multiple_of 256 through Llama 3's formula
would give 8192; their code reads neither); every weight N(0, 0.02), norms 1, biases only on
gate linears; the embedding in float32 (`embed_dtype=bfloat16`: the authors').

Skip-middle, our choices where the paper is open or the authors' code differs:
  - Gate linears N(0, init_std), bias 0, like every weight (Section 3.1; at the paper's width
    most middle gates start closed); `gate_init=zero` (g = 1, the dense model) is an ablation.
  - ln g is added to the logit of the *key* j (eq. 3: g_j multiplies exp(q_i k_j)). The
    authors' code adds it on the query axis, which softmax cancels, so their attention was
    never gated: `gate_axis=query` reproduces that (no compact path: skipped tokens stay keys).
    Eq. 3's sum over j < i is read as j <= i, a token its own key (else token 0 has none).
  - ReLU in eq. 1 and eq. 2's clamp have subgradient 1 at their bounds (clamp_keep_grad, on
    every torch), so `gate_init=zero` gates learn.
  - The gate of block l < L/2 reads the stream entering block l (h^(i,l) is ambiguous).
  - Section 2.4's targets run linearly from mu_start at block 0 to mu_end at block L/2 - 1
    (the last gated one; the paper's index is L/2), as the authors' code (mean_targets).
  - Eq. 6's tolerance applies to |deviation| (authors' code): coefficients fall as well as rise;
    beta uses it with variance targets mu*(1 - mu*); eq. 4's variance is over N (their loss's:
    N - 1).
    `adaptive` is Table 1's gamma sign(dev) with no tolerance (theirs applies delta). The controller
    reads the global batch's statistics; each micro-step's regulariser its own micro-batch's.
  - Table 1's fixed coefficients (the paper gives none): alpha = fixed_coef, 0.1 for each
    sparsity* controller (the authors': 0.01, 0.01, 0.1); `sparsity_variance` sets beta =
    -fixed_coef, rewarding variance as Section 2.4 means it to (some gates zero, not all).
    `sparsity_variance_l2` is Table 1's squared deviation per layer (the authors' code: one
    unsquared L2 norm over the layers).
  - Validation reads val_tokens, 10,485,760 (modded-nanogpt's), at each val_every; Figure 2
    measured 100M: `--init_from=RUN --eval_only=true --val_tokens=99876864` (whole batches on 1, 2,
    4 or 8 ranks; the validation shard holds 100M).
  - FLOPs: matmuls only, causal attention (T(T+1)/2 pairs), per token at seq_len (docs/flops.md
    relates this to the authors' estimator, ~1.9x ours at the paper's size).
  - compact=True (but a block packed to every position, run as masked) and the KV-cached
    decoder weight a key with g = 0 by exactly 0, not 1e-6.
"""

import collections
import contextlib
import math
import os
import sys
from dataclasses import dataclass, fields, replace
from functools import lru_cache, partial
from typing import NamedTuple

import support  # (no torch: quick)

if __name__ == "__main__":
    support.exit_quietly_on_signals()  # a signal while torch loads: exit at once, quietly
    sys.modules["train_gpt"] = sys.modules[__name__]  # sources.py's import: this, not a copy

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.nn.attention.flex_attention import flex_attention  # noqa: E402

import ranks  # noqa: E402
import runlog  # noqa: E402
import runs  # noqa: E402
from data.shards import (  # noqa: E402
    BYTES_EOT,
    EOT,
    check_fingerprints,
    find_shards,
    read_shard,
    shard_fingerprint,
    shard_header,
    shard_tokens,
)
from ranks import Dist, add_sums, all_reduce_sums  # noqa: E402
from routers import (  # noqa: E402
    DLO,
    PACKS,
    Dense,
    MixtureOfDepths,
    MixtureOfRecursions,
    Router,
    packed_counts,
    packed_length,
    ran,
)
from runs import RunState  # noqa: E402
from support import STOP, UserError, check_fields, cli, fmt_list, setting  # noqa: E402

# -----------------------------------------------------------------------------
# Components: RMSNorm, rotary embeddings, SwiGLU


class RMSNorm(nn.RMSNorm):
    def forward(self, x):  # as Llama (and the authors' code): normalised in fp32, cast back to
        # x's dtype, then scaled (a bf16 x is rounded before the weight, not after)
        return F.rms_norm(x.float(), self.normalized_shape, eps=self.eps).type_as(x) * self.weight


class Rotary(nn.Module):
    """RoPE (Su et al. 2024) with Llama's interleaved pairs, table precomputed up to max_seq_len;
    scaled: Llama 3.1's frequencies (llama31_frequencies)."""

    def __init__(self, head_dim: int, max_seq_len: int, theta: float, scaled: bool = False):
        super().__init__()
        inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2).float() / head_dim)
        inv_freq = llama31_frequencies(inv_freq) if scaled else inv_freq
        angles = torch.outer(torch.arange(max_seq_len).float(), inv_freq)  # (T_max, hd/2)
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def forward(self, x, pos=None):
        """x: (B, H, T, hd); pos: (B, T) positions (packed or cached tokens), None: 0..T-1."""
        if pos is None:
            cos, sin = self.cos[: x.size(2)], self.sin[: x.size(2)]  # (T, hd/2)
        else:
            cos, sin = self.cos[pos][:, None], self.sin[pos][:, None]  # (B, 1, T, hd/2)
        x1, x2 = x.float().unflatten(-1, (-1, 2)).unbind(-1)  # even / odd features
        return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), -1).flatten(-2).type_as(x)


def llama31_frequencies(inv_freq: torch.Tensor) -> torch.Tensor:
    """Llama 3.1's RoPE scaling (factor 8 past a wavelength of 8192 / 1, none under 8192 / 4,
    interpolated between: Meta's constants), in the authors' order of float32 operations."""
    factor, low, high, context = 8, 1, 4, 8192
    wavelen = 2 * math.pi / inv_freq
    smooth = (context / wavelen - low) / (high - low)
    between = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    scaled = torch.where(wavelen > context / low, inv_freq / factor, between)
    return torch.where(wavelen < context / high, inv_freq, scaled)


class SwiGLU(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)  # gate branch
        self.w3 = nn.Linear(dim, hidden, bias=False)  # value branch
        self.w2 = nn.Linear(hidden, dim, bias=False)  # down projection

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


# -----------------------------------------------------------------------------
# Gated attention (eq. 3) and the gated block (Section 2)


@lru_cache(maxsize=64)
def causal_block_mask(T: int, device: str):
    from torch.nn.attention.flex_attention import create_block_mask

    return create_block_mask(lambda b, h, q, kv: q >= kv, None, None, T, T, device=device)


@lru_cache(maxsize=2)
def flex_attention_fn(compiled: bool):
    """Flex fuses (and has a backward) only compiled; on CPU it runs eagerly, forward only."""
    return torch.compile(flex_attention, dynamic=False) if compiled else flex_attention


@torch.library.custom_op("depth_routing::stored", mutates_args=())
def stored(x: torch.Tensor) -> torch.Tensor:
    """An identity Inductor cannot fuse: torch 2.11's Inductor inlined a score_mod's inputs into
    the Flex kernel and failed ("convert FlexibleLayout to FixedLayout first", on an H100)."""
    return x.clone()


stored.register_fake(torch.empty_like)
stored.register_autograd(lambda ctx, grad: grad)


def gated_attention(q, k, v, log_g, mask=None, axis: str = "key"):
    """Causal attention with ln g added to the logits. q: (B, H, T, hd); k, v: (B, H_kv, T, hd);
    log_g: (B, T) per position or None. axis 'key': logit (i, j) gets ln g_j (eq. 3); 'query':
    ln g_i (the authors' code), which softmax cancels. mask: a BlockMask -> Flex with a
    score_mod; None -> SDPA with an fp32 additive mask (exact, and trains on CPU)."""
    gqa = q.size(1) != k.size(1)
    if mask is not None:
        log_g = None if log_g is None else stored(log_g)

        def mod(score, b, h, q_idx, kv_idx):  # the score_mod
            return score + log_g[b, kv_idx if axis == "key" else q_idx]

        # in a compiled region (compile_model's) Flex itself: Dynamo would trace through the
        # cache and the nested compile to the same graph, warning of the cache
        flex = flex_attention if torch.compiler.is_compiling() else flex_attention_fn(q.is_cuda)
        return flex(
            q, k, v, score_mod=None if log_g is None else mod, block_mask=mask, enable_gqa=gqa
        )
    if log_g is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
    T = q.size(2)
    future = torch.ones(T, T, dtype=torch.bool, device=q.device).triu(1)
    per = log_g.float()[:, None, None, :] if axis == "key" else log_g.float()[:, None, :, None]
    bias = torch.zeros(T, T, device=q.device).masked_fill(future, -math.inf) + per  # (B, 1, Tq, Tk)
    return F.scaled_dot_product_attention(
        q.float(), k.float(), v.float(), attn_mask=bias, enable_gqa=gqa
    ).type_as(q)


FLEX_MIN_HEAD_DIM = 16  # Inductor's Flex kernels refuse smaller head dimensions


def attention_impl(hp: "Hyperparameters", cuda: bool) -> str:
    """attn_impl; auto: Flex on CUDA (its backward needs it) at head dim >= 16, else SDPA."""
    if hp.attn_impl != "auto":
        return hp.attn_impl
    return "flex" if cuda and hp.dim // hp.n_heads >= FLEX_MIN_HEAD_DIM else "sdpa"


class Attention(nn.Module):
    """Grouped-query attention (Ainslie et al. 2023) with RoPE and optional gating of keys."""

    def __init__(self, hp: "Hyperparameters"):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.gate_axis = hp.n_heads, hp.n_kv_heads, hp.gate_axis
        self.head_dim = hp.dim // hp.n_heads
        self.wq = nn.Linear(hp.dim, hp.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(hp.dim, hp.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(hp.dim, hp.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(hp.n_heads * self.head_dim, hp.dim, bias=False)
        self.rotary = Rotary(self.head_dim, hp.max_seq_len, hp.rope_theta, hp.rope_scaling)

    def forward(self, x, log_g, mask, pos=None, cache=None):
        """x: (B, T, d); log_g: (B, T) per position or None; pos: (B, T) positions or None.
        cache: (KVCache, layer) to decode one token (B = T = 1) against the cached keys."""
        B, T, _ = x.shape
        q = self.wq(x).view(B, T, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)
        q, k = self.rotary(q, pos), self.rotary(k, pos)
        if cache is None:
            y = gated_attention(q, k, v, log_g, mask, self.gate_axis)
        else:  # sample.py; on the query axis ln g is one constant on this row (softmax cancels it)
            y = cache[0].attend(cache[1], q, k, v, log_g if self.gate_axis == "key" else None)
        return self.wo(y.transpose(1, 2).reshape(B, T, -1))


class Block(nn.Module):
    """x + g * Norm(Attn(Norm(x))), then x + g * Norm(FFN(Norm(x))) (Sections 2, 2.3). g: (B, T, 1)
    or None (dense); keys: each token's weight as a key (eq. 3), by default g."""

    def __init__(self, hp: "Hyperparameters"):
        super().__init__()
        self.attn = Attention(hp)
        self.ffn = SwiGLU(hp.dim, hp.ffn_mult * hp.dim)
        self.attn_in, self.ffn_in = RMSNorm(hp.dim, hp.norm_eps), RMSNorm(hp.dim, hp.norm_eps)
        self.attn_out = RMSNorm(hp.dim, hp.norm_eps) if hp.sandwich_norm else nn.Identity()
        self.ffn_out = RMSNorm(hp.dim, hp.norm_eps) if hp.sandwich_norm else nn.Identity()
        self.gate_eps = hp.gate_eps

    def attend(self, x, g, mask, pos=None, cache=None, keys=None):  # x + g Norm(Attn(Norm(x)))
        keys = g if keys is None else keys  # log_g below: (B, T), per key
        log_g = None if keys is None else keys.squeeze(-1).float().clamp(min=self.gate_eps).log()
        y = self.attn_out(self.attn(self.attn_in(x), log_g, mask, pos, cache))
        return x + (y if g is None else g * y)

    def mlp(self, x):  # the FFN branch, without the residual
        return self.ffn_out(self.ffn(self.ffn_in(x)))

    def forward(self, x, g, mask, *, compact=False, pos=None, cache=None, keys=None, length=None):
        """compact: attention and FFN on the tokens with keys > 0 only, packed to `length` (see
        pack); exact, as a token with keys = g = 0 adds nothing to its residual and is invisible
        as a key."""
        if compact and g is not None:
            return self.forward_compact(x, g, mask, g if keys is None else keys, length)
        return self.every_token(x, g, mask, pos, cache, keys)

    def every_token(self, x, g, mask, pos=None, cache=None, keys=None):
        """The block on every token of x."""
        x = self.attend(x, g, mask, pos, cache, keys)
        return x + (self.mlp(x) if g is None else g * self.mlp(x))

    @staticmethod
    def pack(active, length=None):
        """active: (B, T) bool -> pos: the positions of each sequence's active tokens first, in
        order, then its inactive ones (the padding), (B, Tc); None where Tc >= T (every position:
        packing would only add its cost, 1.09-1.12x masked's forward+backward time at sparsity 0
        in three bench calls on an H200, records/2026-11-28_gpu_check_NVIDIA_H200). Tc = length,
        known on the host (no sync); a sequence with more active tokens loses those past it, so
        whoever gives lengths checks packed_counts (train_step redoes such a step at full
        length). Without one, Tc is packed_size's. At least 1: with no active token a block
        still runs on one padding token (g = 0, x unchanged) and every parameter gets a (zero)
        gradient: under DDP a rank where a block's parameters got none would stall the
        all-reduce."""
        T = active.size(1)
        Tc = Block.packed_size(active) if length is None else length
        return None if Tc >= T else (~active).to(torch.int8).argsort(dim=1, stable=True)[:, :Tc]

    @staticmethod
    def packed_size(active) -> int:
        """The most active tokens any sequence of active (B, T) has, read on the host (a sync:
        evaluation) and rounded up as packed_length rounds, so that a compiled block sees few
        shapes."""
        return packed_length(int(active.sum(dim=1).max()), active.size(1))

    def forward_compact(self, x, g, mask, keys, length):
        """The active tokens (keys > 0) packed to `length` and run there (packed). Packed to
        every position, the block runs as masked (a g = 0 key weighted by gate_eps)."""
        if length is None:
            length = self.packed_size(keys.squeeze(-1) > 0)
        # (skip_middle's and MoR's key weight is their gate: masked's graph)
        if length >= x.size(1):
            return self.every_token(x, g, mask, keys=None if keys is g else keys)
        mask = None if mask is None else causal_block_mask(length, str(x.device))
        # g and keys as one input: as two, one tensor or two would compile two graphs a length
        return self.packed(x, torch.cat((g, keys), dim=-1), mask, length, keys.requires_grad)

    def packed(self, x, gk, mask, length, keys_grad):
        """The active tokens packed (pack), run with their positions, scattered back: causality
        by packed index is causality by position, and the padding, inactive tokens (keys = g = 0)
        after every active one, is seen by no active query and left unchanged. One compiled
        region per length (compile_model): the packing's sort, gathers and scatter in the
        block's graph, not launched eagerly around it (measured on an H200:
        records/2026-11-30_gpu_check_NVIDIA_H200). keys_grad: whether keys learn (skip-middle's
        gate; not MoD's or MoR's choices, whose gradient through ln keys would be wasted)."""
        pos = self.pack(gk[..., 1] > 0, length)  # (B, Tc); gk: (B, T, 2), g and keys
        index = pos[..., None].expand(-1, -1, x.size(-1))
        gc, kc = gk.gather(1, pos[..., None].expand(-1, -1, 2)).split(1, dim=-1)
        kc = kc if keys_grad else kc.detach()
        return x.scatter(1, index, self.every_token(x.gather(1, index), gc, mask, pos=pos, keys=kc))


# -----------------------------------------------------------------------------
# The skip-middle router (Sections 2.1-2.4); the Router base and the others: routers.py


def clamp_keep_grad(x: torch.Tensor, low: float, high: float = math.inf) -> torch.Tensor:
    """clamp(x, low, high) with gradient 1 on [low, high], bounds included, on every torch
    (2.15 made clamp's gradient 0 at a bound): eq. 1's ReLU and eq. 2 at exactly 0."""
    return torch.where((x >= low) & (x <= high), x, x.detach().clamp(low, high))


def mean_targets(hp: "Hyperparameters") -> torch.Tensor:
    """(L,) per layer: linspace(mu_start, mu_end) over the first half, mirrored (Section 2.4)."""
    half = torch.linspace(hp.mu_start, hp.mu_end, hp.n_layers // 2, dtype=torch.float64)
    return torch.cat([half, half.flip(0)])


class GateController(nn.Module):
    """The loss on the per-layer gate mean and variance and its coefficients' update (Table 1):
    proportional_tol, eq. 5 loss and eq. 6 update (the paper's); proportional / adaptive, gamma
    dev / gamma sign(dev); sparsity*, fixed coefficients; none, no loss. alpha and beta are
    float64 buffers on the model's device (no host copy), checkpointed via routing_state."""

    def __init__(self, hp: "Hyperparameters"):
        super().__init__()
        self.kind, self.gamma, self.delta = hp.controller, hp.gamma, hp.delta
        mu = mean_targets(hp)
        adaptive = "gamma" in CONTROLLERS[self.kind].split()  # (gamma: the rate they adapt at)
        init = 0.0 if adaptive else hp.fixed_coef
        beta = {"sparsity": 0.0, "sparsity_variance": -init}.get(self.kind, init)  # (docstring)
        for name, v in (
            ("mu", mu),  # (L,) mean targets
            ("var", mu * (1 - mu)),  # (L,) Bernoulli variance targets
            ("alpha", torch.full_like(mu, init)),
            ("beta", torch.full_like(mu, beta)),
        ):
            self.register_buffer(name, v, persistent=False)

    def loss(self, gates):
        """gates: (L, B, T) -> scalar; eq. (4) statistics over this micro-batch."""
        if self.kind == "none":
            return gates.new_zeros(())
        mean, var = gates.mean(dim=(1, 2)), gates.var(dim=(1, 2), unbiased=False)
        a, b, mu, tv = (t.to(gates) for t in (self.alpha, self.beta, self.mu, self.var))
        l2 = self.kind == "sparsity_variance_l2"
        terms = a * (mean - mu) ** 2 + b * (var - tv) ** 2 if l2 else a * mean + b * var
        return terms.mean()  # (1/L) sum over layers

    def update(self, mean, var):
        """mean, var: (L,) statistics of the whole global batch, identical on every rank."""
        for c, dev in ((self.alpha, mean.double() - self.mu), (self.beta, var.double() - self.var)):
            if self.kind == "proportional_tol":
                c += self.gamma * dev * (dev.abs() > self.delta)  # eq. (6)
            elif self.kind == "proportional":
                c += self.gamma * dev
            elif self.kind == "adaptive":
                c += self.gamma * torch.sign(dev)


class SkipMiddle(Router):
    """The paper's router (Sections 2.1-2.4): block l < L/2 reads s_l = ReLU(w.h + b) (eq. 1);
    g_l = 1 - clamp(sum_{k<=l} s_k, 0, 1) (eq. 2) scales both residual branches and weights the
    token as a key by ln g (eq. 3); block L-1-l reuses g_l. Trace: "gates" (L, B, T), "S" sums."""

    expandable = False  # the gates and their mirror are tied to the layer count
    means = {"gate_mean": "gates"}

    def __init__(self, hp):
        super().__init__(hp)
        self.gates = nn.ModuleList(nn.Linear(hp.dim, 1, bias=True) for _ in range(hp.n_layers // 2))
        self.ctrl = GateController(hp)

    def reset_parameters(self):
        for gate in self.gates:  # weights N(0, init_std) like every weight (Section 3.1), bias 0
            nn.init.zeros_(gate.bias)
            if self.hp.gate_init == "zero":  # ablation: every g is exactly 1, the dense model
                nn.init.zeros_(gate.weight)

    def run(self, layer, block, x, trace, mask, pos=None, cache=None):
        L = self.hp.n_layers
        if layer < L // 2:
            # eq. (1): s = ReLU(w.h + b), d/dz at z = 0 is 1 (module docstring)
            s = clamp_keep_grad(self.gates[layer](x).float(), 0.0)[..., 0]  # (B, T)
            trace["S"].append(s if layer == 0 else trace["S"][-1] + s)
            trace["gates"].append(1.0 - clamp_keep_grad(trace["S"][-1], 0.0, 1.0))  # eq. (2)
        else:
            trace["gates"].append(trace["gates"][L - 1 - layer])  # block L-1-l reuses g_l
        g = trace["gates"][-1][..., None].type_as(x)  # (B, T, 1)
        # decoding a token skipped under key gating: run nothing (invisible later); under
        # query gating later tokens still attend to it, so its K/V are computed
        if cache is None or self.hp.gate_axis == "query" or bool(g.any()):
            compact = self.hp.compact and cache is None
            x = block(x, g, mask, compact=compact, pos=pos, cache=cache, length=self.length(layer))
        ran(trace, trace["gates"][-1] > 0)
        return x

    @staticmethod
    def check(hp):
        if hp.n_layers % 2:
            return f"n_layers={hp.n_layers}: a gated model needs an even number of layers"
        if hp.compact and hp.gate_axis == "query":
            return (
                "compact=true needs gate_axis=key: with the gate on the query axis later "
                "tokens still attend to a skipped token, so it cannot be dropped"
            )
        return ""

    @staticmethod
    def weighs_keys(hp):  # (on the query axis softmax cancels ln g)
        return hp.gate_axis == "key"

    @classmethod
    def idle(cls, hp):  # and the controller knobs its controller does not read
        knobs = {k for read in CONTROLLERS.values() for k in read.split()}
        unread = knobs - set(CONTROLLERS[hp.controller].split())
        idle = {**super().idle(hp), **dict.fromkeys(unread, f"controller={hp.controller}")}
        if hp.n_layers == 2 and "mu_end" not in idle:  # (mean_targets: one block, at mu_start)
            idle["mu_end"] = "n_layers=2: one gated block, its target mu_start"
        return idle

    def loss(self, route, step):
        g = route["gates"].detach().double()
        return self.ctrl.loss(route["gates"]), torch.stack([g.sum((1, 2)), (g * g).sum((1, 2))])

    def update(self, sums, count, step):
        mean = sums[0] / count
        self.ctrl.update(mean, sums[1] / count - mean * mean)

    def log_lines(self, v):
        return [f"  gate_mean:{fmt_list(v['gate_mean'])}"]

    def state_lines(self, step):
        c = self.ctrl
        return [f"  alpha:{fmt_list(c.alpha.tolist())} beta:{fmt_list(c.beta.tolist())}"]

    @staticmethod
    def extra_flops(hp, T):
        return (hp.n_layers // 2) * T * 2 * hp.dim  # gate linears' matmuls, all tokens

    @staticmethod
    def skipped_tokens_are_keys(hp):
        return hp.gate_axis == "query"  # later tokens still attend to a skipped one

    def zero_targets(self):  # None per layer: a controller that does not read mu aims at none
        aims = "mu_start" in CONTROLLERS[self.hp.controller].split()
        return [1 - m if aims else None for m in mean_targets(self.hp).tolist()]

    def routing_state(self):
        return {"controller": {k: getattr(self.ctrl, k).cpu().clone() for k in ("alpha", "beta")}}

    def load_routing_state(self, state):
        for k in ("alpha", "beta"):
            getattr(self.ctrl, k).copy_(state["controller"][k])


ROUTERS = {
    "none": Dense,
    "skip_middle": SkipMiddle,
    "dlo": DLO,
    "mod": MixtureOfDepths,
    "mor": MixtureOfRecursions,
}
CONTROLLERS = {  # Table 1's controllers (GateController), and the fields each one reads
    "proportional_tol": "mu_start mu_end gamma delta",
    "proportional": "mu_start mu_end gamma",
    "adaptive": "mu_start mu_end gamma",
    "sparsity": "fixed_coef",
    "sparsity_variance": "fixed_coef",
    "sparsity_variance_l2": "mu_start mu_end fixed_coef",
    "none": "",
}

# -----------------------------------------------------------------------------
# The model


class Output(NamedTuple):
    logits: torch.Tensor  # (B, T, V) fp32; None when the loss was asked for instead
    loss: torch.Tensor  # mean cross-entropy against the targets, when given
    route: dict  # the trace stacked: "block", "mlp" (L, B, T) bool and the router's own
    resid: torch.Tensor  # (L,) mean L2 norm of the residual after each block (eval only)


class LinearCrossEntropy(torch.autograd.Function):
    """Summed cross-entropy of h W^T against targets, `rows` rows at a time: the (N, V) logits and
    their gradient (6.6 GB each in fp32 at the paper's device batch) never exist whole. Each
    chunk's gradients for h and W (softmax minus one-hot) are formed at once and kept; backward
    scales them. No buffer is made before and written after: torch 2.11's compile saved such
    buffers as they were before the writes (all gradients 0)."""

    @staticmethod
    def forward(ctx, h, weight, targets, rows: int, grads: bool):
        """h: (N, d); weight: (V, d); targets: (N,) -> scalar fp32 sum over the N rows. The
        softmax gradient is cast once to the first product's precision (autocast's, or h's) for
        both of its products (grad_w's transposed cast took 8 ms of an H200's 90 ms step,
        records/2026-11-28_gpu_check_NVIDIA_H200), and grad_w sums the chunks in fp32."""
        w, total, grad_h, grad_w = weight.to(h.dtype), torch.zeros((), device=h.device), [], 0.0
        for i in range(0, h.size(0), rows):
            hc, tc = h[i : i + rows], targets[i : i + rows]
            product = hc @ w.t()  # (n, V) in the products' precision
            logits = product.float()  # the only logits alive
            picked = logits.gather(1, tc[:, None])[:, 0]
            top = logits.amax(dim=-1)
            e = logits.sub_(top[:, None]).exp_()  # in place: no second (n, V) buffer
            z = e.sum(dim=-1)
            total = total + (top + z.log() - picked).sum()  # logsumexp - the target's logit
            if grads:
                p = e.div_(z[:, None])  # the softmax
                p[torch.arange(len(tc), device=h.device), tc] -= 1.0
                p = p.to(product.dtype)
                grad_h.append(p @ w)
                grad_w = grad_w + (p.t() @ hc).float()
        ctx.save_for_backward(torch.cat(grad_h) if grads else None, grad_w if grads else None)
        ctx.weight_dtype = weight.dtype
        return total

    @staticmethod
    def backward(ctx, grad):
        dh, dw = ctx.saved_tensors  # forward's gradients of h and the weight, for grad = 1
        return dh * grad.to(dh.dtype), (dw * grad).to(ctx.weight_dtype), None, None, None


class GPT(nn.Module):
    def __init__(self, hp: "Hyperparameters"):
        super().__init__()
        self.hp = hp
        self.embed = nn.Embedding(hp.vocab_size, hp.dim)
        self.embed_norm = RMSNorm(hp.dim, hp.norm_eps)
        self.blocks = nn.ModuleList(Block(hp) for _ in range(ROUTERS[hp.router].n_blocks(hp)))
        self.router = ROUTERS[hp.router](hp)
        self.head_norm = RMSNorm(hp.dim, hp.norm_eps)
        self.head = nn.Linear(hp.dim, hp.vocab_size, bias=False)
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, mean=0.0, std=hp.init_std)
        self.router.reset_parameters()

    def forward(self, idx, pos=None, cache=None, targets=None, per_token=False) -> Output:
        """idx: (B, T) token ids; with a KVCache one token (1, 1) at position pos (1, 1), kept as
        K/V only in the blocks it runs. Routing follows model.train() / model.eval(). With targets
        (B, T): the mean cross-entropy (chunked, loss_rows), no logits; per_token: each token's,
        (B, T)."""
        # Flex: one causal block mask per forward (eagerly: lru_cache per length), none decoding
        flex = cache is None and attention_impl(self.hp, idx.is_cuda) == "flex"
        mask = causal_block_mask(idx.size(1), str(idx.device)) if flex else None
        trace = collections.defaultdict(list)
        x = self.embed(idx).to(getattr(torch, self.hp.embed_dtype))  # (B, T, d)
        x = self.router(self.blocks, self.embed_norm(x), trace, mask, pos, cache)
        route = {k: torch.stack(v) for k, v in trace.items()}
        resid = route.pop("resid", None)
        return Output(*self.readout(x, targets, per_token), route, resid)

    def readout(self, x, targets=None, per_token=False):  # -> (logits, None) or (None, loss)
        h = self.head_norm(x)
        if targets is None:
            return self.head(h).float(), None
        h, weight = h.flatten(0, 1), self.head.weight
        if per_token:  # loss_rows rows of logits at a time, as LinearCrossEntropy computes them
            w, rows = weight.to(h.dtype), self.hp.loss_rows
            return None, torch.cat(
                [
                    F.cross_entropy((hc @ w.t()).float(), tc, reduction="none")
                    for hc, tc in zip(h.split(rows), targets.flatten().split(rows), strict=True)
                ]
            ).view_as(targets)
        grads = torch.is_grad_enabled() and (h.requires_grad or weight.requires_grad)
        total = LinearCrossEntropy.apply(h, weight, targets.flatten(), self.hp.loss_rows, grads)
        return None, total / targets.numel()


# -----------------------------------------------------------------------------
# Data: modded-nanogpt shards, in order, one global batch per step (format: data/shards.py)


class DistributedLoader:
    """Walks the shards in order, cycling. Each step takes one contiguous global batch of
    B_global * T (+1) tokens; rank r gets sequences [r B_local, (r + 1) B_local): the same global
    batch at every world size; a shard's last tokens short of one are left, and a shard shorter
    than one global batch (a corpus's last, say) is passed over, never read. Every header (and
    encoding) is checked up front, so a bad shard stops the run before it starts; token ids are
    checked as each shard is loaded, and each is fingerprinted (state()'s "read"), so that a
    resume finds one replaced or re-tokenized."""

    def __init__(
        self,
        pattern: str,
        B_local: int,
        T: int,
        rank: int,
        world: int,
        vocab_size: int = 2**16,
        encoding: str = None,
    ):
        self.files, step = find_shards(pattern), B_local * T * world
        self.batches = []  # per shard: the global batches next_batch takes from it
        for path in self.files:
            count, found = shard_header(path)
            if encoding not in (None, found):
                raise UserError(
                    f"{path} holds {found} tokens, but encoding={encoding}: train a "
                    f"{found} model on it (--encoding={found}), or give {encoding} shards"
                )
            self.batches.append(max(0, (count - 1) // step))
        if not any(self.batches):
            raise UserError(
                f"no shard that {pattern} matches holds one batch over the ranks (ranks x "
                f"sequences x length + 1 = {world} x {B_local} x {T} + 1 = {step + 1} tokens): "
                f"give a smaller batch, or more tokens a shard"
            )
        self.B, self.T, self.rank, self.world, self.vocab_size = B_local, T, rank, world, vocab_size
        self.shard, self.read = None, {}  # read: {index: shard_fingerprint} of those loaded
        self.reset()

    def reset(self):
        self.laps = 0  # passes finished over every shard
        self._load(next(i for i, n in enumerate(self.batches) if n))

    def state(self) -> dict:
        return {
            "shard": self.shard,
            "pos": self.pos,
            "read": [[i, *f] for i, f in sorted(self.read.items())],
            "laps": self.laps,
            "files": len(self.files),
        }

    def restore(self, state: dict):
        """state: a checkpoint's, which loaders() checked (check_position) before anything was
        written (not again here: the fingerprints read every shard the run had read)."""
        self.read.update({i: kept for i, *kept in state.get("read", [])})  # (kept on)
        self.laps = state.get("laps", 0)  # (unknown before they were counted)
        self._load(state["shard"])
        self.pos = state["pos"]

    def check_position(self, state: dict):
        """A checkpoint's data position (state()) must lie in these shards (changed or edited?),
        and the shards the run had read must be the same (check_fingerprints)."""
        state = state if isinstance(state, dict) else {}
        shard, pos = state.get("shard"), state.get("pos")
        if not (
            type(shard) is type(pos) is int
            and 0 <= shard < len(self.files)
            and 0 <= pos <= shard_tokens(self.files[shard]) - self.B * self.T * self.world - 1
        ):
            raise UserError(
                f"the checkpoint's data position (shard {shard}, token {pos}) is "
                f"not in the training shards now matched ({len(self.files)} files); "
                f"resume with the run's own train_files and batch size"
            )
        check_fingerprints(self.files, state)

    def fingerprints(self, batches: int) -> dict:
        """A checkpoint's record (state()'s form, for check_fingerprints) of the shards that the
        first `batches` global batches read: a validation's, the same at every one."""
        read = []
        for i, n in enumerate(self.batches):
            if batches <= 0:
                break
            if n:  # (a shard passed over is never read)
                read.append([i, *shard_fingerprint(self.files[i])])
                batches -= n
        return {"read": read, "laps": 0, "files": len(self.files)}

    def _load(self, shard: int):
        if shard != self.shard:  # the validation shard stays in memory between evaluations
            self.tokens = read_shard(self.files[shard], self.vocab_size)
            self.read[shard] = shard_fingerprint(self.files[shard], self.tokens)
        self.shard, self.pos = shard, 0

    def next_batch(self):
        """-> x, y: (B_local, T) int64, inputs and next-token targets."""
        start = self.pos + self.rank * self.B * self.T
        buf = torch.from_numpy(self.tokens[start : start + self.B * self.T + 1].astype(np.int64))
        self.pos += self.B * self.T * self.world
        if self.pos + self.B * self.T * self.world + 1 > len(self.tokens):
            shard = self.shard
            while True:  # to the next shard that holds a global batch, counting the passes
                if shard + 1 == len(self.files):
                    self.laps += 1
                shard = (shard + 1) % len(self.files)
                if self.batches[shard]:
                    break
            self._load(shard)
        return buf[:-1].view(self.B, self.T), buf[1:].view(self.B, self.T)


# -----------------------------------------------------------------------------
# FLOPs: forward pass of one sequence of seq_len tokens, 2 per multiply-add


def forward_flops(hp: "Hyperparameters", active=None, mlp_active=None, pairs=None) -> float:
    """Forward FLOPs of one sequence of T = seq_len tokens (the convention: docs/flops.md).
    active / mlp_active: per layer, the share a of tokens that run the block / its MLP (None: all
    / as active); pairs: per layer, the mean causal query-key pairs of the active tokens
    (route_sums), else a^2 T(T+1)/2. Where skipped tokens stay keys (the query-axis gate), K/V
    run for every token and attention for a T(T+1)/2 pairs, whatever pairs says."""
    T, d, hd = hp.seq_len, hp.dim, hp.dim // hp.n_heads
    kv = hp.n_kv_heads * hd
    proj_qo, proj_kv = 2 * 2 * d * d, 2 * 2 * d * kv  # q and o, k and v per token
    keys_stay = ROUTERS[hp.router].skipped_tokens_are_keys(hp)
    ffn = 2 * 3 * d * hp.ffn_mult * d  # SwiGLU per token
    total = 2 * T * d * hp.vocab_size  # head
    for layer in range(hp.n_layers):
        a = 1.0 if active is None else float(active[layer])
        m = a if mlp_active is None else float(mlp_active[layer])
        k = 1.0 if keys_stay else a  # the share of tokens that are keys
        p = a * k * T * (T + 1) / 2 if pairs is None or keys_stay else float(pairs[layer])
        # attention: 2 x 2 per head dim and query-key pair (the scores q.k, the sum of v)
        total += a * T * proj_qo + k * T * proj_kv + 2 * 2 * hp.n_heads * hd * p + m * T * ffn
    return total + ROUTERS[hp.router].extra_flops(hp, T)


def mfu(hp: "Hyperparameters", step_s: float, world: int, peak: float, stats=None) -> float:
    """Model FLOPs utilisation of one step: 3x the forward FLOPs of the work executed on its
    batch_size x seq_len tokens over all devices' peak. stats: a training step's sums
    (train_step), whose blocks' shares and query-key pairs are the work that ran (compact)."""
    active, pairs = None, None
    if hp.compact and stats is not None:  # all tokens, except what compact really skips
        n = stats["tokens"][0]
        active = [a / n for a in stats["block_active"]]
        pairs = [p * hp.seq_len / n for p in stats["attn_pairs"]]
    return 3 * forward_flops(hp, active, pairs=pairs) * hp.batch_size / step_s / (peak * world)


# -----------------------------------------------------------------------------
# Settings: the run's (Hyperparameters) and the job's (Job); a model's source, read and checked
# for --resume, --init_from and --eval_only: sources.py (it reads the names below)


trains = partial(setting, use="train")  # a field that training alone reads (not --eval_only)
initial = partial(setting, use="init")  # one that a new model's initial weights alone read
# a field that one router alone reads (setting it under another: an error)
on_skip_middle = partial(setting, router="skip_middle")
on_dlo = partial(setting, router="dlo")
on_mod = partial(setting, router="mod")
on_mor = partial(setting, router="mor")


@dataclass
class Hyperparameters:
    """What defines a run: a checkpoint stores it, a resume restores it. Each field is a
    support.setting (its docstring: what its facts mean; trains, initial, on_ROUTER: above; what
    they refuse: sources.check_source). The comments in it are for readers: no code reads them."""

    # data
    train_files: str = trains("data/fineweb10B/fineweb_train_*.bin", help="training shards (glob)")
    val_files: str = setting("data/fineweb10B/fineweb_val_*.bin", help="validation shards (glob)")
    encoding: str = setting("gpt2", ("gpt2", "bytes"), "GPT-2 BPE | UTF-8 bytes", fixed=True)
    # model (paper Table 2)
    vocab_size: int = setting(50257, "[2, 65536]", "GPT-2 BPE; bytes: 256", fixed=True)
    n_layers: int = setting(12, "[1, inf)", "L, must be even when gated", fixed=True)
    dim: int = setting(768, "[1, inf)", "model width d", fixed=True)
    n_heads: int = setting(12, "[1, inf)", "query heads", fixed=True)
    n_kv_heads: int = setting(12, "[1, inf)", "key/value heads (GQA when < n_heads)", fixed=True)
    ffn_mult: int = setting(4, "[1, inf)", "SwiGLU hidden = ffn_mult * dim", fixed=True)
    norm_eps: float = setting(1e-5, "(0, 1)", "RMSNorm epsilon")
    rope_theta: float = setting(10000.0, "(0, inf)", "RoPE base")
    rope_scaling: bool = setting(False, help="Llama 3.1's RoPE scaling (the authors' option)")
    max_seq_len: int = setting(1024, "[1, inf)", "RoPE table size (longest context to sample)")
    init_std: float = initial(0.02, "(0, inf)", "normal init of every weight matrix")
    embed_dtype: str = setting("float32", ("float32", "bfloat16"), "bfloat16: as the authors'")
    sandwich_norm: bool = setting(True, help="x + Norm(F(Norm(x))); false: pre-norm", fixed=True)
    attn_impl: str = setting("auto", ("auto", "flex", "sdpa"), "auto: flex on CUDA at hd >= 16")
    router: str = setting("skip_middle", tuple(ROUTERS), "depth router", fixed=True)
    compact: bool = setting(False, help="run routed blocks on their tokens only (exact)")
    gate_eps: float = setting(1e-6, "(0, 1)", "floor on a gate inside ln g (Section 2.2)")
    # router=skip_middle: gates and sparsity control (Section 2.4)
    gate_init: str = on_skip_middle(
        "normal", ("normal", "zero"), "N(0, init_std) | g = 1", use="init"
    )
    gate_axis: str = on_skip_middle("key", ("key", "query"), "ln g per key | query", fixed=True)
    controller: str = on_skip_middle("proportional_tol", tuple(CONTROLLERS), "Table 1", use="train")
    mu_start: float = on_skip_middle(1.0, "[0, 1]", "mean-gate target at block 0", use="train")
    # mu_end: our choice of one point on Figure 2's sweep of it from 1 to 0
    mu_end: float = on_skip_middle(0.5, "[0, 1]", "... at block L/2 - 1, linearly", use="train")
    gamma: float = on_skip_middle(1e-3, "(0, inf)", "coefficient update (eq. 6)", use="train")
    delta: float = on_skip_middle(1e-2, "[0, inf)", "tolerance on |deviation| (eq. 6)", use="train")
    fixed_coef: float = on_skip_middle(0.1, "(0, inf)", "sparsity*: fixed alpha/beta", use="train")
    # router=dlo: DLO (Tan et al. 2024, Section 3)
    dlo_rho: float = on_dlo(0.25, "[0, 1)", "rho, the share of MLP calls skipped", use="train")
    dlo_anneal_steps: int = on_dlo(500, "[0, inf)", "T': steps to reach rho (eq. 9)", use="train")
    dlo_beta: float = on_dlo(2.0, "(0, inf)", "r = (beta + (2 sigmoid(hW) - 1) gamma) / 2")
    dlo_gamma: float = on_dlo(0.05, "(0, inf)", "gamma of eq. 1")
    # router=mod: Mixture-of-Depths (Raposo et al. 2024)
    mod_capacity: float = on_mod(0.125, "(0, 1]", "routed block's share of tokens", use="train")
    mod_every: int = on_mod(2, "[1, inf)", "route every mod_every-th block", fixed=True)
    mod_aux_coef: float = on_mod(0.01, "(0, inf)", "BCE weight: r > 0 for the top-k", use="train")
    # router=mor: Mixture-of-Recursions (Bae et al. 2025), Middle-Cycle sharing
    mor_recursions: int = on_mor(3, "[1, inf)", "N_r runs of (L - 2) / N_r blocks", fixed=True)
    mor_routed: bool = on_mor(True, help="false: the recursive baseline (every token)", fixed=True)
    mor_aux_coef: float = on_mor(0.1, "(0, inf)", "BCE weight: z > 0 for the top-k", use="train")
    # optimisation (Table 2)
    lr: float = trains(1e-3, "(0, inf)", "AdamW peak learning rate, one for all parameters")
    beta1: float = trains(0.8, "[0, 1)", "AdamW betas")
    beta2: float = trains(0.95, "[0, 1)")
    adam_eps: float = trains(1e-10, "(0, inf)")
    weight_decay: float = trains(0.0, "[0, inf)")
    warmup_frac: float = trains(0.1, "[0, 1]", "linear warm-up over this fraction of steps ...")
    warmup_start: float = trains(0.1, "[0, 1]", "... from this fraction of lr, then cosine to 0")
    batch_size: int = trains(512, "[1, inf)", "global batch in sequences (x 1024 = 524,288)")
    device_batch_size: int = setting(32, "[1, inf)", "sequences per forward (accumulation derived)")
    seq_len: int = setting(1024, "[1, inf)", "training and validation length, <= max_seq_len")
    loss_rows: int = setting(4096, "[1, inf)", "tokens whose logits exist at once in the loss")
    train_tokens: int = trains(10_000_000_000, "[1, inf)", "budget; steps = it / global batch")
    seed: int = initial(0, "[0, 9223372036854775808)")
    # evaluation and checkpoints
    val_every: int = trains(250, "[0, inf)", "steps between validations (0: only at the end)")
    val_tokens: int = setting(10_485_760, "[1, inf)", "validation tokens, split over ranks")
    save_every: int = trains(250, "[0, inf)", "steps between checkpoints (0: only at the end)")


PRESETS = {
    "": {},
    # ~3 minutes on 2 CPU cores; 4 layers so that both halves and the mirror are exercised
    "smoke": dict(
        train_files="data/sample/sample_train_*.bin",
        val_files="data/sample/sample_val_*.bin",
        n_layers=4,
        dim=128,
        n_heads=4,
        n_kv_heads=2,
        max_seq_len=128,
        seq_len=128,
        batch_size=8,
        device_batch_size=4,
        train_tokens=8 * 128 * 120,
        val_every=20,
        val_tokens=4 * 128 * 8,
        save_every=60,
        compile=False,
        lr=3e-3,  # 3x the paper's lr so the fall is plain within 120 steps
    ),
}


@dataclass
class Job:
    """What one job is told: never saved as the run's settings (config.json shows them)."""

    run_dir: str = setting("", help="default: a new logs/<date_time>_<preset or run>_<hex>/")
    resume: str = setting("", help="RUN_DIR: continue that run from its checkpoint, in place")
    init_from: str = setting(
        "",
        help="SOURCE (a run folder, a folder in Hugging Face layout, hf:OWNER/NAME[@REVISION]): "
        "a new run from its weights; its settings are the defaults",
    )
    eval_only: bool = setting(False, help="with init_from: validate once, print it, write nothing")
    preset: str = setting("", tuple(PRESETS), "smoke: a small gated model on the sample, CPU")
    stop_step: int = setting(0, "[0, inf)", "end this job after this step, saved (0: run on)")
    max_bad_steps: int = setting(0, "[0, inf)", "non-finite losses skipped (no update), then stop")
    compile: bool = setting(True, help="torch.compile the model (CUDA only)")
    peak_flops: float = setting(0.0, "[0, inf)", "per-GPU bf16 peak for MFU; 0: the device's")
    untimed_steps: int = setting(10, "[0, inf)", "first steps of each job off the clock (warm-up)")


FIXED = [f.name for f in fields(Hyperparameters) if f.metadata["fixed"]]
INITIAL = {f.name for f in fields(Hyperparameters) if f.metadata["use"] == "init"}


def parse_overrides(argv) -> dict:
    """--field=value pairs of Hyperparameters and Job, typed as the defaults (Job's checked)."""
    given = support.parse_fields((Hyperparameters, Job), argv)
    check_fields(Job(**{k: v for k, v in given.items() if k in JOB}))
    return given


def job_settings(given: dict) -> Job:
    """This job's settings: the defaults, then the preset's, then the given ones."""
    merged = {**PRESETS[given.get("preset", "")], **given}
    return Job(**{k: v for k, v in merged.items() if k in JOB})


def resolve(given: dict, base: Hyperparameters = None) -> Hyperparameters:
    """base (the defaults, or a resumed run's), then the preset, then the given fields. Data paths
    become absolute (to resume from any folder): given ones from here, others the repository's."""
    merged = {**PRESETS[given.get("preset", "")], **given}
    hp = replace(base or Hyperparameters(), **{k: v for k, v in merged.items() if k not in JOB})
    check_fields(hp)  # (the router among them, before check_knobs reads it)
    check_knobs(hp, merged)
    for f in ("train_files", "val_files"):
        root = "" if f in given else support.HERE
        hp = replace(hp, **{f: os.path.abspath(os.path.join(root, getattr(hp, f)))})
    return hp


JOB = {f.name for f in fields(Job)}


def check_model(hp: Hyperparameters):
    """The model's settings in range and consistent (a model can be built, its sequences within
    its RoPE table); UserError naming the first that is not."""
    check_fields(hp)
    if hp.dim % hp.n_heads or hp.n_heads % hp.n_kv_heads:
        raise UserError(
            f"need dim ({hp.dim}) divisible by n_heads ({hp.n_heads}) and n_heads "
            f"by n_kv_heads ({hp.n_kv_heads})"
        )
    if (hp.dim // hp.n_heads) % 2:
        raise UserError("head dim (dim / n_heads) must be even for RoPE")
    if hp.seq_len > hp.max_seq_len:
        raise UserError(
            f"seq_len={hp.seq_len} is beyond the RoPE table (max_seq_len={hp.max_seq_len})"
        )
    if hp.encoding == "bytes" and hp.vocab_size != 256:
        raise UserError(
            f"encoding=bytes has 256 token ids: give vocab_size=256 (not {hp.vocab_size})"
        )
    check_knobs(hp, [f.name for f in fields(hp) if getattr(hp, f.name) != f.default])
    if problem := ROUTERS[hp.router].check(hp):
        raise UserError(problem)
    ranks.check_memory(
        model_bytes(hp), "to build the model", "dim, n_layers, vocab_size or max_seq_len"
    )


def check_knobs(hp: Hyperparameters, names):
    """A UserError if a field among `names` does nothing under hp: another router's, or one its
    router (Router.idle) or the schedule leaves unread. names: those given (resolve: even at
    their defaults), or those not at their defaults (check_model: a model file's too)."""
    idle = ROUTERS[hp.router].idle(hp)
    if not hp.warmup_frac:  # (lr_at: no warm-up)
        idle["warmup_start"] = "warmup_frac=0: no warm-up"
    for f in fields(Hyperparameters):
        owner = f.metadata["router"]
        if f.name in names and owner not in ("", hp.router):
            raise UserError(
                f"{f.name} sets the {owner} router's behaviour; router={hp.router} has none"
            )
        if f.name in names and f.name in idle:
            raise UserError(f"{f.name}={getattr(hp, f.name)} has no effect with {idle[f.name]}")


def model_bytes(hp: Hyperparameters) -> int:
    """A lower bound on a built model's bytes, no model built: fp32 weights (n_weights) and each
    built block's RoPE tables (cos and sin, max_seq_len x head_dim / 2 each)."""
    blocks = ROUTERS[hp.router].n_blocks(hp)
    return 4 * n_weights(hp) + 4 * blocks * hp.max_seq_len * hp.dim // hp.n_heads


def check_evaluation(hp: Hyperparameters, world: int):
    """check_model, and a validation's settings: val_tokens whole batches over the world (as
    modded-nanogpt asserts), so that every validation reads them all, on any number of ranks
    that divides them."""
    check_model(hp)
    batch = hp.device_batch_size * hp.seq_len * world
    if hp.val_tokens % batch:
        raise UserError(
            f"val_tokens={hp.val_tokens} is not a whole number of validation batches of "
            f"device_batch_size x seq_len x world size = {batch} tokens: give a multiple, "
            f"such as {max(1, hp.val_tokens // batch) * batch} (a resume, which keeps val_tokens: "
            f"another device_batch_size)"
        )


def validate(hp: Hyperparameters, world: int):
    """check_evaluation, and the training's settings consistent with the world and the
    machine."""
    check_evaluation(hp, world)
    if hp.batch_size % (hp.device_batch_size * world):
        raise UserError(
            f"batch_size={hp.batch_size} is not divisible by device_batch_size "
            f"({hp.device_batch_size}) x world size ({world})"
        )
    if num_steps(hp) < 1:
        raise UserError("train_tokens is less than one global batch")
    # a lower bound: the model, fp32 gradients and AdamW moments, one loss chunk's logits
    # (validation's per_token: bf16, fp32, log-softmax)
    rows = min(hp.loss_rows, hp.device_batch_size * hp.seq_len)
    need = model_bytes(hp) + 12 * n_weights(hp) + 10 * rows * hp.vocab_size
    ranks.check_memory(
        need, "to train", "dim, n_layers, vocab_size, max_seq_len or device_batch_size"
    )


def n_weights(hp: Hyperparameters) -> int:
    """A lower bound on the parameter count by arithmetic, no model built (so no size overflows
    or takes minutes): the embedding, the head, and each built block's attention and FFN."""
    d, kv = hp.dim, hp.dim // hp.n_heads * hp.n_kv_heads
    block = 2 * d * (d + kv) + 3 * d * hp.ffn_mult * d  # q, o, k, v; SwiGLU's three matrices
    return 2 * hp.vocab_size * d + ROUTERS[hp.router].n_blocks(hp) * block


def num_steps(hp: Hyperparameters) -> int:
    return hp.train_tokens // (hp.batch_size * hp.seq_len)


def val_batches(hp: Hyperparameters, world: int) -> int:
    """The global batches of one validation (check_evaluation: val_tokens is whole ones)."""
    return hp.val_tokens // (hp.device_batch_size * hp.seq_len * world)


def lr_at(hp: Hyperparameters, step: int, total: int) -> float:
    """Linear warm-up from warmup_start * lr over warmup_frac of the steps (its whole steps, at
    least one; none at 0), then cosine to 0."""
    warmup = max(1, int(hp.warmup_frac * total)) if hp.warmup_frac else 0
    if step < warmup:
        return hp.lr * (hp.warmup_start + (1 - hp.warmup_start) * step / warmup)
    progress = (step - warmup) / max(1, total - warmup)
    return hp.lr * 0.5 * (1 + math.cos(math.pi * progress))


def built(hp: Hyperparameters, init: tuple, device: str) -> GPT:
    """GPT(hp) on device with init's weights (sources.read_source's (weights, where, label)),
    checked first against the model built on the meta device (its shapes, no memory): settings
    that do not fit their tensors build nothing (check_model bounds the memory of those that do)."""
    with torch.device("meta"):
        runs.check_weights(GPT(hp).state_dict(), *init)
    model = GPT(hp).to(device)
    model.load_state_dict(init[0])  # (checked: no check again)
    return model


# -----------------------------------------------------------------------------
# Training loop


def to_device(batch: torch.Tensor, device: str) -> torch.Tensor:
    """A CPU batch on device; to a GPU from pinned memory, not blocking (ordered on its stream)."""
    return batch if device == "cpu" else batch.pin_memory().to(device, non_blocking=True)


def route_sums(route: dict, router: Router) -> dict:
    """Per-layer sums over the tokens of a forward pass, float64 (L,) per key, detached: the
    tokens that ran each block and each MLP, and the router's `means` (made means later)."""
    keys = {"block_active": "block", "mlp_active": "mlp", **router.means}
    sums = {name: route[key].detach().double().sum(dim=(1, 2)) for name, key in keys.items()}
    n = route["block"].detach().double().sum(2)  # (L, B) tokens that ran each block, per sequence
    return {**sums, "attn_pairs": (n * (n + 1) / 2).sum(dim=1)}  # their causal query-key pairs


@torch.no_grad()
def evaluate(
    model: GPT, hp: Hyperparameters, loader: DistributedLoader, d: Dist, autocast, stop=None
):
    """Validation over val_tokens, inference routing, all-reduced over ranks: the loss, the
    route_sums and residual norms per token, FLOPs per token at the shares that ran. Documents,
    not tokens, are the sampled units (each runs from one separator to the next): the loss is a
    ratio of per-document sums, and val_se its standard error over them (delta method).
    stop: the training job's StopSignal: a signal, or a torchrun launcher gone, cuts it (None),
    at the same batch on every rank (agreed_signal)."""
    model.eval()
    loader.reset()
    lengths = model.router.lengths  # (put back at the end)
    model.router.lengths = None  # each block's count read on the host: exact
    B, T, sep = hp.device_batch_size, hp.seq_len, BYTES_EOT if hp.encoding == "bytes" else EOT
    steps, sums = val_batches(hp, d.world), {}
    # (loss | starts a document, step, rank, token): every target in the order the loader reads
    each = torch.zeros(2, steps, d.world, B * T, dtype=torch.float64, device=d.device)
    try:
        for i in range(steps):
            # a collective a batch (under torchrun): every rank cuts at the same one
            if stop is not None and ranks.agreed_signal(stop, d):
                return None
            x, y = (to_device(t, d.device) for t in loader.next_batch())
            with autocast:
                _, loss, route, resid = model(x, targets=y, per_token=True)
            each[0, i, d.rank], each[1, i, d.rank] = loss.flatten(), (y == sep).flatten()
            more = {"resid_norm": resid.double() * y.numel(), **route_sums(route, model.router)}
            sums = add_sums(sums, more)
        sums = all_reduce_sums({**sums, "each": each})
    finally:
        model.train()
        model.router.lengths = lengths
    loss, starts = sums.pop("each").cpu().flatten(1)  # (on the CPU: index_add_ in a fixed order)
    doc = starts.long().cumsum(0)  # (tokens,) each target's document
    count = torch.bincount(doc).double()
    present = count > 0  # (document 0 is empty when the first target starts one)
    total = torch.zeros_like(count).index_add_(0, doc, loss)[present]
    count = count[present]
    docs, tokens, mean = len(count), loss.numel(), (total.sum() / count.sum()).item()
    se = (
        math.sqrt(docs / (docs - 1) * (total - mean * count).square().sum().item())
        / count.sum().item()
        if docs > 1
        else None
    )
    pairs = (sums.pop("attn_pairs") * hp.seq_len / tokens).tolist()  # per layer, per sequence
    v = {k: (t / tokens).tolist() for k, t in sums.items()}  # per-layer means
    fwd = forward_flops(hp, v["block_active"], v["mlp_active"], pairs)  # of one sequence
    dense = forward_flops(replace(hp, router="none", compact=False))
    return dict(
        val_loss=mean,
        val_se=se,
        val_docs=docs,
        sparsity=1 - sum(v["mlp_active"]) / hp.n_layers,
        **v,
        attn_pairs=pairs,
        fwd_flops_per_token=fwd / hp.seq_len,
        fwd_flops_per_token_dense=dense / hp.seq_len,
        fwd_flops_per_seq=fwd,
    )


# compiled of a block: what the routers call (DLO: the halves) and forward_compact's packed work
REGIONS = ("every_token", "attend", "mlp", "packed")


def compile_model(raw: GPT) -> GPT:
    """Regional compilation (PyTorch's recipe for a fast cold start): each block's REGIONS and
    the model's readout compiled in place, shapes static. The blocks share their code, so a
    graph compiled for one serves all: a cold compile is one block's, not the model's. The
    embedding and the router run eagerly (DLO's packing too). Under compact a packed length is a
    shape: a new one compiles a new graph of one block, at most PACKS lengths per mode
    (packed_length) and the routers' top-k ones in training, each shown in the log
    (compile_ms). Why static lengths (symbolic ones crashed Inductor) and a compiled readout
    (eagerly, slow kernels), measured: docs/gpu.md."""
    config = torch._dynamo.config
    # graphs per region (docstring), for training and evaluation, gated and not, all routers in
    # one process (sweep.py's measure); past the default 8, Dynamo would run the rest eagerly
    config.recompile_limit = max(config.recompile_limit, 4 * (PACKS + raw.hp.mor_recursions))
    regions = [(block, name) for block in raw.blocks for name in REGIONS] + [(raw, "readout")]
    for module, name in regions:
        if name not in vars(module):  # (compiled already: as it is)
            setattr(module, name, torch.compile(getattr(module, name), dynamic=False))
    return raw


def adamw_options(hp: Hyperparameters) -> dict:
    """Table 2's AdamW settings as this job gives them, read here alone: for the optimiser built,
    and for one a resume loads (its saved groups hold the last job's; lr: lr_at, each step)."""
    return dict(betas=(hp.beta1, hp.beta2), eps=hp.adam_eps, weight_decay=hp.weight_decay)


def optimizer(raw: GPT, hp: Hyperparameters) -> torch.optim.AdamW:
    return torch.optim.AdamW(param_groups(raw), lr=hp.lr, fused=True, **adamw_options(hp))


def param_groups(raw: GPT) -> list:
    """AdamW groups: everything outside the blocks, then one group per block with the router's
    parameters of that block, so that a router can scale each layer's rate (DLO eq. 10)."""
    groups = [list(b.parameters()) + raw.router.layer_params(i) for i, b in enumerate(raw.blocks)]
    inside = {id(p) for group in groups for p in group}
    rest = [p for p in raw.parameters() if id(p) not in inside]
    return [{"params": params} for params in [rest] + groups]


def check_run(hp: Hyperparameters, job: Job, d: Dist, ckpt: dict):
    """Refuse settings that cannot train here, before anything is written."""
    validate(hp, d.world)
    hd = hp.dim // hp.n_heads
    if hp.attn_impl == "flex" and not d.device.startswith("cuda"):
        raise UserError(
            f"attn_impl=flex trains on CUDA only (FlexAttention has no CPU backward); here "
            f"{d.device}: use auto or sdpa"
        )
    if hp.attn_impl == "flex" and hd < FLEX_MIN_HEAD_DIM:
        raise UserError(
            f"attn_impl=flex needs a head dimension of at least {FLEX_MIN_HEAD_DIM}; here "
            f"dim / n_heads = {hd}: use auto or sdpa"
        )
    steps = num_steps(hp)
    if ckpt is not None and ckpt["step"] > steps:
        raise UserError(
            f"the checkpoint is at step {ckpt['step']} but these settings make "
            f"{steps} steps in all (train_tokens / (batch_size x seq_len)); give a "
            f"train_tokens of at least {ckpt['step'] * hp.batch_size * hp.seq_len}"
        )
    if ckpt is not None and 0 < job.stop_step <= ckpt["step"]:
        raise UserError(
            f"stop_step={job.stop_step} is not after the checkpoint's step {ckpt['step']}"
        )


def loaders(hp: Hyperparameters, d: Dist, ckpt: dict = None) -> tuple:
    """The training and validation loaders of this rank, checked: every shard sound, enough
    validation tokens, and with a checkpoint its data position in these shards and the shards
    its run read the same files (check_fingerprints): the training shards it had read, and the
    validation shards its validations read (DistributedLoader.fingerprints), so that a log's
    validation losses are on one set of tokens."""
    B = hp.batch_size // d.world  # the rank's sequences of a step, all its micro-steps
    train_loader = DistributedLoader(
        hp.train_files, B, hp.seq_len, d.rank, d.world, hp.vocab_size, hp.encoding
    )
    val_loader = validation_loader(hp, d)
    if ckpt is not None:
        train_loader.check_position(ckpt["loader"])
        validated = ckpt.get("validation", {})  # (an older checkpoint has none: not checked)
        then = "resume with the validation shards the run was validated on"
        check_fingerprints(val_loader.files, validated, then, "validation")
    return train_loader, val_loader


def validation_loader(hp: Hyperparameters, d: Dist) -> DistributedLoader:
    """This rank's validation loader, checked: enough tokens that none repeats."""
    val_loader = DistributedLoader(
        hp.val_files, hp.device_batch_size, hp.seq_len, d.rank, d.world, hp.vocab_size, hp.encoding
    )
    capacity = sum(val_loader.batches)  # global batches in one pass over all shards
    if val_batches(hp, d.world) > capacity:
        batch = hp.device_batch_size * hp.seq_len * d.world
        raise UserError(
            f"val_tokens={hp.val_tokens} is more than the validation shards hold in whole "
            f"batches of {hp.device_batch_size} x {hp.seq_len} x {d.world} = {batch} tokens "
            f"({capacity * batch}); validation would repeat tokens"
        )
    return val_loader


def prepare(hp: Hyperparameters, job: Job, d: Dist, ckpt: dict, init) -> tuple:
    """-> (raw model, optimiser, RunState, train loader, validation loader), all checked, built
    and restored (a checkpoint, or --init_from's weights at step 0) before anything is written."""
    check_run(hp, job, d, ckpt)
    torch.manual_seed(hp.seed)
    train_loader, val_loader = loaders(hp, d, ckpt)
    raw = built(hp, init, d.device) if init else GPT(hp).to(d.device)
    opt = optimizer(raw, hp)
    if ckpt is not None:
        run = runs.restore(ckpt, job, raw, opt, train_loader, d.device.startswith("cuda"))
    else:
        run = RunState(run_id=os.urandom(8).hex())
    for group in opt.param_groups:  # this job's settings, not a checkpoint's
        group.update(adamw_options(hp))
    if raw.router.packs() and raw.router.lengths is None:  # a new run's first step: every token
        raw.router.lengths = [hp.seq_len] * hp.n_layers
    return raw, opt, run, train_loader, val_loader


def wrapped(raw: GPT, job: Job, d: Dist) -> nn.Module:
    """The model the training steps run: raw, its blocks compiled (CUDA, job.compile), in DDP
    (more than one rank)."""
    cuda = d.device.startswith("cuda")
    model = compile_model(raw) if job.compile and cuda else raw
    if d.world > 1:
        model = nn.parallel.DistributedDataParallel(
            model, device_ids=[d.local_rank] if cuda else None
        )
    return model


def mixed_precision(device: str):
    """The forward passes' autocast: bf16 on CUDA; on the CPU none (fp32)."""
    return torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.startswith("cuda"))


def train(
    hp: Hyperparameters, job: Job, d: Dist, ckpt: dict = None, argv: list = (), init=None
) -> str:
    """Train (or, given a checkpoint, go on training) and return the run directory.
    argv: the command-line arguments, for the record; init: sources.read_source's (weights, where,
    label) to start from."""
    raw, opt, run, train_loader, val_loader = prepare(hp, job, d, ckpt, init)
    validated = val_loader.fingerprints(val_batches(hp, d.world))  # (each checkpoint's)
    inodes = {(s.st_dev, s.st_ino) for s in map(os.stat, train_loader.files)}
    overlap = any((s.st_dev, s.st_ino) in inodes for s in map(os.stat, val_loader.files))
    steps, accum = num_steps(hp), hp.batch_size // (hp.device_batch_size * d.world)
    start, saved_val = run.step, run.val_done
    if ckpt is not None and start == run.val_done == steps:  # complete: nothing to write
        if d.master:
            print(f"the run is complete at step {start}")
        return job.run_dir
    cuda = d.device.startswith("cuda")
    peak = support.peak_flops(torch.cuda.get_device_name(d.device) if cuda else "", job.peak_flops)
    model = wrapped(raw, job, d)
    amp = mixed_precision(d.device)
    d.barrier()  # every rank has checked before rank 0 creates anything
    run_dir = d.on_master(lambda: runs.open_run_dir(job.run_dir, job.preset or "run", ckpt))
    STOP.armed = True  # till now a signal stopped at once; from here it saves (step 0 at least)
    ledger = runs.Ledger(run_dir, start if ckpt else None)
    origin = init[1] if init else None  # where the weights came from: a local path resolved
    if origin is not None and not origin.startswith("hf:"):
        origin = os.path.abspath(origin)
    facts = dict(grad_accum=accum, num_steps=steps)
    with (
        ledger,
        STOP as stop,
        runs.open_log(d, ledger, run, hp, job, argv, origin, ckpt is not None, **facts) as log,
    ):
        note = runs.resume_note(d, ledger, run) if ckpt else ""
        log.print(
            f"params:{sum(p.numel() for p in raw.parameters())} steps:{steps} grad_accum:{accum} "
            f"world:{d.world} attn:{attention_impl(hp, cuda)} device:{d.device} "
            f"peak_flops:{peak:.4g} run_dir:{run_dir}{note}"
        )
        if overlap:
            log.print(  # (gpu_check.sh's paper runs: the sample's validation shard is too small)
                "note: some validation shards are training shards too: the validation losses "
                "are on tokens the model trains on"
            )
        clock = runlog.StepClock(log, start, job.untimed_steps)
        for step in range(start, steps + 1):  # at each step boundary, then the step
            signum = ranks.agreed_signal(stop, d)
            ending = step == steps or signum > 0 or (step == job.stop_step and step > start)
            # validate every val_every steps and at the last; a signal skips it (to stop soon):
            # the checkpoint marks it owed (val_done < step), so a resume runs it first
            val_due = step == steps or (hp.val_every > 0 and step % hp.val_every == 0)
            if val_due and not signum and run.val_done < step:
                clock.begin(d)
                v = evaluate(raw, hp, val_loader, d, amp, stop)  # raw: no DDP hooks
                clock.compile_ms += clock.lap(d)[1]  # (its graphs count in the job's total)
                if v is None:  # cut by a signal: saved with the validation owed, then stop
                    signum = ranks.agreed_signal(stop, d)
                    ending = True
                else:
                    log.validation(raw.router, v, run, steps)
                    run.val_done = step
            # save every save_every steps and when the job ends, if anything is new
            periodic = step > start and hp.save_every and step % hp.save_every == 0
            if (ending or periodic) and (step > start or run.val_done != saved_val or not ckpt):
                runs.save_run_checkpoint(d, ledger, run, hp, raw, opt, train_loader, validated)
                log.saved(step)
                saved_val = run.val_done
            if ending:
                break
            clock.begin(d)
            lrs = [lr_at(hp, step, steps) * f for f in [1.0] + raw.router.lr_scales(step)]
            stats = train_step(model, raw.router, hp, opt, train_loader, d, amp, accum, lrs, step)
            run.step += 1
            if not math.isfinite(stats["total_loss"][0]):  # no update was applied; past
                # max_bad_steps, RunStopped naming the last good checkpoint (last_good)
                runs.skip_bad_step(log, run, job.max_bad_steps, steps, d, ledger)
                continue
            run.tokens += hp.batch_size * hp.seq_len
            ledger.untried = False  # a step from the newest checkpoint trained: it is good
            raw.router.update(stats.get("router"), stats["tokens"][0], step)
            times = clock.lap(d)  # (step ms, of which compile ms)
            clock.add(run, *times)
            util = mfu(hp, times[0] / 1000, d.world, peak, stats) if peak else None
            log.step(run, steps, stats, raw.router.means, lrs, times, util)
        clock.end(run)
        owed = val_due and run.val_done != run.step
        runs.report_end(log, d, ledger, run, start, steps, signum, owed)
    return run_dir


def train_step(model, router: Router, hp, opt, loader, d, autocast, accum, lrs, step) -> dict:
    """One optimiser step over the global batch, applied only if the loss is finite. -> sums over
    micro-steps and ranks as lists of floats ("lm_loss", "total_loss": means; "tokens";
    route_sums; "packed": packed_counts, the most over micro-batches and ranks) and "router",
    loss()'s sums for its update, float64 left on the device. Compact: a step in which a sequence
    had more tokens at a block than its packed length (router.lengths) is redone at full length,
    exact ("redone": 1); the next step's lengths come from the counts of the last steps
    (Router.saw)."""
    for group, lr in zip(opt.param_groups, lrs, strict=True):
        group["lr"] = lr
    xs, ys = (to_device(t, d.device) for t in loader.next_batch())  # (accum * B, T) for this rank
    sums = micro_steps(model, router, hp, xs, ys, d, autocast, accum, step)
    if router.outgrew(sums["packed"]):
        opt.zero_grad(set_to_none=True)
        router.lengths = [hp.seq_len] * hp.n_layers  # room for every token
        sums = {**micro_steps(model, router, hp, xs, ys, d, autocast, accum, step), "redone": [1]}
    router.saw(sums["packed"])
    if math.isfinite(sums["total_loss"][0]):
        opt.step()
    opt.zero_grad(set_to_none=True)
    return sums


def micro_steps(model, router: Router, hp, xs, ys, d, autocast, accum, step) -> dict:
    """The forward and backward passes of train_step, its sums read to the host at once."""
    sums, packed = {}, None
    for micro in range(accum):
        sl = slice(micro * hp.device_batch_size, (micro + 1) * hp.device_batch_size)
        x, y = xs[sl], ys[sl]
        # only the last micro-step all-reduces gradients
        no_sync = model.no_sync() if d.world > 1 and micro < accum - 1 else contextlib.nullcontext()
        with no_sync:
            with autocast:
                out = model(x, targets=y)
                reg, router_sums = router.loss(out.route, step)
            ((out.loss + reg) / accum).backward()
        parts = accum * d.world  # micro-batches in the global batch: the losses sum to means
        more = {
            "lm_loss": out.loss.detach().double() / parts,
            "total_loss": (out.loss + reg).detach().double() / parts,
            "tokens": y.new_full((), y.numel(), dtype=torch.float64),  # made there: no copy
            **route_sums(out.route, router),
        }
        if router_sums is not None:
            more["router"] = router_sums.detach().double()
        sums = add_sums(sums, more)
        n = packed_counts(out.route).double()
        packed = n if packed is None else torch.maximum(packed, n)
    sums = {**all_reduce_sums(sums), "packed": ranks.all_reduce(packed, "max")}
    # the step's one host read: every figure but the router's sums (they stay on the device)
    flat = torch.cat([t.reshape(-1) for k, t in sums.items() if k != "router"]).tolist()
    for k, t in sums.items():
        if k != "router":
            sums[k], flat = flat[: t.numel()], flat[t.numel() :]  # lists of floats
    return sums


def evaluate_only(hp: Hyperparameters, d: Dist, init: tuple) -> dict:
    """--eval_only: the model of init (weights, where, label) validated once, its lines printed
    (rank 0); nothing is written."""
    check_evaluation(hp, d.world)
    loader = validation_loader(hp, d)
    raw = built(hp, init, d.device)
    with ranks.watching(d):  # (nothing written: a launcher gone ends it at once)
        v = evaluate(raw, hp, loader, d, mixed_precision(d.device))
    if d.master:  # (one line, whatever the source's name holds)
        head = f"eval_only {support.one_line(init[1])} "
        print("\n".join(runlog.validation_lines(raw.router, v, head, "")))
    return v


# -----------------------------------------------------------------------------
# main


def main(argv):
    """One training job. Its exit status (support.cli, as every command here): 0 done, or
    stopped with a checkpoint by a signal or stop_step; 2 bad input, before anything is
    written; 1 a failure mid-run; 128+N signal N before the job could save, or a second one."""
    if "--help" in argv or "-h" in argv:
        print(support.usage(Hyperparameters, Job, PRESETS))
        return
    import sources  # keep it here: it imports this module, whole only once loaded

    with STOP:  # from the start: a signal during start-up stops at once (train() arms STOP)
        given = parse_overrides(argv)
        job = job_settings(given)
        sources.check_source(given, job)
        base, init = sources.read_source(job.init_from) if job.init_from else (None, None)
        if job.resume:
            hp, ckpt = sources.resume_settings(given)
        else:  # a new run, on the source's settings if any
            hp, ckpt = resolve(given, base), None
        job = replace(job, run_dir=job.resume or job.run_dir)
        d = ranks.setup_distributed()
        try:
            if job.eval_only:
                evaluate_only(hp, d, init)
            else:
                train(hp, job, d, ckpt, argv, init)
            STOP.finish()  # saved: a late signal changes nothing
        finally:
            support.release_locks()  # the job is over (in a test, the process goes on)
            d.close()


if __name__ == "__main__":
    sys.exit(cli(main, sys.argv[1:]))
