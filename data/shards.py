"""The shard format, numpy only (no torch), so that fetching, tokenizing and checking shards
start at once. train_gpt.py's loader reads shards through these functions too.

A shard (modded-nanogpt's format) is a header of HEADER_INTS int32 values (SHARD_MAGIC,
SHARD_VERSION, the token count, the encoding, then zeros) followed by the tokens as uint16.
The encoding is ENCODINGS' index: 0 GPT-2 BPE ids (modded-nanogpt's and FineWeb's shards, where
the field is 0), 1 UTF-8 bytes (ids 0-255, each document preceded by BYTES_EOT).
"""

import contextlib
import glob
import hashlib
import json
import os
import sys

import numpy as np

if __name__ == "__main__":  # a library: run as a script, it could not even import fileio
    print(
        "error: data/shards.py is the shard format's library, not a command; shards are written"
        " and checked by data/tokenize_corpus.py (--check=DIR)",
        file=sys.stderr,
    )
    sys.exit(2)

from fileio import kind_of, named, regular  # noqa: E402
from support import UserError  # noqa: E402

SHARD_MAGIC = 20240520
SHARD_VERSION = 1
HEADER_INTS = 256
HEADER_BYTES = HEADER_INTS * np.dtype(np.int32).itemsize
EOT = 50256  # GPT-2's <|endoftext|>, before each document
BYTES_EOT = 0  # a byte shard's document separator: NUL, which text does not hold
ENCODINGS = ("gpt2", "bytes")  # header[3]


def header(count: int, encoding: str = "gpt2") -> bytes:
    """The header bytes of a shard holding count tokens of the encoding."""
    values = np.zeros(HEADER_INTS, dtype=np.int32)
    values[:4] = SHARD_MAGIC, SHARD_VERSION, count, ENCODINGS.index(encoding)
    return values.tobytes()


def shard_encoding(path: str) -> str:
    """The encoding a sound shard's header names (see shard_header)."""
    return shard_header(path)[1]


def shard_tokens(path: str) -> int:
    """The number of tokens in a sound shard (see shard_header)."""
    return shard_header(path)[0]


def shard_header(path: str) -> tuple:
    """(token count, encoding) of the shard at path, once its header is read and found sound
    (the magic number, the version, a known encoding and a count that matches the file's size).
    A folder, named pipe or device is named by its kind, never opened (a pipe would wait)."""
    with named(path), open(regular(path), "rb") as f:
        size = os.fstat(f.fileno()).st_size
        head = f.read(HEADER_BYTES)
    if len(head) < HEADER_BYTES:
        raise UserError(
            f"{path}: truncated shard ({size} bytes, shorter than the {HEADER_BYTES}-byte header)"
        )
    magic, version, count, encoding = (int(v) for v in np.frombuffer(head, dtype=np.int32, count=4))
    expected_size = HEADER_BYTES + 2 * count
    if magic != SHARD_MAGIC:
        problem = f"bad magic number {magic} (expected {SHARD_MAGIC})"
    elif version != SHARD_VERSION:
        problem = f"unsupported shard version {version} (expected {SHARD_VERSION})"
    elif not 0 <= encoding < len(ENCODINGS):
        problem = f"unknown encoding {encoding} in its header (0: gpt2, 1: bytes)"
    elif count < 0 or size != expected_size:
        problem = (
            f"header says {count} tokens ({expected_size} bytes) but the file has "
            f"{size} bytes (truncated or corrupt)"
        )
    else:
        return count, ENCODINGS[encoding]
    raise UserError(f"{path}: {problem}")


def read_shard(path: str, vocab_size: int = 2**16) -> np.ndarray:
    """All tokens of a sound shard (see shard_tokens), each one checked to be below vocab_size."""
    count = shard_tokens(path)
    with named(path):
        tokens = np.fromfile(path, dtype=np.uint16, count=count, offset=HEADER_BYTES)
    biggest = int(tokens.max()) if count else -1
    if biggest >= vocab_size:
        raise UserError(
            f"{path}: token id {biggest} is outside the vocabulary (vocab_size={vocab_size}): "
            f"these shards hold another vocabulary's tokens"
        )
    return tokens


FINGERPRINT_TOKENS = 2**20  # a fingerprint reads this many tokens at each end of a shard


