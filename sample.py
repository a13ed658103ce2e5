"""Sample text from a run's checkpoint with the KV-cached decoder of train_gpt.py.

    python sample.py RUN_DIR [--prompt=TEXT] [--tokens=100] [--temperature=0.8] [--top_k=200]
                             [--seed=0] [--device=cpu]

Prints the text, then how many K/V entries the cache holds against a dense cache: a token
whose gate is 0 at a block skips it and stores nothing there. --temperature=0 is greedy;
--top_k=0 samples from the whole vocabulary; an empty prompt starts from <|endoftext|>.
"""

import sys

import torch

import train_gpt as tg

EOT = 50256


def parser() -> tg.ArgParser:
    p = tg.ArgParser("python sample.py", __doc__)
    p.add_argument("run_dir", metavar="RUN_DIR", help="a run directory with a checkpoint")
    p.add_argument("--prompt", default="\n", metavar="TEXT",
                   help="text to continue; empty: start from <|endoftext|> (default: a newline)")
    p.add_argument("--tokens", type=tg.in_range(int, 1), default=100, metavar="N",
                   help="tokens to sample, at most what the context leaves (default: %(default)s)")
    p.add_argument("--temperature", type=tg.in_range(float, 0), default=0.8, metavar="T",
                   help="softmax temperature; 0 is greedy (default: %(default)s)")
    p.add_argument("--top_k", type=tg.in_range(int, 0), default=200, metavar="K",
                   help="sample among the K likeliest tokens; 0: all (default: %(default)s)")
    p.add_argument("--seed", type=tg.in_range(int, 0, 2**63 - 1), default=0,
                   help="random seed of the sampler (default: %(default)s)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   help="cpu, cuda or cuda:K (default: %(default)s)")
    return p


def main(argv):
    args = parser().parse_args(argv)
    n, temperature, top_k, seed = args.tokens, args.temperature, args.top_k, args.seed
    device = tg.check_device(args.device)
    enc = tg.gpt2_encoding()
    prompt = enc.encode_ordinary(args.prompt) or [EOT]
    ckpt = tg.load_checkpoint(args.run_dir)
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
