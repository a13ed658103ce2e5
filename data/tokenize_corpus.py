"""Turn text into training shards, regenerate the embedded sample, or check a folder of shards.

    python data/tokenize_corpus.py a.txt b.jsonl --out=data/mycorpus   # your own corpus
    python data/tokenize_corpus.py                                     # the embedded sample
    python data/tokenize_corpus.py --check=data/fineweb10B             # verify shards

Input: .txt files (each file one document, UTF-8) and .jsonl files (one JSON object per line,
its "text" field one document). Each document is encoded with the GPT-2 BPE (tiktoken) and
preceded by <|endoftext|> (50256), as in FineWeb. Tokens go into shards of --shard_tokens
tokens (the last one shorter) in the modded-nanogpt format that train_gpt.py reads; the first
shard is named as validation: NAME_val_000000.bin, then NAME_train_000001.bin, ... Shards are
written under temporary names and renamed only when the whole corpus encoded, so a failed run
leaves nothing that looks finished. Encoding uses --workers processes.

With no input it regenerates data/sample/ from CPython's `pydoc_data.topics`, split by document
(every 10th topic, in sorted order, to validation). That text depends on the Python version:
the committed sample was made with the version in data/sample/README.md.

Disk: 2 bytes per token plus a 1 KiB header per shard (100M-token shards are ~200 MB).
"""

import glob
import json
import multiprocessing as mp
import os
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # the repository: support.py and data/shards.py, no torch
from support import (ArgParser, UserError, cli, in_range, nonempty, writable_dir,  # noqa: E402
                     write_atomically)
from data.shards import EOT, gpt2_encoding, header, read_shard  # noqa: E402
GPT2_VOCAB = 50257


def write_shard(path: str, tokens) -> None:
    """Header (magic, version, count) then uint16 tokens; via a temporary file and rename."""
    tokens = np.asarray(tokens)
    if tokens.dtype != np.uint16:
        if len(tokens) and (tokens.min() < 0 or tokens.max() >= 2**16):
            raise UserError(f"{path}: token ids must fit uint16")
        tokens = tokens.astype(np.uint16)
    write_atomically(path, header(len(tokens)) + tokens.tobytes())


# ---------------------------------------------------------------------------- reading documents

def documents(paths):
    """Yield (name, text) for every document; a malformed one is an error naming it."""
    for path in paths:
        if path.endswith(".jsonl"):
            with open(path, "rb") as f:  # bytes: a bad line is named, not a decoder traceback
                for i, raw in enumerate(f, 1):
                    name = f"{path}:{i}"
                    try:
                        line = raw.decode("utf-8", errors="strict")
                    except UnicodeDecodeError as e:
                        raise UserError(f"{name}: not valid UTF-8 ({e.reason} at byte "
                                        f"{e.start} of the line)") from None
                    if not line.strip():
                        continue
                    try:
                        text = json.loads(line)["text"]
                    except (json.JSONDecodeError, KeyError, TypeError):
                        raise UserError(f"{name}: not a JSON object with a \"text\" field") from None
                    if not isinstance(text, str):
                        raise UserError(f"{name}: \"text\" is not a string")
                    yield name, text
        else:
            try:
                with open(path, encoding="utf-8", errors="strict") as f:
                    yield path, f.read()
            except UnicodeDecodeError as e:
                raise UserError(f"{path}: not valid UTF-8 ({e.reason} at byte {e.start})") from None


_enc = None


def _encode(item):
    """Worker: (name, text) -> (name, uint16 array of [EOT] + ids) or (name, error message)."""
    global _enc
    if _enc is None:
        _enc = gpt2_encoding()
    name, text = item
    try:
        ids = _enc.encode_ordinary(text)
    except Exception as e:  # e.g. lone surrogates that cannot become UTF-8
        return name, f"cannot be encoded: {type(e).__name__}: {e}"
    if ids and max(ids) >= 2**16:
        return name, "token ids do not fit uint16"
    return name, np.array([EOT] + ids, dtype=np.uint16)


class Progress:
    """One status line on stderr, redrawn at most every half second."""
    open_line = False  # a redrawn line is pending: an error message must start on a new one

    def __init__(self):
        self.t0 = self.last = time.time()

    def update(self, docs, tokens, shards, final=False):
        now = time.time()
        if final or now - self.last > 0.5:
            self.last = now
            rate = tokens / max(now - self.t0, 1e-9)
            print(f"\r{docs:,} docs  {tokens:,} tokens  {shards} shards  {rate:,.0f} tok/s",
                  end="\n" if final else "", file=sys.stderr, flush=True)
            Progress.open_line = not final


