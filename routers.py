"""The depth routers beside the paper's: the Router base every router shares (its hooks are
all that the model, the loop, evaluation, FLOPs, logs and tools call), the dense model (Dense),
DLO (Tan et al. 2024), Mixture-of-Depths (Raposo et al. 2024) and Mixture-of-Recursions (Bae et
al. 2025). The paper's own router, SkipMiddle, and the registry ROUTERS are in train_gpt.py.

Guarantees: a router changes only which tokens run which blocks and how that is trained; a
block it skips for a token leaves that token's residual unchanged and, where the router says
so (skipped_tokens_are_keys), removes it as a key, so that compact=True (the skipped work not
done) computes the same function as the masked path. Nothing here reads the router's name.

Our choices where a paper is open:
DLO (Tan et al. 2024), `router=dlo`:
  - Pre-training or continuing our own FineWeb checkpoints (the paper fine-tunes Llama 2 on
    instructions); expand.py starts a new run (fresh AdamW, step 0) from expanded weights.
  - The router reads the block's input h_i; r scales only the MLP branch.
  - Eq. 4's M_i(A_i(h)) is the MLP sublayer's output with its residual, a + f (a: its input,
    f: the branch): the paper's range for the cosine, [0, 1], fits a + f (near a) better
    than the branch alone.
  - Eq. 8 is used as a skip rate (the share labelled 0): as written it counts labels 1, which
    contradicts eq. 3's top floor((1 - rho_i) S) and eq. 10, whose scales average near 1 only
    for a skip rate (Algorithm 1 line 35's top floor(rho_i S) agrees with eq. 8 as written).
    rho_{i,1} is step 1's annealed rate.
  - Inference runs the MLP where r >= beta / 2 (eq. 2; Algorithm 1 line 37: r > beta / 2):
    only a token with r exactly beta / 2 differs, every token of the zero-initialised routers.
  - Labels (eq. 5) rank the R' x S similarities (R' = n_layers) within each sequence, keeping
    floor((1 - rho^t) R' S) at the annealed rate (Algorithm 1 line 46; eq. 5 prints the target
    rho); eqs. 6 and 8 average over the global batch. The top-k by r is ranked by the router
    logit z, which r rises with (in fp32 r is one value past z = 14); ties (every z is 0 at the
    routers' zero init) go to the earlier token.
    Training runs every MLP (labels need every similarity) and drops the skipped outputs; only
    evaluation and decoding skip the work.
Mixture-of-Depths (Raposo et al. 2024), `router=mod`:
  - Blocks mod_every - 1, 2 mod_every - 1, ... are routed (every one at mod_every = 1), at
    the paper's best capacity, 12.5% of each sequence.
  - r = w.h (no bias) scales both residual branches of a chosen token, as g does in our block
    (the MLP reads x + r Attn, not the block output scaled once). Tokens not chosen are neither
    queries nor keys there (weight gate_eps masked, 0 when compacted or decoding: train_gpt's
    deviations).
  - Causal inference: the paper's first method, BCE (mod_aux_coef, our 0.01) teaching
    sigmoid(r) the top-k; evaluation and decoding run r > 0 (validation reports that share).
Mixture-of-Recursions (Bae et al. 2025), `router=mor`:
  - n_layers counts applied blocks, as for the dense model it is set against: blocks 0 and
    L-1 are unique, a stack of (L - 2) / N_r shared blocks runs N_r = mor_recursions times
    (Middle-Cycle): 2 + (L - 2) / N_r unique blocks; L - 2 must be a multiple of N_r.
  - Expert-choice, hierarchical filtering: recursion r keeps floor((N_r - r) / N_r T) tokens
    of each sequence (all, 2/3, 1/3 for N_r = 3). Recursion 0 (share 1) keeps every token in
    inference too and has no BCE term (the authors' code: one, every target 1).
  - A kept token moves by g = sigmoid(z) times the recursion's update, h + g (f(h) - h) (no
    extra scale; the authors' code adds alpha sigmoid(z) times the stack's output, residual
    included). In the stack the kept tokens run ungated; the others are neither queries nor
    keys (weight gate_eps masked, 0 when compacted or decoding: train_gpt's deviations).
  - Causal inference: BCE (mor_aux_coef, our 0.1: at 0.01 the CPU smoke run kept almost no
    token past recursion 0) of z, one mean over the routed recursions' active tokens (the
    authors' code: 0.001 times the sum of each recursion's mean); inference keeps z > 0 (the
    authors' evaluation: the top-k over the whole sequence, which sees later tokens).
    Recursion-wise KV caching; no KV-sharing variant, z-loss or capacity warm-up.
"""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from support import UserError, fmt_list

