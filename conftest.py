"""What the test files share: test_train.py (the paper's path) and tests/ (the rest, by module).

REPO is the repository root. Commands run there (run_command, start_command: one way to start a
command in a process of its own; run_main: a command's main in this process), whatever folder
pytest was started from and wherever the test file is.
"""

import errno
import fcntl
import hashlib
import importlib.util
import json
import math
import os
import shutil
import signal
import stat
import subprocess
import sys
import threading
import time
import warnings
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import fileio
import routers
import support
import train_gpt as tg

REPO = os.path.dirname(os.path.abspath(__file__))

# the GPT-2 BPE offline, as .ci/run sets it; online, tiktoken downloads it instead
_BPE_CACHE = os.path.join(REPO, "..", "shared", "tiktoken")
if os.path.isdir(_BPE_CACHE):
    os.environ.setdefault("TIKTOKEN_CACHE_DIR", os.path.abspath(_BPE_CACHE))
warnings.filterwarnings("ignore", message=".*flex_attention.*")  # eager Flex on CPU warns

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.fixture(autouse=True, scope="session")
def in_repo():
    """Every test runs in REPO: relative paths (data/sample/...) are the repository's."""
    cwd = os.getcwd()
    os.chdir(REPO)
    yield
    os.chdir(cwd)


@pytest.fixture(autouse=True)
def own_signal_handlers():
    """Each test finds the handlers of the saving signals as the session had them: a command run
    in-process (support.cli) leaves its own, which end the process at once."""
    held = {sig: signal.getsignal(sig) for sig in support.SAVE_SIGNALS}
    yield
    for sig, handler in held.items():
        signal.signal(sig, handler)


@pytest.fixture(autouse=True)
def free_folders():
    """Each test leaves no folder locked by this process (a command called without support.cli,
    which releases them, keeps its locks)."""
    yield
    support.release_locks()


# ---------------------------------------------------------------------------- commands


# bash started as from a terminal, with the saving signals' defaults: one that this process
# ignores (as pytest started in the background ignores SIGINT) bash could not trap
FROM_A_TERMINAL = """import os, signal, sys
for sig in (signal.SIGHUP, signal.SIGINT, signal.SIGTERM):
    signal.signal(sig, signal.SIG_DFL)
os.execvp("bash", sys.argv[1:])
"""


def _command(script, args, nproc, threads, env, cwd) -> dict:
    """The command line, folder and environment of run_command and start_command, as keywords."""
    # script: a path (from cwd), "-c" with the code as the first argument, or a .sh (for bash);
    # under torchrun with nproc > 1. OMP_NUM_THREADS: by default this process's thread count, so
    # that a run begun in this process and resumed in another reduces in the same order (bit for
    # bit), or one thread per process under torchrun (for the 2 cores). env: added to os.environ
    if str(script).endswith(".sh"):
        argv = [sys.executable, "-c", FROM_A_TERMINAL, "bash", str(script)]
    elif nproc > 1:
        launcher = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
        argv = [sys.executable, *launcher, str(script)]
    else:
        argv = [sys.executable, str(script)]
    threads = threads or (torch.get_num_threads() if nproc == 1 else 1)
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), **(env or {})}
    return dict(args=[*argv, *map(str, args)], cwd=cwd, env=env, text=True)


def run_command(script, *args, nproc=1, threads=None, env=None, cwd=REPO, timeout=600, **popen):
    """`python SCRIPT ARGS...` run to its end -> CompletedProcess (text, stdout and stderr kept)."""
    popen.setdefault("stdout", subprocess.PIPE)
    popen.setdefault("stderr", subprocess.PIPE)
    command = _command(script, args, nproc, threads, env, cwd)
    return subprocess.run(**command, timeout=timeout, **popen)


def start_command(script, *args, nproc=1, threads=None, env=None, cwd=REPO, **popen):
    """run_command's command, started and left -> Popen (stdout, stderr piped if not given)."""
    popen.setdefault("stdout", subprocess.PIPE)
    popen.setdefault("stderr", subprocess.PIPE)
    return subprocess.Popen(**_command(script, args, nproc, threads, env, cwd), **popen)


