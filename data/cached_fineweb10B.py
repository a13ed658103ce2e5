"""Fetch pre-tokenized FineWeb (GPT-2 BPE, modded-nanogpt shards) into data/fineweb10B/.

    python data/cached_fineweb10B.py        # validation shard + all 103 training shards
    python data/cached_fineweb10B.py 8      # validation shard + the first 8 training shards

Source: the public Hugging Face dataset kjj0/fineweb10B-gpt2. Each shard holds 100M tokens,
about 200 MB; all 104 are about 20.8 GB (10.3B training tokens, 100M validation). Files go
through the Hugging Face cache (HF_HOME / HF_HUB_CACHE) and are hard-linked into the data
folder when both are on one filesystem, so they take the space once; otherwise they are
copied. Set HF_HUB_CACHE next to the data folder if you want to be sure.

A file already in the data folder with a valid header and size, of GPT-2 tokens, is skipped
(its tokens are not compared with the Hub's), so an interrupted fetch resumes where it stopped.
Every file is checked after download (magic, version, token count against the file size) before
it takes its final name; a bad one is reported and fetched again. So a file of a shard's name in
the data folder that is not a whole shard (or holds bytes) was not written here: it is refused
before anything is fetched, never replaced; a NAME.part left by a fetch cut short is replaced,
and any other file of that name keeps that shard from being placed (a reason at the end, as a
failed download's). Several files download at once (--workers, default 8). One fetch at a time
writes a folder: a second is refused while it runs.

Why not huggingface_hub.snapshot_download(local_dir=...): in that mode (huggingface_hub 2.4)
a file found in the Hugging Face cache is copied, not linked (20.8 GB twice); offline it does
not look in the cache at all; and a file takes its final name before anything could check
its shard header, while offline an existing file is returned as it is.
"""

import os
import shlex
import shutil
import stat
import sys
from concurrent.futures import ThreadPoolExecutor

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # the repository: support, fileio, data/shards (no torch)
from fileio import HASH_BLOCK, kind_of, sync_folder, writable_dir  # noqa: E402
from support import (  # noqa: E402
    MAX_PROCESSES,
    ArgParser,
    RunStopped,
    UserError,
    cli,
    exit_quietly_on_signals,
    first_line,
    in_range,
    lock_folder,
    path_arg,
)

if __name__ == "__main__":
    exit_quietly_on_signals()

from data.shards import shard_header, shard_tokens  # noqa: E402

REPO = "kjj0/fineweb10B-gpt2"
N_TRAIN = 103


def damage(path: str) -> str:
    """Why the file at path is not a whole FineWeb shard (named), or "" where it is one: its
    header, size and encoding (GPT-2; a byte shard of the name is not one), not its tokens. A link
    to a file is one (the Hugging Face cache's files are links to its blobs). One that cannot be
    read (a permission) is its OSError: not known to be damaged."""
    if not os.path.isfile(path):
        return f"{path} is {kind_of(path)}"
    try:
        encoding = shard_header(path)[1]
    except UserError as e:
        return str(e)
    return "" if encoding == "gpt2" else f"{path} holds {encoding} tokens, not FineWeb's GPT-2"


def left_by_place(part: str, src: str) -> bool:
    """Whether part is what a place() of src that was cut short left: a link to src's file, or a
    copy of its first bytes (a regular file whose bytes begin src's, compared in blocks)."""
    if not stat.S_ISREG(os.lstat(part).st_mode):
        return False
    with open(part, "rb") as a, open(src, "rb") as b:
        while block := a.read(HASH_BLOCK):
            if b.read(len(block)) != block:
                return False
    return True


def place(src: str, dest: str) -> None:
    """Put src at dest atomically: hard link (or copy) to a temporary name, then rename, in a
    folder this process holds (lock_folder: another fetch there would take its .part); a copy is
    on disk before its name, the name after (a link is the Hugging Face cache's file, as written
    there)."""
    tmp = dest + ".part"
    os.makedirs(os.path.dirname(dest), exist_ok=True)
    lock_folder(os.path.dirname(dest))
    if os.path.lexists(tmp):
        if not left_by_place(tmp, src):
            raise UserError(  # (or the cache's file changed since this command left it)
                f"{tmp} is there and is not this shard, cut short: move it away and run this again"
            )
        os.remove(tmp)
    try:
        os.link(os.path.realpath(src), tmp)
    except OSError:  # another filesystem, or links not allowed: a copy, synced before its rename;
        # a new file ("x"): never written through a link (where flock is not honoured, another
        # fetch's, to the Hugging Face cache's file itself)
        with open(src, "rb") as f, open(tmp, "xb") as copy:
            shutil.copyfileobj(f, copy)
            copy.flush()
            os.fsync(copy.fileno())
    os.replace(tmp, dest)
    sync_folder(os.path.dirname(dest))


