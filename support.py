"""What train_gpt.py and the commands beside it share that is not training: command lines and
their errors, dataclass fields as options, files written whole, run directories and their
logs, stop signals, the ranks of a torchrun job. torch is imported only inside the functions
that use it: the data scripts import this module too, and start at once."""

import argparse, contextlib, errno, functools, glob, hashlib, inspect, json, math, os, platform
import re, signal, stat, subprocess, sys, tempfile, time
from dataclasses import dataclass, fields

# -----------------------------------------------------------------------------
# Command lines: exit statuses, options, dataclass fields

class UserError(Exception):
    """Bad input from the user: one `error: <message>` line, exit status 2."""

class RunStopped(Exception):
    """A training job cannot go on; its message names the last checkpoint. Exit status 1."""

class Interrupted(KeyboardInterrupt):
    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum

def interrupted(signum, _frame):
    raise Interrupted(signum)

DISK_FULL = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)  # no space, quota, file size limit

def cli(main, argv, before_error=None) -> int:
    """main(argv) as a command: 0; 2 bad input (a UserError, an OS error on a user's path); 1 a
    full disk, RunStopped, or a failure once a training job has a run directory (then the
    line names STOP.last_ckpt); 128+N on signal N. At most one error line. Once it returns, a
    signal (say, during the interpreter's shutdown) changes neither the output nor the status."""
    for sig in SAVE_SIGNALS:  # each unwinds: a command takes back what it was writing
        signal.signal(sig, interrupted)
    status, STOP.last_ckpt = 0, None  # (tests run several commands in one process)
    try:
        main(argv)
        sys.stdout.flush()
        return 0
    except KeyboardInterrupt as e:
        status, ckpt = 128 + getattr(e, "signum", signal.SIGINT), STOP.last_ckpt
        text = "interrupted by a second signal"
        if ckpt is None:
            return status
    except RunStopped as e:
        status, text, ckpt = 1, str(e), None  # it names the checkpoint itself
    except (UserError, OSError) as e:
        ckpt, text = STOP.last_ckpt, os_error_text(e)
        status = 1 if ckpt is not None or getattr(e, "errno", None) in DISK_FULL else 2
    finally:  # once it is over a signal ends the process at once, with the command's own status
        for sig in SAVE_SIGNALS:
            signal.signal(sig, lambda *_: os._exit(status))
    text += "" if ckpt is None else f"; last checkpoint: {ckpt}"
    try:
        sys.stdout.flush()
    except OSError:  # what stdout could not take is lost: drop it, or the flush at exit
        with contextlib.suppress(OSError, ValueError):  # would add a second message
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    if before_error is not None:  # e.g. the tokenizer ends its progress line first
        before_error()
    sys.stderr.write(f"error: {text}\n")  # one write: ranks' lines do not interleave
    sys.stderr.flush()
    return status

def os_error_text(e: Exception) -> str:
    """An OS error as an error line says it: the file, if known, then what went wrong."""
    if not isinstance(e, OSError):
        return str(e)
    return f"{str(e.filename) + ': ' if e.filename else ''}{e.strerror or e}"

def exit_quietly_on_signals():
    """Until cli(): a signal exits at once, 128+N, no traceback (os._exit: no half-done import)."""
    for sig in SAVE_SIGNALS:
        signal.signal(sig, lambda signum, _: os._exit(128 + signum))

def parse_bool(text: str) -> bool:
    """A boolean option, the same in every command: 1/0, true/false, yes/no."""
    if text.lower() not in ("1", "0", "true", "false", "yes", "no"):
        raise argparse.ArgumentTypeError(f"expected bool (1/0/true/false/yes/no), got {text!r}")
    return text.lower() in ("1", "true", "yes")

def float32_safe(value: float) -> bool:
    """0 or a normal float32, where the numbers are used (1e-50 would become 0, 1e39 inf)."""
    return value == 0 or 2.0 ** -126 <= abs(value) <= 3.4028234663852886e38

def in_range(kind, low, high=math.inf):
    """argparse type= for a finite `kind` in [low, high] (a float also float32_safe); the bounds
    stay on it (.kind, .low, .high) for the tests that generate bad values."""
    def convert(text: str):
        with contextlib.suppress(ValueError, OverflowError):
            value = kind(text)
            if (math.isfinite(value) and low <= value <= high
                    and (kind is int or float32_safe(value))):
                return value
        size = "" if kind is int else ", 0 or of float32 size"
        raise argparse.ArgumentTypeError(f"expected {kind.__name__} in [{low}, {high}]{size}, "
                                         f"got {text!r}")
    convert.kind, convert.low, convert.high = kind, low, high
    return convert