def shard_fingerprint(path: str, tokens: np.ndarray = None) -> list:
    """[file name, token count, sha256 of its first and last FINGERPRINT_TOKENS tokens] (tokens:
    the shard's, read already; else its two ends are read here): a shard replaced, re-tokenized
    or renamed has another; a change inside it, away from both ends, is not seen (hashing whole
    shards would read every shard a run had read at each resume: up to ~20 GB on FineWeb)."""
    count, n = shard_tokens(path) if tokens is None else len(tokens), FINGERPRINT_TOKENS
    ends = hashlib.sha256()
    with named(path):
        for start in (0, max(0, count - n)):
            ends.update(
                np.fromfile(path, np.uint16, min(n, count), offset=HEADER_BYTES + 2 * start)
                if tokens is None
                else tokens[start : start + n]
            )
    return [os.path.basename(path), count, ends.hexdigest()]


def check_fingerprints(
    files: list,
    state: dict,
    then: str = "go on with the shards it trained on",
    kind: str = "training",
):
    """state: a loader's checkpoint state (kind: its shards', training or validation), with
    "read", [[index, *shard_fingerprint], ...] of the shards its run had read, "laps", the passes
    it finished over them all, and "files", their number (a checkpoint from before keeps none:
    nothing is checked). A UserError unless each shard read is still files[index] and, once the
    run has been round them all, their number is the same (the order it goes round in again is
    set). A shard not read yet, after the one the run is in, may be added, removed or changed
    before then. then: the advice."""
    state = state if isinstance(state, dict) else {"read": None}  # (not a record: refused below)
    if "read" not in state:
        return
    read, laps, count = state["read"], state.get("laps"), state.get("files")
    if not (
        isinstance(read, list)
        and all(isinstance(e, list) and [type(v) for v in e] == [int, str, int, str] for e in read)
        and type(laps) is type(count) is int
    ):
        raise UserError(
            f"the checkpoint's record of the {kind} shards its run read is not one this "
            "trainer writes (an edited or damaged checkpoint)"
        )
    for i, *kept in read:
        if not 0 <= i < len(files):
            raise UserError(
                f"the run had read {kept[0]} as {kind} shard {i}, and {len(files)} match now: "
                f"{then}"
            )
        if shard_fingerprint(files[i]) != kept:
            raise UserError(
                f"the run had read {kept[0]} as {kind} shard {i}, and {files[i]} is another "
                f"now (its name, token count, or first or last tokens differ): {then}"
            )
    if laps and count != len(files):
        raise UserError(
            f"the run has been round its {count} {kind} shards and goes round them again: "
            f"{len(files)} match now: {then}"
        )


def find_shards(pattern: str) -> list:
    """The files a glob matches, sorted (where it matches none, the path it names, if any: a
    name with [ ] in it); a UserError when there are none or one is not a file."""
    files = sorted(glob.glob(pattern))
    if not files and os.path.lexists(pattern):  # (tr[1].bin: a glob of tr1.bin; checked below)
        files = [pattern]
    for path in files:
        if not os.path.isfile(path):
            raise UserError(f"{pattern} matches {path}, which is {kind_of(path)}, not a shard file")
    if not files:  # the advice by the folder's own name (data/fineweb10B_bytes, say)
        folder = os.path.basename(os.path.dirname(pattern)).lower()
        hint = (
            "make them from FineWeb's with `python data/tokenize_corpus.py --from_shards="
            f"'data/fineweb10B/*.bin' --encoding=bytes --out={os.path.dirname(pattern) or '.'} "
            f"--name=fineweb`"
            if "fineweb" in folder and "bytes" in folder
            else "fetch FineWeb with `python data/cached_fineweb10B.py`, or train on the "
            "embedded sample with --preset=smoke"
            if "fineweb" in folder
            else "build it with `python data/debian_docs.py`"
            if folder == "debian_docs"
            else "check the path"
        )
        raise UserError(f"no shards match {pattern}: {hint}")
    check_whole(files)
    return files


def first_tokens(pattern: str, vocab_size: int, n: int) -> np.ndarray:
    """The first n >= 1 tokens of pattern's shards (find_shards), read in order across them: an
    empty or short shard does not end them; fewer where all of them hold fewer, none a
    UserError."""
    parts, held = [], 0
    for path in find_shards(pattern):
        if held == n:
            break
        parts.append(read_shard(path, vocab_size)[: n - held])
        held += len(parts[-1])
    if not held:
        raise UserError(f"the shards {pattern} matches hold no tokens")
    return np.concatenate(parts)


