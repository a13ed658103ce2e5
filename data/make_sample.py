"""Regenerate the embedded sample under data/sample/ from CPython's own documentation.

    python data/make_sample.py

The text is `pydoc_data.topics` (the help() topics shipped with CPython, ~140k GPT-2 tokens),
split by document: every 10th topic, in sorted order, goes to validation. Each document is
preceded by <|endoftext|> (50256), as in the FineWeb shards. The shards use the modded-nanogpt
format that train_gpt.py reads: 256 int32 header (magic 20240520, version 1, token count),
then uint16 tokens. The topics text differs between Python versions; the committed sample
was made with Python 3.11.7 (see data/sample/README.md).
"""

import os
import sys

import numpy as np

EOT = 50256
HERE = os.path.dirname(os.path.abspath(__file__))


def gpt2_encoding():
    """GPT-2 BPE. "r50k_base" is the same vocabulary as "gpt2" and loads offline from
    TIKTOKEN_CACHE_DIR; online, tiktoken downloads it once."""
    import tiktoken
    errors = []
    for name in ("r50k_base", "gpt2"):
        try:
            return tiktoken.get_encoding(name)
        except Exception as e:  # network or cache failure: try the next name
            errors.append(f"{name}: {type(e).__name__}")
    sys.exit("error: cannot load the GPT-2 BPE from tiktoken (" + "; ".join(errors) + "). "
             "Connect to the internet once, or set TIKTOKEN_CACHE_DIR to a folder holding "
             "the cached r50k_base file.")


def write_shard(path: str, tokens) -> None:
    tokens = np.asarray(tokens)
    assert tokens.max() < 2**16, "token ids must fit uint16"
    header = np.zeros(256, dtype=np.int32)
    header[:3] = (20240520, 1, len(tokens))
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(header.tobytes())
        f.write(tokens.astype(np.uint16).tobytes())
    os.replace(tmp, path)  # never leave a half-written shard under the final name


def main():
    from pydoc_data.topics import topics
    enc = gpt2_encoding()
    train, val = [], []
    for i, key in enumerate(sorted(topics)):
        (val if i % 10 == 0 else train).extend([EOT] + enc.encode_ordinary(topics[key]))
    out = os.path.join(HERE, "sample")
    os.makedirs(out, exist_ok=True)
    write_shard(os.path.join(out, "sample_val_000000.bin"), val)
    write_shard(os.path.join(out, "sample_train_000001.bin"), train)
    print(f"python {sys.version.split()[0]}: {len(train)} train and {len(val)} val tokens "
          f"written to {out}")


if __name__ == "__main__":
    main()