def nonempty(text: str) -> str:
    if not text:
        raise argparse.ArgumentTypeError("expected a non-empty value")
    return text

def path_arg(text: str) -> str:  # a file or folder: what is there is checked where it is used
    return nonempty(text)

def check_device(name: str) -> str:
    """A device the commands can run on (cpu, cuda, cuda:K), or a UserError saying why not."""
    import torch  # loaded already by every command that runs a model
    try:
        dev = torch.device(name)
    except RuntimeError:
        raise UserError(f"--device={name}: not a device name (cpu, cuda or cuda:K)") from None
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if dev.type not in ("cpu", "cuda"):
        raise UserError(f"--device={name}: only cpu and cuda are supported")
    if dev.type == "cuda" and (dev.index or 0) >= count:
        raise UserError(f"--device={name}: " + (f"there are {count} CUDA devices" if count else
                                                "no CUDA device is available here"))
    return name

class ArgParser(argparse.ArgumentParser):
    """argparse for every command but the trainer: --help shows doc; an error is a UserError."""
    def __init__(self, prog: str, doc: str):
        super().__init__(prog, description=doc, allow_abbrev=False,
                         formatter_class=argparse.RawDescriptionHelpFormatter)
    def error(self, message):
        raise UserError(f"{message.removeprefix('argument ')} (see {self.prog} --help)")

def parse_fields(classes, argv) -> dict:
    """--field=value pairs for the fields of the dataclasses, each typed against its default
    (an int may be written 10_000, or 1e6 while a float holds it exactly)."""
    defaults = {f.name: getattr(cls(), f.name) for cls in classes for f in fields(cls)}
    given = {}
    for arg in argv:
        name, eq, text = arg[2:].partition("=")
        if not arg.startswith("--") or not eq:
            raise UserError(f"bad argument {arg!r}: use --field=value")
        if name not in defaults:
            raise UserError(f"unknown field {name!r}; valid fields: {', '.join(defaults)}")
        kind = type(defaults[name])
        if not text:
            raise UserError(f"--{name}=: expected a value (leave the field out for its default)")
        try:
            if kind is int and not re.fullmatch(r"[-+]?[\d_]+", text.strip()):
                value = float(text.replace("_", ""))
                if not (value.is_integer() and abs(value) <= 2**53):
                    raise ValueError
                given[name] = int(value)
            else:
                given[name] = parse_bool(text) if kind is bool else kind(text)
        except (ValueError, argparse.ArgumentTypeError):
            raise UserError(f"--{name}={text}: expected {kind.__name__}") from None
    return given

def saved_fields(cls, saved) -> dict:
    """The fields of dataclass cls in saved (read from a run's files), others dropped; a missing
    or mistyped one (an int may stand for a float) is a UserError: no default stands in."""
    if not isinstance(saved, dict):
        raise UserError(f"saved settings are {type(saved).__name__}, not an object")
    out = {}
    for f in fields(cls):
        if f.name not in saved:
            raise UserError(f"it lacks the setting {f.name!r}")
        value, kind = saved[f.name], type(getattr(cls(), f.name))
        if kind is float and type(value) is int:
            value = float(value) if abs(value) <= sys.float_info.max else math.inf  # then refused
        if type(value) is not kind:
            raise UserError(f"saved {f.name}={value!r} is not of type {kind.__name__}")
        out[f.name] = value
    return out

SPEC = re.compile(r"[\[(]\s*([^,\])]+),\s*([^\])]+)[\])]|\{([^}]*)\}")  # "[0, 1)" or "{a|b}"

@functools.lru_cache(maxsize=None)
def field_facts(cls) -> dict:
    """name -> (group, spec, help) per field of dataclass cls, from its source: the comment heading
    its block; the interval or choices opening its comment (SPEC; {NAME}: NAME's keys); the rest."""
    facts, group = {}, ""
    for line in inspect.getsource(cls).splitlines()[2:]:
        code, _, comment = (part.strip() for part in line.partition("#"))
        if not code:
            group = comment or group
        elif name := re.match(r"(\w+): \w+ = ", code):  # a field's line
            spec = SPEC.match(comment)
            rest = comment[spec.end() if spec else 0:].strip()
            keys = spec and spec[3] and vars(inspect.getmodule(cls)).get(spec[3])  # {NAME}
            facts[name[1]] = (group, "{%s}" % "|".join(keys) if keys else (spec or [""])[0], rest)
    return facts

