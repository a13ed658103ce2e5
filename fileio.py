"""Files for every command: what is at a path (named in an error line, never opened blind),
folders proven writable before the work, files written whole or not at all, and the outputs a
command wrote, recorded by digest in the folder (OUTPUTS) so that it replaces or removes only
those.

Guarantees: a file is replaced only whole (write_atomically), and a command replaces or deletes
only what it wrote itself (write_output, writable_dir, remove_output). None of it is torch (the
data scripts import it); it imports support (UserError, the folder locks), never the reverse."""

import contextlib
import errno
import hashlib
import json
import os
import re
import shutil
import stat
import tempfile

from support import DISK_FULL, UserError, lock_folder

KINDS = {
    stat.S_IFREG: "a file",
    stat.S_IFDIR: "a folder",
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
    stat.S_IFIFO: "a named pipe",
    stat.S_IFSOCK: "a socket",
}


def kind_of(path: str) -> str:
    """What is at path, for an error line: 'a file', 'a folder', ..., 'a symbolic link to a
    file', ..., 'nothing'."""
    try:
        found = KINDS.get(stat.S_IFMT(os.stat(path).st_mode), "not a file")
        return f"a symbolic link to {found}" if os.path.islink(path) else found
    except OSError as e:
        if e.errno == errno.ELOOP:
            return "a symbolic link loop"
        if os.path.islink(path):
            return "a broken symbolic link"
        missing = e.errno in (errno.ENOENT, errno.ENOTDIR)
        return "nothing" if missing else (e.strerror or str(e)).lower()


def regular(path: str, shown: str = None) -> str:
    """path, if it is a regular file (or a link to one); else an OSError naming it as shown
    (default: path), before it is opened (a named pipe would block, a device never end)."""
    if not os.path.isfile(path):
        found = kind_of(path)
        missing = found == "nothing"
        why = "no such file" if missing else f"not a regular file: {found}"
        raise OSError(errno.ENOENT if missing else errno.EINVAL, why, shown or path)
    return path


def need(path: str, kind: str) -> str:
    """path, if it is kind ('a file' or 'a folder', or a link to one: an input may be linked),
    a folder one whose files can be reached (else they would all seem absent); else a UserError
    saying what is there."""
    found = kind_of(path)
    if found not in (kind, f"a symbolic link to {kind}"):
        raise UserError(
            f"{path}: no such {kind[2:]}"
            if found == "nothing"
            else f"{path} is {found}, not {kind}"
        )
    if kind == "a folder" and not os.access(path, os.X_OK):
        raise UserError(f"cannot read {path}: {os.strerror(errno.EACCES)}")
    return path


def refuse(e: OSError, path: str, doing: str = "write to"):
    """An OS error on a user's path: a full disk stays one (status 1), else a UserError (2)."""
    if e.errno in DISK_FULL:
        raise OSError(e.errno, e.strerror, path) from None
    raise UserError(f"cannot {doing} {path}: {e.strerror or e}") from None


PROBE_BYTES = 1 << 20
OUTPUTS = ".outputs.json"  # in a folder commands wrote files into, per file: {name: {"by": the
# command's file name, "sha256": its digest, or [old, new] while it is replaced: write_output}}


def writable_dir(path: str, outputs=(), by: str = "") -> str:
    """Before any long work: folder path (or where it would be made) takes PROBE_BYTES, synced, in
    a nameless file (an empty file fits on a full disk), and each of outputs there is absent or
    a file that write_output wrote for command `by` (its file), unchanged since: no user's file
    is replaced, nor another command's. With outputs, an existing folder is locked now, as
    write_output would lock it (another job's, a run in training say: refused before the work)."""
    if not path:
        raise UserError("expected a folder, got an empty path")
    if OUTPUTS in outputs:  # (skipview.py --out=FILE names its own)
        raise UserError(
            f"{os.path.join(path, OUTPUTS)}: that name is the folder's record of what commands "
            f"wrote there: name the output otherwise; nothing was written"
        )
    if outputs and os.path.isdir(path):
        lock_folder(path)
    ours = written_outputs(path) if outputs else {}  # (a command that keeps no record: not read)
    for name in outputs:
        problem, _ = ownership(path, name, ours, by)
        if problem:
            raise UserError(f"{problem}: move it or write elsewhere; nothing was written")
    made = first_missing(path)
    existing = os.path.dirname(made) if made else os.path.abspath(path)
    if not os.path.isdir(existing):
        raise UserError(f"cannot write to {path}: {existing} is {kind_of(existing)}, not a folder")
    try:
        with tempfile.TemporaryFile(dir=existing) as f:
            f.write(bytes(PROBE_BYTES))
            f.flush()
            os.fsync(f.fileno())
    except OSError as e:
        refuse(e, path)
    return path


