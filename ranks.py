"""The ranks of a job: this process's place in it (Dist: rank, device, world; the device's
memory, which bounds the sizes a job may ask for), a torchrun worker's launcher watched (a
worker whose launcher is gone stops, at start-up before it writes anything, and while it waits
in C++), and what every rank agrees on: sums, maxima, and the signal that stops them all at the
same step, so that none waits in a collective for another."""

import contextlib
import gc
import os
import signal
import socket
import sys
import threading
from dataclasses import dataclass

import torch
import torch.distributed as dist

from support import PARENT, RunStopped, UserError, first_line, out_of_memory


@dataclass
class Dist:
    """This process's place in the job: its rank, its device, and how many ranks there are."""

    rank: int = 0
    local_rank: int = 0
    world: int = 1
    device: str = "cpu"
    parent: int = 0  # a torchrun worker's launcher (pid; 0: not a worker), gone: agreed_signal

    @property
    def master(self) -> bool:
        return self.rank == 0

    @property
    def launcher(self) -> str:
        """The trainer's command line as this job's, for "resume with:"."""
        if self.world > 1:
            return f"torchrun --nproc_per_node={self.world} train_gpt.py"
        return "python train_gpt.py"

    def sync(self):
        """Wait for the device's queued work (CUDA runs asynchronously): before timing."""
        if self.device.startswith("cuda"):
            torch.cuda.synchronize()

    def barrier(self):
        if dist.is_initialized():
            dist.barrier()

    def close(self):
        """End the job's process group, first collecting what still refers to it (DDP's reducer
        sits in reference cycles): left to the interpreter's exit, torch 2.11's gloo aborted a
        finished two-rank CPU job ("terminate called without an active exception") in 6 of 36
        runs here; collected first, in none of 60."""
        if dist.is_initialized():
            gc.collect()
            dist.destroy_process_group()

    def on_master(self, fn, share: bool = True, last: str = None):
        """fn() on rank 0; its failure is raised on every rank, so none waits in a collective for
        it: the same UserError or OSError, else RunStopped (naming last, the job's last good
        checkpoint, if given). share: all get the result."""
        result, error = None, None
        if self.master:
            try:
                result = fn()
            except Exception as e:
                error = e
        if dist.is_initialized():
            sent = error
            if not (error is None or isinstance(error, (UserError, OSError))):
                said = out_of_memory(error) or f"{type(error).__name__}: {error}"
                sent = RunStopped(
                    f"rank 0 failed ({said})"
                    + (f"; last checkpoint: {last}" if last is not None else "")
                )
            box = [sent, result if share else None]
            dist.broadcast_object_list(box, src=0)
            if not self.master:
                error, result = box
        if error is not None:
            raise error
        return result


def machine_memory() -> int:
    """Bytes of memory of one device: the GPU's when there is one, else physical RAM."""
    if torch.cuda.is_available():
        return torch.cuda.get_device_properties(0).total_memory
    with contextlib.suppress(ValueError, OSError, AttributeError):
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return 2**62


def check_memory(need: int, what: str, sizes: str):
    """A UserError when `need` bytes (a lower bound, for `what`) exceed this machine's memory,
    naming the sizes that would lower it."""
    if need > machine_memory():
        raise UserError(
            f"these sizes need at least {need >> 30} GiB on one device {what}; it has "
            f"{machine_memory() >> 30} GiB (lower {sizes})"
        )


GONE = "the launcher is gone: this worker stops; nothing was written"