def field_help(cls) -> list:
    """The --help lines for dataclass cls: each field's default and comment, under its group."""
    defaults, lines, group = cls(), [], None
    for name, (head, spec, text) in field_facts(cls).items():
        if head != group:
            lines.append(f"\n{head}:")
            group = head
        value = getattr(defaults, name)
        flag = f"--{name}={str(value).lower() if isinstance(value, bool) else value}"
        lines.append(f"  {flag:<36} {' '.join(t for t in (spec, text) if t)}".rstrip())
    return lines

def check_fields(obj):
    """A UserError naming the first field of obj outside its spec (field_facts) or float32."""
    for name, (_, spec, _) in field_facts(type(obj)).items():
        v, m = getattr(obj, name), SPEC.match(spec)
        if m and m[3] is not None and v not in m[3].split("|"):
            raise UserError(f"{name}={v!r}; choose from {', '.join(map(repr, m[3].split('|')))}")
        if m and m[3] is None:
            low, high = (int(b) if b.lstrip("-").isdigit() else float(b) for b in m.group(1, 2))
            if not (low < v < high or v == low and spec[0] == "[" or v == high and spec[-1] == "]"):
                raise UserError(f"{name}={v} must lie in {spec}")
        if isinstance(v, float) and not float32_safe(v):
            raise UserError(f"{name}={v} is not 0 and outside float32's range (the numbers "
                            f"are float32): it would become 0 or infinity")

# Dense bf16 peak FLOP/s per GPU, from the vendors' data sheets (no sparsity), by a part of
# torch.cuda.get_device_name(): the first entry that matches wins, so PCIe and NVL come first.
PEAK_FLOPS = (("H100 PCIe", 756e12), ("H100 NVL", 835e12), ("H100", 989e12), ("H200", 989e12),
              ("A100", 312e12))

def peak_flops(device_name: str, given: float = 0.0) -> float:
    """MFU's denominator per GPU: given, else the table's for the device; 0 when unknown."""
    return given or next((f for part, f in PEAK_FLOPS if part in device_name), 0.0)

def machine_memory() -> int:
    """Bytes of memory of one device: the GPU's when there is one, else physical RAM."""
    import torch  # loaded already by the trainer, its only caller
    if torch.cuda.is_available():
        return torch.cuda.get_device_properties(0).total_memory
    with contextlib.suppress(ValueError, OSError, AttributeError):
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return 2**62

# -----------------------------------------------------------------------------
# Files: named by what is there, proven writable first, written whole or not at all

KINDS = {stat.S_IFREG: "a file", stat.S_IFDIR: "a folder", stat.S_IFCHR: "a character device",
         stat.S_IFBLK: "a block device", stat.S_IFIFO: "a named pipe", stat.S_IFSOCK: "a socket"}

def kind_of(path: str) -> str:
    """What is at path, for an error line: 'a file', 'a folder', ..., 'nothing'."""
    try:
        return KINDS.get(stat.S_IFMT(os.stat(path).st_mode), "not a file")
    except OSError as e:
        if e.errno == errno.ELOOP:
            return "a symbolic link loop"
        if os.path.islink(path):
            return "a broken symbolic link"
        missing = e.errno in (errno.ENOENT, errno.ENOTDIR)
        return "nothing" if missing else (e.strerror or str(e)).lower()

def need(path: str, kind: str) -> str:
    """path, if it is kind ('a file' or 'a folder'); else a UserError saying what is there."""
    found = kind_of(path)
    if found != kind:
        raise UserError(f"{path}: no such {kind[2:]}" if found == "nothing" else
                        f"{path} is {found}, not {kind}")
    return path

def refuse(e: OSError, path: str, doing: str = "write to"):
    """An OS error on a user's path: a full disk stays one (status 1), else a UserError (2)."""
    if e.errno in DISK_FULL:
        raise OSError(e.errno, e.strerror, path) from None
    raise UserError(f"cannot {doing} {path}: {e.strerror or e}") from None

PROBE_BYTES = 1 << 20
OUTPUTS = ".outputs.json"  # in a folder a command wrote files into: {name: sha256} of each

