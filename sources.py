"""Where a job's model comes from, for train_gpt.py and the commands beside it: a run folder's
checkpoint (--resume goes on with its run; --init_from=RUN starts a new run from its weights) or a
folder in Hugging Face layout, local or hf:OWNER/NAME[@REVISION] (hub.py), its settings and
weights read and checked before anything is built or written. The checkpoint's own format, its
saving and its run folder: runs.py.

It builds on train_gpt (its settings, their checks, the model), whose main calls it: train_gpt
imports it inside main, and run as a script registers itself as train_gpt first, so that the
import here gets the module that runs, not a second copy of it (train_gpt.py loaded by path under
another name, as a notebook may, is loaded again as train_gpt when its main runs)."""

import os
import shlex
from dataclasses import asdict, fields, replace

import fileio
import hub
import runs
import support
import train_gpt as tg
from runs import CHECKPOINT, RunState
from support import UserError, check_fields

# what training alone reads: the initial weights' settings, and those marked "train"
TRAINING = tg.INITIAL | {f.name for f in fields(tg.Hyperparameters) if f.metadata["use"] == "train"}


def load_checkpoint(run_dir: str) -> dict:
    """RUN_DIR's checkpoint, its counters and settings checked (its weights: runs.check_weights)."""

    def check(state):  # a UserError if the counters or the settings are not a run's
        runs.check_run_state(RunState(**support.saved_fields(RunState, state)))
        saved_settings(state["hp"])

    return runs.read_checkpoint(run_dir, runs.CHECKPOINT_KEYS, check)


def saved_settings(saved: dict) -> tg.Hyperparameters:
    """A checkpoint's settings: every field, its type and range checked. Keys that are no longer
    fields are dropped (older versions' expand_* fields and Job's); older versions knew only
    GPT-2 shards (no encoding: gpt2), a float32 embedding (no embed_dtype) and RoPE unscaled."""
    older = {"encoding": "gpt2", "embed_dtype": "float32", "rope_scaling": False}
    saved = {**older, **saved} if isinstance(saved, dict) else saved
    hp = tg.Hyperparameters(**support.saved_fields(tg.Hyperparameters, saved))
    check_fields(hp)
    return hp


def read_source(source: str) -> tuple:
    """-> (settings, (weights, where, label)) of a model: a run folder's checkpoint, or hub.read's
    (a folder in Hugging Face layout, or hf:OWNER/NAME[@REVISION]); `where` names it for messages
    and the record, label(name) a tensor as the file names it (runs.check_weights)."""
    local = not source.startswith("hf:")
    if local:
        fileio.need(source, "a folder")
    held = [n for n in (hub.WEIGHTS, CHECKPOINT) if os.path.lexists(os.path.join(source, n))]
    if local and len(held) != 1:
        raise UserError(
            f"{source}: holds both {hub.WEIGHTS} (a model folder) and {CHECKPOINT} (a run "
            f"folder): which is meant is not clear; move one away"
            if held
            else f"{source}: neither a model folder ({hub.WEIGHTS}) nor a run folder ({CHECKPOINT})"
        )
    if not local or held == [hub.WEIGHTS]:
        settings, weights, where, label = hub.read(source, asdict(tg.Hyperparameters()))
        named = os.path.join(where, hub.CONFIG)
    else:
        ckpt = load_checkpoint(source)
        where = os.path.join(source, CHECKPOINT)
        settings, weights, named = ckpt["hp"], ckpt["model"], where
        label = str  # (a tensor is named as the checkpoint names it)
    return model_settings(settings, named), (weights, where, label)


def model_settings(settings: dict, named: str) -> tg.Hyperparameters:
    """A model file's settings (a checkpoint's, a config.json's), checked as a model's and named
    as that file in a UserError (data paths relative to the repository)."""
    try:
        hp = tg.resolve({}, saved_settings(settings))
        tg.check_model(hp)
    except UserError as e:
        raise UserError(f"{named}: {e}") from None
    return hp


def load_model(source: str, device: str = "cpu", **changes) -> tg.GPT:
    """The model of SOURCE (read_source) with its weights; model.hp holds its settings, with
    changes that keep the weights' shapes (compact=True, say)."""
    hp, weights = read_source(source)
    hp = replace(hp, **changes)
    tg.check_model(hp)
    return tg.built(hp, weights, device)


def check_source(given: dict, job: tg.Job):
    """--resume's, --init_from's and --eval_only's company: each field that would do nothing
    refused (a field of a new model's initial weights, INITIAL; under --eval_only, a job field
    or one that training alone reads, TRAINING)."""
    if job.init_from and ({"resume", "preset"} & given.keys()):
        raise UserError(
            "--init_from starts from the source's settings: drop --resume (which goes on with a "
            "run) and --preset (a new run's settings)"
        )
    if job.eval_only and not job.init_from:
        raise UserError("--eval_only validates the model of --init_from=SOURCE: give it")
    if job.eval_only:
        idle = sorted(given.keys() & (tg.JOB - {"init_from", "eval_only"} | TRAINING))
        if idle:
            raise UserError(f"--eval_only trains nothing: drop --{idle[0]}")
    start = "resume" if job.resume else "init_from" if job.init_from else ""
    moot = sorted(given.keys() & tg.INITIAL)
    if start and moot:
        raise UserError(
            f"--{moot[0]} sets a new model's initial weights, and --{start} takes "
            f"{'the checkpoint' if job.resume else 'the source'}'s: drop it"
        )


def resume_settings(given: dict) -> tuple:
    """-> (hp, checkpoint): the checkpoint's settings with the given ones on top; none fixed,
    a step of as many tokens (its sequences may be cut otherwise), and the same val_tokens."""
    run_dir = given["resume"]
    if given.get("run_dir", run_dir) != run_dir:
        raise UserError("--resume continues in its own directory; drop --run_dir")
    if "preset" in given:  # it would lay a new run's settings over the resumed run's
        raise UserError("--preset starts a new run; a resume keeps its run's settings (drop it)")
    ckpt = load_checkpoint(run_dir)
    runs.check_owner(run_dir, ckpt)  # (a complete run of another folder is not "complete")
    base = saved_settings(ckpt["hp"])
    hp = tg.resolve(given, base)
    changed = [
        f"{k} {getattr(base, k)} -> {getattr(hp, k)}"
        for k in tg.FIXED
        if getattr(base, k) != getattr(hp, k)
    ]
    if changed:
        raise UserError("cannot resume with a different model shape: " + ", ".join(changed))
    step = base.batch_size * base.seq_len  # the tokens of a step, which num_steps and lr_at count
    if hp.batch_size * hp.seq_len != step:
        raise UserError(
            f"a resume keeps the tokens of a step, batch_size x seq_len = {step} (the schedule "
            f"counts steps of them): give a batch_size and seq_len whose product is {step}"
        )
    if hp.val_tokens != base.val_tokens:
        raise UserError(
            f"a resume keeps the run's val_tokens={base.val_tokens}, so that its validation "
            f"losses are all on one set of tokens: drop --val_tokens (other tokens: --init_from="
            f"{shlex.quote(run_dir)} --eval_only=true --val_tokens=N)"
        )
    return hp, ckpt