# -----------------------------------------------------------------------------
# Packed lengths (compact=True): how many tokens each applied block runs, known on the host

PACKS = 16  # a packed length is a multiple of seq_len / PACKS, or seq_len: few shapes to compile
PACK_STEPS = 16  # packed lengths hold the most tokens packed over this many steps


def packed_length(count: int, T: int) -> int:
    """count tokens (of a sequence of T) rounded up to a multiple of the unit T / PACKS (rounded
    up: at most PACKS lengths below T), at least one unit (Block.pack), at most T."""
    unit = math.ceil(T / PACKS)
    units = math.ceil(max(1, count) / unit)
    return min(T, units * unit)


def packed_counts(route: dict) -> torch.Tensor:
    """(L,) per applied block, the most tokens one sequence packed there (ran its MLP)."""
    return route["mlp"].sum(dim=-1).amax(dim=-1)


def packed_lengths(seen: list, T: int) -> list:
    """Packed lengths per applied block from packed_counts seen (lists of L): the most a sequence
    packed there in any of them, rounded up (packed_length). A count that exceeds its length
    next step makes train_step redo the step. Over the last PACK_STEPS steps rather than the
    last one plus a unit of headroom: the smoke run at 300 steps redid 12 steps, where the other
    rule, replayed on its counts, redoes 71 (records/2026-11-26_smoke_compact_packed_cpu/)."""
    return [packed_length(int(max(c)), T) for c in zip(*seen, strict=True)]


@torch.no_grad()
def fit_lengths(raw, idx: torch.Tensor):
    """Compact: set raw's packed lengths to what a forward pass on idx packs, in its current mode
    (bf16 on CUDA), so that a compiled model runs that batch with no host read per block (as
    bench.py and sweep.py time it)."""
    raw.router.lengths = None
    with torch.autocast("cuda", torch.bfloat16, enabled=idx.is_cuda):
        raw.router.lengths = packed_lengths([packed_counts(raw(idx).route).tolist()], idx.size(1))


# -----------------------------------------------------------------------------
# Router: which tokens run which blocks, and how that is trained and counted
#
# The model hands its router the blocks (Router.forward runs the depth loop). A new router: a
# subclass here, an entry in train_gpt.ROUTERS, its fields in Hyperparameters marked with
# router=NAME, tests. A forward pass fills a trace (per-layer lists): every router records
# "block" and "mlp", (B, T) bool, the tokens that ran the block and its MLP.


def ran(trace: dict, block, mlp=None):
    """Record the tokens ((B, T) bool) that ran this block and its MLP (default: the same)."""
    trace["block"].append(block)
    trace["mlp"].append(block if mlp is None else mlp)