def writable_dir(path: str, outputs=()) -> str:
    """Before any long work: folder path (or where it would be made) takes PROBE_BYTES, synced, in
    a nameless file (an empty file fits on a full disk), and each of outputs there is absent or
    a file write_output wrote, unchanged since (no user's file is replaced)."""
    if not path:
        raise UserError("expected a folder, got an empty path")
    ours = written_outputs(path)
    for p in (os.path.join(path, name) for name in outputs):
        if os.path.lexists(p) and (os.path.islink(p) or ours.get(os.path.basename(p)) != (
                sha256_of(p) if os.path.isfile(p) else "")):
            raise UserError(f"{p} is there ({kind_of(p)}) and this command did not write it, or "
                            f"it changed since: move it or write elsewhere; nothing was written")
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

def written_outputs(d: str) -> dict:  # (a named pipe opens at once, empty: no hang)
    path = os.path.join(d, OUTPUTS)
    with contextlib.suppress(OSError):  # none there, or not readable: checked where written
        with open(path, opener=lambda p, m: os.open(p, m | os.O_NONBLOCK)) as f:
            with contextlib.suppress(ValueError, TypeError, AttributeError):
                return {str(k): str(v) for k, v in json.load(f).items()}
        raise UserError(f"{path} is not a record this project wrote: move it; nothing was written")
    return {}

def write_output(folder: str, name: str, data: bytes):
    """write_atomically, its sha256 recorded in folder's OUTPUTS (writable_dir may replace it)."""
    ours = {**written_outputs(folder), name: hashlib.sha256(data).hexdigest()}
    write_atomically(os.path.join(folder, name), data)
    write_atomically(os.path.join(folder, OUTPUTS), json.dumps(ours, indent=1).encode())

def sha256_of(path: str) -> str:
    with open(path, "rb") as f:  # (a FineWeb shard is 200 MB)
        return hashlib.sha256(f.read()).hexdigest()

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
def named(path: str):
    """An OS error while writing or reading path names it (a write error carries no name)."""
    try:
        yield
    except OSError as e:
        if e.filename is None:
            raise OSError(e.errno, e.strerror or str(e), path) from None
        raise

def write_atomically(path: str, data: bytes):
    """Write data to path so that a reader sees the old file or all of the new one: a temporary
    file beside it (mode as open() would give), fsynced, renamed over it, the rename fsynced."""
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)  # an output folder is made when its first file is
    handle, tmp = tempfile.mkstemp(dir=folder, prefix=os.path.basename(path) + ".", suffix=".tmp")
    os.close(handle)
    os.umask(umask := os.umask(0))  # (read by setting it)
    try:
        os.chmod(tmp, 0o666 & ~umask)
        with named(path), open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:  # a full disk, a second signal
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)

# -----------------------------------------------------------------------------
# Checkpoints and what a resume reads

CHECKPOINT = "checkpoint.pt"  # the run directory's newest, replaced atomically at each save
PREVIOUS = "checkpoint.prev.pt"  # the one before it, if a step from it had a finite loss
LOGS = ("train.log", "metrics.jsonl", "config.json")

def save_checkpoint(run_dir: str, state: dict, keep: bool = False) -> str:
    """torch.save to RUN_DIR/checkpoint.pt (write_atomically), keep: the old one as PREVIOUS too."""
    import io, torch
    path, prev = (os.path.join(run_dir, n) for n in (CHECKPOINT, PREVIOUS))
    torch.save(state, buf := io.BytesIO())
    with contextlib.suppress(OSError):  # (a first save has none to keep)
        keep and os.path.lexists(prev) and os.remove(prev)
        keep and os.link(path, prev)
    write_atomically(path, buf.getvalue())
    return path

def read_checkpoint(run_dir: str, keys: tuple, check) -> dict:
    """RUN_DIR/checkpoint.pt if it loads, holds keys and passes check(state) (a UserError for
    malformed records); state["mtime"] is the file's."""
    import torch
    path = os.path.join(need(run_dir, "a folder"), CHECKPOINT)
    if not os.path.isfile(path):
        raise UserError(f"{run_dir}: no checkpoint ({CHECKPOINT}) in it" + (
            f" ({path} is {kind_of(path)})" if os.path.lexists(path) else ""))
    try:
        mtime = os.stat(path).st_mtime_ns
        state = torch.load(path, map_location="cpu", weights_only=True)
        missing = [k for k in keys if k not in state]
        if not missing:
            check(state)
    except UserError as e:
        raise UserError(f"{path}: {e} (an edited or damaged checkpoint)") from None
    except Exception as e:  # truncated, overwritten, or from an incompatible version
        raise UserError(f"{path}: corrupt or incompatible checkpoint "
                        f"({type(e).__name__})") from None
    if missing:
        raise UserError(f"{path}: checkpoint lacks {', '.join(missing)} (written by an older "
                        f"version of train_gpt.py?)")
    return {**state, "mtime": mtime}