def setup_distributed() -> Dist:
    """torchrun sets RANK/WORLD_SIZE; plain `python train_gpt.py` is world size 1. A worker whose
    launcher is gone gives up before anything is written: at once, or while it waits for the
    other ranks (which would wait till torch's timeout): watching. An environment that is not a
    torchrun worker's, or a rendezvous that fails, is one line as well."""
    cuda = torch.cuda.is_available()
    if "RANK" not in os.environ:
        return Dist(device="cuda" if cuda else "cpu")
    names = ("RANK", "LOCAL_RANK", "WORLD_SIZE")
    try:  # (RANK alone, say another launcher's, is not a torchrun worker's environment)
        d = Dist(*(int(os.environ[k]) for k in names))
        if not (0 <= d.rank < d.world and 0 <= d.local_rank <= d.rank):
            raise ValueError  # (a rank past the world would wait for the others till a timeout)
    except (KeyError, ValueError):
        said = " ".join(f"{k}={os.environ.get(k, '(unset)')}" for k in names)
        raise UserError(
            f"{said}: not a torchrun worker's environment; start the job with torchrun, or "
            f"unset RANK"
        ) from None
    d.device = f"cuda:{d.local_rank}" if cuda else "cpu"
    d.parent = PARENT
    if gone(d):
        raise RunStopped(GONE)
    if cuda:
        torch.cuda.set_device(d.device)
    with watching(d):  # (init_process_group blocks in C++: no Python signal handler runs there)
        try:
            dist.init_process_group(backend="nccl" if cuda else "gloo")
        except dist.DistError as e:  # (its text: a C++ stack)
            raise RunStopped(
                GONE if gone(d) else f"the rendezvous failed: {first_line(e)}"
            ) from None
        except ValueError as e:  # env:// without MASTER_ADDR or MASTER_PORT: not torchrun's
            raise UserError(f"the rendezvous cannot start: {first_line(e)}") from None
    return d


def gone(d: Dist) -> bool:
    """Whether this torchrun worker's launcher is gone: the worker was re-parented
    (launcher_gone), or torchrun's store refuses it (store_refused: a launcher that died before
    this process could read its parent)."""
    return launcher_gone(d) or store_refused()


@contextlib.contextmanager
def watching(d: Dist):
    """Meanwhile, a thread ends this process (one line, status 1) once its launcher is gone: for
    a wait in C++, or a job that writes nothing (--eval_only), so no worker outlives it."""
    done = threading.Event()

    def watch():
        while not done.wait(0.5):
            if gone(d):
                sys.stderr.write(f"error: {GONE}\n")
                sys.stderr.flush()
                os._exit(1)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        yield
    finally:
        done.set()
        watcher.join()  # (a poll under way ends before the block's end is the caller's)


def store_refused() -> bool:
    """Whether torchrun's store (its agent hosts it: TORCHELASTIC_USE_AGENT_STORE, at
    MASTER_ADDR:MASTER_PORT, open before any worker starts) refuses a connection: the launcher
    is gone. Any other answer (a timeout, another launcher's variables) is no evidence."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return False
    try:
        address = (os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]))
        socket.create_connection(address, timeout=2).close()
    except ConnectionRefusedError:
        return True
    except (OSError, KeyError, ValueError):
        pass
    return False


def launcher_gone(d: Dist) -> bool:
    """Whether this torchrun worker's launcher has ended: the worker was re-parented."""
    return d.parent != 0 and os.getppid() != d.parent


def all_reduce(t, op: str = "sum"):
    """A tensor summed ("sum") or maximised ("max") over the ranks, in place; returns it."""
    if dist.is_initialized() and dist.get_world_size() > 1:  # (one rank: no collective)
        dist.all_reduce(t, op={"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}[op])
    return t


def add_sums(total: dict, more: dict) -> dict:
    """Per-key sums of tensors: total plus more, a key missing from either counting as 0."""
    return {k: total.get(k, 0) + more.get(k, 0) for k in {**total, **more}}


def all_reduce_sums(sums: dict) -> dict:
    """Each float64 tensor of a dict summed over the ranks, in one collective call."""
    flat = all_reduce(torch.cat([t.reshape(-1) for t in sums.values()]))
    parts = flat.split([t.numel() for t in sums.values()])
    return {k: part.view_as(t) for (k, t), part in zip(sums.items(), parts, strict=True)}


def agreed_signal(stop, d: Dist) -> int:
    """The highest signal number any rank got (0: none): every rank stops at the same step, or
    the others would hang (a scheduler may signal some ranks only). A worker whose launcher is
    gone, as torchrun is on a SIGUSR1 it does not pass on, counts that as SIGHUP."""
    signum = stop.signum
    if not signum and launcher_gone(d):
        signum = signal.SIGHUP
    return int(
        all_reduce(
            torch.tensor(  # (one process: no collective, no copy)
                float(signum), device=d.device if d.world > 1 else "cpu"
            ),
            "max",
        )
    )
