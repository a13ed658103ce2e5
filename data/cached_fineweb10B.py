"""Download pre-tokenized FineWeb shards (GPT-2 BPE, modded-nanogpt format) into data/fineweb10B/.

    python data/cached_fineweb10B.py        # validation shard + all 103 training shards (~20 GB)
    python data/cached_fineweb10B.py 8      # validation shard + the first 8 (~1.6 GB, 800M tokens)

Each shard holds 100M tokens. Shards already present are skipped.
"""

import os
import sys

REPO = "kjj0/fineweb10B-gpt2"
OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fineweb10B")


def fetch(name: str) -> None:
    from huggingface_hub import hf_hub_download
    if os.path.exists(os.path.join(OUT, name)):
        print(f"{name}: present, skipped")
        return
    hf_hub_download(repo_id=REPO, filename=name, repo_type="dataset", local_dir=OUT)
    print(f"{name}: downloaded")


def main(argv) -> None:
    n = int(argv[0]) if argv else 103
    fetch("fineweb_val_000000.bin")
    for i in range(1, n + 1):
        fetch(f"fineweb_train_{i:06d}.bin")


if __name__ == "__main__":
    main(sys.argv[1:])
