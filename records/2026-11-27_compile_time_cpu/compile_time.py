"""Cold and warm compile time of the smoke-size gated model under CPU Inductor, masked or
compacted, forward and backward, as a checkout's compile_model compiles it (the whole model
before issue 54, its blocks after). One process, one JSON line: per training step its wall time
and the part spent compiling (torch.compile's own timers), and the graphs compiled.

    python compile_time.py CHECKOUT --compact=0|1 [--steps=6]

Run it with TORCHINDUCTOR_CACHE_DIR set: a new folder gives a cold compile, the same folder a
second time a warm one (Inductor's on-disk caches). run.sh runs the record's grid.
"""

import argparse
import json
import sys
import time
from dataclasses import replace


def main(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("checkout", help="a checkout of the repository (its train_gpt.py is timed)")
    p.add_argument("--compact", type=int, choices=(0, 1), required=True)
    p.add_argument("--steps", type=int, default=6, help="training steps (default: %(default)s)")
    args = p.parse_args(argv)
    sys.path.insert(0, args.checkout)
    import torch
    import torch._dynamo.utils as du

    import routers
    import train_gpt as tg

    hp = replace(
        tg.Hyperparameters(),
        **{k: v for k, v in tg.PRESETS["smoke"].items() if k not in tg.JOB},
        router="skip_middle",
        compact=bool(args.compact),
    )
    torch.manual_seed(0)
    raw = tg.GPT(hp)
    for gate in raw.router.gates:  # some tokens skip some blocks, more or fewer each batch
        torch.nn.init.normal_(gate.weight, std=0.15)
        torch.nn.init.constant_(gate.bias, 0.1)
    if hp.compact:  # as train() and train_step set them: all, then each step's counts
        raw.router.lengths = [hp.seq_len] * hp.n_layers
    model = tg.compile_model(raw)

    def compile_s():
        times = du.compilation_time_metrics
        return sum(
            sum(times.get(k, ())) for k in ("_compile.compile_inner", "backward._backward_impl")
        )

    steps, lengths = [], []
    for _ in range(args.steps):
        idx = torch.randint(0, hp.vocab_size, (hp.device_batch_size, hp.seq_len))
        t0, c0 = time.perf_counter(), compile_s()
        out = model(idx, targets=torch.roll(idx, -1, 1))
        out.loss.backward()
        steps.append(dict(wall_s=time.perf_counter() - t0, compile_s=compile_s() - c0))
        if hp.compact:
            lengths.append(raw.router.lengths)
            raw.router.lengths = routers.packed_lengths(
                [routers.packed_counts(out.route).tolist()], hp.seq_len
            )
    print(
        json.dumps(
            dict(
                compact=hp.compact,
                torch=torch.__version__,
                steps=steps,
                lengths=lengths,
                graphs=du.counters["stats"]["unique_graphs"],
            )
        )
    )


if __name__ == "__main__":
    main(sys.argv[1:])
