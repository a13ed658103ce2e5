"""Turn text into training shards, regenerate the embedded sample, or check a folder of shards.

    python data/tokenize_corpus.py a.txt b.jsonl --out=data/mycorpus   # your own corpus
    python data/tokenize_corpus.py                                     # the embedded sample
    python data/tokenize_corpus.py --check=data/fineweb10B             # verify shards

    python data/tokenize_corpus.py a.txt --encoding=bytes --val_every=10 --out=data/bytes
    python data/tokenize_corpus.py --from_shards='data/fineweb10B/*.bin' --encoding=bytes \\
        --out=data/fineweb10B_bytes --name=fineweb                    # FineWeb as bytes

Input: .jsonl files (one JSON object per line, its "text" field one document) and text files:
any other name, .txt say, is one document, UTF-8 (a .json file's raw JSON text too: give JSON
Lines). Each document is encoded with the GPT-2 BPE (tiktoken) and
preceded by <|endoftext|> (50256), as in FineWeb; or, with --encoding=bytes, as its bytes (ids
0-255) preceded by a NUL byte (0): a text file's bytes exactly as they are, invalid UTF-8
included (decoding shows those as U+FFFD; a document holding a NUL byte is refused), a JSON
text's UTF-8. Tokens go into shards of --shard_tokens tokens (the last one shorter) in the
modded-nanogpt format that train_gpt.py reads, the encoding in the header; the first shard is
named as validation: NAME_val_000000.bin, then NAME_train_000001.bin, ... (with --val_every=K,
every K-th document goes to validation shards instead). Documents with empty text are
skipped; an input with none is an error; a JSON text holding a lone surrogate (an escape such as
"\\ud800": not Unicode) is refused in either encoding. Encoding uses --workers threads; the
documents keep their order.

What it may delete (class Corpus): shards are written into a temporary folder inside --out and
take their names only when the whole corpus is encoded; then the shards of the previous version
of the same corpus (the files NAME.manifest.json lists, with the content it records) that the
new one does not replace are removed. A file named like a shard of NAME that is not in that
manifest (a FineWeb download, your own shards, one edited since), or a manifest this script did
not write, is never replaced or removed: the command refuses before any work. A failed run
leaves nothing; a killed one (SIGKILL) leaves its hidden temporary folder .NAME.<random>; a
Ctrl-C (even twice) as the shards take their names stops the command once all of them have.
A failure or SIGKILL while they take them leaves the corpus half replaced: --check says so,
and the same command run again finishes it.

With no input it regenerates data/sample/ from CPython's `pydoc_data.topics`, split by document
(every 10th topic, in sorted order, to validation). That text depends on the Python version:
the committed sample was made with the version in data/sample/README.md.

Disk: 2 bytes per token plus a 1 KiB header per shard (100M-token shards are ~200 MB).
"""

import collections
import concurrent.futures
import contextlib
import errno
import glob
import hashlib
import itertools
import json
import os
import queue
import re
import stat
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # the repository: support, fileio, data/shards (no torch)
from fileio import (  # noqa: E402
    first_missing,
    named,
    need,
    remove_made,
    sha256_of,
    writable_dir,
    write_atomically,
)
from support import (  # noqa: E402
    MAX_PROCESSES,
    ArgParser,
    UserError,
    cli,
    exit_quietly_on_signals,
    in_range,
    nonempty,
    out_of_memory,
    path_arg,
    signals_held,
    usable_cpus,
)

if __name__ == "__main__":
    exit_quietly_on_signals()

import numpy as np  # noqa: E402

from data.shards import (  # noqa: E402
    EOT,
    check_whole,
    encoding,
    find_shards,
    header,
    read_shard,
    shard_encoding,
)

GPT2_VOCAB = 50257


def shard_bytes(tokens, enc: str = "gpt2") -> bytes:
    """Header (magic, version, count, encoding) then the tokens as uint16."""
    tokens = np.asarray(tokens)
    if tokens.dtype != np.uint16:
        if len(tokens) and (tokens.min() < 0 or tokens.max() >= 2**16):
            raise UserError("token ids must fit uint16")
        tokens = tokens.astype(np.uint16)
    return header(len(tokens), enc) + tokens.tobytes()