class Router(nn.Module):
    """The hooks every router has, each defaulting to the dense model's behaviour. Sums are
    float64 (k, L), summed over micro-batches and ranks before a hook reads them."""

    means = {}  # metric -> trace key: per-layer means over tokens in train and val records
    expandable = True  # its parameters move with their layers in a depth expansion (expand.py)
    layer_modules = ""  # its ModuleList of one module per layer, which expand.py moves with them
    skips = "block"  # trace key of what a token skips (skipview.py); "mlp": DLO, "recursion": MoR
    packs_in_training = True  # compact packs tokens in training too; DLO: no

    def __init__(self, hp):
        super().__init__()
        self.hp = hp
        # compact: each applied block's packed length (Block.pack), set by train_step from the
        # packed counts seen in the last steps; None: read on the host per block (exact, a sync
        # each: eager use)
        self.lengths, self.seen = None, []

    def length(self, applied: int):
        """The packed length of applied block `applied` (its index in the depth loop), or None."""
        return None if self.lengths is None else self.lengths[applied]

    def packs(self) -> bool:
        """Whether training packs tokens to lengths known on the host (compact; DLO: never)."""
        return self.hp.compact and self.packs_in_training

    def outgrew(self, packed: list) -> bool:
        """Whether a sequence of the step (packed: packed_counts) had more tokens at a block than
        its packed length: train_step redoes such a step at full length (every token)."""
        if self.lengths is None:  # (none given: each block's count read on the host)
            return False
        return any(n > m for n, m in zip(packed, self.lengths, strict=True))

    def saw(self, packed: list):
        """After a step: the next step's lengths from the counts of the last PACK_STEPS."""
        if self.lengths is not None:
            self.seen = [*self.seen, packed][-PACK_STEPS:]
            self.lengths = packed_lengths(self.seen, self.hp.seq_len)

    def restore_packing(self, ckpt: dict, where: str):
        """The packed lengths and the counts they come from, as a checkpoint saved them, so that
        a resumed run packs and redoes the steps the uninterrupted one does; refused unless they
        are what a run makes (the lengths of the counts of at most PACK_STEPS steps, or before
        the first step every token). Absent (saved before issue 55), saved without compact or at
        another seq_len: a new run's first lengths stand, every token."""
        hp, packing = self.hp, ckpt.get("packing")
        if packing is None or ckpt["hp"].get("seq_len") != hp.seq_len:
            return
        bad = UserError(
            f"{where}: packed lengths that no run makes (an edited or damaged checkpoint)"
        )
        if not isinstance(packing, dict):
            raise bad
        lengths, seen = packing.get("lengths"), packing.get("seen")
        if lengths is None:  # saved by a job without compact
            return

        def counts(v, kinds, least):  # one per applied block, each a number of a sequence's tokens
            return (
                isinstance(v, list)
                and len(v) == hp.n_layers
                and all(type(n) in kinds and least <= n <= hp.seq_len for n in v)
            )

        if not (isinstance(seen, list) and len(seen) <= PACK_STEPS):
            raise bad
        if not all(counts(v, (int, float), 0) for v in seen):
            raise bad
        made = packed_lengths(seen, hp.seq_len) if seen else [hp.seq_len] * hp.n_layers
        if not counts(lengths, (int,), 1) or lengths != made:
            raise bad
        self.lengths, self.seen = lengths, seen

    def forward(self, blocks, x, trace: dict, mask, pos=None, cache=None):
        """The depth loop: x (B, T, d) through each block once, in order, by run(). A router that
        re-applies a block or stops tokens early overrides it, recording "block" and "mlp" and
        calling resid() per applied block (n_layers in all)."""
        for layer, block in enumerate(blocks):
            x = self.resid(
                trace,
                self.run(
                    layer, block, x, trace, mask, pos, None if cache is None else (cache, layer)
                ),
            )
        return x

    def resid(self, trace: dict, x):  # x; its mean norm recorded in evaluation
        if not self.training:
            trace["resid"].append(x.detach().float().norm(dim=-1).mean())
        return x

    def run(self, layer: int, block, x, trace: dict, mask, pos=None, cache=None):
        """Block `layer` on x (B, T, d), routed and recorded in trace."""
        x = block(x, None, mask, pos=pos, cache=cache)
        ran(trace, torch.ones(x.shape[:2], dtype=torch.bool, device=x.device))
        return x

    def loss(self, route: dict, step: int):
        """route: the trace stacked, (L, B, T) per key -> (regularising loss, sums for update)."""
        return route["block"].new_zeros((), dtype=torch.float32), None

    def lr_scales(self, step: int) -> list:
        return [1.0] * self.n_blocks(self.hp)  # per block, a factor on its (and layer_params') rate

    def reset_parameters(self):
        """Its own init, after GPT's N(0, init_std) of every linear."""

    def layer_params(self, layer: int) -> list:
        """Its parameters trained at block `layer`'s rate (lr_scales)."""
        return []

    def update(self, sums, count: int, step: int):
        """After a step: loss()'s sums over the global batch of `count` tokens."""

    def log_lines(self, v: dict) -> list:
        """Its lines of the validation log from v, evaluate's figures."""
        return []

    def state_lines(self, step: int) -> list:
        """Its training state's lines of the validation log (a training job's alone: a model
        only evaluated has none, its router as built)."""
        return []

    def zero_targets(self):
        """Per layer, the share of zero gates aimed at (sweep.py); None: it aims at none."""
        return None

    def routing_state(self) -> dict:
        """Its state outside the parameters, checkpointed."""
        return {}

    def load_routing_state(self, state: dict):
        """routing_state() back from a checkpoint."""

    @staticmethod
    def n_blocks(hp) -> int:
        """Blocks built; n_layers is how many are applied."""
        return hp.n_layers

    @staticmethod
    def check(hp) -> str:
        """What makes these settings wrong for it: an error line, or "" when they are right."""
        return ""

    @staticmethod
    def weighs_keys(hp) -> bool:
        """Whether a block's keys are weighted (by g, or the router's own), so gate_eps is read."""
        return True

    @classmethod
    def idle(cls, hp) -> dict:
        """{field: why}: the fields these settings leave unread (giving one: an error); a router
        adds its own to these."""
        why = f"router={hp.router} as set: no key is weighted"
        return {} if cls.weighs_keys(hp) else {"gate_eps": why}

    @staticmethod
    def extra_flops(hp, T: int) -> float:
        """Its own forward FLOPs on a sequence of T tokens."""
        return 0.0

    @staticmethod
    def skipped_tokens_are_keys(hp) -> bool:
        """Whether a token that skips a block stays a key there (attention runs for it)."""
        return False