# -----------------------------------------------------------------------------
# Run directories: creation, locking, logs, provenance

HERE = os.path.dirname(os.path.abspath(__file__))
SOURCES = ("train_gpt.py", "support.py", os.path.join("data", "shards.py"))  # what a run runs

def provenance() -> dict:
    """The git commit, whether the tree differs, and the sha256 of each source a run executes."""
    def git(*args):
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            r = subprocess.run(["git", *args], cwd=HERE, capture_output=True, text=True, timeout=20)
            return r.stdout.strip() if r.returncode == 0 else None
    commit = git("rev-parse", "HEAD")
    dirty = bool(git("status", "--porcelain")) if commit else None
    return {"git_commit": commit, "git_dirty": dirty,
            **{f"sha256 {name}": sha256_of(os.path.join(HERE, name)) for name in SOURCES}}

def describe_system() -> str:
    import numpy as np, torch  # loaded already by every caller
    lines = [f"python {sys.version.split()[0]}  torch {torch.__version__}  "
             f"cuda {torch.version.cuda}  numpy {np.__version__}",
             f"platform {platform.platform()}  cpus {os.cpu_count()}"]
    if torch.cuda.is_available():
        lines.append(f"gpu {torch.cuda.get_device_name()} x {torch.cuda.device_count()}")
        with contextlib.suppress(Exception):
            lines.append(subprocess.run(["nvidia-smi"], capture_output=True, text=True,
                                        timeout=20).stdout)
    return "\n".join(lines)

def new_run_dir(name: str) -> str:
    """A fresh logs/<date_time>_<name>_<6 hex>/ (never shared: mkdir refuses an existing one)."""
    while True:  # a taken name (the same second, the same 6 hex digits) draws another
        stamp = time.strftime('%Y-%m-%d_%H%M%S')
        path = os.path.join("logs", f"{stamp}_{name}_{os.urandom(3).hex()}")
        try:
            return os.makedirs(path) or path
        except OSError as e:
            if e.errno != errno.EEXIST:
                refuse(e, path, "create")

held_locks = []  # this process's run directories, open: closing one (or exiting) releases it