MAX_RECORD_BYTES = 1 << 20  # OUTPUTS and the like: a few names and digests; more is not ours


def written_outputs(d: str) -> dict:
    """Folder d's OUTPUTS (what each file written there is: by whom, its digests), {} if there is
    none. Ours only if it is a regular file (no link, pipe or device: never opened) of at most
    MAX_RECORD_BYTES in that exact form (or an older version's, {name: its digests}, which names
    no command); anything else is a UserError, so that it is never replaced (nor a file it
    names)."""
    path = os.path.join(d, OUTPUTS)
    if not os.path.lexists(path):
        return {}
    record = None
    if kind_of(path) == "a file":
        try:
            with open(path, "rb") as f:
                data = f.read(MAX_RECORD_BYTES + 1)
            record = json.loads(data) if len(data) <= MAX_RECORD_BYTES else None
        except (OSError, ValueError, RecursionError):
            record = None
    ours = isinstance(record, dict) and all(
        name == os.path.basename(name) not in ("", ".", "..") and recorded_file(entry)
        for name, entry in record.items()
    )
    if not ours:
        raise UserError(
            f"{path} ({kind_of(path)}) is not a record this project wrote: move it; nothing "
            "was written"
        )
    return record


def ownership(folder: str, name: str, ours: dict, by: str) -> tuple:
    """-> (why folder's file name is not command `by`'s to replace (ours: written_outputs), or ""
    if it is absent, or a file that write_output wrote for `by`, unchanged since; the file's
    sha256, or None)."""
    p, entry = os.path.join(folder, name), ours.get(name)
    if not os.path.lexists(p):
        return "", None
    digest = sha256_of(p) if kind_of(p) == "a file" else None
    if digest in digests(entry, by):
        return "", digest
    if digest in digests(entry):  # (an older version's entry)
        why = f"{p} is there and the record of it is an older version's, which names no command"
    else:
        why = f"{p} is there ({kind_of(p)}) and this command did not write it, or it changed since"
    return why, digest


def recorded_file(entry) -> bool:
    """Whether entry is what OUTPUTS holds for a file: {"by": a file name, "sha256": one digest,
    or two while it is replaced}, or an older version's digests alone."""
    if isinstance(entry, dict) and entry.keys() == {"by", "sha256"}:
        by, entry = entry["by"], entry["sha256"]
        if not (isinstance(by, str) and by == os.path.basename(by) != ""):
            return False
    listed = [entry] if isinstance(entry, str) else entry
    return (
        isinstance(listed, list)
        and 1 <= len(listed) <= 2
        and all(isinstance(d, str) and re.fullmatch("[0-9a-f]{64}", d) for d in listed)
    )


def digests(entry, by: str = None) -> list:
    """The digests that OUTPUTS' entry for a name accepts from command `by` (its file): one, or
    two while it is replaced; none where another command wrote it, or an older version (whose
    entry, its digests alone, named no command: by None reads them)."""
    if isinstance(entry, dict):
        listed = entry["sha256"] if by is not None and entry["by"] == os.path.basename(by) else []
    else:
        listed = entry if by is None and entry is not None else []
    return [listed] if isinstance(listed, str) else listed


def write_output(folder: str, name: str, data: bytes, by: str):
    """write_atomically for command `by` (its file), with the file's sha256 in folder's OUTPUTS
    before and after the write (beside the old file's, while it is replaced), so that a command
    cut at any point (a signal, a full disk) leaves only files its rerun recognises as its own
    (writable_dir)."""
    os.makedirs(folder, exist_ok=True)  # (a new folder, as write_atomically would make it)
    lock_folder(folder)  # held to the command's end: its outputs are written by it alone
    ours = written_outputs(folder)
    problem, old = ownership(folder, name, ours, by)  # (since writable_dir: another's, a user's)
    if problem:
        raise UserError(f"{problem}: not replaced; move it and run this again")
    new = hashlib.sha256(data).hexdigest()
    path, record = os.path.join(folder, name), os.path.join(folder, OUTPUTS)

    def recorded(digest):  # the record with this file's entry
        entry = {"by": os.path.basename(by), "sha256": digest}
        return json.dumps({**ours, name: entry}, indent=1).encode()

    write_atomically(record, recorded([new] if old is None else [old, new]))
    write_atomically(path, data)
    write_atomically(record, recorded(new))