def check_whole(files: list):
    """A UserError if some of files belong to a corpus half replaced: a manifest beside them
    (data/tokenize_corpus.py's NAME.manifest.json) that lists them still lists a previous
    version, as a failure or SIGKILL leaves it while the new version's shards are moved in. Read
    as it stands, such a folder mixes two versions; rerunning the command finishes the move. A
    manifest that cannot be read is no concern here (the command that writes it refuses it)."""
    held = {}  # folder -> the names of files in it
    for path in files:
        held.setdefault(os.path.dirname(path), set()).add(os.path.basename(path))
    for folder, names in held.items():
        for path in sorted(glob.glob(os.path.join(glob.escape(folder), "*.manifest.json"))):
            listed = set()
            with contextlib.suppress(
                OSError, ValueError, TypeError, AttributeError, RecursionError
            ):
                if os.path.isfile(path) and not os.path.islink(path):  # (a pipe is never opened)
                    with open(path, "rb") as f:
                        m = json.load(f)
                    if m.get("previous"):
                        listed = {*m["previous"], *m.get("shards", ())}
            if listed & names:
                raise UserError(
                    f"{path}: its corpus is half replaced (a run stopped while it moved the "
                    f"shards): run the command that wrote it again to finish"
                )


class ByteEncoding:
    """UTF-8 bytes as tokens, in tiktoken's terms: encode_ordinary (text -> ids), decode (ids
    -> text; bytes that are not UTF-8 show as U+FFFD), decode_bytes (ids -> the bytes, exact)."""

    name, eot_token, n_vocab = "bytes", BYTES_EOT, 256

    def encode_ordinary(self, text: str) -> list:
        """(surrogateescape: the bytes of a command-line argument that is not UTF-8, exactly)"""
        return list(text.encode("utf-8", errors="surrogateescape"))

    def decode(self, ids) -> str:
        """The separator as <|endoftext|>, as GPT-2's decoding shows it."""
        return "<|endoftext|>".join(
            part.decode("utf-8", errors="replace") for part in bytes(ids).split(bytes([BYTES_EOT]))
        )

    def decode_bytes(self, ids) -> bytes:
        return bytes(ids)


def encoding(name: str, vocab_size: int = None):
    """The tokenizer of an encoding name in ENCODINGS: tiktoken's GPT-2 BPE, or ByteEncoding.
    With a model's vocab_size, a UserError unless the two fit: every id the tokenizer makes has
    a row in the model, and a byte model makes only bytes (a checkpoint edited to the other
    encoding would otherwise fail inside the model or the decoder)."""
    enc = ByteEncoding() if name == "bytes" else gpt2_encoding()
    too_big = name == "bytes" and vocab_size is not None and vocab_size > enc.n_vocab
    if vocab_size is not None and vocab_size < enc.n_vocab or too_big:
        raise UserError(
            f"a model with vocab_size={vocab_size} cannot use encoding={name} "
            f"({enc.n_vocab} token ids): its settings do not go together (edited?)"
        )
    return enc


def text_ids(enc, text: str, option: str) -> list:
    """A command line's text (`option`'s) as enc's token ids, each <|endoftext|> in it the
    document separator (as nanoGPT's sample.py reads a prompt). Bytes that are not UTF-8 a
    byte-level model takes exactly; GPT-2's BPE, whose tokenizer would make them U+FFFD,
    refuses them."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        if enc.name != "bytes":
            raise UserError(
                f"{option} is not UTF-8 from byte {len(text[: e.start].encode())} on, and "
                f"GPT-2's BPE encodes text alone"
            ) from None
    parts = [enc.encode_ordinary(part) for part in text.split("<|endoftext|>")]
    ids = parts[0]
    for part in parts[1:]:
        ids += [enc.eot_token, *part]
    return ids


def gpt2_encoding():
    """tiktoken's GPT-2 BPE. The name r50k_base (the same vocabulary) is tried first, as it is
    found offline in TIKTOKEN_CACHE_DIR; then gpt2 (online, tiktoken downloads and caches it
    once); if neither loads, a UserError says how to get it."""
    import tiktoken

    failures = []
    for name in ("r50k_base", "gpt2"):
        try:
            return tiktoken.get_encoding(name)
        except Exception as e:  # offline without a cached file, most often
            failures.append(f"{name}: {type(e).__name__}")
    raise UserError(
        f"cannot load the GPT-2 BPE from tiktoken ({'; '.join(failures)}); connect "
        "to the internet once, or set TIKTOKEN_CACHE_DIR to a folder holding the "
        "cached r50k_base file"
    )