def lock_run_dir(run_dir: str, make: bool = True):
    """An exclusive flock on the folder RUN_DIR itself (made first if make; no file is written):
    the kernel drops it however the process ends (some network file systems ignore flock)."""
    import fcntl
    try:
        if make:
            os.makedirs(run_dir, exist_ok=True)
        folder = os.open(run_dir, os.O_RDONLY)
    except OSError as e:
        refuse(e, run_dir, "use run_dir")
    try:
        fcntl.flock(folder, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(folder)
        raise UserError(f"{run_dir} is in use by another job (it holds the folder's lock); "
                        f"wait for that job to end") from None
    held_locks.append(folder)

def release_locks():
    while held_locks:  # the job is over (in a test, the process goes on)
        os.close(held_locks.pop())

def open_run_dir(run_dir: str, name: str, ckpt: dict = None) -> str:
    """Choose (default: a new one) and lock the run directory. Resuming (ckpt: read_checkpoint's),
    the checkpoint must be the one read and of this folder's run; a run that never saved
    starts afresh, its files kept in aborted_<k>/."""
    writable_dir(run_dir or "logs")  # before anything is written, folders included
    run_dir = run_dir or new_run_dir(name)
    for path in (os.path.join(run_dir, n) for n in LOGS):
        if os.path.lexists(path):  # a folder or a named pipe there is bad input
            need(path, "a file")
    path, resuming = os.path.join(run_dir, CHECKPOINT), ckpt is not None
    lock_run_dir(run_dir, make=not resuming)  # first: what is checked below cannot change under it
    held = [n for n in (CHECKPOINT, PREVIOUS) if os.path.lexists(os.path.join(run_dir, n))]
    if not resuming and held:
        raise UserError(f"{run_dir} already holds a run that saved a checkpoint ({held[0]}); "
                        f"choose another directory, or continue it with train_gpt.py --resume="
                        f"{run_dir}" + (f" once {PREVIOUS} is renamed {CHECKPOINT}"
                                        if held == [PREVIOUS] else ""))
    if resuming and (os.stat(path).st_mtime_ns if os.path.exists(path) else None) != ckpt["mtime"]:
        raise UserError(f"{path} changed while this job started (another job was using the "
                        f"run); resume again")
    logged = logged_run_id(run_dir) if resuming else None  # another run's: its logs would be cut
    if resuming and logged != ckpt["run_id"] and (logged or os.path.lexists(os.path.join(
            run_dir, "metrics.jsonl"))):  # (no config.json and no metrics: expand.py's new run)
        raise UserError(f"{path} belongs to another run (run_id {ckpt['run_id']}, config.json "
                        f"says {logged or 'nothing'}); resume the run it came from")
    for stale in glob.glob(os.path.join(glob.escape(run_dir), CHECKPOINT + ".????????.tmp")):
        if os.path.isfile(stale):  # a save killed half-way (SIGKILL): write_atomically's
            os.remove(stale)
    old = [n for n in LOGS if not resuming and os.path.exists(os.path.join(run_dir, n))]
    if old:
        k = 1
        while os.path.exists(aside := os.path.join(run_dir, f"aborted_{k}")):
            k += 1
        try:
            os.makedirs(aside)
            for n in old:
                os.replace(os.path.join(run_dir, n), os.path.join(aside, n))
        except OSError as e:
            raise UserError(f"cannot move the earlier attempt's logs aside: {e.strerror}") from None
        print(f"{run_dir} held a run with no checkpoint; its files are in {aside}", file=sys.stderr)
    return run_dir

def logged_run_id(run_dir: str):
    """The run_id that RUN_DIR/config.json records, or None (no such file, or unreadable)."""
    with contextlib.suppress(OSError, ValueError, AttributeError):
        if os.path.isfile(path := os.path.join(run_dir, "config.json")):  # (a pipe would hang)
            with open(path) as f:
                return json.load(f).get("run_id")

def fmt_list(xs) -> str:
    """Per-layer figures in a log line: [0.123 0.456 ...]."""
    return "[" + " ".join(f"{x:.3f}" for x in xs) + "]"

def clock(train_ms: float, timed_steps: int) -> str:
    """The timing fields of the trainer's train and validation lines: the same in both."""
    avg = f"{train_ms / timed_steps:.2f}ms" if timed_steps else "-"
    return f"train_time:{train_ms:.0f}ms step_avg:{avg}"

class RunLog:
    """train.log, config.json and metrics.jsonl (rank 0 only). Each job appends to train.log the
    sources it runs, in full; a resume keeps the metrics its checkpoint saw, each step once."""
    def __init__(self, run_dir: str, config: dict, active: bool, resumed_at: int = None,
                 val_done: int = -1):
        self.active, self.resumed_at = active, resumed_at
        if not active:
            return
        log, metrics, config_path = (os.path.join(run_dir, n) for n in LOGS)
        write_atomically(config_path, json.dumps(config, indent=2).encode())
        with named(log):  # a write error carries no file name
            self.log = open(log, "w" if resumed_at is None else "a")
            if resumed_at is not None:
                self.log.write(f"{'=' * 100}\nresumed at step {resumed_at}\n")
                kept = []
                with contextlib.suppress(FileNotFoundError), open(metrics, "rb") as f:
                    for line in f:  # our records past what the checkpoint saw go, and one a
                        try:  # crash cut (no newline); a line of the user's stays, ended
                            m = json.loads(line)
                            seen = min(resumed_at, val_done) if m["kind"] == "val" else resumed_at
                            gone = m["step"] > seen
                        except (ValueError, KeyError, TypeError):
                            gone = line.startswith(b'{"kind": ') and not line.endswith(b"\n")
                        kept += [] if gone else [line.rstrip(b"\n") + b"\n"]
                record = json.dumps({"kind": "checkpoint", "step": resumed_at}).encode() + b"\n"
                write_atomically(metrics, b"".join(kept + [record] * (record not in kept)))
            for name in SOURCES:  # in full, as they ran: the trainer's first, unmarked
                with open(os.path.join(HERE, name)) as f:
                    rule = "" if name == SOURCES[0] else f"{'-' * 40} {name}\n"
                    self.log.write(rule + f.read())
            self.metrics = open(metrics, "a")
            dirty = {True: " (tree differs from the commit)", False: " (clean)", None: ""}
            sources = "".join(f"source: {n} sha256 {config[f'sha256 {n}']}\n" for n in SOURCES)
            self.log.write(f"{'=' * 100}\ncommand: {config['command']}\n"
                           f"git: {config['git_commit'] or 'not a git checkout'}"
                           f"{dirty[config['git_dirty']]}\n{sources}{describe_system()}\n"
                           f"hyperparameters: {json.dumps(config)}\n{'=' * 100}\n")
            self.log.flush()
    def print(self, line: str):
        if self.active:
            print(line, flush=True)
            with named(self.log.name):
                self.log.write(line + "\n")
                self.log.flush()
    def saved(self, step: int):
        """A checkpoint of step is on disk: said in both logs (metrics.jsonl: once per step)."""
        self.print(f"checkpoint saved at step {step}")
        if step != self.resumed_at:  # (a resumed job's step saved again, its validation done)
            self.record({"kind": "checkpoint", "step": step})
    def record(self, obj: dict):
        if self.active:
            with named(self.metrics.name):
                self.metrics.write(json.dumps(obj) + "\n")
                self.metrics.flush()
    def close(self):
        if self.active:  # every write was flushed: a failure here would only hide the first
            for f in (self.log, self.metrics):
                with contextlib.suppress(OSError):
                    f.close()

# -----------------------------------------------------------------------------
# Stop signals

SAVE_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)  # Ctrl-C, schedulers, Slurm

