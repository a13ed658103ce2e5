"""Sample text from a run's checkpoint with the KV-cached decoder of train_gpt.py.

    python sample.py RUN_DIR [--prompt=TEXT] [--tokens=100] [--temperature=0.8] [--top_k=200]
                             [--seed=0] [--device=cpu]

Prints the text, then how many K/V entries the cache holds against a dense cache: a token
whose gate is 0 at a block skips it and stores nothing there.
"""

import sys

import torch

import train_gpt as tg


def main(argv):
    opts = {"prompt": "\n", "tokens": "100", "temperature": "0.8", "top_k": "200", "seed": "0",
            "device": "cuda" if torch.cuda.is_available() else "cpu"}
    runs = []
    for arg in argv:
        key, _, value = arg[2:].partition("=") if arg.startswith("--") else ("", "", "")
        if arg.startswith("--") and key in opts:
            opts[key] = value
        elif not arg.startswith("--"):
            runs.append(arg)
        else:
            raise tg.UserError(f"bad option {arg!r}; options: " + ", ".join(f"--{k}=" for k in opts))
    if len(runs) != 1:
        raise tg.UserError("usage: python sample.py RUN_DIR [--prompt=TEXT] [--tokens=N] ...")
    try:
        n, temperature, top_k, seed = (int(opts["tokens"]), float(opts["temperature"]),
                                       int(opts["top_k"]), int(opts["seed"]))
    except ValueError:
        raise tg.UserError("--tokens, --top_k and --seed take integers, --temperature a number") from None
    ckpt = tg.load_checkpoint(runs[0])
    hp = tg.Hyperparameters(**ckpt["hp"])
    model = tg.GPT(hp)
    model.load_state_dict(ckpt["model"])
    model.to(opts["device"])
    enc = tg.gpt2_encoding()
    prompt = enc.encode_ordinary(opts["prompt"])
    n = min(n, hp.max_seq_len - len(prompt))
    tokens, cache = tg.generate(model, prompt, n, temperature, top_k, seed)
    print(enc.decode(tokens))
    fed = len(tokens) - 1  # the last sampled token is never fed back
    dense = hp.n_layers * fed
    print(f"\n--- KV cache: {sum(cache.n)} of {dense} entries ({100 * sum(cache.n) / dense:.1f}% "
          f"of a dense cache); per block {cache.n}", file=sys.stderr)


if __name__ == "__main__":
    try:
        main(sys.argv[1:])
    except tg.UserError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