class Dense(Router):
    """router=none: the dense model, all hooks at their defaults."""

    @staticmethod
    def weighs_keys(hp):
        return False

    @staticmethod
    def check(hp):
        return "compact=true: router=none runs every token everywhere" if hp.compact else ""


class DLO(Router):
    """DLO (Tan et al. 2024, Section 3): attention always runs; the MLP runs for the tokens
    picked, scaled by r = (beta + (2 sigmoid(hW) - 1) gamma) / 2 (eqs. 1-2): in training the top
    (1 - rho_i) of each sequence by r, rho_i from similarity labels (eqs. 5-8) and an annealed
    rate (eq. 9); in inference r >= beta / 2. Trace: "logits" hW, "scale" r (0: skipped),
    "similarity" (training) eq. 4's cosine of the MLP's input and output."""

    skips, packs_in_training = "mlp", False
    layer_modules = "routers"

    def __init__(self, hp):
        super().__init__(hp)
        self.routers = nn.ModuleList(nn.Linear(hp.dim, 1, bias=False) for _ in range(hp.n_layers))
        # rho_{i,1}: step 1's annealed rate (paper's rho would skip most when meant to skip least)
        self.register_buffer(
            "rates",
            torch.full((hp.n_layers,), self.overall(0), dtype=torch.float64),
            persistent=False,
        )

    def reset_parameters(self):
        for router in self.routers:  # zero: every r is exactly beta / 2 = 1 (Section 3.2)
            nn.init.zeros_(router.weight)

    def layer_params(self, layer):
        return list(self.routers[layer].parameters())

    @classmethod
    def idle(cls, hp):
        unread = {} if hp.dlo_rho else {"dlo_anneal_steps": "dlo_rho=0"}  # nothing to anneal
        return {**super().idle(hp), **unread}

    def overall(self, step: int) -> float:
        """eq. (9) with rho_bar = 0, at training step t = step + 1."""
        t, hp = step + 1, self.hp
        return (
            hp.dlo_rho
            if hp.dlo_anneal_steps == 0 or t > hp.dlo_anneal_steps
            else hp.dlo_rho * t / hp.dlo_anneal_steps
        )

    def run(self, layer, block, x, trace, mask, pos=None, cache=None):
        hp = self.hp
        z = self.routers[layer](x).float()  # (B, T, 1) router logit h W
        r = (hp.dlo_beta + (2 * torch.sigmoid(z) - 1) * hp.dlo_gamma) / 2  # eq. (1)
        a = block.attend(x, None, mask, pos, cache)
        if self.training:  # the top floor((1 - rho_i) S) of each sequence by r, ranked by z:
            # r rises with z, but in fp32 it is one value for every z past about 14
            k = torch.floor((1 - self.rates[layer]) * x.size(1))  # a tensor: no host read
            order = z[..., 0].argsort(dim=1, descending=True, stable=True)  # (B, T) by rank
            first = torch.arange(x.size(1), device=x.device) < k  # (T,) per rank: in the top k
            run = torch.empty_like(order, dtype=torch.bool).scatter(
                1, order, first.expand_as(order)
            )[..., None]
        else:  # inference: r >= beta / 2, i.e. sigmoid(z) >= 1/2 as gamma > 0, i.e. z >= 0
            run = z >= 0  # (r itself in fp32 rounds to beta / 2 for z down to about -2.5e-6)
        if hp.compact and not self.training:  # the MLP on the running tokens only, packed
            pos = block.pack(run[..., 0], self.length(layer))  # (B, Tc), None: every token
            if pos is None:
                f = block.mlp(a)
            else:  # (the padding's MLP lands on tokens that do not run it: r * run = 0 there)
                index = pos[..., None].expand(-1, -1, a.size(-1))  # (B, Tc, d)
                packed = block.mlp(a.gather(1, index))  # (autocast's dtype without sandwich norm)
                f = packed.new_zeros(a.shape).scatter(1, index, packed)
        else:
            f = block.mlp(a)
            trace["similarity"].append(
                F.cosine_similarity(a.detach().float(), (a + f).detach().float(), dim=-1)
            )
        trace["logits"].append(z[..., 0])
        trace["scale"].append((r * run)[..., 0])  # the factor on the MLP branch, 0: skipped
        ran(trace, torch.ones_like(run[..., 0]), run[..., 0])
        return a + r * run * f  # r in fp32: in bf16 it would round to 1 for small |hW|

    @staticmethod
    def labels(similarity, rho_t: float):
        """eq. (5): in each sequence, the floor((1 - rho_t) R' S) (layer, token) positions with
        the least similar MLP input and output are labelled 1 (run). (L, B, T) -> (L, B, T)."""
        L, B, T = similarity.shape
        k = math.floor((1 - rho_t) * L * T)
        flat = similarity.permute(1, 0, 2).reshape(B, L * T)
        labels = torch.zeros_like(flat)
        if k:
            labels.scatter_(1, flat.topk(k, dim=1, largest=False).indices, 1.0)
        return labels.view(B, L, T).permute(1, 0, 2)

    def loss(self, route, step):
        """eqs. (5)-(7): similarity labels, BCE of sigmoid(h W) against them."""
        labels = self.labels(route["similarity"], self.overall(step))
        return (
            F.binary_cross_entropy_with_logits(route["logits"], labels),
            labels.double().sum(dim=(1, 2))[None],
        )

    def update(self, sums, count, step):
        """eq. (8) as a skip rate (module docstring): each layer's share of tokens labelled 0."""
        self.rates.copy_(1 - sums[0].double() / count)  # on the device

    def lr_scales(self, step):
        """eq. (10): zeta_i / zeta_bar = (1 - rho_i,t) / (1 - rho^t)."""
        return ((1 - self.rates) / (1 - self.overall(step))).tolist()  # (a host read per step)

    def state_lines(self, step):
        return [
            f"  train_skip_rates:{fmt_list(self.rates.tolist())} rho_t:{self.overall(step):.3f}"
        ]

    @staticmethod
    def extra_flops(hp, T):
        return hp.n_layers * T * 2 * hp.dim  # routers, all tokens

    @staticmethod
    def weighs_keys(hp):  # (attention runs for every token, unweighted)
        return False

    def routing_state(self):
        return {"rates": self.rates.cpu().clone()}

    def load_routing_state(self, state):
        self.rates.copy_(state["rates"])