class StopSignal:
    """Once armed (the job can save), SAVE_SIGNALS ask for a checkpoint at the next step; before
    that, or a second one, stops at once. Re-entrant: held for the job. After finish() (the final
    save) signals are ignored (status 0). The job's checkpoint: last_ckpt, untried (last_good)."""

    def __init__(self):
        self.signum, self.depth, self.previous, self.finished, self.armed = 0, 0, {}, False, False
        self.last_ckpt = None  # a training job's last good checkpoint ("none" before its first)
    def __call__(self, signum, frame):
        if self.signum or not self.armed:
            raise Interrupted(signum)
        self.signum = signum
    def __enter__(self):
        if self.depth == 0:
            self.signum, self.finished, self.armed, self.untried = 0, False, False, True
            self.previous = {sig: signal.signal(sig, self) for sig in SAVE_SIGNALS}
        self.depth += 1
        return self
    def __exit__(self, *exc):
        self.depth -= 1
        if self.depth == 0:
            for sig, handler in self.previous.items():
                signal.signal(sig, signal.SIG_IGN if self.finished else handler)
    def finish(self): self.finished = True

STOP = StopSignal()  # handlers are installed only inside `with STOP:`

# -----------------------------------------------------------------------------
# Processes: the ranks of a training job and what they agree on

@dataclass
class Dist:
    rank: int = 0
    local_rank: int = 0
    world: int = 1
    device: str = "cpu"
    @property
    def master(self): return self.rank == 0
    @property
    def launcher(self) -> str:  # the trainer's command line, as this job's ("resume with:")
        return (f"torchrun --nproc_per_node={self.world} train_gpt.py" if self.world > 1
                else "python train_gpt.py")
    def sync(self):
        """Wait for the device's queued work (CUDA runs asynchronously): before timing."""
        import torch
        if self.device.startswith("cuda"):
            torch.cuda.synchronize()
    def barrier(self):
        import torch.distributed as dist
        if dist.is_initialized():
            dist.barrier()
    def close(self):
        import torch.distributed as dist
        if dist.is_initialized():
            dist.destroy_process_group()
    def on_master(self, fn, share: bool = True):
        """fn() on rank 0; its failure is raised on every rank, so none waits in a collective for
        it: the same UserError or OSError, else RunStopped. share: all get the result."""
        import torch.distributed as dist
        result, error = None, None
        if self.master:
            try:
                result = fn()
            except Exception as e:
                error = e
        if dist.is_initialized():
            sent = error
            if not (error is None or isinstance(error, (UserError, OSError))):
                sent = RunStopped(f"rank 0 failed ({type(error).__name__}: {error})" + (
                    f"; last checkpoint: {STOP.last_ckpt}" if STOP.last_ckpt is not None else ""))
            box = [sent, result if share else None]
            dist.broadcast_object_list(box, src=0)
            if not self.master:
                error, result = box
        if error is not None:
            raise error
        return result

