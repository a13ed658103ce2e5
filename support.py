"""What every command here shares, none of it torch: command lines (exit statuses, one error
line, options typed from dataclass fields and the facts each field carries), folders held by
one job at a time, and the stop signals that a training job saves on. Files, written whole and
only a command's own, are fileio.py's (it imports this module, never the reverse). The data
scripts import it and start at once; check_device imports torch, as its callers have already.

Guarantees: bad input is one `error: ...` line and exit status 2, raised before anything is
written; a folder a job writes is locked for it alone, the lock dropped however it ends."""

import argparse
import atexit
import contextlib
import decimal
import errno
import fcntl
import math
import os
import re
import signal
import sys
import threading
from dataclasses import field, fields

HERE = os.path.dirname(os.path.abspath(__file__))  # the repository: its scripts and data
PARENT = os.getppid()  # who started this process, read as it starts: a torchrun worker's launcher
MAX_PROCESSES = max(8, 4 * (os.cpu_count() or 1))  # a command's processes: a few per CPU at most

# -----------------------------------------------------------------------------
# Command lines: exit statuses, options, dataclass fields


class UserError(Exception):
    """Bad input from the user: one `error: <message>` line, exit status 2."""


class RunStopped(Exception):
    """A command cannot go on once it has written something (a training job's message names its
    last checkpoint; export's, its files). Exit status 1: the input was not at fault."""


class Interrupted(KeyboardInterrupt):
    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def interrupted(signum, _frame):
    raise Interrupted(signum)


DISK_FULL = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)  # no space, quota, file size limit
SECOND = "interrupted by a second signal"  # a training job's line on one (cli)
OUT_OF_MEMORY = "out of memory: this machine cannot allocate what it needs"  # (out_of_memory)
# torch's other words for it, in a RuntimeError of no type of its own: its CPU allocator's
# (c10's alloc_cpu.cpp: POSIX's, Windows'), CUDA's own (a GPU full as a context or a library starts)
RAN_OUT = re.compile(
    r"DefaultCPUAllocator: (can't allocate|not enough) memory: you tried to allocate \d+ bytes"
    r"|CUDA error: out of memory"
)


def cli(main, argv, end_line=None) -> int:
    """main(argv) as a command: 0; 2 bad input (a UserError, an OS error on a user's path); 1 a
    full disk, a pipe whose reader is gone, memory run out (out_of_memory), RunStopped, or a
    failure once a training job has a run directory (the error's `checkpoint`, runs.Ledger: the
    line names it); 128+N on signal N. At most one error line. Once main has returned (its work
    done), a signal (say, during the interpreter's shutdown) changes neither the output nor the
    status. end_line: called as it stops early (an error, a signal), to end a line left open (the
    tokenizer's progress line)."""
    for sig in SAVE_SIGNALS:  # each unwinds: a command takes back what it was writing
        signal.signal(sig, interrupted)
    for name in ("stdout", "stderr"):  # closed as the process began (None): what it says is lost
        if getattr(sys, name) is None:
            setattr(sys, name, open(os.devnull, "w"))
    status, done = 0, False
    try:
        main(argv)
        done = True  # (CPython handles a signal at its next call or loop: after this store)
        sys.stdout.flush()
        return 0
    except KeyboardInterrupt as e:
        status, ckpt = 128 + getattr(e, "signum", signal.SIGINT), getattr(e, "checkpoint", None)
        text = None if ckpt is None else SECOND  # (a first: no line)
        if done:  # (as the flush began: what it had not written is written below)
            status, text = 0, None
    except RunStopped as e:
        status, text, ckpt = 1, str(e), None  # it names the checkpoint itself
    except (UserError, OSError) as e:
        ckpt, text = getattr(e, "checkpoint", None), os_error_text(e)
        lost = getattr(e, "errno", None) in (*DISK_FULL, errno.EPIPE)  # (not the input's fault)
        status = 1 if ckpt is not None or lost else 2
    except Exception as e:  # memory run out: the machine's limit, not the input's (as a full disk)
        text = out_of_memory(e)
        if text is None:
            raise
        status, ckpt = 1, getattr(e, "checkpoint", None)
    finally:  # once it is over a signal ends the process at once, with the command's own
        # status, and its folders are free (in a test, the process goes on); the signals held
        # while the handlers change (a second one: no traceback)
        signal.pthread_sigmask(signal.SIG_BLOCK, SAVE_SIGNALS)
        release_locks()
        for sig in SAVE_SIGNALS:
            signal.signal(sig, lambda *_: os._exit(status))
        atexit.unregister(ignore_signals)
        atexit.register(ignore_signals)  # (last registered: the first to run at exit)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, SAVE_SIGNALS)
    try:
        sys.stdout.flush()
    except OSError:  # what stdout could not take is lost: drop it, or the flush at exit
        with contextlib.suppress(OSError, ValueError):  # would add a second message
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    if end_line is not None:
        end_line()
    if text is None:
        return status
    text += "" if ckpt is None else f"; last checkpoint: {ckpt}"
    # one line, whatever a name in it holds, in one write: ranks' lines do not interleave
    sys.stderr.write(f"error: {one_line(text)}\n")
    sys.stderr.flush()
    return status