def run_main(args, capsys, main=None):
    """A main (train_gpt.py's by default) run here as __main__ does -> (status, stdout, stderr).
    stderr begins with the warnings it raised that a process would print too (a deprecation
    not: Python hides those outside __main__); all go on to pytest (its summary, its -W). Not
    shown: one that torch gives once a process and gave in an earlier test."""
    with warnings.catch_warnings(record=True) as raised:
        code = support.cli(main or tg.main, [str(a) for a in args])
    out = capsys.readouterr()
    printed = ""
    for w in raised:
        warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
        if not issubclass(w.category, (DeprecationWarning, PendingDeprecationWarning)):
            printed += warnings.formatwarning(w.message, w.category, w.filename, w.lineno)
    return code, out.out, printed + out.err


def load_command(path):
    """The command at path (from REPO) loaded as a module of its own, its main not run."""
    spec = importlib.util.spec_from_file_location(Path(path).stem, os.path.join(REPO, path))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def wait_for_line(proc, prefix, timeout=120):
    """proc's first line of stdout starting with prefix, failing if it ends first; killed if no
    such line comes within timeout seconds (a silent process would hold the loop for ever)."""
    deadline = threading.Timer(timeout, proc.kill)
    deadline.start()
    try:
        for line in proc.stdout:
            if line.startswith(prefix):
                return line
    finally:
        deadline.cancel()
    how = "was killed" if proc.wait() == -signal.SIGKILL else f"ended ({proc.returncode})"
    raise AssertionError(f"no {prefix!r}: it {how} first: {proc.stderr.read()[-2000:]}")


def disk_nearly_full(limit=256 << 10):
    """For a subprocess (preexec_fn): files may not grow past limit bytes, as a nearly full disk."""
    # RLIMIT_FSIZE (EFBIG), the way a disk with little space left refuses a write (ENOSPC); both
    # are DISK_FULL
    import resource

    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # else the write kills the process
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))


COMMANDS = (  # every command but train_gpt.py
    "sample.py",
    "bench.py",
    "sweep.py",
    "skipview.py",
    "expand.py",
    "export.py",
    "data/tokenize_corpus.py",
    "data/cached_fineweb10B.py",
    "data/debian_docs.py",
)


# ---------------------------------------------------------------------------- runs

TINY_RUN = [
    "--preset=smoke",
    "--n_layers=2",
    "--dim=64",
    "--n_heads=4",
    "--n_kv_heads=2",
    "--max_seq_len=64",
    "--seq_len=64",
]

RESUME_RUN = TINY_RUN + [
    "--dim=32",
    "--max_seq_len=32",
    "--seq_len=32",
    "--batch_size=8",
    "--device_batch_size=4",
    "--train_tokens=2048",
    "--val_every=4",
    "--val_tokens=256",
    "--save_every=0",
    "--gamma=0.05",
    "--mu_start=0.5",
    "--untimed_steps=1",
]  # 8 steps, an active controller


def read_metrics(run_dir):
    """The records of run_dir's metrics.jsonl."""
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def timing(m):
    """A metrics record without its times (which differ from one job to the next)."""
    return {k: v for k, v in m.items() if k not in ("step_ms", "compile_ms", "train_time_ms")}


def val_steps(run_dir):
    """The steps run_dir validated at."""
    return [m["step"] for m in read_metrics(run_dir) if m["kind"] == "val"]


def documents_by_hand(losses, targets, sep) -> tuple:
    """The reference for evaluate's statistics, written out: per-token losses split into
    documents, each starting at a target that is the separator (no empty first one). -> (the
    documents' losses, the mean per token, its standard error by the delta method)."""
    docs, cur = [], []
    for loss, target in zip(losses, targets, strict=True):
        if target == sep and cur:
            docs.append(cur)
            cur = []
        cur.append(loss)
    docs.append(cur)
    total, n = sum(map(sum, docs)), sum(map(len, docs))
    deviations = sum((sum(d) - total / n * len(d)) ** 2 for d in docs)
    return docs, total / n, math.sqrt(len(docs) / (len(docs) - 1) * deviations) / n


