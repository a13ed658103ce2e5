"""Models as Hugging Face folders: config.json and model.safetensors, in this project's layout
(export.py writes it) or in the authors' (Lawson & Aitchison's released SkipMiddleModel), from
a local folder or from the Hub (hf:OWNER/NAME[@REVISION], fetched into huggingface_hub's cache,
which HF_HUB_OFFLINE=1 reads without a network). train_gpt.read_source reads run folders itself
and builds the model; this module never imports train_gpt.

Reading the authors' layout (their projects/skip_middle/model, as `save_pretrained` writes it):
  - Their tensor names (prefixed `model.`) map to ours by AUTHORS_NAMES; a name with no place,
    a missing tensor or a shape that does not fit is one error naming the tensor.
  - Their config gives the sizes, RoPE base and norm eps (AUTHORS_FIELDS); every other setting
    is our default. Their code puts ln g on the query axis (gate_axis=query) and stores the
    embedding in bfloat16, whose rounding their first norm keeps (embed_dtype=bfloat16, read
    from the stored tensor's dtype).
  - Their SwiGLU width is ffn_dim_multiplier * dim (the fixture's 128 at dim 32), so
    `multiple_of` is not read, and a fractional multiplier is refused. Llama 3.1's scaled RoPE
    (use_scaled_rope: true) is not represented here: refused. `initializer_range` and
    `zero_init_masks`, where given, become init_std and gate_init (they matter only to a run
    that re-initialises).
"""

import json
import os
import re

import torch

from support import UserError

CONFIG, WEIGHTS = "config.json", "model.safetensors"
FORMAT = "train_gpt"  # our config.json: {"format": FORMAT, "settings": {...}, "trained": {...}}
MAX_CONFIG_BYTES = 1 << 20  # a config.json is a few hundred bytes; more is not one

AUTHORS = "SkipMiddleModel"  # their config's "architectures"
AUTHORS_FIELDS = {  # their config field -> our setting
    "dim": "dim",
    "n_layers": "n_layers",
    "n_heads": "n_heads",
    "n_kv_heads": "n_kv_heads",  # null: n_heads (their config's rule)
    "vocab_size": "vocab_size",
    "ffn_dim_multiplier": "ffn_mult",
    "norm_eps": "norm_eps",
    "rope_theta": "rope_theta",
    "max_seq_len": "max_seq_len",
    "use_scaled_rope": None,  # read, and refused when true
}
AUTHORS_INIT = {"initializer_range": "init_std", "zero_init_masks": "gate_init"}  # if given
AUTHORS_NAMES = {  # their module (after "model.") -> ours; \1 the layer
    r"tok_embeddings": "embed",
    r"input_norm": "embed_norm",
    r"layers\.(\d+)\.attention\.(w[qkvo])": r"blocks.\1.attn.\2",
    r"layers\.(\d+)\.feed_forward\.(w[123])": r"blocks.\1.ffn.\2",
    r"layers\.(\d+)\.pre_attention_norm": r"blocks.\1.attn_in",
    r"layers\.(\d+)\.post_attention_norm": r"blocks.\1.attn_out",
    r"layers\.(\d+)\.pre_feed_forward_norm": r"blocks.\1.ffn_in",
    r"layers\.(\d+)\.post_feed_forward_norm": r"blocks.\1.ffn_out",
    r"masks\.(\d+)\.linear": r"router.gates.\1",  # their masks: the first L/2 layers' gates
    r"output_norm": "head_norm",
    r"output": "head",
}


def read(source: str, defaults: dict) -> tuple:
    """-> (settings, weights, where) of SOURCE, a folder or hf:OWNER/NAME[@REVISION]: our
    settings (defaults under the authors' few) and weights by our names; where: the folder, or
    the repository at its commit."""
    folder, where = local_folder(source)
    config = read_config(os.path.join(folder, CONFIG))
    weights = read_weights(os.path.join(folder, WEIGHTS))
    if config.get("format") == FORMAT:
        if not isinstance(config.get("settings"), dict):
            raise UserError(f'{where}: {CONFIG} has no "settings" object')
        return config["settings"], weights, where
    if AUTHORS in (config.get("architectures") or []):
        return (
            {**defaults, **authors_settings(config, weights, where)},
            authors_weights(weights, where),
            where,
        )
    raise UserError(
        f"{where}: {CONFIG} is neither this project's (format {FORMAT!r}) nor the authors' "
        f"(architectures [{AUTHORS!r}]); it says architectures {config.get('architectures')!r}"
    )