class MixtureOfDepths(Router):
    """Mixture-of-Depths (Raposo et al. 2024): every mod_every-th block scores each token, r =
    w.h; in training the top mod_capacity of each sequence runs it, both branches scaled by r,
    the rest pass by (neither query nor key, no MLP). BCE (mod_aux_coef) teaches r > 0 to the
    top k, which evaluation and decoding run (causal). Trace: "logits" r, "topk" (training)."""

    expandable = False  # which blocks are routed depends on the layer count

    def __init__(self, hp):
        super().__init__(hp)
        self.routed = [i for i in range(hp.n_layers) if i % hp.mod_every == hp.mod_every - 1]
        self.routers = nn.ModuleList(nn.Linear(hp.dim, 1, bias=False) for _ in self.routed)

    def layer_params(self, layer):
        return [
            p
            for i, r in zip(self.routed, self.routers, strict=True)
            if i == layer
            for p in r.parameters()
        ]

    def run(self, layer, block, x, trace, mask, pos=None, cache=None):
        if layer not in self.routed:
            return super().run(layer, block, x, trace, mask, pos, cache)
        r = self.routers[self.routed.index(layer)](x).float()[..., 0]  # (B, T)
        trace["logits"].append(r)
        if self.training:
            k = max(1, math.floor(self.hp.mod_capacity * x.size(1)))  # k of each sequence
            length = k
            top = r.topk(k, dim=1).indices  # (B, k)
            chosen = torch.zeros_like(r, dtype=torch.bool).scatter(1, top, True)
            trace["topk"].append(chosen)
        else:
            chosen = r > 0  # causal: one token's own score
            length = self.length(layer)
        ran(trace, chosen)
        if cache is not None and not bool(chosen.any()):
            return x  # a token that passes the block keeps no K/V there
        keys = chosen[..., None].to(x.dtype)  # (B, T, 1): the chosen tokens are the only keys
        g = (r[..., None] * keys).type_as(x)  # (B, T, 1): r on the chosen tokens, else 0
        compact = self.hp.compact and cache is None
        return block(x, g, mask, compact=compact, pos=pos, cache=cache, keys=keys, length=length)

    def loss(self, route, step):
        bce = F.binary_cross_entropy_with_logits(route["logits"], route["topk"].float())
        return self.hp.mod_aux_coef * bce, None

    @staticmethod
    def check(hp):
        if hp.mod_every > hp.n_layers:
            return f"mod_every={hp.mod_every} routes no block of {hp.n_layers}"
        return ""

    @staticmethod
    def extra_flops(hp, T):
        return len(range(hp.mod_every - 1, hp.n_layers, hp.mod_every)) * T * 2 * hp.dim


