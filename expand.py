"""Depth expansion (DLO, Tan et al. 2024, Section 3.1): a checkpoint with R layers in P groups
becomes a step-0 checkpoint with q new layers after each group, which train_gpt.py then trains
like any run it resumes.

    python expand.py RUN_DIR NEW_RUN_DIR [--groups=P] [--per_group=q] [--init=identity]
                     [--field=value ...]            # --init=linear|slerp [--tau=2]
    python train_gpt.py --resume=NEW_RUN_DIR

The new run's settings are the checkpoint's, then any run setting of train_gpt.py given here as
--field=value (the router, dlo_rho, lr, train_tokens, ...; a job's, such as stop_step, go to
train_gpt.py --resume); n_layers is derived, P (R / P + q), and the other shape fields are the
checkpoint's, as are the weights (so no setting of initial weights is taken: --seed draws
--init=random's new layers alone). Its optimiser state, step and clock start afresh: our
analogue of the paper's fine-tuning stage. With the checkpoint's train_files it reads on from
the checkpoint's data position (tokens the source has not seen), else from the start. A dense
checkpoint may become any router whose parameters do not depend on the layer count (dense or
DLO; new DLO routers start at zero, the model's own initialisation); a DLO checkpoint stays
DLO, its routers moving with their layers. Policies for the new layers: identity (wo = w2 = 0,
the function is unchanged: Section 3.1 zeroes only attention's W_out, yet says the new layers
preserve the original features, which needs w2 = 0 too, as in LLaMA Pro, which it cites;
identity and copy take the group's last original layer, where Section 3.1's index Q + q - 1
names a new one when q > 1), copy, random (Xavier uniform), linear (the mean of the group's
last tau layers, equal weights 1/tau) and slerp (halfway, per tensor, between the last layer
and the tau-th from last): the weights of the merges are our choice, where Section 3.1 leaves
them open.
"""

import contextlib
import json
import math
import os
import shlex
import sys
from dataclasses import asdict

import fileio
import support

if __name__ == "__main__":
    support.exit_quietly_on_signals()

import torch  # noqa: E402

import ranks  # noqa: E402
import runlog  # noqa: E402
import runs  # noqa: E402
import sources  # noqa: E402
import train_gpt as tg  # noqa: E402

EXPAND_INITS = ("random", "copy", "identity", "linear", "slerp")


def new_layer(layers: list, init: str, tau: int, gen: torch.Generator) -> dict:
    """Weights of one added layer from its group's layers (state dicts, oldest first), by the
    policies of DLO Section 3.1. identity keeps the function: wo = 0 and w2 = 0 make both
    residual branches exactly 0 (an RMSNorm of zeros is zero)."""
    last = layers[-1]
    if init in ("copy", "identity"):
        out = {k: v.clone() for k, v in last.items()}
        if init == "identity":
            out["attn.wo.weight"].zero_()
            out["ffn.w2.weight"].zero_()
        return out
    if init == "random":  # Xavier uniform for matrices, 1 for norm weights
        out = {}
        for k, v in last.items():
            if v.dim() < 2:
                out[k] = torch.ones_like(v)
            else:
                bound = math.sqrt(6 / (v.size(0) + v.size(1)))
                out[k] = (torch.rand(v.shape, generator=gen) * 2 - 1).to(v) * bound
        return out
    if init == "linear":  # equal weights alpha_k = 1 / tau on the last tau layers
        return {k: sum(layer[k] for layer in layers[-tau:]) / tau for k in last}
    out = {}  # slerp halfway between the last layer and the tau-th from last, per tensor
    for k, u in last.items():
        v = layers[-tau][k]
        cos = (u.flatten() @ v.flatten() / (u.norm() * v.norm()).clamp(min=1e-12)).clamp(-1, 1)
        omega = torch.arccos(cos)
        if omega.abs() < 1e-6:  # parallel: slerp is the linear mean
            out[k] = (u + v) / 2
        else:
            out[k] = (torch.sin(omega / 2) * u + torch.sin(omega / 2) * v) / torch.sin(omega)
    return out


