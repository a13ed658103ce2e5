"""Data: the shard format (shards.py), the fetch and tokenize scripts, the embedded sample."""