def nan_on_call(*n):
    """The model's loss, NaN on its n-th calls with gradients enabled (training)."""
    calls, real = [0], tg.LinearCrossEntropy.apply

    def fake(*args, **kwargs):
        loss = real(*args, **kwargs)
        if torch.is_grad_enabled():
            calls[0] += 1
            if calls[0] in n:
                return loss * float("nan")
        return loss

    return fake


CUDA_OUT_OF_MEMORY = "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity"
CUDA_ERROR = "CUDA error: out of memory\nCUDA kernel errors might be asynchronously reported"
OOM_TEXT = "out of memory: this machine cannot allocate what it needs"
OUT_OF_MEMORY_LINES = {  # memory run out, each raiser's error line as a user reads it
    "python": OOM_TEXT,
    "cpu": f"{OOM_TEXT} (DefaultCPUAllocator: can't allocate memory: you tried to allocate "
    f"{2**62} bytes)",
    "gpu": f"{OOM_TEXT} ({CUDA_OUT_OF_MEMORY})",
    "gpu starting": f"{OOM_TEXT} (CUDA error: out of memory)",
}


def run_out_of_memory(kind: str):
    """Memory run out as kind (OUT_OF_MEMORY_LINES) raises it: Python's MemoryError; torch's CPU
    allocator asked for 2**62 bytes (its own error, really raised); torch on a GPU, its
    OutOfMemoryError or CUDA's own error as a context starts (made here with their words)."""
    if kind == "python":
        raise MemoryError
    if kind == "cpu":
        torch.empty(2**62, dtype=torch.uint8)
    if kind == "gpu starting":
        raise RuntimeError(CUDA_ERROR)
    raise torch.OutOfMemoryError(CUDA_OUT_OF_MEMORY)


def deny_reading(monkeypatch, path):
    """open(path) fails as a permission would stop it (as root none does): a file whose reader
    must say so, not call it damaged or absent."""
    opened = open

    def denied(file, *args, **kwargs):
        if str(file) == str(path):
            raise PermissionError(errno.EACCES, "Permission denied", str(file))
        return opened(file, *args, **kwargs)

    monkeypatch.setattr("builtins.open", denied)


def sha256(data):
    """The SHA-256 of data, in hexadecimal."""
    return hashlib.sha256(data).hexdigest()


def note_syncs(monkeypatch, events: list):
    """os.fsync, each call first noted in events as (inode, size; None for a folder), as the OS
    gives them: what a write made durable, and when, among the test's own notes."""
    fsync = os.fsync

    def noted(fd):
        st = os.fstat(fd)
        events.append((st.st_ino, st.st_size if stat.S_ISREG(st.st_mode) else None))
        fsync(fd)

    monkeypatch.setattr(os, "fsync", noted)


def signal_self(signum=signal.SIGINT):
    """Send this process signum, then give its Python handler its turn (the next bytecode): a
    signal that arrives in the middle of what a test patched in."""
    os.kill(os.getpid(), signum)
    time.sleep(0.01)


def signal_at_each_write(monkeypatch):
    """Each fileio.write_atomically (write_output's writes), then a signal to this process
    (signal_self): a Ctrl-C that lands while a command writes its files."""
    real = fileio.write_atomically

    def write(path, data):
        real(path, data)
        signal_self()

    monkeypatch.setattr(fileio, "write_atomically", write)