def expand_state(
    state: dict, R: int, P: int, q: int, init: str, tau: int, seed: int, router_layers: str
):
    """A model state with R layers in P groups of Q -> P groups of Q + q: each group's new
    layers come after its originals. The router's per-layer modules (router.<router_layers>,
    DLO's routers) move with their layers; new ones are left out (their zero initialisation
    is the model's own)."""
    Q, gen = R // P, torch.Generator().manual_seed(seed)
    moving = ["blocks"] + ([f"router.{router_layers}"] if router_layers else [])
    out = {k: v for k, v in state.items() if not k.startswith(tuple(f"{m}." for m in moving))}

    def layer_state(prefix, i):
        return {
            k[len(f"{prefix}.{i}.") :]: v
            for k, v in state.items()
            if k.startswith(f"{prefix}.{i}.")
        }

    j = 0
    for p in range(P):
        group = [layer_state("blocks", p * Q + i) for i in range(Q)]
        for i in range(Q):
            for m in moving:
                out.update({f"{m}.{j}.{k}": v for k, v in layer_state(m, p * Q + i).items()})
            j += 1
        for _ in range(q):
            out.update({f"blocks.{j}.{k}": v for k, v in new_layer(group, init, tau, gen).items()})
            j += 1
    return out


def parser() -> support.ArgParser:
    p = support.ArgParser("python expand.py", __doc__)
    p.add_argument(
        "run_dir",
        type=support.path_arg,
        metavar="RUN_DIR",
        help="the run whose checkpoint is expanded",
    )
    p.add_argument(
        "out",
        type=support.path_arg,
        metavar="NEW_RUN_DIR",
        help="the new run's directory (it must not hold a checkpoint)",
    )
    p.add_argument(
        "--groups",
        type=support.in_range(int, 1),
        default=1,
        metavar="P",
        help="the checkpoint's R layers form P groups of R / P (default: %(default)s)",
    )
    p.add_argument(
        "--per_group",
        type=support.in_range(int, 1),
        default=1,
        metavar="q",
        help="new layers appended to each group (default: %(default)s)",
    )
    p.add_argument(
        "--init",
        choices=EXPAND_INITS,
        default="identity",
        help="how a new layer is made (default: %(default)s)",
    )
    p.add_argument(
        "--tau",
        type=support.in_range(int, 1),
        default=2,
        help="layers merged by linear and slerp (default: %(default)s)",
    )
    return p


def parse_settings(argv: list) -> dict:
    """--field=value settings of the new run, Hyperparameters' alone: a job's (train_gpt.py's
    Job) are for the jobs that train it."""
    return support.parse_fields((tg.Hyperparameters,), argv)


