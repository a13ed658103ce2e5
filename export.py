"""Export a run's model as a folder in Hugging Face layout, to share it or push it to the Hub.

    python export.py RUN_DIR OUT_DIR                        # model.safetensors, config.json,
    python export.py RUN_DIR OUT_DIR --push_to=OWNER/NAME   # README.md; then uploaded there
    python export.py RUN_DIR OUT_DIR --format=authors       # the authors' layout
    python train_gpt.py --init_from=OUT_DIR --eval_only=true   # (or hf:OWNER/NAME) loads it

--format=ours (the default): config.json holds every setting of the run in our names
(hub.FORMAT), and what trained it. --format=authors: the layout of the authors' released models
(their config fields and tensor names, the embedding in bfloat16, hub.py), which their
SkipMiddleModel.from_pretrained reads (transformers 4.51.1, their pinned version) and runs to
our logits; only a model theirs can express is written (authors_config says what else is
refused, in one line). README.md is the model card: the model, the command and commit that
trained it (and whether the tree had changes), the source it started from, the steps trained,
the validation of these weights (loss, sparsity, FLOPs per token) if one was made at their step,
and how to load it here. The checkpoint is read once: all of it describes the weights written.
OUT_DIR may hold only files export wrote, which it replaces (an earlier export's, of any run).
A push needs the network and a token (huggingface_hub's login); without them it is one error
line, after the local files are written.
"""

import argparse
import json
import os
import re
import sys
from dataclasses import asdict

import fileio
import support

if __name__ == "__main__":
    support.exit_quietly_on_signals()

import torch  # noqa: E402

import hub  # noqa: E402
import runlog  # noqa: E402
import runs  # noqa: E402
import sources  # noqa: E402
import train_gpt as tg  # noqa: E402

CARD = "README.md"
FILES = (hub.WEIGHTS, hub.CONFIG, CARD)
TEMPORARY = "|".join(  # fileio.write_atomically's temporary files, of FILES and the record
    re.escape(name) + r"\.[a-z0-9_]{8}\.tmp" for name in (*FILES, fileio.OUTPUTS)
)


def parser() -> support.ArgParser:
    p = support.ArgParser("python export.py", __doc__)
    p.add_argument("run_dir", type=support.path_arg, metavar="RUN_DIR", help="a run's folder")
    p.add_argument(
        "out_dir",
        type=support.path_arg,
        metavar="OUT_DIR",
        help="the folder to write: new, or an earlier export's (replaced)",
    )
    p.add_argument(
        "--format",
        choices=("ours", "authors"),
        default="ours",
        help="ours: every setting in our names | authors: their released models' layout "
        "(default: %(default)s)",
    )
    p.add_argument(
        "--push_to",
        type=repo_id,
        metavar="OWNER/NAME",
        help="then upload the folder to this Hub repository, made if absent (default: no push)",
    )
    return p


def repo_id(text: str) -> str:
    """OWNER/NAME as the Hub allows it: letters, digits, - _ . (no -- or .., none at an end)."""
    part = r"[A-Za-z0-9](?:[\w.-]*[A-Za-z0-9])?"
    if not re.fullmatch(f"{part}/{part}", text) or "--" in text or ".." in text:
        raise argparse.ArgumentTypeError(f"expected OWNER/NAME, got {text!r}")
    return text


def check_out_dir(out: str):
    """OUT_DIR holds nothing export did not write (fileio.writable_dir checks its own files)."""
    if os.path.isdir(out):  # (a write cut by SIGKILL leaves its temporary file: NAME.*.tmp)
        cut = {n for n in os.listdir(out) if re.fullmatch(TEMPORARY, n)}
        foreign = sorted(set(os.listdir(out)) - {*FILES, fileio.OUTPUTS} - cut)
        if foreign:
            more = f" and {len(foreign) - 3} more" if len(foreign) > 3 else ""
            raise support.UserError(
                f"{out} holds files export did not write ({', '.join(foreign[:3])}{more}): "
                "give a new or empty folder; nothing was written"
            )
    fileio.writable_dir(out, FILES, by=__file__)


def last_validation(run_dir: str, step: int) -> dict:
    """The run's last validation record of step `step` in metrics.jsonl ({} if none)."""
    found = [v for v in runlog.run_records(run_dir, "val") if v.get("step") == step]
    return found[-1] if found else {}


