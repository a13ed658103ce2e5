"""Models as Hugging Face folders: config.json and model.safetensors, in this project's layout
(export.py writes it) or in the authors' (Lawson & Aitchison's released SkipMiddleModel), from
a local folder or from the Hub (hf:OWNER/NAME[@REVISION], fetched into huggingface_hub's cache,
which HF_HUB_OFFLINE=1 reads without a network). sources.read_source reads run folders itself
and builds the model; this module never imports train_gpt.

Reading the authors' layout as their code reads it (their projects/skip_middle/model:
`SkipMiddleModel.from_pretrained`, transformers 4.51.1, their pinned version):
  - Their tensor names (prefixed `model.`) map to ours by AUTHORS_NAMES; a name with no place,
    a missing tensor or a shape that does not fit is one error naming the tensor as the file
    does.
  - A field their config lacks takes their config class's default (AUTHORS_DEFAULTS: RoPE base
    500000, scaled): their class supplies it. Every setting their model implies is set, not
    left to our defaults: the sizes, RoPE base and scaling (use_scaled_rope: Llama 3.1's, our
    rope_scaling), norm eps, sandwich norm, the gate on the query axis (their attention adds
    ln g there), gate_eps 1e-6, GPT-2 tokens.
  - Their SwiGLU width is 4 * dim whatever ffn_dim_multiplier and multiple_of say (their code
    reads neither), and their embedding is a bfloat16 module: whatever dtype the file stores,
    its output is rounded to bfloat16 (embed_dtype=bfloat16), which their first norm keeps.
  - `initializer_range` and `zero_init_masks` become init_std and gate_init (they matter only
    to a run that re-initialises).
  - Their config has no sequence length of training or evaluation: seq_len is our default, cut
    to their max_seq_len (their RoPE table) where that is shorter.
"""

import json
import os
import re

from fileio import regular
from support import UserError, first_line, out_of_memory

CONFIG, WEIGHTS = "config.json", "model.safetensors"
FORMAT = "train_gpt"  # our config.json: {"format": FORMAT, "settings": {...}, "trained": {...}}
MAX_CONFIG_BYTES = 1 << 20  # a config.json is a few hundred bytes; more is not one

AUTHORS = "SkipMiddleModel"  # their config's "architectures"
AUTHORS_DEFAULTS = {  # their config class's defaults (SkipMiddleConfig): a field not given
    "dim": 768,
    "n_layers": 12,
    "n_heads": 12,
    "n_kv_heads": None,  # None: n_heads (their config's rule)
    "vocab_size": 50257,
    "norm_eps": 1e-5,
    "rope_theta": 500000,
    "use_scaled_rope": True,
    "max_seq_len": 1024,
    "initializer_range": 0.02,
    "zero_init_masks": True,
}
AUTHORS_FIELDS = {  # their config field -> our setting
    "dim": "dim",
    "n_layers": "n_layers",
    "n_heads": "n_heads",
    "n_kv_heads": "n_kv_heads",
    "vocab_size": "vocab_size",
    "norm_eps": "norm_eps",
    "rope_theta": "rope_theta",
    "use_scaled_rope": "rope_scaling",
    "max_seq_len": "max_seq_len",
    "initializer_range": "init_std",
    "zero_init_masks": "gate_init",
}
AUTHORS_IMPLIED = {  # what their model is, whatever its config says (module docstring)
    "ffn_mult": 4,
    "embed_dtype": "bfloat16",
    "sandwich_norm": True,
    "router": "skip_middle",
    "gate_axis": "query",
    "gate_eps": 1e-6,
    "encoding": "gpt2",
}
AUTHORS_NAMES = {  # their tensor -> ours; {i}: a layer, {w}: a projection, {t}: weight or bias
    "model.tok_embeddings.{t}": "embed.{t}",
    "model.input_norm.{t}": "embed_norm.{t}",
    "model.layers.{i}.attention.{w}.{t}": "blocks.{i}.attn.{w}.{t}",
    "model.layers.{i}.feed_forward.{w}.{t}": "blocks.{i}.ffn.{w}.{t}",
    "model.layers.{i}.pre_attention_norm.{t}": "blocks.{i}.attn_in.{t}",
    "model.layers.{i}.post_attention_norm.{t}": "blocks.{i}.attn_out.{t}",
    "model.layers.{i}.pre_feed_forward_norm.{t}": "blocks.{i}.ffn_in.{t}",
    "model.layers.{i}.post_feed_forward_norm.{t}": "blocks.{i}.ffn_out.{t}",
    "model.masks.{i}.linear.{t}": "router.gates.{i}.{t}",  # their masks: layer i < L/2's gate
    "model.output_norm.{t}": "head_norm.{t}",
    "model.output.{t}": "head.{t}",
}
PARTS = {"i": r"\d+", "w": r"w[qkvo123]", "t": r"weight|bias"}


def renamed(name: str, names: dict):
    """name under the first template of names (from -> to) that matches it whole; None if none."""
    for source, target in names.items():
        pattern = re.escape(source)
        for part, form in PARTS.items():
            pattern = pattern.replace(re.escape("{" + part + "}"), f"(?P<{part}>{form})")
        if match := re.fullmatch(pattern, name):
            return target.format(**match.groupdict())
    return None