def setup_distributed() -> Dist:
    """torchrun sets RANK/WORLD_SIZE; plain `python train_gpt.py` is world size 1."""
    import torch
    import torch.distributed as dist
    cuda = torch.cuda.is_available()
    if "RANK" not in os.environ:
        return Dist(device="cuda" if cuda else "cpu")
    d = Dist(int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"]), int(os.environ["WORLD_SIZE"]))
    d.device = f"cuda:{d.local_rank}" if cuda else "cpu"
    if cuda:
        torch.cuda.set_device(d.device)
    dist.init_process_group(backend="nccl" if cuda else "gloo")
    return d

def all_reduce(t, op: str = "sum"):
    """A tensor summed ("sum") or maximised ("max") over the ranks, in place; returns it."""
    import torch.distributed as dist
    if dist.is_initialized() and dist.get_world_size() > 1:  # (one rank: no collective)
        dist.all_reduce(t, op={"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}[op])
    return t

def add_sums(total: dict, more: dict) -> dict:
    """Per-key sums of tensors: total plus more, a key missing from either counting as 0."""
    return {k: total.get(k, 0) + more.get(k, 0) for k in {**total, **more}}

def all_reduce_sums(sums: dict) -> dict:
    """Each float64 tensor of a dict summed over the ranks, in one collective call."""
    import torch
    flat = all_reduce(torch.cat([t.reshape(-1) for t in sums.values()]))
    parts = flat.split([t.numel() for t in sums.values()])
    return {k: part.view_as(t) for (k, t), part in zip(sums.items(), parts)}

def all_finite(model, opt) -> bool:
    """Whether every weight and every optimiser moment is finite (one host sync)."""
    import torch
    tensors = [p.detach() for p in model.parameters()] + [
        v for state in opt.state.values() for v in state.values()
        if torch.is_tensor(v) and v.is_floating_point()]
    return bool(torch.stack([t.float().abs().max() for t in tensors if t.numel()]).isfinite().all())

def save_run_checkpoint(d: Dist, run_dir: str, step: int, model, opt, state):
    """state() as RUN_DIR/checkpoint.pt (rank 0) if all is finite; else, or failing, RunStopped.
    The old one stays as PREVIOUS if a step from it was finite (not STOP.untried): last_good."""
    if not all_finite(model, opt):
        raise RunStopped(f"non-finite weights after step {step}; the checkpoint was not "
                         f"replaced; last good checkpoint: {STOP.last_ckpt}")
    try:
        path = d.on_master(lambda: save_checkpoint(run_dir, state(), keep=not STOP.untried))
    except (UserError, OSError) as e:  # a full disk, or a folder made read-only
        raise RunStopped(f"cannot write the checkpoint of step {step} ({os_error_text(e)}); "
                         f"last good checkpoint: {STOP.last_ckpt}") from None
    STOP.last_ckpt, STOP.untried = f"{path} (step {step})", True

def last_good(d: Dist, run_dir: str) -> str:
    """For a stop on a non-finite loss: the newest checkpoint, or if no step from it was finite
    (an update that exploded but stayed finite, saved at its step), PREVIOUS put back."""
    path, prev = os.path.join(run_dir, CHECKPOINT), os.path.join(run_dir, PREVIOUS)
    def put_back():  # -> its step; None: none there, the same file (a save cut after its link),
        import torch  # or one that does not load
        with contextlib.suppress(Exception):
            step = torch.load(prev, map_location="cpu", mmap=True, weights_only=True)["step"]
            return None if os.path.samefile(prev, path) else os.replace(prev, path) or step
    if STOP.untried and (step := d.on_master(put_back)) is not None:
        STOP.untried, STOP.last_ckpt = False, (f"{path} (step {step}, put back: no step from the "
                                               f"newer {STOP.last_ckpt} had a finite loss)")
    return STOP.last_ckpt

def open_log(d: Dist, run_dir: str, config: dict, resumed_at: int = None,
             val_done: int = -1) -> RunLog:
    """The job's RunLog (inactive off rank 0); failing, RunStopped: the run directory exists."""
    try:
        log = d.on_master(lambda: RunLog(run_dir, config, True, resumed_at, val_done), share=False)
    except (UserError, OSError) as e:
        raise RunStopped(f"cannot write the run's logs ({os_error_text(e)}); last checkpoint: "
                         f"{STOP.last_ckpt}") from None
    return log if d.master else RunLog(run_dir, config, active=False)
