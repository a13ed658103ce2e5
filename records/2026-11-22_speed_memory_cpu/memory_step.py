"""Peak memory of one training micro-step (forward + backward) at the paper's width.

    python records/2026-11-22_speed_memory_cpu/memory_step.py REPO DEVICE_BATCH N_LAYERS

REPO is a checkout of this project (its train_gpt.py is imported). The model is the paper's
(dim 768, vocab 50257, seq 1024) with N_LAYERS blocks, router=none, on the CPU; the figure is
the process's peak resident set size, read from the operating system after the step.
"""

import argparse
import resource
import sys
import time
from dataclasses import replace

import torch
import torch.nn.functional as F

p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
p.add_argument("repo", metavar="REPO", help="a checkout of this project")
p.add_argument("B", metavar="DEVICE_BATCH", type=int, help="sequences of 1024 tokens")
p.add_argument("L", metavar="N_LAYERS", type=int, help="blocks")
args = p.parse_args()
sys.path.insert(0, args.repo)
import train_gpt as tg  # noqa: E402

B, L = args.B, args.L
hp = replace(tg.Hyperparameters(), n_layers=L, router="none", attn_impl="sdpa")  # never compiled
model = tg.GPT(hp)
x = torch.randint(0, hp.vocab_size, (B, hp.seq_len))
y = torch.roll(x, -1, dims=1)
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
t0 = time.time()
if "targets" in tg.GPT.forward.__code__.co_varnames:  # the chunked loss
    loss = model(x, targets=y).loss
else:  # full logits, then F.cross_entropy
    logits = model(x).logits
    loss = F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1))
loss.backward()
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
print(
    f"device_batch={B} x {hp.seq_len} n_layers={L}: peak RSS {peak / 2**20:.2f} GiB "
    f"(after building the model {before / 2**20:.2f} GiB), step {time.time() - t0:.1f} s"
)