def another_job_locks(folder):
    """Lock folder as another process would (an flock on a descriptor of its own) -> the
    descriptor (close it to release), or None where a lock is held."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return None
    return fd


def gpt2():
    """tiktoken's GPT-2 BPE, by hand: the reference for shards of GPT-2 tokens (r50k_base, the
    same vocabulary, as the offline cache holds it)."""
    import tiktoken

    return tiktoken.get_encoding("r50k_base")


def write_shard(path, tokens, magic=20240520, version=1, count=None, encoding=0):
    """A shard of tokens at path: its 256-int32 header (magic, version, count, encoding: 0 gpt2,
    1 bytes), then uint16s."""
    header = np.zeros(256, dtype=np.int32)
    header[:4] = (magic, version, len(tokens) if count is None else count, encoding)
    with open(path, "wb") as f:
        f.write(header.tobytes())
        f.write(np.asarray(tokens, dtype=np.uint16).tobytes())


# ---------------------------------------------------------------------------- models


def tiny(**kw) -> tg.Hyperparameters:
    """The defaults at a tiny size (vocabulary 97, 4 layers of 32, 16 tokens, SDPA), then kw."""
    base = dict(
        vocab_size=97,
        n_layers=4,
        dim=32,
        n_heads=4,
        n_kv_heads=2,
        max_seq_len=16,
        seq_len=16,
        attn_impl="sdpa",
    )
    return replace(tg.Hyperparameters(), **{**base, **kw})


def logits_gates(model, idx, **kw):
    """-> (logits, the skip_middle gates g (L, B, T), or None without them)."""
    out = model(idx, **kw)
    return out.logits, out.route.get("gates")


class CountedOps(TorchDispatchMode):
    """`with CountedOps(which) as ops:` counts in ops.n the aten calls for which
    which(func, args, kwargs) holds (an op a path must run, or must not)."""

    def __init__(self, which):
        super().__init__()
        self.which, self.n = which, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.n += bool(self.which(func, args, kwargs))
        return func(*args, **kwargs)


def spread_gates(model, std=0.15, bias=0.1, seed=1):
    """The gates' linears drawn wide enough that some tokens skip some blocks."""
    torch.manual_seed(seed)
    for gate in model.router.gates:
        torch.nn.init.normal_(gate.weight, std=std)
        torch.nn.init.constant_(gate.bias, bias)


def steered_model(hp):
    """A gated model whose token 5 skips every gated block (S > 1) and token 7 none (s = 0)."""
    # by one direction u that its embeddings and every gate share; other tokens vary
    torch.manual_seed(0)
    model = tg.GPT(hp)
    u = torch.randn(hp.dim)
    u = u / u.norm()
    with torch.no_grad():
        model.embed.weight[5], model.embed.weight[7] = 3 * u, -3 * u
        for gate in model.router.gates:
            gate.weight.copy_(10 * u[None])
            gate.bias.zero_()
    return model


def mor_model(seed=0, **kw):
    """8 applied blocks: 0 and 3 once, the stack 1-2 three times (N_r = 3, M = 2)."""
    torch.manual_seed(seed)
    model = tg.GPT(tiny(**{"router": "mor", "n_layers": 8, **kw}))
    for router in model.router.routers:  # scores spread well beyond their init
        torch.nn.init.normal_(router.weight, std=0.3)
    return model


def grads(module):
    """Each parameter's gradient, by name (those with one)."""
    return {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}


def assert_close_rel(a, b, tol):
    """a and b within tol of the larger of their largest magnitudes, both finite (an infinite
    magnitude would pass anything)."""
    assert torch.isfinite(a).all() and torch.isfinite(b).all(), "not finite"
    scale = max(a.abs().max().item(), b.abs().max().item(), 1e-12)
    assert (a - b).abs().max().item() <= tol * scale


def compact_matches_masked(masked, idx, given=None, evaluate=True):
    """Asserts masked's compacted twin gives its logits and gradients -> (twin, outputs, counts)."""
    # the twin: masked's weights, compact=True. Both train on idx (the router's loss in the
    # backward) and, with evaluate, evaluate it: logits within 1e-4, each gradient within 1e-4 of
    # the largest. given: the twin's packed lengths read on the host (None), the masked pass's
    # packed_counts in each mode ("fit": the exact fit), or the whole sequence ("full").
    # -> the twin; [(training output, evaluation output or None)] and [{training: packed counts}]
    # for masked, then the twin (True: training, False: evaluation). Masked weights a key of
    # weight 0 (g, or MoD's and MoR's keys) by gate_eps, compact by 0 (train_gpt's deviations): at
    # the default 1e-6 that alone moved a gradient by 1.5e-4 of the largest (the steered model),
    # so both run at 1e-20, far below fp32's rounding
    exact = tg.GPT(replace(masked.hp, gate_eps=1e-20))
    exact.load_state_dict(masked.state_dict())
    masked = exact
    twin = tg.GPT(replace(masked.hp, compact=True))
    twin.load_state_dict(masked.state_dict())
    outputs, counts, gradients = [], [], []
    for m in (masked, twin):
        seen, evaluated = {}, None
        for training in (True, False)[: 1 + evaluate]:
            if m is twin and given:
                fit = counts[0][training]
                m.router.lengths = fit if given == "fit" else [idx.size(1)] * len(fit)
            if training:
                o = m.train()(idx)
                reg, _ = m.router.loss(o.route, 0)
                (F.cross_entropy(o.logits.flatten(0, 1), idx.flatten()) + reg).backward()
            else:
                with torch.no_grad():
                    evaluated = m.eval()(idx)
            seen[training] = (
                routers.packed_counts((o if training else evaluated).route).int().tolist()
            )
        outputs.append((o, evaluated))
        counts.append(seen)
        gradients.append(grads(m))
    (o0, e0), (o1, e1) = outputs
    assert (o0.logits - o1.logits).abs().max().item() < 1e-4
    assert not evaluate or (e0.logits - e1.logits).abs().max().item() < 1e-4
    for name in gradients[0]:
        assert_close_rel(gradients[0][name], gradients[1][name], 1e-4)
    return twin, outputs, counts