def read(source: str, defaults: dict) -> tuple:
    """-> (settings, weights, where, label) of SOURCE, a folder or hf:OWNER/NAME[@REVISION]: our
    settings (defaults under the authors' few), weights by our names, where: the folder or the
    repository at its commit, label(our tensor name): its name in the file (for messages)."""
    folder, where = local_folder(source)
    shown = os.path.join(where, CONFIG)  # (the user's name for it: never a cache path)
    config = read_config(os.path.join(folder, CONFIG), shown)
    weights = read_weights(os.path.join(folder, WEIGHTS), os.path.join(where, WEIGHTS))
    if config.get("format") == FORMAT:
        if not isinstance(config.get("settings"), dict):
            raise UserError(f'{shown} has no "settings" object')
        return config["settings"], weights, where, str
    architectures = config.get("architectures")
    if isinstance(architectures, list) and AUTHORS in architectures:
        theirs = {v: k for k, v in AUTHORS_NAMES.items()}
        settings = {**defaults, **authors_settings(config)}
        if type(settings["max_seq_len"]) is int:  # (else refused by the model's checks)
            settings["seq_len"] = min(settings["seq_len"], settings["max_seq_len"])
        return settings, authors_weights(weights, where), where, lambda k: renamed(k, theirs) or k
    raise UserError(
        f"{shown} is neither this project's (format {FORMAT!r}) nor the authors' "
        f"(architectures [{AUTHORS!r}]); it says architectures {architectures!r}"
    )


def local_folder(source: str) -> tuple:
    """-> (folder, where): a local folder as it is (sources.read_source checked it); hf:OWNER/NAME
    [@REVISION] fetched (resumably, the two files only) into the Hub's cache, or found there
    offline."""
    if not source.startswith("hf:"):
        return source, source
    repo, at, revision = source[3:].partition("@")
    if not re.fullmatch(r"[\w.-]+/[\w.-]+", repo) or "@" in revision or (at and not revision):
        raise UserError(f"{source}: give hf:OWNER/NAME or hf:OWNER/NAME@REVISION")
    from huggingface_hub import errors, snapshot_download

    why = {  # the Hub's error kinds, most specific first
        errors.RevisionNotFoundError: f"the repository has no revision {revision!r}",
        errors.RepositoryNotFoundError: "no such repository (or it is private or gated)",
        errors.LocalEntryNotFoundError: "not in the local cache, and the Hub was not reached "
        "(HF_HUB_OFFLINE=1, or no network)",
    }
    try:
        folder = snapshot_download(
            repo, revision=revision or None, allow_patterns=[CONFIG, WEIGHTS]
        )
    except Exception as e:  # offline, not there, or the network failed
        reason = next((w for kind, w in why.items() if isinstance(e, kind)), None)
        raise UserError(f"{source}: {reason or first_line(e)}") from None
    return folder, f"hf:{repo}@{os.path.basename(folder)}"  # the snapshot folder: its commit


def read_config(path: str, shown: str) -> dict:
    if os.path.getsize(regular(path, shown)) > MAX_CONFIG_BYTES:  # (the Hub's cache: links)
        raise UserError(f"{shown} is over {MAX_CONFIG_BYTES} bytes: not a model's config")
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise UserError(f"cannot read {shown}: {e.strerror or e}") from None
    try:
        config = json.loads(data)
    except (ValueError, RecursionError) as e:
        raise UserError(f"{shown} is not readable JSON ({type(e).__name__})") from None
    if not isinstance(config, dict):
        raise UserError(f"{shown} holds {type(config).__name__}, not a JSON object")
    return config


def read_weights(path: str, shown: str) -> dict:
    """Every tensor of a safetensors file; a damaged or truncated one is one UserError."""
    from safetensors.torch import load_file

    regular(path, shown)
    try:  # opened here first: safetensors says "No such file" of one it may not read
        open(path, "rb").close()
    except OSError as e:
        raise UserError(f"cannot read {shown}: {e.strerror or e}") from None
    try:
        return load_file(path)
    except Exception as e:  # safetensors' own error, or the OS's
        if out_of_memory(e):  # (the machine's, not the file's: support.cli says so)
            raise
        raise UserError(f"{shown} is not a complete safetensors file ({first_line(e)})") from None


def authors_settings(config: dict) -> dict:
    """Our settings for the authors' config, as their code reads it (module docstring)."""
    given = {**AUTHORS_DEFAULTS, **{k: v for k, v in config.items() if k in AUTHORS_DEFAULTS}}
    settings = {ours: given[theirs] for theirs, ours in AUTHORS_FIELDS.items()}
    if settings["n_kv_heads"] is None:
        settings["n_kv_heads"] = settings["n_heads"]
    # their code tests these two for truth ("if use_scaled:"): any JSON value reads so
    settings["rope_scaling"] = bool(settings["rope_scaling"])
    settings["gate_init"] = "zero" if settings["gate_init"] else "normal"
    if settings["init_std"] is None:  # theirs: no re-initialisation; ours: the default
        del settings["init_std"]
    return {**settings, **AUTHORS_IMPLIED}


def authors_weights(weights: dict, where: str) -> dict:
    """Their tensors by our names (AUTHORS_NAMES); one with no place is a UserError naming it."""
    out = {}
    for name, tensor in weights.items():
        if (ours := renamed(name, AUTHORS_NAMES)) is None:
            raise UserError(f"{os.path.join(where, WEIGHTS)}: {name} has no place in this model")
        out[ours] = tensor
    return out