def expanded_settings(
    base: tg.Hyperparameters, overrides: dict, P: int, q: int, init: str, tau: int
) -> tg.Hyperparameters:
    """The new run's settings, or a UserError naming what cannot be expanded that way."""
    if not tg.ROUTERS[base.router].expandable:
        raise support.UserError(
            f"expand a dense or DLO checkpoint: the {base.router} router is tied to the layer count"
        )
    shape = [k for k in tg.FIXED if k not in ("router", "n_layers")]
    changed = [
        f"{k} {getattr(base, k)} -> {overrides[k]}"
        for k in shape
        if k in overrides and overrides[k] != getattr(base, k)
    ]
    if changed:
        raise support.UserError(
            "an expanded model keeps the checkpoint's shape: " + ", ".join(changed)
        )
    # the weights come from the checkpoint: of a new model's initial settings (tg.INITIAL) only
    # the seed does anything, and only for --init=random's new layers
    moot = sorted(overrides.keys() & tg.INITIAL - ({"seed"} if init == "random" else set()))
    if moot:
        raise support.UserError(
            f"--{moot[0]} sets a new model's initial weights; an expanded model's are the "
            f"checkpoint's (--seed draws --init=random's new layers alone)"
        )
    R = base.n_layers
    if R % P:
        raise support.UserError(f"cannot make {P} groups of {R} layers")
    if init in ("linear", "slerp") and tau > R // P:
        raise support.UserError(f"--tau={tau} must lie in [1, {R // P}] (layers per group)")
    n_layers = P * (R // P + q)
    if overrides.get("n_layers", n_layers) != n_layers:
        raise support.UserError(f"n_layers is derived: {n_layers}, not {overrides['n_layers']}")
    hp = tg.resolve({**overrides, "n_layers": n_layers}, base)
    if tg.ROUTERS[base.router].layer_modules and hp.router != base.router:  # they fit no other
        raise support.UserError(
            f"a {base.router} checkpoint expands into a {base.router} model, "
            f"not router={hp.router}; expand a dense checkpoint for that"
        )
    if not tg.ROUTERS[hp.router].expandable:
        raise support.UserError(
            f"router={hp.router} is tied to the layer count; expand into a dense or DLO model"
        )
    # first: check_model's message would name n_layers, which is derived here
    ranks.check_memory(tg.model_bytes(hp), "to build the expanded model", "--per_group or --groups")
    tg.validate(hp, world=1)
    return hp


def main(argv):
    try:
        expand(argv)
    finally:
        support.release_locks()  # NEW_RUN_DIR is free for train_gpt.py, in this process too


def expand(argv):
    p = parser()
    args, rest = p.parse_known_args(argv)
    if args.init not in ("linear", "slerp"):
        p.refuse(p.given(argv) & {"tau"}, f"with --init={args.init}: linear and slerp read it")
    if os.path.abspath(args.out) == os.path.abspath(args.run_dir):
        raise support.UserError("NEW_RUN_DIR must differ from RUN_DIR: a new run is written")
    src = sources.load_checkpoint(args.run_dir)
    runs.check_owner(args.run_dir, src)  # (the folder's own run: expand.json names the folder)
    base = sources.saved_settings(src["hp"])
    try:
        overrides = parse_settings(rest)
    except support.UserError as e:
        raise support.UserError(
            f"{e} (or this command's own: --groups, --per_group, --init, --tau)"
        ) from None
    hp = expanded_settings(base, overrides, args.groups, args.per_group, args.init, args.tau)
    if hp.train_files == base.train_files:
        position = src["loader"]
        tg.loaders(hp, ranks.Dist(), {"loader": position})  # checked now: resuming would refuse it
    else:  # other shards: from their first global batch (the loader's own start)
        position = tg.loaders(hp, ranks.Dist())[0].state()
    ours = (runs.CHECKPOINT, "expand.json", "train.log")  # what this writes: none may be there,
    taken = [
        n
        for n in (*ours, runs.PREVIOUS, *runlog.LOGS)  # nor another run's files (moving
        if os.path.lexists(os.path.join(args.out, n))
    ]  # an aborted run's aside is not ours)
    if taken:
        raise support.UserError(
            f"{args.out} already holds {', '.join(dict.fromkeys(taken))}: "
            f"expand into a folder of its own; nothing was written"
        )
    made = fileio.first_missing(args.out)
    out = runs.open_run_dir(args.out, "")  # probes it: a full disk is found
    try:
        write_run(out, hp, src, base, args, argv, position)
    except BaseException:  # a disk that fills during the writes: take back what this wrote
        with support.signals_held():  # (a second Ctrl-C: not with half of it left)
            for n in ours:
                with contextlib.suppress(OSError):
                    os.remove(os.path.join(out, n))
            with contextlib.suppress(OSError):
                fileio.remove_made(out, made)
        raise
    print(
        f"{args.run_dir} (step {src['step']}, {base.n_layers} layers, {base.router}) -> {out} "
        f"({hp.n_layers} layers, {hp.router}, init {args.init}); train it with:\n"
        f"  python train_gpt.py --resume={shlex.quote(out)}"
    )


def write_run(
    out: str,
    hp: tg.Hyperparameters,
    src: dict,
    base: tg.Hyperparameters,
    args,
    argv,
    position: dict,
):
    """NEW_RUN_DIR's checkpoint (step 0 of the expanded model, reading on from the data
    position), expand.json and train.log."""
    torch.manual_seed(hp.seed)
    model = tg.GPT(hp)
    state = expand_state(
        src["model"],
        base.n_layers,
        args.groups,
        args.per_group,
        args.init,
        args.tau,
        hp.seed,
        tg.ROUTERS[base.router].layer_modules,
    )
    missing, unexpected = model.load_state_dict(state, strict=False)
    # only new routers (zero-initialised, as in a fresh model) may lack weights
    assert not unexpected and all(k.startswith("router.") for k in missing), (missing, unexpected)
    run = runs.RunState(run_id=os.urandom(8).hex())
    runs.save_checkpoint(
        out, runs.checkpoint_state(run, hp, 1, model, tg.optimizer(model, hp), position)
    )
    record = {
        "expanded_from": os.path.abspath(args.run_dir),
        "data_position": position,
        "source_step": src["step"],
        "groups": args.groups,
        "per_group": args.per_group,
        "init": args.init,
        "tau": args.tau,
        "hp": asdict(hp),
        **runlog.provenance(),
        "command": " ".join(["python expand.py", *map(shlex.quote, argv)]),
    }
    fileio.write_atomically(os.path.join(out, "expand.json"), json.dumps(record, indent=2).encode())
    fileio.write_atomically(
        os.path.join(out, "train.log"),
        (  # train_gpt.py appends its jobs
            f"expanded from {args.run_dir} (step {src['step']}, {base.n_layers} layers) to "
            f"{hp.n_layers} layers by: {record['command']}\nsettings and provenance: "
            f"expand.json\n"
        ).encode(),
    )


if __name__ == "__main__":
    sys.exit(support.cli(main, sys.argv[1:]))