def remove_output(folder: str, name: str, by: str):
    """Remove folder's file name if write_output wrote it for command `by`, unchanged since (an
    earlier run's output that this run does not make again); a user's file, another command's,
    or a changed one, is left."""
    if not os.path.isdir(folder):  # (not made yet: nothing to remove)
        return
    lock_folder(folder)
    ours = written_outputs(folder)
    path = os.path.join(folder, name)
    if kind_of(path) == "a file" and sha256_of(path) in digests(ours.get(name), by):
        os.remove(path)  # (then its digest: a cut between leaves a digest of no file)
    if name in ours and not os.path.lexists(path):
        ours.pop(name)
        write_atomically(os.path.join(folder, OUTPUTS), json.dumps(ours, indent=1).encode())


HASH_BLOCK = 16 << 20  # sha256_of reads this much at a time: memory stays bounded


def sha256_of(path: str) -> str:
    """The file's sha256, read in blocks (a FineWeb shard is 200 MB, a .deb package more)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(HASH_BLOCK):
            digest.update(block)
    return digest.hexdigest()


def first_missing(path: str):
    """The topmost folder that making path would create (None if path exists), for remove_made."""
    made, top = None, os.path.abspath(path)
    while not os.path.lexists(top):
        made, top = top, os.path.dirname(top)
    return made


def remove_made(path: str, made):
    """Remove the empty folders from path up to made (first_missing's), deepest first."""
    folder = os.path.abspath(path)
    while made and os.path.isdir(folder) and not os.listdir(folder):
        os.rmdir(folder)
        if folder == made:
            break
        folder = os.path.dirname(folder)


@contextlib.contextmanager
def named(path: str, always: bool = False):
    """An OS error while writing or reading path names it (a write error carries no name);
    always: even where it names another (write_atomically's temporary file: not the user's)."""
    try:
        yield
    except OSError as e:
        if e.filename is None or (always and e.filename != path):
            raise OSError(e.errno, e.strerror or str(e), path) from None
        raise


def open_mode(path: str) -> int:
    """The permissions that open(path, "wb") leaves a file with: the file's own where one is there
    (a user's chmod 600 stays; setuid and the like do not), else 0o666 less the umask."""
    with contextlib.suppress(OSError):
        return os.stat(path).st_mode & 0o777
    umask = os.umask(0)  # the only way to read it is to set it: put it back at once
    os.umask(umask)
    return 0o666 & ~umask


def write_atomically(path: str, data, tag: str = "", mode: int = None):
    """Write data (bytes, or a file open to read: copied in pieces) to path so that a reader sees
    the old file or all of the new one: a temporary file beside it (mkstemp's 0o600 while it is
    written, then mode, by default open_mode(path): a read-only file is replaced too), fsynced,
    renamed over it, the rename fsynced.
    The temporary file: PATH.<8 random>.tmp, or PATH.<tag>.<8 random>.tmp (a run's checkpoint:
    its run_id, so that a kill's leftover is known as the run's)."""
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)  # an output folder is made when its first file is
    prefix = os.path.basename(path) + "." + (f"{tag}." if tag else "")
    with named(path, always=True):
        handle, tmp = tempfile.mkstemp(dir=folder, prefix=prefix, suffix=".tmp")
    os.close(handle)
    mode = open_mode(path) if mode is None else mode
    try:
        with named(path, always=True), open(tmp, "wb") as f:
            if hasattr(data, "read"):
                shutil.copyfileobj(data, f)
            else:
                f.write(data)
            f.flush()
            os.fchmod(f.fileno(), mode)
            os.fsync(f.fileno())
        with named(path, always=True):
            os.replace(tmp, path)
    except BaseException:  # a full disk, a second signal
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise
    sync_folder(folder)


def sync_folder(folder: str):
    """fsync a folder: the names renamed into it are on disk (a file's own fsync keeps its
    bytes, not its name)."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