def out_of_memory(e: BaseException | None) -> str | None:
    """An error line's text if e is memory run out, else None: Python's MemoryError, torch's
    OutOfMemoryError (a GPU's) or a RuntimeError in RAN_OUT's words (torch's words follow). A
    command that reads a file lets it through, not blaming the file."""
    torch = sys.modules.get("torch")  # (imported by what raised it, if torch did)
    if isinstance(e, MemoryError):
        return OUT_OF_MEMORY
    if torch is not None and isinstance(e, torch.OutOfMemoryError):
        return f"{OUT_OF_MEMORY} ({first_line(e, 400)})"
    said = RAN_OUT.search(str(e)) if isinstance(e, RuntimeError) else None
    return None if said is None else f"{OUT_OF_MEMORY} ({said[0]})"


def one_line(text: str) -> str:
    """text on one line: each character that does not print (a newline, say) as its escape."""
    return "".join(c if c.isprintable() else ascii(c)[1:-1] for c in text)


def fmt_list(xs) -> str:
    """Per-layer figures in a log line: [0.123 0.456 ...]."""
    return "[" + " ".join(f"{x:.3f}" for x in xs) + "]"


def first_line(e: Exception, width: int = 160) -> str:
    """An exception's message as an error line quotes it: its first line, or its type."""
    return (str(e).strip().splitlines() or [type(e).__name__])[0][:width]


def ignore_signals():
    """At exit, once the command's status is known: SAVE_SIGNALS ignored. The interpreter resets a
    Python handler to the fatal default as it shuts down; SIG_IGN it keeps (a complete run that
    a late signal reaches still exits 0)."""
    for sig in SAVE_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)


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
    return value == 0 or 2.0**-126 <= abs(value) <= 3.4028234663852886e38


def in_range(kind, low, high=math.inf):
    """argparse type= for a finite `kind` in [low, high] (a float also float32_safe); the bounds
    stay on it (.kind, .low, .high) for the tests that generate bad values."""

    def convert(text: str):
        with contextlib.suppress(ValueError, OverflowError):
            value = parse_int(text) if kind is int else kind(text)
            if (
                math.isfinite(value)
                and low <= value <= high
                and (kind is int or float32_safe(value))
            ):
                return value
        size = "" if kind is int else ", 0 or of float32 size"
        end = ")" if high == math.inf else "]"  # (inf itself is refused: not finite)
        raise argparse.ArgumentTypeError(
            f"expected {kind.__name__} in [{low}, {high}{end}{size}, got {text!r}"
        )

    convert.kind, convert.low, convert.high = kind, low, high
    return convert


def nonempty(text: str) -> str:
    if not text:
        raise argparse.ArgumentTypeError("expected a non-empty value")
    return text


def path_arg(text: str) -> str:
    """A file or folder (what is there is checked where it is used); a leading ~ is the home
    folder, as a shell makes it of a word, though not after --name= (a folder named ~ is one
    that `rm -r ~` would lose the home with)."""
    return os.path.expanduser(nonempty(text))


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
        raise UserError(
            f"--device={name}: "
            + (f"there are {count} CUDA devices" if count else "no CUDA device is available here")
        )
    return name