def math_sdpa(q, k, v, attn_mask=None, is_causal=False, enable_gqa=False, **_):
    """Stand-in for SDPA made of matmuls, so that FlopCounterMode sees the attention."""
    rep = q.size(1) // k.size(1)
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    s = q @ k.transpose(-1, -2) / math.sqrt(q.size(-1))
    T = q.size(2)
    s = s.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    return torch.softmax(s, -1) @ v


def counted_flops(model, B, T, backward=False):
    """FLOPs FlopCounterMode sees for a forward (and backward) pass of a (B, T) batch, causally."""
    # the attention charged for the T(T+1)/2 pairs of a causal kernel instead of all T^2
    from torch.utils.flop_counter import FlopCounterMode

    idx = torch.randint(0, model.hp.vocab_size, (B, T))
    with FlopCounterMode(display=False) as counter, torch.set_grad_enabled(backward):
        logits = model(idx).logits
        if backward:
            logits.sum().backward()
    counts = {str(op): n for op, n in counter.get_flop_counts()["Global"].items()}
    attention = sum(n for op, n in counts.items() if "bmm" in op)
    assert attention > 0.03 * counter.get_total_flops()  # the attention term matters here
    return counter.get_total_flops() - attention + attention * (T + 1) / (2 * T)


@pytest.fixture
def strict_dynamo():
    """torch._dynamo failing where it would give up (its recompile limit), for the test."""
    # a context, not monkeypatch: pytest 9.2 undoes a config attribute by deleting it, and the
    # option is gone. Put back afterwards (compile_model raises the limit)
    import torch._dynamo

    with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True):
        yield


# ---------------------------------------------------------------------------- the authors' model

AUTHORS_TINY = Path(REPO) / "data" / "fixtures" / "authors_hf_tiny"  # its README: what it is

EVAL_ON_SAMPLE = [
    "--eval_only=true",
    "--val_files=data/sample/sample_val_*.bin",
    "--val_tokens=2048",
    "--seq_len=64",
    "--device_batch_size=8",
]

TRAIN_ON_SAMPLE = [  # a new run of the source's settings, on the sample
    "--train_files=data/sample/sample_train_*.bin",
    *EVAL_ON_SAMPLE[1:],
    "--batch_size=8",
    "--train_tokens=5120",
]


def authors_copy(tmp_path, name, config=None, weights=None, raw=None) -> str:
    """A copy of the authors' tiny folder with its config or weights changed."""
    from safetensors.torch import load_file, save_file

    folder = tmp_path / name
    folder.mkdir()
    cfg = json.loads((AUTHORS_TINY / "config.json").read_text())
    text = raw if raw is not None else json.dumps(config(cfg) if config else cfg)
    (folder / "config.json").write_text(text)
    tensors = load_file(AUTHORS_TINY / "model.safetensors")
    if weights is None:
        shutil.copy(AUTHORS_TINY / "model.safetensors", folder)
    elif isinstance(weights, bytes):
        (folder / "model.safetensors").write_bytes(weights)
    else:
        save_file(weights(tensors), folder / "model.safetensors")
    return str(folder)
