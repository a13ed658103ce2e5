"""Sample text from a model, one token at a time with a KV cache.

    python sample.py RUN_DIR [--prompt=TEXT] [--tokens=100] [--temperature=0.8] [--top_k=200]
                             [--seed=0] [--device=cpu]
    python sample.py --init_from=SOURCE ...   # a folder in Hugging Face layout, hf:OWNER/NAME

Prints the text, then how many K/V entries the cache holds against a dense cache: a token
whose gate is 0 at a block skips it and stores nothing there. --temperature=0 is greedy;
--top_k=0 samples from the whole vocabulary; <|endoftext|> in the prompt, and an empty prompt,
is the document separator (a NUL byte for a byte-level run, whose text is decoded as UTF-8,
U+FFFD where it is not).
"""

import sys

import support

if __name__ == "__main__":
    support.exit_quietly_on_signals()

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import sources  # noqa: E402
import train_gpt as tg  # noqa: E402
from data.shards import encoding, text_ids  # noqa: E402


class KVCache:
    """Keys, values and ln g per block for one sequence being decoded. A token skipped at a
    block stores nothing there, so middle blocks hold fewer entries than outer ones."""

    def __init__(self, hp: tg.Hyperparameters, device, size: int):
        """size: the positions to hold (generate's prompt and tokens, not the whole context: a
        model whose max_seq_len is large would not leave room for the cache of all of it)."""
        hd = hp.dim // hp.n_heads
        self.k = torch.zeros(hp.n_layers, hp.n_kv_heads, size, hd, device=device)
        self.v = torch.zeros_like(self.k)
        self.log_g = torch.zeros(hp.n_layers, size, device=device)  # per cached key
        self.n = [0] * hp.n_layers  # entries per block

    def attend(self, layer, q, k, v, log_g):
        """Store this token's k, v (1, H_kv, 1, hd) and ln g as a key ((1, 1), or None: 0) at
        `layer`, then its attention output (1, H, 1, hd) over the block's cached keys, each
        logit plus the key's ln g (eq. 3). Every cached key is earlier: no causal mask."""
        n = self.n[layer]
        self.k[layer, :, n], self.v[layer, :, n] = k[0, :, 0], v[0, :, 0]
        self.log_g[layer, n] = 0.0 if log_g is None else log_g.reshape(())
        self.n[layer] = n + 1
        keys, values = self.k[layer, :, : n + 1][None], self.v[layer, :, : n + 1][None]
        return F.scaled_dot_product_attention(
            q.float(),
            keys,
            values,
            attn_mask=self.log_g[layer, None, None, None, : n + 1],
            enable_gqa=q.size(1) != keys.size(1),
        ).type_as(q)


@torch.no_grad()
def generate(
    model: tg.GPT,
    prompt: list,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int = 0,
    seed: int = 0,
    vocab: int = None,
):
    """Sample after `prompt` (token ids) one token at a time with a KVCache. The prompt goes
    through the same incremental path. vocab: the tokenizer's ids, the model's first (None: all
    of them); a vocabulary padded past them (nanoGPT's 50304) has ids no text decodes to, never
    drawn. -> (all tokens, the cache)."""
    hp, device = model.hp, next(model.parameters()).device
    if not prompt or len(prompt) + max_new_tokens > hp.max_seq_len:
        raise support.UserError(f"need 1 <= prompt + new tokens <= max_seq_len ({hp.max_seq_len})")
    model.eval()
    cache, tokens = KVCache(hp, device, len(prompt) + max_new_tokens), list(prompt)
    rng = torch.Generator(device=device).manual_seed(seed)
    for pos in range(len(prompt) + max_new_tokens - 1):
        logits = model(
            torch.tensor([[tokens[pos]]], device=device),
            pos=torch.tensor([[pos]], device=device),
            cache=cache,
        )[0][0, -1, :vocab]
        if pos < len(tokens) - 1:  # within the prompt: its next token is known
            continue
        if not bool(torch.isfinite(logits).all()):
            raise support.UserError(
                f"the model's logits after {pos + 1} tokens are not all finite (finite weights "
                f"too large, say): no distribution to draw the next token from"
            )
        if temperature == 0:  # greedy
            tokens.append(int(logits.argmax()))
        else:  # sample the next token
            # <= 0: no overflow, however small T; float64, where a T of 1e-50 is not 0
            logits = (logits.double() - logits.max()) / temperature
            if top_k:
                logits[logits < torch.topk(logits, min(top_k, logits.numel())).values[-1]] = -float(
                    "inf"
                )
            tokens.append(int(torch.multinomial(torch.softmax(logits, -1), 1, generator=rng)))
    return tokens, cache


def parser() -> support.ArgParser:
    p = support.ArgParser("python sample.py", __doc__)
    p.add_model_source()
    p.add_argument(
        "--prompt",
        default="\n",
        metavar="TEXT",
        help="text to continue; <|endoftext|> in it, or an empty one: the document separator "
        "(default: a newline)",
    )
    p.add_argument(
        "--tokens",
        type=support.in_range(int, 1),
        default=100,
        metavar="N",
        help="tokens to sample, at most what the context leaves (default: %(default)s)",
    )
    p.add_argument(
        "--temperature",
        type=support.in_range(float, 0),
        default=0.8,
        metavar="T",
        help="softmax temperature; 0 is greedy (default: %(default)s)",
    )
    p.add_argument(
        "--top_k",
        type=support.in_range(int, 0),
        default=200,
        metavar="K",
        help="sample among the K likeliest tokens; 0: all (default: %(default)s)",
    )
    p.add_argument(
        "--seed",
        type=support.in_range(int, 0, 2**63 - 1),
        default=0,
        help="random seed of the sampler (default: %(default)s)",
    )
    p.add_argument(
        "--device",
        type=support.check_device,
        default="cuda" if torch.cuda.is_available() else "cpu",
        help="cpu, cuda or cuda:K (default: %(default)s)",
    )
    return p


def main(argv):
    p = parser()
    args = p.parse_args(argv)
    source = p.model_source(args)
    n, temperature, top_k, seed = args.tokens, args.temperature, args.top_k, args.seed
    if temperature == 0:
        p.refuse(p.given(argv) & {"top_k", "seed"}, "with --temperature=0 (the likeliest token)")
    device = args.device
    model = sources.load_model(source, device)
    hp = model.hp
    enc = encoding(hp.encoding, hp.vocab_size)  # the run's: GPT-2 BPE, or UTF-8 bytes
    prompt = text_ids(enc, args.prompt, "--prompt") or [enc.eot_token]
    if len(prompt) >= hp.max_seq_len:
        raise support.UserError(
            f"the prompt is {len(prompt)} tokens; the model's context holds "
            f"{hp.max_seq_len}, so no token could follow it: shorten the prompt"
        )
    if len(prompt) + n > hp.max_seq_len:
        n = hp.max_seq_len - len(prompt)
        print(
            f"note: the context holds {hp.max_seq_len} tokens: sampling {n} after the "
            f"{len(prompt)}-token prompt",
            file=sys.stderr,
        )
    tokens, cache = generate(model, prompt, n, temperature, top_k, seed, enc.n_vocab)
    print(enc.decode(tokens))
    fed = len(tokens) - 1  # the last sampled token is never fed back
    dense = hp.n_layers * fed
    print(
        f"\n--- KV cache: {sum(cache.n)} of {dense} entries ({100 * sum(cache.n) / dense:.1f}% "
        f"of a dense cache); per block {cache.n}",
        file=sys.stderr,
    )


if __name__ == "__main__":
    sys.exit(support.cli(main, sys.argv[1:]))