def local_folder(source: str) -> tuple:
    """-> (folder, where): a local folder as it is; hf:OWNER/NAME[@REVISION] fetched (resumably,
    the two files only) into the Hub's cache, or found there offline."""
    if not source.startswith("hf:"):
        if not os.path.isdir(source):
            raise UserError(f"{source} is not a folder")
        return source, source
    repo, _, revision = source[3:].partition("@")
    if not re.fullmatch(r"[\w.-]+/[\w.-]+", repo) or "@" in revision:
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
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:160]
        raise UserError(f"{source}: {reason or first}") from None
    return folder, f"hf:{repo}@{os.path.basename(folder)}"  # the snapshot folder: its commit


def regular_file(path: str) -> str:
    """path, if it is a regular file (through links, as the Hub's cache makes them): a pipe or a
    device is never opened."""
    if not os.path.isfile(path):
        what = "missing" if not os.path.lexists(path) else "not a regular file"
        raise UserError(f"{path} is {what}")
    return path


def read_config(path: str) -> dict:
    if os.path.getsize(regular_file(path)) > MAX_CONFIG_BYTES:
        raise UserError(f"{path} is over {MAX_CONFIG_BYTES} bytes: not a model's config")
    try:
        with open(path, "rb") as f:
            config = json.loads(f.read())
    except (OSError, ValueError, RecursionError) as e:
        raise UserError(f"{path} is not readable JSON ({type(e).__name__})") from None
    if not isinstance(config, dict):
        raise UserError(f"{path} holds {type(config).__name__}, not a JSON object")
    return config


def read_weights(path: str) -> dict:
    """Every tensor of a safetensors file; a damaged or truncated one is one UserError."""
    from safetensors.torch import load_file

    try:
        return load_file(regular_file(path))
    except UserError:
        raise
    except Exception as e:  # safetensors' own error, or the OS's
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:160]
        raise UserError(f"{path} is not a complete safetensors file ({first})") from None


def authors_settings(config: dict, weights: dict, where: str) -> dict:
    """Our settings for the authors' config (module docstring); one UserError naming a field."""
    for name in AUTHORS_FIELDS:
        if name not in config:
            raise UserError(f"{where}: {CONFIG} lacks the field {name!r}")
    if config["use_scaled_rope"] is not False:
        raise UserError(
            f"{where}: use_scaled_rope={config['use_scaled_rope']!r}: Llama 3.1's scaled RoPE "
            "is not represented here (false only)"
        )
    settings = {ours: config[theirs] for theirs, ours in AUTHORS_FIELDS.items() if ours}
    settings |= {ours: config[theirs] for theirs, ours in AUTHORS_INIT.items() if theirs in config}
    if settings["n_kv_heads"] is None:
        settings["n_kv_heads"] = settings["n_heads"]
    mult = settings["ffn_mult"]
    if not isinstance(mult, (int, float)) or isinstance(mult, bool) or mult != int(mult):
        raise UserError(f"{where}: ffn_dim_multiplier={mult!r}: only a whole number fits here")
    settings["ffn_mult"] = int(mult)
    if "gate_init" in settings:
        settings["gate_init"] = "zero" if settings["gate_init"] else "normal"
    if settings.get("init_std", 0) is None:  # theirs: no re-initialisation; ours: the default
        del settings["init_std"]
    embed = weights.get("model.tok_embeddings.weight")
    bf16 = isinstance(embed, torch.Tensor) and embed.dtype == torch.bfloat16
    return {
        **settings,
        "router": "skip_middle",
        "gate_axis": "query",
        "embed_dtype": "bfloat16" if bf16 else "float32",
    }


def authors_weights(weights: dict, where: str) -> dict:
    """Their tensors by our names (AUTHORS_NAMES); one with no place is a UserError naming it."""
    out = {}
    for name, tensor in weights.items():
        match = re.fullmatch(r"model\.(.+)\.(weight|bias)", name)
        ours = None
        for theirs, template in AUTHORS_NAMES.items() if match else ():
            if re.fullmatch(theirs, match[1]):
                ours = f"{re.sub(theirs, template, match[1])}.{match[2]}"
                break
        if ours is None:
            raise UserError(f"{where}: the tensor {name} has no place in this model")
        out[ours] = tensor
    return out