def fetch(name: str, out: str, counter: str) -> str:
    """Returns None on success, or a short reason for the failure."""
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    dest = os.path.join(out, name)
    if os.path.exists(dest):  # (whole: main checked)
        print(f"{counter} {name}: present, skipped", flush=True)
        return None
    for force in (False, True):  # a bad file in the cache is downloaded once more
        try:
            cached = hf_hub_download(REPO, name, repo_type="dataset", force_download=force)
        except Exception as e:  # offline, the Hub unreachable or refusing (429, too many
            # requests; 5xx, down) once its retries are spent (a forced download's ValueError
            # is from that), a full disk, ...
            answer = getattr(getattr(e.__cause__, "response", None), "status_code", None)
            forced = force and isinstance(e, ValueError) and e.__cause__ is not None
            if not (answer or forced or isinstance(e, LocalEntryNotFoundError)):
                return f"{type(e).__name__}: {first_line(e)}"  # (its own words)
            said = f"answered HTTP {answer}" if answer else "cannot be reached"
            where = "damaged in" if force else "not in"
            return f"{where} the Hugging Face cache, and the Hub {said}"
        problem = damage(cached)
        if not problem:
            try:
                place(cached, dest)
            except OSError as e:
                return f"cannot write {dest}: {e.strerror}"
            except UserError as e:  # (a file in the way: the others are fetched meanwhile)
                return str(e)
            print(
                f"{counter} {name}: {shard_tokens(dest):,} tokens, "
                f"{os.path.getsize(dest) / 2**20:,.0f} MiB",
                flush=True,
            )
            return None
        if not force:
            print(f"{problem}; fetching it again", flush=True)
    return f"{problem}, after a fresh download too"


def parser() -> ArgParser:
    p = ArgParser("python data/cached_fineweb10B.py", __doc__)
    p.add_argument(
        "count",
        nargs="?",
        type=in_range(int, 0, N_TRAIN),
        default=N_TRAIN,
        metavar="N",
        help="training shards to fetch after the validation shard, "
        f"0..{N_TRAIN} (default: all %(default)s)",
    )
    p.add_argument(
        "--out",
        type=path_arg,
        default=os.path.join(HERE, "fineweb10B"),
        metavar="DIR",
        help="data folder (default: %(default)s)",
    )
    p.add_argument(
        "--workers",
        type=in_range(int, 1, MAX_PROCESSES),
        default=8,
        metavar="K",
        help=f"files downloaded at once, at most {MAX_PROCESSES} (default: %(default)s)",
    )
    return p


def main(argv) -> None:
    args = parser().parse_args(argv)
    out, workers, count = args.out, args.workers, args.count
    names = ["fineweb_val_000000.bin"] + [f"fineweb_train_{i:06d}.bin" for i in range(1, count + 1)]
    writable_dir(out)  # before any download starts
    if os.path.isdir(out):  # (one made here: at its first shard, place)
        lock_folder(out)  # one fetch at a time
    for name in names:  # (this command's own are whole: written aside, then renamed)
        path = os.path.join(out, name)
        problem = damage(path) if os.path.lexists(path) else ""
        if problem:
            raise UserError(
                f"{problem}: it is there and is not a whole FineWeb shard, so this command did "
                f"not write it: move it away and run this again; nothing was fetched"
            )
    from huggingface_hub.utils import logging as hub_logging

    if "HF_HUB_VERBOSITY" not in os.environ:  # (the user's, as given)
        hub_logging.set_verbosity_error()  # each retry's warning: a failure is said once, below
    first = fetch(names[0], out, f"[1/{len(names)}]")  # alone: offline, each of the others
    failed = [(names[0], first)] if first else []  # would wait through the same retries
    if not first:
        pool = ThreadPoolExecutor(workers)
        try:
            futures = [
                pool.submit(fetch, n, out, f"[{i + 1}/{len(names)}]")
                for i, n in enumerate(names)
                if i
            ]
            failed = [
                (n, f.result())
                for n, f in zip(names[1:], futures, strict=True)
                if f.result() is not None
            ]
        finally:  # a signal: no download starts; those under way end, each placed whole
            pool.shutdown(cancel_futures=True)
    if failed:
        listed = ", ".join(n for n, _ in failed[:3]) + (" ..." if len(failed) > 3 else "")
        untried = "; the others were not tried" if first and len(names) > 1 else ""
        again = shlex.join(["python", os.path.relpath(__file__), *argv])  # (--out and all)
        raise RunStopped(  # (status 1: the input was good, the fetch failed)
            f"{len(failed)} of {len(names)} files missing ({listed}; "
            f"{failed[0][1]}{untried}). Rerun `{again}` once that is mended; files already "
            f"fetched are kept"
        )
    print(f"{len(names)} files in {out}")


if __name__ == "__main__":
    sys.exit(cli(main, sys.argv[1:]))