class MixtureOfRecursions(Router):
    """Mixture-of-Recursions (Bae et al. 2025), Middle-Cycle: blocks[0] and blocks[-1] run once,
    the stack between them N_r = mor_recursions times. Before recursion r, z = w_r.h; of the
    active tokens training keeps the top floor((N_r - r) / N_r T) per sequence (r = 0: all),
    which run the stack (the rest neither queries nor keys) and move by g = sigmoid(z) times its
    update, h + g (f(h) - h). As for MoD, BCE (mor_aux_coef) teaches z > 0 to the top k, which
    inference keeps. mor_routed=false: every token every recursion, g = 1 (the recursive
    baseline). Trace: "recursion" (N_r, B, T) who ran r; for r >= 1, "logits" z, "active"
    (eligible), "topk" (training)."""

    expandable = False  # its shared blocks are not a stack of layers
    skips = "recursion"

    def __init__(self, hp):
        super().__init__(hp)
        self.routers = nn.ModuleList(
            nn.Linear(hp.dim, 1, bias=False)
            for _ in range(hp.mor_recursions if hp.mor_routed else 0)
        )

    @staticmethod
    def n_blocks(hp):
        return 2 + (hp.n_layers - 2) // hp.mor_recursions

    def forward(self, blocks, x, trace, mask, pos=None, cache=None):
        first, *stack, last = blocks

        def at(i):  # K/V per applied block
            return None if cache is None else (cache, i)

        x = self.resid(trace, self.run(0, first, x, trace, mask, pos, at(0)))
        active = torch.ones(x.shape[:2], dtype=torch.bool, device=x.device)  # (B, T)
        for r in range(self.hp.mor_recursions):
            active, g, k = self.choose(r, x, active, trace)
            trace["recursion"].append(active)
            every = r == 0 or not self.hp.mor_routed  # every token: the block ungated, as dense
            keys = None if every else active[..., None].to(x.dtype)  # (B, T, 1): its tokens
            h = x
            for i, block in enumerate(stack):
                if cache is None or bool(active.any()):  # decoding: a token not kept stores no K/V
                    applied = 1 + r * len(stack) + i
                    h = block(
                        h,
                        keys,
                        mask,
                        compact=self.hp.compact and cache is None,
                        pos=pos,
                        cache=at(applied),
                        keys=keys,
                        length=k or self.length(applied),
                    )
                ran(trace, active)
                if i < len(stack) - 1:
                    self.resid(trace, h)
            x = self.resid(trace, x + g * (h - x))  # a token not kept: h = x
        return self.resid(
            trace,
            self.run(self.hp.n_layers - 1, last, x, trace, mask, pos, at(self.hp.n_layers - 1)),
        )

    def choose(self, r: int, x, active, trace):
        """-> the tokens ((B, T) bool, within active) that run recursion r, their weight g, and
        how many each sequence has if known on the host (training's top k), else None.
        Recursion 0's share is 1: every token runs it, in training and inference alike (its
        router only weights the update), so it has no choice to learn."""
        if not self.hp.mor_routed:
            return active, 1.0, None
        z = self.routers[r](x).float()[..., 0]  # (B, T)
        if r == 0:
            return active, torch.sigmoid(z)[..., None].type_as(x), None
        trace["logits"].append(z)
        trace["active"].append(active)
        k = None
        if self.training:  # k_r <= k_(r-1): the top k are all active
            N, T = self.hp.mor_recursions, x.size(1)
            k = max(1, (N - r) * T // N)
            top = z.masked_fill(~active, -math.inf).topk(k, dim=1).indices
            chosen = torch.zeros_like(active).scatter(1, top, True)  # (B, T)
            trace["topk"].append(chosen)
        else:
            chosen = active & (z > 0)  # causal: the token's own score
        return chosen, torch.sigmoid(z)[..., None].type_as(x), k

    def loss(self, route, step):
        """BCE of each active token's z against its top-k membership, mean over active tokens."""
        if "topk" not in route:  # the recursive baseline, or N_r = 1: nothing is chosen
            return super().loss(route, step)
        bce = F.binary_cross_entropy_with_logits(
            route["logits"], route["topk"].float(), reduction="none"
        )
        return self.hp.mor_aux_coef * (bce * route["active"]).sum() / route["active"].sum(), None

    @staticmethod
    def check(hp):
        N, L = hp.mor_recursions, hp.n_layers
        if L < 2 + N or (L - 2) % N:
            near = [n for n in (L - (L - 2) % N, L - (L - 2) % N + N) if n >= 2 + N]
            return (
                f"n_layers={L}: MoR applies blocks 0 and L-1 once and a stack of (L - 2) / "
                f"mor_recursions blocks mor_recursions={N} times; need L - 2 a positive "
                f"multiple of it (n_layers={' or '.join(map(str, near))})"
            )
        unchosen = MixtureOfRecursions.unchosen(hp)
        if unchosen and hp.compact:  # (recursion 0 runs every token)
            return f"compact=true: with {unchosen} every token runs everywhere"
        return ""

    @staticmethod
    def unchosen(hp) -> str:
        """The setting under which no router chooses (every token, every recursion), or ""."""
        if not hp.mor_routed:
            return "mor_routed=false"
        return "mor_recursions=1" if hp.mor_recursions == 1 else ""

    @classmethod
    def weighs_keys(cls, hp):  # (a recursion's keys: the tokens it runs)
        return not cls.unchosen(hp)

    @classmethod
    def idle(cls, hp):
        unchosen = cls.unchosen(hp)
        unread = {"mor_aux_coef": f"{unchosen}: no router chooses"} if unchosen else {}
        return {**super().idle(hp), **unread}

    @staticmethod
    def extra_flops(hp, T):
        return (hp.mor_recursions if hp.mor_routed else 0) * T * 2 * hp.dim  # routers, all tokens