def figure(v: dict, key: str, form: str) -> str:
    """A validation record's number as the log shows it; n/a where it has none."""
    value = v.get(key)
    return format(value, form) if type(value) in (int, float) else "n/a"


def model_card(hp, trained: dict, params: int, layout: str) -> str:
    v = trained["validation"]
    # each a line of the card: a newline in one (a folder's name, an edit) escaped
    said = {
        k: support.one_line(trained.get(k) or "")
        for k in ("command", "git_commit", "init_from", "expanded_from")
    }
    figures = (
        f"- validation at step {v.get('step')}: loss {figure(v, 'val_loss', '.4f')} (SE "
        f"{figure(v, 'val_se', '.4f')} over {figure(v, 'val_docs', '')} documents), sparsity "
        f"{figure(v, 'sparsity', '.4f')}, forward FLOPs per token "
        f"{figure(v, 'fwd_flops_per_token', '.4g')} (dense "
        f"{figure(v, 'fwd_flops_per_token_dense', '.4g')})"
        if v
        else f"- no validation of these weights (step {trained.get('step')}) recorded"
    )
    commit = said["git_commit"] or "unknown"
    if trained.get("git_dirty"):
        commit = f"{commit}, with changes not committed (the run's train.log holds its sources)"
    origin = "a random initialisation" if trained["logged"] else "unknown (no config.json)"
    if trained.get("expanded"):
        origin = f"a depth expansion (expand.py) of {said['expanded_from'] or 'another run'}"
    if said["init_from"]:
        origin = f"the weights of {said['init_from']}"
    return f"""# {hp.router} model, {hp.n_layers} layers, dim {hp.dim}

A model trained by this project's `train_gpt.py` (token-conditional depth in Transformers:
the skip-middle router of Lawson & Aitchison 2025 and further depth routers). {layout} The
weights are `model.safetensors`.

- router {hp.router}, {hp.n_layers} layers, dim {hp.dim}, {hp.n_heads} heads ({hp.n_kv_heads}
  key/value), vocabulary {hp.vocab_size} ({hp.encoding}), context {hp.max_seq_len},
  {params:,} parameters
- trained here {trained.get("step")} steps, {trained.get("tokens")} tokens (run
  {trained.get("run_id")}), from {origin}
{figures}
- the last job's command: `{said["command"] or "unknown"}` (train.log: every job's)
- commit: {commit}

## Use it with this project

    python train_gpt.py --init_from=SOURCE --eval_only=true --val_files=... --val_tokens=...
    python sample.py --init_from=SOURCE --prompt="..."
    python skipview.py --init_from=SOURCE --text="..."
    python train_gpt.py --init_from=SOURCE ...   # a new run from these weights

SOURCE is this folder, or `hf:OWNER/NAME` once it is on the Hugging Face Hub.
"""


def shared_settings(hp) -> dict:
    """The settings to write: data paths inside this repository made relative to it (as the
    defaults are, so that they hold on another machine), others as they are."""
    settings = asdict(hp)
    for name in ("train_files", "val_files"):
        if settings[name].startswith(support.HERE + os.sep):
            settings[name] = os.path.relpath(settings[name], support.HERE)
    return settings


def authors_config(hp) -> dict:
    """The authors' config.json for hp (their field names, hub.AUTHORS_FIELDS), or a UserError
    naming a setting their model cannot express: it is what hub.AUTHORS_IMPLIED says (query
    gating, a bfloat16 embedding, SwiGLU 4 x dim, sandwich norm, skip_middle)."""
    for name, theirs in hub.AUTHORS_IMPLIED.items():
        ours = getattr(hp, name)
        if ours != theirs:
            raise support.UserError(
                f"{name}={ours}: the authors' model has {name}={theirs} only, so it cannot "
                f"express this run; export it with --format=ours"
            )
    settings = asdict(hp)
    config = {theirs: settings[ours] for theirs, ours in hub.AUTHORS_FIELDS.items()}
    config["zero_init_masks"] = hp.gate_init == "zero"
    return {
        "architectures": [hub.AUTHORS],
        **config,
        "ffn_dim_multiplier": hub.AUTHORS_IMPLIED["ffn_mult"],  # (their code reads neither)
        "multiple_of": 256,
        "torch_dtype": "bfloat16",  # (as theirs: the embedding's)
        "transformers_version": "4.51.1",
    }