def tokenize(paths, out, name, shard_tokens, workers):
    """Encode every document in order and write shards; returns the shard paths."""
    for path in paths:
        if not os.path.isfile(path):
            raise UserError(f"{path}: " + ("a folder, not a file" if os.path.isdir(path) else "no such file"))
        if not os.access(path, os.R_OK):
            raise UserError(f"{path}: not readable")
    writable_dir(out)  # before the long work, not after it
    gpt2_encoding()  # fail early, with the clear message, before any worker starts
    written, n_docs, n_tokens = [], 0, 0
    shard, fill = np.empty(shard_tokens, dtype=np.uint16), 0  # 2 bytes a token, not a list
    progress = Progress()

    def flush_shard(tokens):
        split = "val" if not written else "train"
        final = os.path.join(out, f"{name}_{split}_{len(written):06d}.bin")
        write_shard(final + ".part", tokens)
        written.append(final)

    pool = mp.Pool(workers) if workers > 1 else None
    try:
        results = pool.imap(_encode, documents(paths), chunksize=16) if pool else \
            map(_encode, documents(paths))
        for doc_name, ids in results:
            if isinstance(ids, str):
                raise UserError(f"{doc_name}: {ids}")
            n_docs, n_tokens = n_docs + 1, n_tokens + len(ids)
            while len(ids):  # a long document may span several shards
                take = min(len(ids), shard_tokens - fill)
                shard[fill:fill + take], fill, ids = ids[:take], fill + take, ids[take:]
                if fill == shard_tokens:
                    flush_shard(shard)
                    fill = 0
            progress.update(n_docs, n_tokens, len(written))
        if fill:
            flush_shard(shard[:fill])
        for path in written:  # all encoded: now the shards take their real names
            os.replace(path + ".part", path)
        # shards of an earlier corpus of the same name would be read as part of this one
        stale = sorted(set(glob.glob(os.path.join(glob.escape(out), f"{glob.escape(name)}_*_*.bin")))
                       - set(written))
        for path in stale:
            os.remove(path)
        if stale:
            print(f"removed {len(stale)} shard(s) of an earlier corpus named {name!r} in {out}",
                  file=sys.stderr)
    except BaseException:
        for path in written:
            if os.path.exists(path + ".part"):
                os.remove(path + ".part")
        raise
    finally:
        if pool:
            pool.terminate()
    progress.update(n_docs, n_tokens, len(written), final=True)
    return written


def make_sample(out):
    """The embedded sample: pydoc_data.topics, every 10th topic (sorted) to validation."""
    from pydoc_data.topics import topics
    writable_dir(out)
    enc = gpt2_encoding()
    train, val = [], []
    for i, key in enumerate(sorted(topics)):
        (val if i % 10 == 0 else train).extend([EOT] + enc.encode_ordinary(topics[key]))
    os.makedirs(out, exist_ok=True)
    write_shard(os.path.join(out, "sample_val_000000.bin"), val)
    write_shard(os.path.join(out, "sample_train_000001.bin"), train)
    print(f"python {sys.version.split()[0]}: {len(train):,} train and {len(val):,} val tokens "
          f"written to {out}")


def check(folder, vocab_size=GPT2_VOCAB):
    """Verify every *.bin shard in folder: header, size, token range. Prints the counts."""
    files = sorted(glob.glob(os.path.join(folder, "*.bin")))
    if not files:
        raise UserError(f"{folder}: no .bin shards")
    total = 0
    for path in files:
        n = len(read_shard(path, vocab_size))
        total += n
        print(f"{os.path.basename(path)}: {n:,} tokens")
    print(f"{len(files)} shards, {total:,} tokens, all valid")
    return total


def parser() -> ArgParser:
    p = ArgParser("python data/tokenize_corpus.py", __doc__)
    p.add_argument("files", nargs="*", metavar="FILE",
                   help=".txt or .jsonl files to encode (none: regenerate the embedded sample)")
    p.add_argument("--out", type=nonempty, metavar="DIR",
                   help="folder for the shards, required with FILEs (default: data/sample)")
    p.add_argument("--name", type=nonempty, default="corpus",
                   help="shard names start with it (default: %(default)s)")
    p.add_argument("--shard_tokens", type=in_range(int, 1), default=100_000_000, metavar="N",
                   help="tokens per shard, the last one shorter (default: %(default)s)")
    p.add_argument("--workers", type=in_range(int, 1), default=max(1, (os.cpu_count() or 1) - 1),
                   metavar="K", help="encoding processes (default: CPUs - 1, here %(default)s)")
    p.add_argument("--check", type=nonempty, metavar="DIR",
                   help="only verify every *.bin shard in DIR (default: off)")
    return p


def main(argv):
    args = parser().parse_intermixed_args(argv)
    if args.check:
        check(args.check)
    elif not args.files:
        make_sample(args.out or os.path.join(HERE, "sample"))
    else:
        if not args.out:
            raise UserError("give --out=DIR for the shards")
        tokenize(args.files, args.out, args.name, args.shard_tokens, args.workers)


def run(argv) -> int:
    """main() with one `error:` line for bad input, on a line of its own after the progress."""
    return cli(main, argv, lambda: Progress.open_line and print(file=sys.stderr))


if __name__ == "__main__":
    sys.exit(run(sys.argv[1:]))