class ArgParser(argparse.ArgumentParser):
    """argparse for every command but the trainer: --help shows doc; an error is a UserError."""

    def __init__(self, prog: str, doc: str):
        super().__init__(
            prog,
            description=doc,
            allow_abbrev=False,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )

    def error(self, message):
        raise UserError(f"{message.removeprefix('argument ')} (see {self.prog} --help)")

    def _print_message(self, message, file=None):  # argparse's drops a failed write (--help to
        # a full disk: the help lost, status 0); flushed, for cli to say the error
        if message:
            file = file or sys.stderr
            file.write(message)
            file.flush()

    def given(self, argv) -> set:
        """The options argv gives (by dest), at any value: one that the others leave unread is
        refused even where it holds its default."""
        actions = (self._option_string_actions.get(a.partition("=")[0]) for a in argv)
        return {a.dest for a in actions if a is not None}

    def refuse(self, idle: set, why: str):
        """An error for the first of the options given (given()) that the others leave unread."""
        if idle:
            self.error(f"--{sorted(idle)[0]} does nothing {why}")

    def add_model_source(self):
        """A model to read: RUN_DIR (positional, as before) or --init_from=SOURCE (a run folder, a
        folder in Hugging Face layout, hf:OWNER/NAME[@REVISION]); model_source() picks it."""
        self.add_argument(
            "run_dir", nargs="?", type=path_arg, metavar="RUN_DIR", help="a run folder"
        )
        self.add_argument(
            "--init_from",
            type=path_arg,
            metavar="SOURCE",
            help="a run folder, a folder in Hugging Face layout, or hf:OWNER/NAME[@REVISION] "
            "(default: none; give RUN_DIR or this)",
        )

    def model_source(self, args) -> str:
        if (args.run_dir is None) == (args.init_from is None):
            self.error("give the model once: RUN_DIR or --init_from=SOURCE")
        return args.run_dir or args.init_from


def parse_int(text: str) -> int:
    """An int as every command reads one: digits (10_000), or exactly a whole number as 1e6 up
    to 2**53, where a float holds every integer (1.0000000000000001 is refused, not read as the
    float 1.0). ValueError if it is not one."""
    if re.fullmatch(r"[-+]?[\d_]+", text.strip()):
        return int(text)
    value = float(text.replace("_", ""))
    with contextlib.suppress(decimal.InvalidOperation):
        exact = decimal.Decimal(text.replace("_", ""))
        if value.is_integer() and abs(value) <= 2**53 and exact == value:
            return int(value)
    raise ValueError(f"not an int: {text!r}")


def parse_fields(classes, argv) -> dict:
    """--field=value pairs for the fields of the dataclasses, each typed against its default
    (an int: parse_int)."""
    defaults = {f.name: getattr(cls(), f.name) for cls in classes for f in fields(cls)}
    choices = {
        f.name for cls in classes for f in fields(cls) if type(f.metadata.get("spec")) is tuple
    }
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
            if kind is int:
                given[name] = parse_int(text)
            elif kind is str:  # a path unless it has choices: ~ as path_arg reads it
                given[name] = text if name in choices else os.path.expanduser(text)
            else:
                given[name] = parse_bool(text) if kind is bool else kind(text)
            if kind is float and past_floats(text, given[name]):
                value = given[name]
                raise UserError(f"--{name}={text}: past a float's range (it reads as {value})")
        except (ValueError, argparse.ArgumentTypeError):
            raise UserError(f"--{name}={text}: expected {kind.__name__}") from None
    return given


def past_floats(text: str, value: float) -> bool:
    """Whether text, a finite number, reads as a float it is not: 1e400 as inf, 1e-400 as 0."""
    with contextlib.suppress(decimal.InvalidOperation):  # (what Decimal does not read: float's)
        exact = decimal.Decimal(text)
        return exact.is_finite() and (math.isinf(value) or (value == 0) != (exact == 0))
    return False


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


def setting(default, spec="", help="", *, fixed=False, router="", use=""):
    """A dataclass field with its facts, which the code reads (check_fields, field_help, the
    trainer's resume and validate). spec: an interval "[low, high)" (each end open or closed,
    inf allowed) or a tuple of choices; help: its meaning for --help; fixed: a resume may not
    change it; router: the router that alone reads it ("": every router); use: "train" where
    only training reads it, "init" where only a new model's initial weights do ("": evaluation
    too)."""
    facts = {"spec": spec, "help": help, "fixed": fixed, "router": router, "use": use}
    return field(default=default, metadata=facts)


