"""What the data scripts share, without torch (numpy only), so that fetching, tokenizing and
checking shards never waits for torch to load.

The shard format is the one train_gpt.py reads (modded-nanogpt): a header of HEADER_INTS
int32 values (SHARD_MAGIC, SHARD_VERSION, the token count, then zeros) followed by the tokens
as uint16. The constants below must equal train_gpt.py's; test_train.py checks that they do.

Also here: the commands' option parser (argparse, bad input as one `error:` line), writing a
file so that it appears whole or not at all, and proving a folder can be written to.
"""

import argparse
import contextlib
import math
import os
import sys
import tempfile

import numpy as np

SHARD_MAGIC = 20240520
SHARD_VERSION = 1
HEADER_INTS = 256
HEADER_BYTES = HEADER_INTS * np.dtype(np.int32).itemsize


# ---------------------------------------------------------------------------- command line

class UserError(Exception):
    """Bad input: cli() prints it as one `error: <message>` line and the status is 2."""


def cli(main, argv, before_error=None) -> int:
    """main(argv) as a command's exit status: 0 when it returns; 2, after one `error:` line on
    stderr, for a UserError or an OSError on a path the user gave; 130 on Ctrl-C."""
    try:
        main(argv)
    except KeyboardInterrupt:
        return 130
    except (UserError, OSError) as e:
        if before_error is not None:
            before_error()
        if isinstance(e, OSError):
            where = f"{e.filename}: " if e.filename else ""
            message = where + (e.strerror or str(e))
        else:
            message = str(e)
        print(f"error: {message}", file=sys.stderr)
        return 2
    return 0


def in_range(kind, low, high=math.inf):
    """An argparse type= for a number: a finite value of `kind` no smaller than low and no
    larger than high; anything else is refused with a message holding the text given."""
    def convert(text: str):
        try:
            value = kind(text)
            ok = math.isfinite(value) and low <= value <= high
        except (ValueError, OverflowError):
            ok = False
        if not ok:
            raise argparse.ArgumentTypeError(f"expected {kind.__name__} in [{low}, {high}], "
                                             f"got {text!r}")
        return value
    return convert


def nonempty(text: str) -> str:
    """An argparse type= for a path or name that may not be the empty string."""
    if not text:
        raise argparse.ArgumentTypeError("expected a non-empty value")
    return text


class ArgParser(argparse.ArgumentParser):
    """argparse with the project's conventions: options as --name=value, --help printing the
    script's docstring and each option's default, and every parsing error a UserError (one
    `error:` line, status 2) in place of argparse's usage text and exit."""

    def __init__(self, prog: str, doc: str):
        super().__init__(prog=prog, description=doc, allow_abbrev=False,
                         formatter_class=argparse.RawDescriptionHelpFormatter)

    def error(self, message):
        if message.startswith("argument "):  # "argument --x: ..." -> "--x: ..."
            message = message[len("argument "):]
        raise UserError(f"{message} (see {self.prog} --help)")


# ---------------------------------------------------------------------------- files

def writable_dir(path: str) -> str:
    """Make the folder if it is missing and create (and delete) a file in it, so that a folder
    that cannot take the output is refused before any long work."""
    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".write_test_"):
            pass
    except OSError as e:
        raise UserError(f"cannot write to {path}: {e.strerror or e}") from None
    return path


def write_atomically(path: str, data: bytes) -> None:
    """Put data at path so that readers only ever see the previous file or all of the new one:
    a temporary file beside it (deleted again if anything fails: an error, a full disk,
    Ctrl-C) is synced and renamed over path, and the folder is synced so the rename lasts."""
    folder = os.path.dirname(os.path.abspath(path))
    handle, tmp = tempfile.mkstemp(dir=folder, prefix=os.path.basename(path) + ".", suffix=".tmp")
    done = False
    try:
        with os.fdopen(handle, "wb") as out:
            out.write(data)
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, path)
        done = True
    finally:
        if not done:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
    listing = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(listing)
    finally:
        os.close(listing)


# ---------------------------------------------------------------------------- shards

def header(count: int) -> bytes:
    """The header bytes of a shard holding count tokens."""
    values = np.zeros(HEADER_INTS, dtype=np.int32)
    values[:3] = SHARD_MAGIC, SHARD_VERSION, count
    return values.tobytes()


def shard_tokens(path: str) -> int:
    """The number of tokens in the shard at path, once its header is read and found sound (the
    magic number, the version, and a count that matches the file's size)."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(HEADER_BYTES)
    if len(head) < HEADER_BYTES:
        raise UserError(f"{path}: truncated shard ({size} bytes, shorter than the "
                        f"{HEADER_BYTES}-byte header)")
    magic, version, count = (int(v) for v in np.frombuffer(head, dtype=np.int32, count=3))
    expected_size = HEADER_BYTES + 2 * count
    if magic != SHARD_MAGIC:
        problem = f"bad magic number {magic} (expected {SHARD_MAGIC})"
    elif version != SHARD_VERSION:
        problem = f"unsupported shard version {version} (expected {SHARD_VERSION})"
    elif count < 0 or size != expected_size:
        problem = (f"header says {count} tokens ({expected_size} bytes) but the file has "
                   f"{size} bytes (truncated or corrupt)")
    else:
        return count
    raise UserError(f"{path}: {problem}")


def read_shard(path: str, vocab_size: int = 2**16) -> np.ndarray:
    """All tokens of a sound shard (see shard_tokens), each one checked to be below vocab_size."""
    count = shard_tokens(path)
    tokens = np.fromfile(path, dtype=np.uint16, count=count, offset=HEADER_BYTES)
    biggest = int(tokens.max()) if count else -1
    if biggest >= vocab_size:
        raise UserError(f"{path}: token id {biggest} is outside the vocabulary "
                        f"(vocab_size={vocab_size})")
    return tokens