def corpus_sha256(shards: dict) -> str:
    """One sha256 for a corpus, {shard name: its sha256}: of the names and sha256s, in name
    order."""
    return hashlib.sha256(
        "".join(f"{n} {shards[n]}\n" for n in sorted(shards)).encode()
    ).hexdigest()


class Corpus:
    """The shards of one corpus NAME in folder OUT, replaced whole or not at all. Shards are
    written into a temporary folder inside OUT (.NAME.<random>); commit() writes
    NAME.manifest.json (each shard's name and sha256, the previous version's too until it is
    gone), moves the shards into place, deletes the previous version's others, then drops them
    from the manifest. Only files the manifest lists, with the content it records, are ever
    replaced or deleted: a shard-named file or a manifest this command did not write (a download,
    another tool's, another command's, one edited since; a link or a FIFO, unread; the manifest
    names its writer) is refused before any work, and one that appears or changes while this
    runs stops the commit. On any failure the temporary folder, and the folders this created for
    OUT, are removed; nothing else is touched."""

    def __init__(
        self,
        out: str,
        name: str,
        enc: str = "gpt2",
        check_only=False,
        retry="--name or --out",
        writer="data/tokenize_corpus.py",
    ):
        """check_only: refuse what the corpus may not replace, and write nothing (yet); retry: the
        command's options that would put the corpus elsewhere; writer: the command writing it
        (data/debian_docs.py's corpus and one of this script's never replace each other)."""
        if os.sep in name or name in (".", ".."):
            raise UserError(f"--name={name}: a name, not a path")
        if set(name) & set("*?["):  # (--train_files='OUT/NAME_train_*.bin' would not find it)
            raise UserError(f"--name={name}: a name, not a pattern (no *, ? or [)")
        out = os.path.abspath(out)  # a/b/../c: the folders made are the ones removed
        self.out, self.name, self.shards, self.enc, self.retry = out, name, {}, enc, retry
        self.writer = writer
        self.manifest = os.path.join(out, f"{name}.manifest.json")
        ours = self.read_manifest()  # name -> the sha256 of each version this script wrote
        self.pattern = re.compile(re.escape(name) + r"_(val|train)_\d{6}\.bin")
        self.found = self.present()  # (hashed once: commit compares their stats alone)
        self.sums = {  # (a FIFO or a link is never read, nor ours)
            n: sha256_of(os.path.join(out, n)) if regular else None
            for n, (*_, regular) in self.found.items()
        }
        foreign = [n for n, sha in self.sums.items() if sha not in ours.get(n, ())]
        if foreign:
            more = f" (and {len(foreign) - 1} more)" if len(foreign) > 1 else ""
            self.refuse(
                f"{os.path.join(out, foreign[0])}{more} is named like a shard of corpus {name!r}"
            )
        if check_only:
            return
        self.made = first_missing(out)
        try:
            os.makedirs(out, exist_ok=True)
            self.tmp = tempfile.mkdtemp(prefix=f".{name}.", dir=out)
        except OSError:
            self.__exit__(OSError)
            raise

    def present(self) -> dict:
        """{shard-named file in OUT: its stat (inode, size, mtime, whether a regular file)}."""
        found = {}
        for n in sorted(os.listdir(self.out) if os.path.isdir(self.out) else ()):
            if self.pattern.fullmatch(n):
                st = os.lstat(os.path.join(self.out, n))
                found[n] = (st.st_ino, st.st_size, st.st_mtime_ns, stat.S_ISREG(st.st_mode))
        return found

    def refuse(self, what: str):
        raise UserError(
            f"{what} but was not written by {self.writer}, or changed since: choose "
            f"another {self.retry}; nothing was written"
        )

    def read_manifest(self) -> dict:
        """{shard: [sha256, ...]} from NAME.manifest.json; {} when there is none."""
        if not os.path.lexists(self.manifest):
            return {}
        try:
            if os.path.islink(self.manifest) or not os.path.isfile(self.manifest):
                raise ValueError
            with open(self.manifest, "rb") as f:
                m = json.load(f)
            writer = m["written_by"]
            if writer == "data/tokenize_corpus.py" and "inputs" in m:  # debian_docs.py's, from
                writer = "data/debian_docs.py"  # before manifests named their command
            if writer != self.writer:
                raise ValueError
            ours = {}
            for part in ("shards", "previous"):
                for n, sha in m.get(part, {}).items():
                    ours.setdefault(n, []).append(str(sha))
            return ours
        except (OSError, ValueError, KeyError, TypeError, AttributeError, RecursionError):
            self.refuse(f"{self.manifest} is the manifest of corpus {self.name!r}")

    def add(self, tokens, val: bool = None) -> str:
        """Write the next shard into the temporary folder: validation if val (default: the
        first)."""
        n = len(self.shards)
        shard = f"{self.name}_{'val' if (n == 0 if val is None else val) else 'train'}_{n:06d}.bin"
        data = shard_bytes(tokens, self.enc)
        with named(os.path.join(self.out, shard)), open(os.path.join(self.tmp, shard), "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())  # on disk before the manifest that lists it (commit)
        self.shards[shard] = hashlib.sha256(data).hexdigest()
        return shard

    def write_manifest(self, previous: dict):
        m = {
            "written_by": self.writer,
            "shards": self.shards,
            **({"inputs": self.inputs} if getattr(self, "inputs", None) else {}),
        }
        if previous:  # the files of the version being replaced, while any may remain
            m["previous"] = previous
        write_atomically(self.manifest, json.dumps(m, indent=1).encode())

    def commit(self) -> list:
        """Publish the new shards, then drop the previous version's others; -> their paths."""
        if not self.shards:
            raise UserError("the input holds no documents (no non-empty text); nothing was written")
        if self.present() != self.found:
            raise UserError(
                f"the shards of corpus {self.name!r} in {self.out} changed while this "
                f"ran (another job?); nothing was written"
            )
        with signals_held():  # (whole: a Ctrl-C here stops the command once it is done)
            self.write_manifest(self.sums)  # first: a
            # failure after it leaves only files it lists
            for shard in self.shards:
                os.replace(os.path.join(self.tmp, shard), os.path.join(self.out, shard))
            stale = [n for n in self.found if n not in self.shards]
            for n in stale:
                os.remove(os.path.join(self.out, n))
            self.write_manifest({})
        if stale:
            print(
                f"removed {len(stale)} shard(s) of the previous corpus {self.name!r} in {self.out}",
                file=sys.stderr,
            )
        return [os.path.join(self.out, n) for n in self.shards]

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        with signals_held():  # (a second Ctrl-C: not with half of it left)
            if hasattr(self, "tmp"):
                for n in os.listdir(self.tmp):  # only what add() wrote there
                    os.remove(os.path.join(self.tmp, n))
                os.rmdir(self.tmp)
            if exc[0] is not None:
                remove_made(self.out, self.made)


# ---------------------------------------------------------------------------- reading documents


def documents(paths, raw: bool = False):
    """Yield (name, text) for every document; a malformed one is an error naming it. raw: a
    text file's bytes as they are, not decoded (byte encoding: any bytes round-trip)."""
    for path in paths:
        if path.lower().endswith(".jsonl"):  # (data.JSONL too: not one text of raw JSON)
            with open(path, "rb") as f:  # bytes: a bad line is named, not a decoder traceback
                for i, line_bytes in enumerate(f, 1):
                    name = f"{path}:{i}"
                    try:
                        line = line_bytes.decode("utf-8", errors="strict")
                    except UnicodeDecodeError as e:
                        raise UserError(
                            f"{name}: not valid UTF-8 ({e.reason} at byte {e.start} of the line)"
                        ) from None
                    line = line.removeprefix("\ufeff") if i == 1 else line  # a file's BOM
                    if not line.strip():
                        continue
                    try:  # (ValueError: not JSON, or an integer past Python's digit limit)
                        text = json.loads(line)["text"]
                    except (ValueError, KeyError, TypeError, RecursionError) as e:
                        why = (
                            "starts with a byte-order mark (U+FEFF)"
                            if line.startswith("\ufeff")
                            else f'not a JSON object with a "text" field ({type(e).__name__})'
                        )
                        raise UserError(f"{name}: {why}") from None
                    if not isinstance(text, str):
                        raise UserError(f'{name}: "text" is not a string')
                    yield name, text
        elif raw:
            with open(path, "rb") as f:
                yield path, f.read()
        else:
            try:
                # its text exactly, line ends too (not made "\n"): as --encoding=bytes reads it
                with open(path, encoding="utf-8", errors="strict", newline="") as f:
                    yield path, f.read()
            except UnicodeDecodeError as e:
                raise UserError(f"{path}: not valid UTF-8 ({e.reason} at byte {e.start})") from None


def split_of(path: str):
    """'val' or 'train': the split a shard's file name ends with (NAME_val_000000.bin), whatever
    NAME holds; None for another name."""
    found = re.search(r"_(val|train)_\d{6}\.bin$", os.path.basename(path))
    return found[1] if found else None


_encodings = {}


def encoded(items, workers: int):
    """_encode over items, in order: here, or in `workers` threads (tiktoken lets go of the GIL
    while it encodes), a few chunks of 16 in flight. Threads, not processes: a signal to the
    whole process group (timeout, systemd, Slurm) reaches this process alone, and no worker
    killed by it can leave a queue's lock held (multiprocessing.Pool's terminate() then waited
    for ever). Daemon threads: stopped early (an error, a signal), this returns at once, the
    chunks not begun dropped and one being encoded (a long document) left to end alone. An
    item that cannot be read (a UserError of documents) stops it in its place, as here."""
    if workers == 1:
        yield from map(_encode, items)
        return
    tasks, flight, source = queue.SimpleQueue(), collections.deque(), in_place(items)
    threads = [
        threading.Thread(target=encode_tasks, args=(tasks,), daemon=True) for _ in range(workers)
    ]
    for thread in threads:
        thread.start()
    try:
        for chunk in iter(lambda: list(itertools.islice(source, 16)), []):
            flight.append(concurrent.futures.Future())
            tasks.put((flight[-1], chunk))
            if len(flight) > 2 * workers:
                yield from results_of(flight.popleft())
        while flight:
            yield from results_of(flight.popleft())
    finally:
        for future in flight:
            future.cancel()
        for _ in threads:
            tasks.put(None)  # (each thread ends at it, once its chunk is done)
    for thread in threads:  # (every chunk was read: none is busy, none is waited for long)
        thread.join()


def in_place(items):
    """items, then the UserError that reading the next one raised, as an item."""
    try:
        yield from items
    except UserError as e:
        yield e


def encode_tasks(tasks):
    """A thread of encoded: (future, chunk) tasks until None, each chunk's _encode results (an
    item that is a UserError: as it is) set on its future unless it was cancelled."""
    while (task := tasks.get()) is not None:
        future, chunk = task
        if future.set_running_or_notify_cancel():
            try:
                future.set_result([i if isinstance(i, UserError) else _encode(i) for i in chunk])
            except BaseException as e:  # (MemoryError, say: raised where it is read)
                future.set_exception(e)


def results_of(future):
    for result in future.result():
        if isinstance(result, UserError):
            raise result
        yield result


def _encode(item):
    """Worker: (name, text or bytes, encoding) -> (name, uint16 array of [its EOT] + ids) or
    (name, error message)."""
    name, text, enc = item
    _enc = _encodings.get(enc) or _encodings.setdefault(enc, encoding(enc))
    try:
        if enc == "bytes":  # the bytes themselves: a text file's as read, JSON text's UTF-8
            data = text if isinstance(text, bytes) else text.encode("utf-8")
            if b"\0" in data:
                return name, "holds a NUL byte, the document separator of byte shards"
            ids = np.frombuffer(data, dtype=np.uint8)
        else:
            text.encode("utf-8")  # (checked as bytes are: tiktoken would make it U+FFFD)
            # encode_ordinary's ids (no special token), as an array: no list made while the
            # GIL is held (the threads' time: encoded)
            ids = _enc.encode_to_numpy(text, disallowed_special=())
    except UnicodeEncodeError as e:  # a JSON text's escape such as "\ud800"
        return name, f"a lone surrogate (character {e.start}) is no Unicode text: remove it"
    except Exception as e:  # (what tiktoken may raise: its own words)
        if out_of_memory(e):  # (the machine's, not the document's: cli says so)
            raise
        return name, f"cannot be encoded: {type(e).__name__}: {e}"
    if len(ids) and ids.max() >= 2**16:
        return name, "token ids do not fit uint16"
    return name, np.concatenate([[_enc.eot_token], ids]).astype(np.uint16)


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
            print(
                f"\r{docs:,} docs  {tokens:,} tokens  {shards} shards  {rate:,.0f} tok/s",
                end="\n" if final else "",
                file=sys.stderr,
                flush=True,
            )
            Progress.open_line = not final

    @staticmethod
    def end_line():
        """A line redrawn and left open is ended: what follows (an error) starts a line."""
        if Progress.open_line:
            print(file=sys.stderr)
            Progress.open_line = False


def tokenize(paths, out, name, shard_tokens, workers, enc="gpt2", is_val=None, inputs=None, **by):
    """Encode every document in order and write shards; returns the shard paths. is_val: true of
    the index of each document that goes to validation shards, the others to training shards
    (None: the first shard is validation). inputs: {name: sha256} of what the text came from,
    for the manifest; by: Corpus's retry and writer, for another command."""
    for path in paths:
        need(path, "a file")
        if not os.access(path, os.R_OK):
            raise UserError(f"cannot read {path}: {os.strerror(errno.EACCES)}")
    writable_dir(out)  # before the long work, not after it
    encoding(enc)  # fail early, with the clear message, before any worker starts
    n_docs, n_tokens = 0, 0
    try:  # 2 bytes a token, not a list; the training and the validation shard being filled
        buffers = {
            False: np.empty(shard_tokens, dtype=np.uint16),
            True: np.empty(shard_tokens if is_val else 0, dtype=np.uint16),
        }
    except MemoryError:
        raise UserError(
            f"--shard_tokens={shard_tokens}: the {2 * shard_tokens / 2**30:.1f} GiB "
            f"a shard takes in memory are not available"
        ) from None
    fill, split = {False: 0, True: 0}, is_val or (lambda i: False)
    progress = Progress()
    items = ((n, text, enc) for n, text in documents(paths, raw=enc == "bytes"))
    with (
        Corpus(out, name, enc, **by) as corpus,
        contextlib.closing(encoded(items, workers)) as results,  # (its workers ended first)
    ):
        corpus.inputs = inputs
        for doc_name, ids in results:
            if isinstance(ids, str):
                raise UserError(f"{doc_name}: {ids}")
            if len(ids) == 1:  # empty text: no document
                continue
            val = split(n_docs)
            n_docs, n_tokens = n_docs + 1, n_tokens + len(ids)
            shard = buffers[val]
            while len(ids):  # a long document may span several shards
                take = min(len(ids), shard_tokens - fill[val])
                shard[fill[val] : fill[val] + take], fill[val], ids = (
                    ids[:take],
                    fill[val] + take,
                    ids[take:],
                )
                if fill[val] == shard_tokens:
                    corpus.add(shard, val if is_val else None)
                    fill[val] = 0
            progress.update(n_docs, n_tokens, len(corpus.shards))
        for val in (True, False):
            if fill[val]:
                corpus.add(buffers[val][: fill[val]], val if is_val else None)
        if not any(split_of(n) == "train" for n in corpus.shards) and corpus.shards:
            raise UserError(
                f"all {n_docs} documents went to validation: no training shard; nothing was written"
                if is_val
                else f"the {n_tokens:,} tokens fill one shard (--shard_tokens={shard_tokens}),"
                f" the validation one: no training shard; give a smaller --shard_tokens, or "
                f"--val_every=K; nothing was written"
            )
        written = corpus.commit()
    progress.update(n_docs, n_tokens, len(written), final=True)
    return written


def make_sample(out):
    """The embedded sample: pydoc_data.topics, every 10th topic (sorted) to validation."""
    from pydoc_data.topics import topics

    writable_dir(out)
    enc = encoding("gpt2")
    train, val = [], []
    for i, key in enumerate(sorted(topics)):
        (val if i % 10 == 0 else train).extend([EOT] + enc.encode_ordinary(topics[key]))
    with Corpus(out, "sample") as corpus:
        corpus.add(val)
        corpus.add(train)
        corpus.commit()
    print(
        f"python {sys.version.split()[0]}: {len(train):,} train and {len(val):,} val tokens "
        f"written to {out}"
    )


def convert(pattern, out, name):
    """GPT-2 shards (FineWeb's) as byte shards, one for one, a validation shard staying one:
    <|endoftext|> becomes the byte separator, every other token its bytes. GPT-2's BPE is
    byte-level, so this is exact, and a document cut between two shards is cut between the
    same bytes. Returns the shard paths."""
    files = sorted(find_shards(pattern), key=lambda p: (split_of(p) != "val", p))
    ours = re.compile(re.escape(name) + r"_(val|train)_\d{6}\.bin")  # what the new corpus replaces
    # validation first: FineWeb's val_000000, train_000001, ... keep their numbers
    for path in files:
        if shard_encoding(path) != "gpt2":
            raise UserError(f"{path}: a byte shard already; --from_shards converts GPT-2 shards")
        if os.path.dirname(os.path.realpath(path)) == os.path.realpath(out) and ours.fullmatch(
            os.path.basename(path)
        ):
            raise UserError(
                f"{path} is an input, and corpus {name!r} in {out} would replace it: "
                f"give another --name or --out; nothing was written"
            )
    writable_dir(out)
    gpt2, sep = encoding("gpt2"), bytes([encoding("bytes").eot_token])
    with Corpus(out, name, "bytes") as corpus:
        for path in files:
            tokens, pieces = read_shard(path, GPT2_VOCAB), []
            for part in np.split(tokens, np.flatnonzero(tokens == EOT)):  # each from an EOT on
                data = gpt2.decode_bytes(
                    part[1:].tolist() if len(part) and part[0] == EOT else part.tolist()
                )
                if sep in data:
                    raise UserError(
                        f"{path}: a document holds a NUL byte, the document separator "
                        f"of byte shards; nothing was written"
                    )
                pieces += [sep, data] if len(part) and part[0] == EOT else [data]
            corpus.add(
                np.frombuffer(b"".join(pieces), dtype=np.uint8),
                val=split_of(path) == "val",
            )
            print(
                f"{path}: {len(tokens):,} tokens -> {sum(map(len, pieces)):,} bytes",
                file=sys.stderr,
            )
        return corpus.commit()


def check(folder):
    """Verify every *.bin shard in folder: header, size, token range, and none of a corpus half
    replaced (check_whole). Prints the counts, and a note where the shards are of two encodings
    (a run reads one: its train_files and val_files must match shards of that one alone)."""
    files = sorted(glob.glob(os.path.join(glob.escape(need(folder, "a folder")), "*.bin")))
    if not files:
        raise UserError(f"{folder}: no .bin shards")
    check_whole(files)
    total, encodings = 0, collections.Counter()
    for path in files:
        enc = shard_encoding(path)
        n = len(read_shard(path, encoding(enc).n_vocab if enc == "bytes" else GPT2_VOCAB))
        total += n
        encodings[enc] += 1
        print(f"{os.path.basename(path)}: {n:,} tokens ({enc})")
    print(f"{len(files)} shards, {total:,} tokens, all valid")
    if len(encodings) > 1:
        held = ", ".join(f"{enc}: {n}" for enc, n in sorted(encodings.items()))
        print(
            f"note: shards of two encodings ({held}): a run reads one; give it train_files and "
            f"val_files that match only that one's shards"
        )
    return total


def parser() -> ArgParser:
    p = ArgParser("python data/tokenize_corpus.py", __doc__)
    p.add_argument(
        "files",
        nargs="*",
        type=path_arg,
        metavar="FILE",
        help=".jsonl files and text files (any other name: one document each) to encode (none: "
        "regenerate the embedded sample)",
    )
    p.add_argument(
        "--out",
        type=path_arg,
        metavar="DIR",
        help="folder for the shards, required with FILEs (default: data/sample)",
    )
    p.add_argument(
        "--name",
        type=nonempty,
        default="corpus",
        help="shard names start with it (default: %(default)s)",
    )
    p.add_argument(
        "--shard_tokens",
        type=in_range(int, 1, 2**31 - 1),
        default=100_000_000,
        metavar="N",
        help="tokens per shard, the last one shorter (default: %(default)s)",
    )
    p.add_argument(
        "--workers",
        type=in_range(int, 1, MAX_PROCESSES),
        default=max(1, usable_cpus() - 1),
        metavar="K",
        help=f"encoding threads, at most {MAX_PROCESSES} (default: CPUs - 1, here %(default)s)",
    )
    p.add_argument(
        "--encoding",
        choices=("gpt2", "bytes"),
        default="gpt2",
        help="GPT-2 BPE ids, or UTF-8 bytes (vocabulary 256; a text file's bytes as "
        "they are, valid UTF-8 or not) (default: %(default)s)",
    )
    p.add_argument(
        "--val_every",
        type=in_range(int, 0),
        default=0,
        metavar="K",
        help="documents 0, K, 2K, ... to validation shards (default: 0, the first "
        "shard is validation)",
    )
    p.add_argument(
        "--from_shards",
        type=path_arg,
        metavar="PATTERN",
        help="convert the GPT-2 shards PATTERN matches (FineWeb's) to byte shards, "
        "one for one, instead of FILEs (default: none; needs --encoding=bytes)",
    )
    p.add_argument(
        "--check",
        type=path_arg,
        metavar="DIR",
        help="only verify every *.bin shard in DIR (default: off)",
    )
    return p


MODES = {  # the options each use takes (besides its own)
    "check": {"check"},
    "from_shards": {"from_shards", "encoding", "out", "name"},
    "sample": {"out"},
    "files": {"files", "out", "name", "shard_tokens", "workers", "encoding", "val_every"},
}


def main(argv):
    p = parser()
    args = p.parse_intermixed_args(argv)
    mode = (
        "check"
        if args.check
        else "from_shards"
        if args.from_shards is not None
        else "files"
        if args.files
        else "sample"
    )
    if args.check:  # what the mode's own path is, checked first
        need(args.check, "a folder")
    elif args.from_shards is not None:
        find_shards(args.from_shards)
    given = p.given(argv) | ({"files"} if args.files else set())  # (at any value)
    given = [k for k in vars(args) if k in given]
    if extra := [k for k in given if k not in MODES[mode]]:
        raise UserError(
            ("FILEs do" if extra[0] == "files" else f"--{extra[0]} does")
            + " not apply to "
            + {
                "check": "--check",
                "from_shards": "--from_shards",
                "files": "encoding FILEs",
                "sample": "the embedded sample (no FILEs)",
            }[mode]
        )
    if args.check:
        check(args.check)
    elif args.from_shards is not None:
        if args.encoding != "bytes" or not args.out:
            raise UserError(
                "--from_shards=PATTERN converts to byte shards: give --encoding=bytes "
                "and --out=DIR, and no FILEs"
            )
        convert(args.from_shards, args.out, args.name)
    elif not args.files:
        make_sample(args.out or os.path.join(HERE, "sample"))
    else:
        if not args.out:
            raise UserError("give --out=DIR for the shards")
        tokenize(
            args.files,
            args.out,
            args.name,
            args.shard_tokens,
            args.workers,
            args.encoding,
            args.val_every and (lambda i: i % args.val_every == 0),
        )


def run(argv) -> int:
    """main() with one `error:` line for bad input, on a line of its own after the progress."""
    return cli(main, argv, Progress.end_line)


if __name__ == "__main__":
    sys.exit(run(sys.argv[1:]))