def interval(spec: str) -> tuple:
    """ "[low, high)" -> (low, high, low included, high included); ints stay ints."""
    low, high = (
        int(b) if b.strip().lstrip("-").isdigit() else float(b) for b in spec[1:-1].split(",")
    )
    return low, high, spec[0] == "[", spec[-1] == "]"


def within(v, spec: str) -> bool:
    """Whether the number v lies in the interval spec ("[low, high)", interval's)."""
    low, high, closed_low, closed_high = interval(spec)
    return low < v < high or (v == low and closed_low) or (v == high and closed_high)


def field_help(cls) -> list:
    """The --help lines for dataclass cls: each field's default, spec and help; a router's own
    fields are marked with it, and the fixed ones (a resume may not change them)."""
    lines = []
    for f in fields(cls):
        spec, text, router = (f.metadata[k] for k in ("spec", "help", "router"))
        if isinstance(spec, tuple):
            spec = "{" + "|".join(spec) + "}"
        flag = f"--{f.name}={str(f.default).lower() if isinstance(f.default, bool) else f.default}"
        marks = []
        if router:
            marks.append(f"router={router}")
        if f.metadata["fixed"]:
            marks.append("fixed")
        if f.metadata["use"]:
            marks.append(f"{f.metadata['use']} only")
        shown = [spec, f"({', '.join(marks)})" if marks else "", text]
        lines.append(f"  {flag:<36} {' '.join(t for t in shown if t)}".rstrip())
    return lines


def usage(run, job, presets: dict) -> str:
    """The trainer's --help: every field of its settings (run: the run's, job: one job's) with
    its default, range or choices and help; the presets."""
    return "\n".join(
        [
            "usage: python train_gpt.py [--field=value ...]  (or torchrun ... train_gpt.py ...)",
            "Every field of Hyperparameters and Job, with its default; booleans take true/false "
            "(1/0, yes/no), integers 10_000 or 1e4; a field given twice takes the later value (a "
            "script's overrides last).",
            "(fixed): a resume may not change it; (router=NAME): read by that router only; "
            "(train only): read by training alone; (init only): by a new model's initial weights.",
            "",
            "the run's settings (Hyperparameters: saved in its checkpoint):",
            *field_help(run),
            "",
            "this job's (Job: given on each job's command line, never saved as the run's):",
            *field_help(job),
            "",
            f"presets: {', '.join(p for p in presets if p)}",
        ]
    )


def check_fields(obj):
    """A UserError naming the first field of obj outside its spec or float32's range."""
    for f in fields(obj):
        v, spec = getattr(obj, f.name), f.metadata["spec"]
        if isinstance(spec, tuple) and v not in spec:
            raise UserError(f"{f.name}={v!r}; choose from {', '.join(map(repr, spec))}")
        if isinstance(spec, str) and spec and not within(v, spec):
            raise UserError(f"{f.name}={v} must lie in {spec}")
        if isinstance(v, float) and not float32_safe(v):
            raise UserError(
                f"{f.name}={v} is not 0 and outside float32's range (the numbers are float32): "
                f"it would become 0 or infinity"
            )


# Dense bf16 peak FLOP/s per GPU, from the vendors' data sheets (no sparsity), by a part of
# torch.cuda.get_device_name(): the first entry that matches wins, so PCIe and NVL come first.
PEAK_FLOPS = (
    ("H100 PCIe", 756e12),
    ("H100 NVL", 835e12),
    ("H100", 989e12),
    ("H200", 989e12),
    ("A100", 312e12),
)


def peak_flops(device_name: str, given: float = 0.0) -> float:
    """MFU's denominator per GPU: given, else the table's for the device; 0 when unknown."""
    return given or next((f for part, f in PEAK_FLOPS if part in device_name), 0.0)


CGROUP = "/sys/fs/cgroup"  # cgroup v2's hierarchy; this process's group: SELF_CGROUP's "0::PATH"
SELF_CGROUP = "/proc/self/cgroup"