LAYOUTS = {  # what the card says of config.json
    "ours": "Every setting is in `config.json` (`settings`, in `train_gpt.py`'s names).",
    "authors": "`config.json` is in the layout of the authors' released models (their field "
    "names: their `SkipMiddleModel.from_pretrained` reads it, transformers 4.51.1).",
}


def main(argv):
    args = parser().parse_args(argv)
    out = args.out_dir
    ckpt = sources.load_checkpoint(args.run_dir)  # read once: the weights and what they are
    runs.check_owner(args.run_dir, ckpt)  # (the folder's own run: its logs describe it)
    where = os.path.join(args.run_dir, runs.CHECKPOINT)
    hp = sources.model_settings(ckpt["hp"], where)
    theirs = authors_config(hp) if args.format == "authors" else None
    check_out_dir(out)
    model = tg.built(hp, (ckpt["model"], where, str), "cpu")
    # config.json's command and commit, or an expansion's not yet trained (expand.json's); what
    # it holds of the wrong type: not known
    expansion = runlog.json_object(os.path.join(args.run_dir, "expand.json"))
    logged = runlog.json_object(os.path.join(args.run_dir, runlog.LOGS[2]))
    made_by = logged or expansion
    known = {k: v for k, v in made_by.items() if isinstance(v, bool if k == "git_dirty" else str)}
    source = expansion.get("expanded_from")
    trained = {
        "run_id": ckpt["run_id"],
        "step": ckpt["step"],
        "tokens": ckpt["tokens"],
        "logged": bool(logged),
        "command": known.get("command"),
        "git_commit": known.get("git_commit"),
        "git_dirty": known.get("git_dirty"),
        "init_from": known.get("init_from"),
        "expanded": os.path.isfile(os.path.join(args.run_dir, "expand.json")),
        "expanded_from": source if isinstance(source, str) else None,
        "validation": last_validation(args.run_dir, ckpt["step"]),
    }
    from safetensors.torch import save

    weights = {k: t.detach().cpu().contiguous() for k, t in model.state_dict().items()}
    config = {"format": hub.FORMAT, "settings": shared_settings(hp), "trained": trained}
    if theirs is not None:  # their names; their embedding module is bfloat16 (exact here, as
        config = theirs  # embed_dtype=bfloat16 rounds the embedding's output)
        names = {v: k for k, v in hub.AUTHORS_NAMES.items()}
        weights = {hub.renamed(k, names): t for k, t in weights.items()}
        weights["model.tok_embeddings.weight"] = weights["model.tok_embeddings.weight"].bfloat16()
    params = sum(p.numel() for p in model.parameters())
    files = {  # all made before the first is written
        hub.WEIGHTS: save(weights, metadata={"format": "pt"}),
        hub.CONFIG: json.dumps(config, indent=1).encode(),
        CARD: model_card(hp, trained, params, LAYOUTS[args.format]).encode(),
    }
    os.makedirs(out, exist_ok=True)
    with support.signals_held():  # a signal waits for the last: one export's files, not a mix
        for name, data in files.items():
            fileio.write_output(out, name, data, by=__file__)
    print(f"written to {support.one_line(out)}: {', '.join(FILES)}")
    if args.push_to:
        push(out, args.push_to)


def push(out: str, repo: str):
    """Upload the three files to the Hub repository repo (made if absent, with the account's
    default visibility)."""
    from huggingface_hub import HfApi

    try:
        api = HfApi()
        api.create_repo(repo, exist_ok=True)
        api.upload_folder(repo_id=repo, folder_path=out, allow_patterns=list(FILES))
    except Exception as e:  # no network, no token, no right to the repository
        raise support.RunStopped(  # (status 1: the files are written; the input was good)
            f"--push_to={repo}: not pushed ({support.first_line(e)}); the files are written in "
            f"{out}"
        ) from None
    print(f"pushed to https://huggingface.co/{repo}")


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    sys.exit(support.cli(main, sys.argv[1:]))
