"""Which tokens skip: colour each token of a text by how many blocks it ran (skip_middle: the
blocks whose gate is non-zero for it; mod: the unrouted blocks and the routed ones that chose
it), how many MLPs it ran (DLO) or how many recursions (Mixture-of-Recursions: its depth), from
a run's checkpoint or another model source.

    python skipview.py RUN_DIR [--text=TEXT | --val_tokens=N] [--out=page.html] [--device=cpu]
    python skipview.py --init_from=SOURCE ...   # a folder in Hugging Face layout, hf:OWNER/NAME

Prints a compact terminal view, each token followed by its count, and with --out writes the
same as a self-contained HTML page (inline style, no scripts or fonts from elsewhere) with a
legend and the tokens that ran each unit (block, MLP or recursion). Without --text it reads
the first N tokens (default 256) of the run's validation shard. Text longer than the model's
context is cut to it.
"""

import html
import os
import sys

import fileio
import support

if __name__ == "__main__":
    support.exit_quietly_on_signals()

import torch  # noqa: E402

import sources  # noqa: E402
import train_gpt as tg  # noqa: E402
from data.shards import encoding, first_tokens, text_ids  # noqa: E402


@torch.no_grad()
def token_depths(model: tg.GPT, ids: list, device: str):
    """-> (per token: how many units it ran, per unit: how many tokens ran it, units per
    token): the router's `skips`, MLPs for DLO, recursions for MoR, blocks for the others."""
    model.eval()
    route = model(torch.tensor([ids], device=device)).route
    ran = route[model.router.skips][:, 0].cpu()  # (units, T)
    return ran.sum(0).tolist(), ran.sum(1).tolist(), ran.size(0)


def colour(count: int, units: int) -> str:
    """Light red for tokens that ran few units, light blue for tokens that ran all of them."""
    hue = 0 if units == 0 else round(220 * count / units)
    return f"hsl({hue}, 70%, 85%)"


def html_page(
    pieces: list, counts: list, per_layer: list, units: int, title: str, unit: str
) -> str:
    spans = "".join(
        f'<span class="t" style="background:{colour(c, units)}" title="{c} of '
        f'{units} {unit}">{html.escape(p)}</span>'
        for p, c in zip(pieces, counts, strict=False)
    )
    legend = " ".join(
        f'<span class="k" style="background:{colour(c, units)}">{c}</span>'
        for c in range(units + 1)
    )
    rows = "".join(
        f"<tr><td>{i}</td><td>{n}</td><td>{n / max(len(counts), 1):.1%}</td></tr>"
        for i, n in enumerate(per_layer)
    )
    return (
        f'<!DOCTYPE html>\n<html><head><meta charset="utf-8"><title>{html.escape(title)}'
        f"</title><style>body{{font-family:monospace;max-width:60em;margin:2em auto}}"
        f".t,.k{{white-space:pre-wrap}}table{{border-collapse:collapse}}"
        f"td{{padding:0 1em}}</style></head><body>\n<h1>{html.escape(title)}</h1>\n"
        f"<p>Colour: how many of the {units} {unit} each token ran. {legend}</p>\n"
        f"<div>{spans}</div>\n<h2>Tokens that ran each {unit[:-1]}</h2>\n"
        f"<table><tr><th>{unit[:-1]}</th>"
        f"<th>tokens</th><th>share</th></tr>{rows}</table>\n</body></html>\n"
    )


def token_pieces(enc, ids: list) -> list:
    """Each token's text, together the whole text: each character at the token that holds its
    first byte, so a character split over tokens (bytes; GPT-2 tokens of a byte or two of one)
    shows once and "" at the others; U+FFFD for a byte that starts no character."""
    parts = [enc.decode_bytes([i]) for i in ids]
    data, out, i = b"".join(parts), [""] * len(ids), 0
    owner = [t for t, part in enumerate(parts) for _ in part]  # (len(data),) each byte's token
    while i < len(data):
        n = next((n for n in (1, 2, 3, 4) if _utf8(data[i : i + n])), 0)
        out[owner[i]] += data[i : i + n].decode("utf-8") if n else "\ufffd"
        i += n or 1
    return out


def _utf8(b: bytes) -> bool:
    try:
        return len(b.decode("utf-8")) == 1
    except UnicodeDecodeError:
        return False


def terminal_view(pieces: list, counts: list) -> str:
    """Each token followed by its count, line breaks in the text shown as a visible mark."""
    return "".join(f"{p.replace(chr(10), '⏎')}[{c}]" for p, c in zip(pieces, counts, strict=False))


def parser() -> support.ArgParser:
    p = support.ArgParser("python skipview.py", __doc__)
    p.add_model_source()
    p.add_argument(
        "--text",
        help="the text to show, <|endoftext|> in it the document separator (default: the first "
        "--val_tokens tokens of the run's validation shard)",
    )
    p.add_argument(
        "--val_tokens",
        type=support.in_range(int, 1),
        default=256,
        metavar="N",
        help="validation tokens to show without --text (default: %(default)s)",
    )
    p.add_argument(
        "--out",
        type=support.path_arg,
        metavar="FILE",
        help="also write the HTML page there (default: no page)",
    )
    p.add_argument(
        "--device",
        type=support.check_device,
        default="cpu",
        help="cpu, cuda or cuda:K (default: %(default)s)",
    )
    return p


def main(argv):
    p = parser()
    args = p.parse_args(argv)
    source = p.model_source(args)
    if args.text is not None:
        p.refuse(p.given(argv) & {"val_tokens"}, "with --text (the page shows the text)")
    device = args.device
    model = sources.load_model(source, device)
    hp = model.hp
    enc = encoding(hp.encoding, hp.vocab_size)  # the run's: GPT-2 BPE, or UTF-8 bytes
    if args.text is not None:
        ids = text_ids(enc, args.text, "--text")
        if not ids:
            raise support.UserError("--text is empty")
    else:
        ids = first_tokens(hp.val_files, hp.vocab_size, args.val_tokens).tolist()
    ids = ids[: hp.max_seq_len]
    folder, name = os.path.split(os.path.abspath(args.out or "."))
    if args.out:  # a page that cannot be written fails before the work; a file of the user's
        # (or a link) under its name is never replaced: written_outputs records ours
        there = os.path.lexists(args.out)
        folder_name = os.path.basename(args.out) in ("", ".", "..")  # DIR/, DIR/.: there or not
        if folder_name or (there and not os.path.isfile(args.out)):
            kind = fileio.kind_of(args.out) if there else "a folder's name"
            raise support.UserError(f"--out={args.out} is {kind}; give a file name")
        fileio.writable_dir(folder, (name,), by=__file__)
    counts, per_layer, units = token_depths(model, ids, device)
    unit = {"block": "blocks", "mlp": "MLPs", "recursion": "recursions"}[model.router.skips]
    pieces = token_pieces(enc, ids)
    print(terminal_view(pieces, counts))
    print(
        f"\ntokens {len(ids)}; {unit} run per token: mean {sum(counts) / len(counts):.2f} of "
        f"{units}; per {unit[:-1]}: {per_layer}"
    )
    if args.out:
        page = html_page(pieces, counts, per_layer, units, f"{source}: {unit} run per token", unit)
        fileio.write_output(folder, name, page.encode(), by=__file__)
        print(f"written to {args.out}")


if __name__ == "__main__":
    sys.exit(support.cli(main, sys.argv[1:]))