def usable_cpus() -> int:
    """The CPUs this process may use: its affinity, within the CPU quota of its cgroup v2 group
    and of each group above it (cpu.max, "QUOTA PERIOD": a container's --cpus, systemd's
    CPUQuota; "max": none), rounded up."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    cpus, group = cpus or 1, "/"
    with contextlib.suppress(OSError, StopIteration):
        with open(SELF_CGROUP) as f:
            group = next(line[3:].strip() for line in f if line.startswith("0::"))
    group = os.path.normpath("/" + group.lstrip("/"))  # (within the hierarchy: no ".." left)
    while True:  # the group, then each parent up to the root
        with contextlib.suppress(OSError, ValueError):  # (no file, or "max": no quota)
            with open(os.path.join(CGROUP, group.lstrip("/"), "cpu.max")) as f:
                quota, period = (int(v) for v in f.read().split()[:2])
            if quota > 0 and period > 0:
                cpus = min(cpus, -(-quota // period))
        if group == "/":
            return max(1, cpus)
        group = os.path.dirname(group)


# -----------------------------------------------------------------------------
# Folder locks: one job at a time writes a folder

held_locks = {}  # (device, inode) of each folder this process holds locked -> its descriptor
LOCKING = threading.Lock()  # lock_folder's look and take, one thread at a time


def lock_folder(path: str):
    """An exclusive flock on the folder path itself (no file is written), held till release_locks
    or the process's end (the kernel drops it however the process ends): held by another
    process, a UserError; by this one already, nothing. Where the file system takes no lock
    (some network ones ignore flock or refuse it), a note, and no lock."""
    with LOCKING:
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError as e:  # (opening to read: never a full disk)
            raise UserError(f"cannot use {path}: {e.strerror or e}") from None
        st = os.fstat(fd)
        if (st.st_dev, st.st_ino) in held_locks:
            os.close(fd)
            return
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno == errno.EWOULDBLOCK:
                os.close(fd)
                raise UserError(
                    f"{path} is in use by another job (it holds the folder's lock); wait for "
                    f"that job to end"
                ) from None
            print(  # (once: the folder is this process's as far as it can be)
                f"note: {path} cannot be locked ({e.strerror}): nothing keeps another job "
                f"from writing there meanwhile",
                file=sys.stderr,
            )
        held_locks[(st.st_dev, st.st_ino)] = fd


def release_locks():
    """The job is over (in a test, the process goes on): every folder it locked is free."""
    while held_locks:
        os.close(held_locks.popitem()[1])


# -----------------------------------------------------------------------------
# Stop signals

SAVE_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)  # Ctrl-C, schedulers, Slurm


class StopSignal:
    """Once armed (the job can save), SAVE_SIGNALS ask for a checkpoint at the next step; before
    that, or a second one, stops at once. Re-entrant: held for the job. After finish() (the final
    save) signals are ignored (status 0). It records that a signal came, nothing else."""

    def __init__(self):
        self.signum, self.depth, self.previous, self.finished, self.armed = 0, 0, {}, False, False

    def __call__(self, signum, frame):
        if self.signum or not self.armed:
            raise Interrupted(signum)
        self.signum = signum

    def __enter__(self):
        if self.depth == 0:
            self.signum, self.finished, self.armed = 0, False, False
            self.previous = {sig: signal.signal(sig, self) for sig in SAVE_SIGNALS}
        self.depth += 1
        return self

    def __exit__(self, *exc):
        self.depth -= 1
        if self.depth == 0:
            for sig, handler in self.previous.items():
                signal.signal(sig, signal.SIG_IGN if self.finished else handler)

    def finish(self):
        """The job's final save is done: from here a signal changes nothing."""
        self.finished = True


STOP = StopSignal()  # handlers are installed only inside `with STOP:`


@contextlib.contextmanager
def signals_held():
    """A cleanup that a second signal (Ctrl-C twice) does not cut short: SAVE_SIGNALS are noted
    while it runs; at its end the first is raised (Interrupted), unless an exception was on its
    way out when it began (the command stops with that one's status). The main thread only."""
    came, going = [], sys.exc_info()[1]
    previous = {sig: signal.signal(sig, lambda n, _: came.append(n)) for sig in SAVE_SIGNALS}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if came and going is None:
        raise Interrupted(came[0])
