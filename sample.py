"""Sample text from a run's checkpoint with the KV-cached decoder of train_gpt.py.

    python sample.py RUN_DIR [--prompt=TEXT] [--tokens=100] [--temperature=0.8] [--top_k=200]
                             [--seed=0] [--device=cpu]

Prints the text, then how many K/V entries the cache holds against a dense cache: a token
whose gate is 0 at a block skips it and stores nothing there. --temperature=0 is greedy;
--top_k=0 samples from the whole vocabulary; an empty prompt starts from <|endoftext|>.
"""

import math
import sys

import torch

import train_gpt as tg

EOT = 50256


def number(opts, key, kind, low, high=math.inf):
    """opts[key] as kind, within [low, high], or a UserError naming the option."""
    try:
        value = kind(opts[key])
    except ValueError:
        value = None
    if value is None or not math.isfinite(value) or not low <= value <= high:
        raise tg.UserError(f"--{key}={opts[key]}: expected {kind.__name__} in [{low}, {high}]")
    return value


def main(argv):
    opts = {"prompt": "\n", "tokens": "100", "temperature": "0.8", "top_k": "200", "seed": "0",
            "device": "cuda" if torch.cuda.is_available() else "cpu"}
    runs = []
    for arg in argv:
        key, _, value = arg[2:].partition("=") if arg.startswith("--") else ("", "", "")
        if arg.startswith("--") and key in opts and "=" in arg:
            opts[key] = value
        elif not arg.startswith("--"):
            runs.append(arg)
        else:
            raise tg.UserError(f"bad option {arg!r}; options: " + ", ".join(f"--{k}=" for k in opts))
    if len(runs) != 1:
        raise tg.UserError("usage: python sample.py RUN_DIR [--prompt=TEXT] [--tokens=N] ...")
    n = number(opts, "tokens", int, 1)
    temperature = number(opts, "temperature", float, 0)
    top_k = number(opts, "top_k", int, 0)
    seed = number(opts, "seed", int, 0, 2**63 - 1)
    device = tg.check_device(opts["device"])
    enc = tg.gpt2_encoding()
    prompt = enc.encode_ordinary(opts["prompt"]) or [EOT]
    ckpt = tg.load_checkpoint(runs[0])
    hp = tg.Hyperparameters(**ckpt["hp"])
    if len(prompt) >= hp.max_seq_len:
        raise tg.UserError(f"the prompt is {len(prompt)} tokens; the model's context holds "
                           f"{hp.max_seq_len}, so no token could follow it: shorten the prompt")
    if len(prompt) + n > hp.max_seq_len:
        n = hp.max_seq_len - len(prompt)
        print(f"note: the context holds {hp.max_seq_len} tokens: sampling {n} after the "
              f"{len(prompt)}-token prompt", file=sys.stderr)
    model = tg.GPT(hp)
    model.load_state_dict(ckpt["model"])
    model.to(device)
    tokens, cache = tg.generate(model, prompt, n, temperature, top_k, seed)
    print(enc.decode(tokens))
    fed = len(tokens) - 1  # the last sampled token is never fed back
    dense = hp.n_layers * fed
    print(f"\n--- KV cache: {sum(cache.n)} of {dense} entries ({100 * sum(cache.n) / dense:.1f}% "
          f"of a dense cache); per block {cache.n}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(tg.cli(main, sys.argv[1:]))
