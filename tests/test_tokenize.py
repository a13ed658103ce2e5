"""data/tokenize_corpus.py: a corpus as shards of GPT-2 tokens or of bytes, its manifest and
its check, and the loader reading them back (the other data scripts: tests/test_data.py)."""

import contextlib
import errno
import glob
import json
import math
import os
import re
import shutil
import signal
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

import support
import train_gpt as tg
from conftest import (
    REPO,
    TINY_RUN,
    gpt2,
    load_command,
    note_syncs,
    read_metrics,
    run_command,
    run_main,
    sha256,
    signal_self,
    start_command,
    write_shard,
)
from data import shards

# --------------------------------------------------------------- tokenize_corpus.py


def test_tokenize_matches_tiktoken_and_the_loader_reads_it_back(tmp_path):
    docs = [
        "The quick\r\nbrown\rfox.",  # (a .txt file's line ends as they are: not made "\n")
        "Ünïcödé and emoji 🙂 too",
        "",
        "line one\nline two\n",
        "<|endoftext|> is plain text here",
    ]
    (tmp_path / "a.txt").write_text(docs[0], encoding="utf-8", newline="")
    with open(tmp_path / "b.JSONL", "w", encoding="utf-8") as f:  # (.JSONL: JSON lines too)
        for d in docs[1:-1]:  # (blank lines between them, passed over)
            f.write(json.dumps({"text": d, "id": 1}) + "\n\n  \n")
    (tmp_path / "c.txt").write_text(docs[-1], encoding="utf-8")  # a .txt after a .jsonl
    out = tmp_path / "shards"
    r = run_command(
        "data/tokenize_corpus.py",
        str(tmp_path / "a.txt"),
        str(tmp_path / "b.JSONL"),
        str(tmp_path / "c.txt"),
        f"--out={out}",
        "--name=t",
        "--shard_tokens=7",
        "--workers=2",
    )
    assert r.returncode == 0, r.stderr
    enc = gpt2()
    expected = [t for d in docs if d for t in [50256] + enc.encode_ordinary(d)]  # "" skipped
    files = sorted(out.glob("*.bin"))
    assert json.loads((out / "t.manifest.json").read_text())["shards"] == {
        f.name: sha256(f.read_bytes()) for f in files
    }
    assert files[-1].name == "t_val_000000.bin"  # sorted: train shards come first
    assert [f.name for f in files[:-1]] == [f"t_train_{i:06d}.bin" for i in range(1, len(files))]
    got = np.concatenate(
        [tg.read_shard(str(out / "t_val_000000.bin"))] + [tg.read_shard(str(f)) for f in files[:-1]]
    )
    assert got.tolist() == expected
    assert all(len(tg.read_shard(str(f))) == 7 for f in files[:-2])
    loader = tg.DistributedLoader(str(out / "t_train_*.bin"), 1, 3, 0, 1)
    x, y = loader.next_batch()
    assert x.flatten().tolist() == expected[7:10] and y.flatten().tolist() == expected[8:11]


def test_check_command_counts_and_rejects(tmp_path):
    r = run_command("data/tokenize_corpus.py", "--check=data/sample")
    total = sum((os.path.getsize(p) - 1024) // 2 for p in glob.glob(f"{REPO}/data/sample/*.bin"))
    assert r.returncode == 0 and f"2 shards, {total:,} tokens, all valid" in r.stdout
    assert "note" not in r.stdout
    # two encodings in one folder: each shard valid, and a note that a run reads one of them
    (tmp_path / "mixed").mkdir()
    write_shard(tmp_path / "mixed" / "a_000000.bin", range(10))
    write_shard(tmp_path / "mixed" / "b_000000.bin", range(3), encoding=1)
    r = run_command("data/tokenize_corpus.py", f"--check={tmp_path / 'mixed'}")
    assert r.returncode == 0 and "2 shards, 13 tokens, all valid\n" in r.stdout, r.stderr
    note = "note: shards of two encodings (bytes: 1, gpt2: 1): a run reads one; give it train_files"
    assert r.stdout.endswith(f"{note} and val_files that match only that one's shards\n"), r.stdout
    write_shard(tmp_path / "x_000000.bin", range(10))
    write_shard(tmp_path / "x_000001.bin", [5, 60000])
    r = run_command("data/tokenize_corpus.py", f"--check={tmp_path}")
    assert (
        r.returncode == 2 and "x_000001.bin: token id 60000 is outside the vocabulary" in r.stderr
    )
    # a named pipe, a folder: named by their kind in one line, never opened (a pipe would wait)
    for name, make, kind in (("p.bin", os.mkfifo, "a named pipe"), ("d.bin", os.mkdir, "a folder")):
        other = tmp_path / name.split(".")[0]
        other.mkdir()
        make(other / name)
        r = run_command("data/tokenize_corpus.py", f"--check={other}", timeout=60)
        line = f"error: {other / name}: not a regular file: {kind}\n"
        assert (r.returncode, r.stderr) == (2, line)


def test_sample_regenerates_byte_for_byte(tmp_path):
    made_with = "3.11.7"  # data/sample/README.md: pydoc_data.topics changes between versions
    if sys.version.split()[0] != made_with:
        pytest.skip(f"the sample was made with Python {made_with}")
    r = run_command("data/tokenize_corpus.py", f"--out={tmp_path}")
    assert r.returncode == 0, r.stderr
    for name in ("sample_train_000001.bin", "sample_val_000000.bin", "sample.manifest.json"):
        assert (tmp_path / name).read_bytes() == (
            Path(REPO) / "data" / "sample" / name
        ).read_bytes()


def test_tokenize_names_a_bad_document_and_writes_nothing(tmp_path):
    (tmp_path / "c.jsonl").write_text('{"text": "fine"}\n{"title": "no text"}\n')
    (tmp_path / "d.txt").write_bytes(b"caf\xe9 latin-1")
    (tmp_path / "e.jsonl").write_bytes(b'{"text": "fine"}\n{"text": "caf\xe9"}\n')
    (tmp_path / "f.jsonl").write_text('{"text": "fine"}\n' + "[" * 100000 + "\n")  # too deep
    (tmp_path / "g.jsonl").write_text('{"text": "a", "n": ' + "9" * 5000 + "}\n")  # 5,000 digits
    (tmp_path / "h.jsonl").write_text('\ufeff{"text": "a"}\n\ufeff{"text": "b"}\n')  # 2 BOMs
    (tmp_path / "s.jsonl").write_text('{"text": "fine"}\n{"text": "a\\ud800b"}\n')  # no Unicode
    out = tmp_path / "shards" / "b" / ".." / "deeper"  # makedirs makes shards/b too
    lone = "s.jsonl:2: a lone surrogate (character 1) is no Unicode text: remove it"
    for name, message, encoding in (
        ("c.jsonl", 'c.jsonl:2: not a JSON object with a "text" field', "gpt2"),
        ("d.txt", "d.txt: not valid UTF-8", "gpt2"),
        ("e.jsonl", "e.jsonl:2: not valid UTF-8", "gpt2"),
        ("f.jsonl", 'f.jsonl:2: not a JSON object with a "text" field (RecursionError)', "gpt2"),
        ("g.jsonl", 'g.jsonl:1: not a JSON object with a "text" field (ValueError)', "gpt2"),
        ("h.jsonl", "h.jsonl:2: starts with a byte-order mark (U+FEFF)", "gpt2"),  # (line 1 ok)
        ("s.jsonl", lone, "gpt2"),  # (tiktoken alone would make it U+FFFD)
        ("s.jsonl", lone, "bytes"),
    ):
        r = run_command(
            "data/tokenize_corpus.py",
            str(tmp_path / name),
            f"--out={out}",
            "--shard_tokens=1",
            f"--encoding={encoding}",
        )
        assert r.returncode == 2 and r.stderr.startswith("error: ") and message in r.stderr
        assert r.stderr.count("\n") == 1
        assert not (tmp_path / "shards").exists()  # not even the folders it made for --out


def test_documents_keep_their_order_whichever_worker_encodes_them(tmp_path):
    # the workers take 16 documents at a time: the first 16 hold a long one (about 0.2 s of
    # encoding here), the next 16 are short, so the other worker is likely done with them
    # first; the shards hold them in the inputs' order all the same, every 2nd one
    # (--val_every=2) in validation
    docs = [" ".join(f"w{i % 9973}" for i in range(400_000))] + [f"doc {i}" for i in range(1, 40)]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    out = tmp_path / "o"
    r = run_command(
        "data/tokenize_corpus.py",
        str(tmp_path / "d.jsonl"),
        f"--out={out}",
        "--name=o",
        "--val_every=2",
        "--shard_tokens=100000",
        "--workers=2",
    )
    assert r.returncode == 0, r.stderr
    enc = gpt2()
    for split, part in (("val", docs[::2]), ("train", docs[1::2])):
        got = [tg.read_shard(str(p)) for p in sorted(out.glob(f"o_{split}_*.bin"))]
        assert np.concatenate(got).tolist() == [
            t for d in part for t in [50256] + enc.encode_ordinary(d)
        ]


def test_retokenizing_replaces_only_its_own_corpus_and_only_when_complete(tmp_path):
    big = "many words make many tokens " * 40
    (tmp_path / "big.txt").write_text(big)
    small = "few words make a corpus " * 12  # 62 tokens: two shards (one would be refused)
    (tmp_path / "small.txt").write_text(small)
    (tmp_path / "blank.jsonl").write_text('\n{"text": ""}\n')
    out = tmp_path / "shards"
    out.mkdir()
    others = {
        "other_train_000001.bin": b"another corpus, kept",  # a name sharing the prefix:
        "corpus_big_train_000001.bin": b"corpus_big is not corpus",
    }
    for name, data in others.items():
        (out / name).write_bytes(data)

    def tokenize(src):
        return run_command(
            "data/tokenize_corpus.py",
            str(tmp_path / src),
            f"--out={out}",
            "--shard_tokens=50",
            "--workers=1",
        )

    n_big = -(-(1 + len(gpt2().encode_ordinary(big))) // 50)
    assert n_big > 2
    for src, n_shards in (("big.txt", n_big), ("small.txt", 2)):
        r = tokenize(src)
        assert r.returncode == 0, r.stderr
        assert (
            len([p for p in out.iterdir() if re.fullmatch(r"corpus_(val|train)_\d+\.bin", p.name)])
            == n_shards
        )
    assert f"removed {n_big - 2} shard(s) of the previous corpus 'corpus'" in r.stderr
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    r = tokenize("blank.jsonl")  # no documents: an error, and the corpus stays as it was
    assert r.returncode == 2 and r.stderr == (
        "error: the input holds no documents (no non-empty text); nothing was written\n"
    )
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert all((out / n).read_bytes() == data for n, data in others.items())
    assert (
        list(tg.read_shard(str(out / "corpus_val_000000.bin")))
        == ([50256] + gpt2().encode_ordinary(small))[:50]
    )


def test_a_corpus_named_like_shards_it_did_not_write_is_refused(tmp_path):
    # a downloaded FineWeb, or shards an older version wrote: never replaced or removed
    (tmp_path / "a.txt").write_text("some words " * 30)
    out = tmp_path / "fineweb10B"
    out.mkdir()
    download = {
        f"fineweb_{s}_{i:06d}.bin": f"download {i}".encode()
        for i, s in enumerate(["val", "train", "train"])
    }
    for name, data in download.items():
        (out / name).write_bytes(data)
    r = run_command(
        "data/tokenize_corpus.py",
        str(tmp_path / "a.txt"),
        f"--out={out}",
        "--name=fineweb",
        "--shard_tokens=20",
        "--workers=1",
    )
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert (
        "fineweb_train_000001.bin (and 2 more) is named like a shard of corpus 'fineweb' but "
        "was not written by data/tokenize_corpus.py" in r.stderr
    )
    assert {p.name: p.read_bytes() for p in out.iterdir()} == download
    # its own corpus, edited since it was written, is not its own any more
    r = run_command(
        "data/tokenize_corpus.py",
        str(tmp_path / "a.txt"),
        f"--out={out}",
        "--name=mine",
        "--shard_tokens=20",
        "--workers=1",
    )
    assert r.returncode == 0, r.stderr
    (out / "mine_train_000002.bin").write_bytes(b"edited")
    r = run_command(
        "data/tokenize_corpus.py",
        str(tmp_path / "a.txt"),
        f"--out={out}",
        "--name=mine",
        "--workers=1",
    )
    assert r.returncode == 2 and "mine_train_000002.bin is named like" in r.stderr
    assert (out / "mine_train_000002.bin").read_bytes() == b"edited"
    assert not list(out.glob(".mine.*"))  # no temporary folder left
    os.mkfifo(out / "fifo_val_000000.bin")  # never read (that would wait for a writer)
    (out / "link_val_000000.bin").symlink_to(out / "mine_val_000000.bin")
    for name in ("fifo", "link"):
        r = run_command(
            "data/tokenize_corpus.py",
            str(tmp_path / "a.txt"),
            f"--out={out}",
            f"--name={name}",
            "--workers=1",
            timeout=60,
        )
        assert r.returncode == 2 and f"{name}_val_000000.bin is named like" in r.stderr


def test_a_manifest_it_did_not_write_is_refused_like_a_shard(tmp_path):
    (tmp_path / "a.txt").write_text("some words " * 30)
    (tmp_path / "theirs.json").write_text('{"shards": {}}')
    out = tmp_path / "s"
    out.mkdir()
    for make in (
        lambda m: m.write_text('{"shards": {}}'),  # another tool's
        lambda m: m.write_text("not json"),
        lambda m: m.mkdir(),
        lambda m: m.symlink_to(tmp_path / "theirs.json"),
    ):
        manifest = out / "corpus.manifest.json"
        make(manifest)
        r = run_command(
            "data/tokenize_corpus.py", str(tmp_path / "a.txt"), f"--out={out}", "--workers=1"
        )
        assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
        assert f"{manifest} is the manifest of corpus 'corpus' but was not written" in r.stderr
        assert [p.name for p in out.iterdir()] == ["corpus.manifest.json"]
        manifest.rmdir() if manifest.is_dir() and not manifest.is_symlink() else manifest.unlink()
    assert (tmp_path / "theirs.json").read_text() == '{"shards": {}}'


def test_a_corpus_being_replaced_is_read_once(tmp_path, monkeypatch):
    # its shards are hashed as the command starts (whose they are), not again at the commit
    # (their stats say whether they changed since): a FineWeb-size corpus is read once, not twice
    tokenize, out = load_command("data/tokenize_corpus.py"), tmp_path / "s"
    (tmp_path / "a.txt").write_text("many words make many tokens " * 20)
    tokenize.tokenize([str(tmp_path / "a.txt")], str(out), "c", 20, 1)
    old, hashed, sha256_of = sorted(str(p) for p in out.glob("*.bin")), [], tokenize.sha256_of

    def noted(path):
        hashed.append(path)
        return sha256_of(path)

    monkeypatch.setattr(tokenize, "sha256_of", noted)
    tokenize.tokenize([str(tmp_path / "a.txt")], str(out), "c", 20, 1)
    assert len(old) > 1 and sorted(p for p in hashed if os.path.dirname(p) == str(out)) == old


def test_a_shard_that_appears_while_tokenizing_is_not_replaced(tmp_path, monkeypatch):
    tokenize = load_command("data/tokenize_corpus.py")
    out, real = tmp_path / "s", tokenize.documents

    def documents(paths, raw=False):  # another job writes a shard of the same name meanwhile
        for i, doc in enumerate(real(paths, raw)):
            if i == 1:
                (out / "c_train_000001.bin").write_bytes(b"theirs")
            yield doc

    (tmp_path / "a.jsonl").write_text(
        "".join(json.dumps({"text": f"doc {i} " * 20}) + "\n" for i in range(3))
    )
    monkeypatch.setattr(tokenize, "documents", documents)
    with pytest.raises(support.UserError, match="changed while this ran"):
        tokenize.tokenize([str(tmp_path / "a.jsonl")], str(out), "c", 20, 1)
    assert [p.name for p in out.iterdir()] == ["c_train_000001.bin"]
    assert (out / "c_train_000001.bin").read_bytes() == b"theirs"


def test_a_corpus_cut_short_at_either_manifest_write_stays_its_own(tmp_path, monkeypatch):
    tokenize = load_command("data/tokenize_corpus.py")
    (tmp_path / "long.txt").write_text("many words make many tokens " * 20)
    (tmp_path / "short.txt").write_text("few words " * 12)  # 26 tokens: two shards of 20
    out, real = tmp_path / "s", tokenize.write_atomically

    def corpus():
        return {p.name: p.read_bytes() for p in out.iterdir()}

    for fail_at in (1, 2):  # the manifest written before the shards move, the one after
        tokenize.tokenize([str(tmp_path / "long.txt")], str(out), "c", 20, 1)
        before, calls = corpus(), []

        def disk_full(path, data, calls=calls, fail_at=fail_at):
            calls.append(path)
            if len(calls) == fail_at:
                raise OSError(errno.ENOSPC, "No space left on device", path)
            real(path, data)

        monkeypatch.setattr(tokenize, "write_atomically", disk_full)
        with pytest.raises(OSError):
            tokenize.tokenize([str(tmp_path / "short.txt")], str(out), "c", 20, 1)
        monkeypatch.undo()
        if fail_at == 1:
            assert corpus() == before  # nothing moved yet
        else:  # the new corpus is in place, the previous one's extra shards are gone
            shards = sorted(n for n in corpus() if n.endswith(".bin"))
            assert shards == ["c_train_000001.bin", "c_val_000000.bin"]
        # either way every file is still known as this corpus's: the next run goes on
        assert len(tokenize.tokenize([str(tmp_path / "short.txt")], str(out), "c", 20, 1)) == 2
        assert not list(out.glob(".c.*"))
        shutil.rmtree(out)


def test_each_shard_is_on_disk_before_the_manifest_that_lists_it(tmp_path, monkeypatch):
    # after a power cut the manifest names no shard whose bytes never reached the disk: each
    # shard, all of it, synced before the manifest's first write; each known by its inode and
    # size, as the OS gives them
    tokenize, synced = load_command("data/tokenize_corpus.py"), []
    real = tokenize.write_atomically

    def manifest(*args):  # (the manifest's writes)
        synced.append("manifest")
        real(*args)

    (tmp_path / "a.txt").write_text("many words make many tokens " * 20)
    note_syncs(monkeypatch, synced)
    monkeypatch.setattr(tokenize, "write_atomically", manifest)
    tokenize.tokenize([str(tmp_path / "a.txt")], str(tmp_path / "s"), "c", 40, 1)
    monkeypatch.undo()
    made = [(p.stat().st_ino, p.stat().st_size) for p in (tmp_path / "s").glob("c_*.bin")]
    assert len(made) == 3 and set(made) <= set(synced[: synced.index("manifest")])


@pytest.mark.parametrize(
    "signum, workers, group",
    [(signal.SIGTERM, 1, False), (signal.SIGUSR1, 1, False), (signal.SIGTERM, 2, True)],
    ids=["sigterm", "sigusr1", "sigterm_to_the_group_of_two_workers"],
)
def test_a_signal_to_the_tokenizer_takes_back_what_it_wrote(tmp_path, signum, workers, group):
    # what a scheduler sends (scancel: SIGTERM; Slurm's --signal: SIGUSR1) mid-way through; to
    # the process group (timeout, systemd, Slurm), the workers too: one killed while it held
    # multiprocessing.Pool's task queue lock made the pool's terminate() wait for ever
    # (two workers: many short documents, so that one mostly waits for its next, holding that
    # lock, while this process writes the shards)
    doc, docs = (" word" * 20_000, 300) if workers == 1 else (" word" * 4, 300_000)
    (tmp_path / "big.jsonl").write_text((json.dumps({"text": doc}) + "\n") * docs)
    out = tmp_path / "out" / "deeper"
    for _ in range(2 if group else 1):  # (two rounds: the Pool's hang, in 8 runs of 11)
        proc = start_command(
            "data/tokenize_corpus.py",
            str(tmp_path / "big.jsonl"),
            f"--out={out}",
            f"--workers={workers}",
            "--shard_tokens=10000",
            stdout=None,
            env={"PYTHONUNBUFFERED": "1"},
            start_new_session=True,  # (its own process group)
        )
        try:
            deadline = time.time() + 120
            while not list(out.glob(".corpus.*/*.bin")) and time.time() < deadline:
                time.sleep(0.02)
            if group:
                os.killpg(proc.pid, signum)
            else:
                proc.send_signal(signum)
            _, err = proc.communicate(timeout=60)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)  # (a hung one)
        assert proc.returncode == 128 + signum and "Traceback" not in err, err
        assert not (tmp_path / "out").exists()  # no shard, no temporary folder, no folder it made


def test_a_second_signal_while_the_tokenizer_cleans_up_leaves_nothing(tmp_path, monkeypatch):
    # Ctrl-C twice: the second comes while the first's cleanup removes the shards written so
    # far; the cleanup goes on to the end (no temporary folder left, nor the folders made for
    # --out), then the command stops
    tokenize = load_command("data/tokenize_corpus.py")
    signal.signal(signal.SIGINT, support.interrupted)  # (as support.cli sets it)
    out, remove, removed = tmp_path / "out" / "deeper", os.remove, []

    def remove_and_signal(path):
        remove(path)
        removed.append(path)
        if len(removed) == 1:
            signal_self()

    with pytest.raises(support.Interrupted):
        with tokenize.Corpus(str(out), "c") as corpus:
            for _ in range(5):
                corpus.add([1, 2, 3])
            monkeypatch.setattr(os, "remove", remove_and_signal)
            raise support.Interrupted(signal.SIGINT)  # the first
    assert len(removed) == 5 and not (tmp_path / "out").exists()


def test_a_corpus_name_that_is_a_path_is_refused_before_anything_is_made(tmp_path):
    # --name is a file name's start: a/b or .. would put shards outside --out
    tokenize = load_command("data/tokenize_corpus.py")
    for name in ("a/b", "..", "."):
        with pytest.raises(support.UserError, match=re.escape(f"--name={name}: a name, not a")):
            tokenize.Corpus(str(tmp_path / "out"), name)
    assert not (tmp_path / "out").exists()


def test_a_check_only_corpus_writes_nothing_and_a_failed_start_leaves_no_folder(
    tmp_path, monkeypatch
):
    # check_only (debian_docs.py, before its downloads): no folder, no temporary folder; a
    # temporary folder that cannot be made: the folders made for --out are removed again
    tokenize = load_command("data/tokenize_corpus.py")
    out = tmp_path / "new" / "deeper"
    tokenize.Corpus(str(out), "c", check_only=True)
    (tmp_path / "here").mkdir()
    tokenize.Corpus(str(tmp_path / "here"), "c", check_only=True)
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["here"]

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(tokenize.tempfile, "mkdtemp", full)
    with pytest.raises(OSError, match="No space left"):
        tokenize.Corpus(str(out), "c")
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["here"]


def test_a_backup_beside_a_shard_is_kept_and_a_link_in_a_shards_place_is_refused(tmp_path):
    # c_train_000001.bin.bak (a user's copy of a shard) is not named like a shard: a new
    # version leaves it as it is. A shard replaced by a link to an identical copy is not the
    # file this script wrote (a link is never read): refused, link and copy kept
    tokenize = load_command("data/tokenize_corpus.py")
    (tmp_path / "long.txt").write_text("many words make many tokens " * 20)
    (tmp_path / "short.txt").write_text("few words " * 12)  # 26 tokens: two shards of 20
    out = tmp_path / "s"
    assert len(tokenize.tokenize([str(tmp_path / "long.txt")], str(out), "c", 20, 1)) > 2
    backup = (out / "c_train_000002.bin").read_bytes()
    (out / "c_train_000002.bin.bak").write_bytes(backup)
    assert len(tokenize.tokenize([str(tmp_path / "short.txt")], str(out), "c", 20, 1)) == 2
    assert (out / "c_train_000002.bin.bak").read_bytes() == backup
    assert not (out / "c_train_000002.bin").exists()  # the previous version's: removed
    copy = tmp_path / "copy.bin"
    copy.write_bytes((out / "c_train_000001.bin").read_bytes())
    (out / "c_train_000001.bin").unlink()
    (out / "c_train_000001.bin").symlink_to(copy)
    with pytest.raises(support.UserError, match="c_train_000001.bin is named like a shard"):
        tokenize.tokenize([str(tmp_path / "long.txt")], str(out), "c", 20, 1)
    assert os.readlink(out / "c_train_000001.bin") == str(copy) and copy.exists()


@pytest.mark.parametrize("how", ["in place", "renamed over"])
def test_a_shard_of_its_own_changed_while_tokenizing_stops_the_commit(tmp_path, monkeypatch, how):
    # another job rewrites one of the previous version's shards meanwhile, at the same size:
    # in place (a later time), or a new file renamed over it (the same time, another inode);
    # either is a change, and that job's file is neither replaced nor removed
    tokenize = load_command("data/tokenize_corpus.py")
    out, real = tmp_path / "s", tokenize.documents
    (tmp_path / "a.jsonl").write_text(
        "".join(json.dumps({"text": f"doc {i} " * 20}) + "\n" for i in range(3))
    )
    tokenize.tokenize([str(tmp_path / "a.jsonl")], str(out), "c", 20, 1)
    shard = out / "c_train_000002.bin"
    theirs = bytes(len(shard.read_bytes()))  # as many bytes, all zero

    def documents(paths, raw=False):
        for i, doc in enumerate(real(paths, raw)):
            if i == 1:
                before = shard.stat().st_mtime_ns
                if how == "in place":
                    with open(shard, "r+b") as f:
                        f.write(theirs)
                    os.utime(shard, ns=(before + 10**9, before + 10**9))
                else:
                    (out / "theirs.tmp").write_bytes(theirs)
                    os.utime(out / "theirs.tmp", ns=(before, before))
                    os.replace(out / "theirs.tmp", shard)
            yield doc

    monkeypatch.setattr(tokenize, "documents", documents)
    with pytest.raises(support.UserError, match="changed while this ran"):
        tokenize.tokenize([str(tmp_path / "a.jsonl")], str(out), "c", 20, 1)
    assert shard.read_bytes() == theirs and not list(out.glob(".c.*"))


def test_after_a_new_version_the_manifest_lists_its_shards_alone(tmp_path):
    # the previous version's shards are gone: the manifest names the new ones with their
    # sha256, and no previous version (whose content could otherwise pass as this corpus's)
    tokenize = load_command("data/tokenize_corpus.py")
    (tmp_path / "long.txt").write_text("many words make many tokens " * 20)
    (tmp_path / "short.txt").write_text("few words " * 12)
    out = tmp_path / "s"
    tokenize.tokenize([str(tmp_path / "long.txt")], str(out), "c", 20, 1)
    tokenize.tokenize([str(tmp_path / "short.txt")], str(out), "c", 20, 1)
    manifest = json.loads((out / "c.manifest.json").read_text())
    assert manifest == {
        "written_by": "data/tokenize_corpus.py",
        "shards": {p.name: sha256(p.read_bytes()) for p in out.glob("c_*.bin")},
    }
    assert sorted(manifest["shards"]) == ["c_train_000001.bin", "c_val_000000.bin"]


def test_check_and_the_loader_refuse_a_corpus_half_replaced(tmp_path, monkeypatch, capsys):
    # a failure (here a rename that fails) while the new version's shards are moved: the
    # manifest still lists the previous version, and --check and the loader say the corpus is
    # half replaced (another corpus beside it is read); a rerun finishes it. A JSON of
    # another's named like a manifest is no corpus's: not read so
    tokenize = load_command("data/tokenize_corpus.py")
    (tmp_path / "long.txt").write_text("many words make many tokens " * 20)
    (tmp_path / "short.txt").write_text("few words " * 12)
    out, replace, moved = tmp_path / "s", os.replace, []
    (tmp_path / "s").mkdir()
    (out / "notes.manifest.json").write_text('["not", "a", "corpus"]')
    tokenize.tokenize([str(tmp_path / "long.txt")], str(out), "c", 20, 1)
    tokenize.tokenize([str(tmp_path / "short.txt")], str(out), "other", 20, 1)
    assert tokenize.run([f"--check={out}"]) == 0

    def fails_at_the_second(src, dst):
        moved.append(dst)
        if len(moved) == 2 and dst.endswith(".bin"):
            raise OSError(errno.EIO, "Input/output error", dst)
        replace(src, dst)

    monkeypatch.setattr(os, "replace", fails_at_the_second)
    with pytest.raises(OSError):
        tokenize.tokenize([str(tmp_path / "short.txt")], str(out), "c", 20, 1)
    monkeypatch.undo()
    capsys.readouterr()
    assert tokenize.run([f"--check={out}"]) == 2
    assert capsys.readouterr().err == (
        f"error: {out / 'c.manifest.json'}: its corpus is half replaced (a run stopped while it "
        f"moved the shards): run the command that wrote it again to finish\n"
    )
    with pytest.raises(support.UserError, match="its corpus is half replaced") as refused:
        tg.DistributedLoader(str(out / "c_train_*.bin"), 1, 4, 0, 1)
    assert str(out / "c.manifest.json") in str(refused.value)
    assert len(tg.DistributedLoader(str(out / "other_*.bin"), 1, 4, 0, 1).files) == 2
    tokenize.tokenize([str(tmp_path / "short.txt")], str(out), "c", 20, 1)
    assert tokenize.run([f"--check={out}"]) == 0
    assert len(tg.DistributedLoader(str(out / "c_train_*.bin"), 1, 4, 0, 1).files) == 1


def test_a_signal_during_the_commit_waits_for_a_whole_corpus(tmp_path, monkeypatch):
    # Ctrl-C as the new version's shards are moved over the old ones: the commit ends (every
    # new shard in place, the old ones gone, the manifest the new version's alone), then the
    # command stops; never a mix of two versions
    tokenize = load_command("data/tokenize_corpus.py")
    signal.signal(signal.SIGINT, support.interrupted)  # (as support.cli sets it)
    (tmp_path / "long.txt").write_text("many words make many tokens " * 20)
    (tmp_path / "short.txt").write_text("few words " * 12)
    out, replace = tmp_path / "s", os.replace
    tokenize.tokenize([str(tmp_path / "long.txt")], str(out), "c", 20, 1)

    def replace_and_signal(src, dst):
        replace(src, dst)
        if dst.endswith(".bin"):
            signal_self()

    monkeypatch.setattr(os, "replace", replace_and_signal)
    with pytest.raises(support.Interrupted):
        tokenize.tokenize([str(tmp_path / "short.txt")], str(out), "c", 20, 1)
    monkeypatch.undo()
    manifest = json.loads((out / "c.manifest.json").read_text())
    assert sorted(manifest) == ["shards", "written_by"]  # (no previous version)
    assert {p.name: sha256(p.read_bytes()) for p in out.glob("c_*.bin")} == manifest["shards"]
    assert sorted(manifest["shards"]) == ["c_train_000001.bin", "c_val_000000.bin"]


@pytest.mark.parametrize(
    "make",
    ["broken link", "link to one of ours", "too deep", "shards a list", "a list"],
)
def test_a_manifest_that_is_a_link_or_not_of_its_shape_is_refused(tmp_path, make):
    # a manifest is read only as a regular file of this script's shape: a link (even to a
    # manifest this script wrote), JSON nested past Python's limit, or the wrong types are
    # refused in one line, and left as they are
    tokenize = load_command("data/tokenize_corpus.py")
    (tmp_path / "a.txt").write_text("some words " * 30)
    tokenize.tokenize([str(tmp_path / "a.txt")], str(tmp_path / "ours"), "c", 20, 1)
    out = tmp_path / "s"
    out.mkdir()
    manifest = out / "c.manifest.json"
    if make == "broken link":
        manifest.symlink_to(tmp_path / "gone.json")
    elif make == "link to one of ours":
        manifest.symlink_to(tmp_path / "ours" / "c.manifest.json")
    else:
        manifest.write_text(
            {
                "too deep": "[" * 100000,
                "shards a list": '{"written_by": "data/tokenize_corpus.py", "shards": []}',
                "a list": "[]",
            }[make]
        )

    def held():  # a link's target, a file's bytes
        return os.readlink(manifest) if manifest.is_symlink() else manifest.read_bytes()

    before = held()
    with pytest.raises(support.UserError, match="c.manifest.json is the manifest of corpus 'c'"):
        tokenize.tokenize([str(tmp_path / "a.txt")], str(out), "c", 20, 1)
    assert [p.name for p in out.iterdir()] == ["c.manifest.json"] and held() == before


def test_a_manifest_that_is_a_named_pipe_is_refused_unread(tmp_path):
    (tmp_path / "a.txt").write_text("some words " * 30)
    out = tmp_path / "s"
    out.mkdir()
    os.mkfifo(out / "corpus.manifest.json")  # opened, it would wait for a writer
    r = run_command(
        "data/tokenize_corpus.py",
        str(tmp_path / "a.txt"),
        f"--out={out}",
        "--workers=1",
        timeout=60,
    )
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert "corpus.manifest.json is the manifest of corpus 'corpus' but was not" in r.stderr
    assert [p.name for p in out.iterdir()] == ["corpus.manifest.json"]


def test_a_json_text_that_is_not_a_string_is_named(tmp_path):
    tokenize = load_command("data/tokenize_corpus.py")
    for i, text in enumerate((5, None, ["a"], {"a": "b"})):
        (tmp_path / f"{i}.jsonl").write_text('{"text": "fine"}\n' + json.dumps({"text": text}))
        with pytest.raises(support.UserError, match=f'{i}.jsonl:2: "text" is not a string$'):
            tokenize.tokenize([str(tmp_path / f"{i}.jsonl")], str(tmp_path / "s"), "c", 2, 1)
    assert not (tmp_path / "s").exists()


def test_the_encoding_workers_end_with_the_tokenizer_and_errors_keep_their_order(tmp_path):
    # the encoding threads: none left once tokenize returns (joined), nor soon after it fails
    # (left to end alone, not waited for); the first error in the documents' order is the one
    # said, whatever the workers (a line that cannot be read after one that cannot be encoded)
    tokenize = load_command("data/tokenize_corpus.py")
    (tmp_path / "a.jsonl").write_text(
        "".join(json.dumps({"text": f"doc {i} " * 5}) + "\n" for i in range(40))
    )
    lines = [json.dumps({"text": "fine"})] * 20 + [json.dumps({"text": "\ud800"})]
    (tmp_path / "bad.jsonl").write_text("\n".join(lines * 2 + ['{"no": "text"}']) + "\n")
    before = set(threading.enumerate())
    tokenize.tokenize([str(tmp_path / "a.jsonl")], str(tmp_path / "s"), "c", 50, 2)
    assert set(threading.enumerate()) == before
    for workers in (1, 2, 3):
        with pytest.raises(support.UserError, match="bad.jsonl:21: a lone surrogate"):
            tokenize.tokenize([str(tmp_path / "bad.jsonl")], str(tmp_path / "t"), "c", 50, workers)
    deadline = time.time() + 10
    while set(threading.enumerate()) != before and time.time() < deadline:
        time.sleep(0.01)
    assert set(threading.enumerate()) == before


def test_memory_exhausted_while_encoding_is_the_machines_limit_not_the_documents(
    tmp_path, monkeypatch, capsys
):
    # a MemoryError inside the encoder (a huge document): status 1, out of memory, at 1 or 2
    # workers; not status 2 blaming the document as one that "cannot be encoded"
    tokenize = load_command("data/tokenize_corpus.py")
    (tmp_path / "a.jsonl").write_text(json.dumps({"text": "fine"}) + "\n")

    class Exhausted:
        eot_token = 50256

        def encode_to_numpy(self, text, **_):
            raise MemoryError

    monkeypatch.setitem(tokenize._encodings, "gpt2", Exhausted())
    for workers in (1, 2):
        argv = [str(tmp_path / "a.jsonl"), f"--out={tmp_path / 's'}", f"--workers={workers}"]
        assert tokenize.run(argv) == 1
        err = capsys.readouterr().err
        assert err.endswith("error: out of memory: this machine cannot allocate what it needs\n")
    assert not (tmp_path / "s").exists()


def test_check_holds_byte_shards_to_256_ids_and_an_empty_folder_is_refused(tmp_path, capsys):
    tokenize = load_command("data/tokenize_corpus.py")
    (tmp_path / "b_val_000000.bin").write_bytes(tokenize.shard_bytes([0, 104, 255], "bytes"))
    assert tokenize.check(str(tmp_path)) == 3
    assert "b_val_000000.bin: 3 tokens (bytes)" in capsys.readouterr().out
    (tmp_path / "b_train_000001.bin").write_bytes(tokenize.shard_bytes([0, 256], "bytes"))
    with pytest.raises(support.UserError, match="token id 256 is outside the vocabulary"):
        tokenize.check(str(tmp_path))
    (tmp_path / "empty").mkdir()
    with pytest.raises(support.UserError, match="empty: no .bin shards"):
        tokenize.check(str(tmp_path / "empty"))


def test_an_error_after_a_progress_line_starts_a_line_of_its_own(monkeypatch, capsys):
    # the progress line is redrawn with \r and no newline: an error then starts a new line
    tokenize = load_command("data/tokenize_corpus.py")
    monkeypatch.setattr(tokenize.Progress, "open_line", False)
    progress = tokenize.Progress()
    progress.last = 0  # due for a redraw
    progress.update(3, 1234, 1)
    assert capsys.readouterr().err.startswith("\r3 docs  1,234 tokens  1 shards  ")
    assert tokenize.run(["--check=/nonexistent/x"]) == 2
    assert capsys.readouterr().err == "\nerror: /nonexistent/x: no such folder\n"
    progress.update(3, 1234, 2, final=True)  # ends its line: an error after it needs none
    assert capsys.readouterr().err.endswith("tok/s\n")
    assert tokenize.run(["--check=/nonexistent/x"]) == 2
    assert capsys.readouterr().err == "error: /nonexistent/x: no such folder\n"
    # nor does a Ctrl-C leave it open (the command says nothing more, but its line ends)

    def interrupted(argv):
        raise KeyboardInterrupt  # (as support.cli's handler raises on a signal)

    monkeypatch.setattr(tokenize, "main", interrupted)
    progress.last = 0
    progress.update(3, 1234, 3)
    assert capsys.readouterr().err.endswith("tok/s")
    assert tokenize.run([]) == 130 and capsys.readouterr().err == "\n"
    tokenize.Progress.end_line()  # (ended once: nothing more)
    assert capsys.readouterr().err == ""


# ------------------------------------------------------------------ bytes as tokens


def test_byte_shards_round_trip_the_bytes_of_every_document(tmp_path, capsys):
    # a .txt file's bytes exactly, invalid UTF-8 included; a JSON text's UTF-8; each document
    # after a NUL byte; every 2nd document to validation; a NUL inside a document is refused
    tokenize = load_command("data/tokenize_corpus.py")
    raw = [b"plain ascii\n", b"caf\xe9 latin-1 and a lone \xff byte", "Ünïcödé 🙂".encode()]
    for i, data in enumerate(raw[:2]):
        (tmp_path / f"{i}.txt").write_bytes(data)
    (tmp_path / "2.jsonl").write_text(json.dumps({"text": raw[2].decode()}) + "\n")
    out = tmp_path / "bytes"
    tokenize.tokenize(
        [str(tmp_path / n) for n in ("0.txt", "1.txt", "2.jsonl")],
        str(out),
        "b",
        1000,
        1,
        "bytes",
        is_val=lambda i: i % 2 == 0,
    )
    val, train = (
        tg.read_shard(str(out / n), 256).tolist()
        for n in ("b_val_000000.bin", "b_train_000001.bin")
    )
    assert bytes(val) == b"\0" + raw[0] + b"\0" + raw[2] and bytes(train) == b"\0" + raw[1]
    assert {shards.shard_encoding(str(p)) for p in out.glob("*.bin")} == {"bytes"}
    assert (
        shards.encoding("bytes").decode(train)
        == "<|endoftext|>caf\ufffd latin-1 and a lone \ufffd byte"
    )
    with pytest.raises(support.UserError, match="all 3 documents went to validation"):
        tokenize.tokenize(
            [str(tmp_path / n) for n in ("0.txt", "1.txt", "2.jsonl")],
            str(tmp_path / "v"),
            "b",
            1000,
            1,
            "bytes",
            is_val=lambda i: True,
        )
    # without is_val the first shard is validation: a corpus that fills one has no training
    # shard, and is refused as well, by the command, with nothing written
    # (a NAME holding "_train_" too: a shard's split is its name's end)
    files = [str(tmp_path / n) for n in ("0.txt", "1.txt", "2.jsonl")]
    for named in ([], ["--name=my_train_set"]):
        argv = [*files, f"--out={tmp_path / 'one'}", "--encoding=bytes", *named]
        code, _, err = run_main(argv, capsys, tokenize.main)
        last = err.split("\n")[-2]  # (after the progress line)
        assert code == 2 and err.count("error: ") == 1, err
        assert last.startswith("error: the 61 tokens fill")
        assert not (tmp_path / "one").exists()  # (made by it: removed)
    # a NAME the documented --train_files='OUT/NAME_train_*.bin' would read as a pattern
    argv = [*files, f"--out={tmp_path / 'one'}", "--name=c[1]"]
    code, _, err = run_main(argv, capsys, tokenize.main)
    assert code == 2 and err.endswith("a name, not a pattern (no *, ? or [)\n")
    # skipview: a character's bytes show it once, at its first byte; a stray byte as U+FFFD
    pieces = load_command("skipview.py").token_pieces(
        shards.encoding("bytes"), list("aé🙂".encode()) + [0xFF, 98]
    )
    assert pieces == ["a", "é", "", "🙂", "", "", "", "\ufffd", "b"]
    # what a command line that is not UTF-8 holds (surrogateescape) is its bytes; the separator
    # reads as GPT-2's <|endoftext|>
    enc = shards.encoding("bytes")
    assert enc.encode_ordinary("a\udcffb") == [97, 255, 98]
    assert enc.decode([0, 104, 105, 0, 0xC3, 0xA9]) == "<|endoftext|>hi<|endoftext|>\u00e9"
    (tmp_path / "nul.txt").write_bytes(b"a\0b")
    with pytest.raises(support.UserError, match="nul.txt: holds a NUL byte"):
        tokenize.tokenize([str(tmp_path / "nul.txt")], str(tmp_path / "x"), "b", 1000, 1, "bytes")
    assert not (tmp_path / "x").exists()


def test_gpt2_shards_convert_to_the_bytes_of_their_documents(tmp_path):
    # FineWeb-like GPT-2 shards, documents cut across shards: converted one for one, the bytes
    # of all shards together are every document's bytes after a NUL, as a byte corpus of them
    tokenize = load_command("data/tokenize_corpus.py")
    docs = ["First document, with ünïcödé.", "second\none " * 5, "third 🙂 " * 3]
    with open(tmp_path / "d.jsonl", "w") as f:
        f.writelines(json.dumps({"text": d}) + "\n" for d in docs)
    tokenize.tokenize([str(tmp_path / "d.jsonl")], str(tmp_path / "g"), "fw", 9, 1)
    converted = tokenize.convert(str(tmp_path / "g" / "fw_*.bin"), str(tmp_path / "y"), "fwb")
    names = sorted(os.path.basename(p) for p in converted)
    assert names == sorted(p.name.replace("fw_", "fwb_") for p in (tmp_path / "g").glob("fw_*.bin"))
    ordered = sorted(converted, key=lambda p: int(p[-10:-4]))  # val_000000, train_000001, ...
    got = b"".join(bytes(tg.read_shard(p, 256).tolist()) for p in ordered)
    assert got == b"".join(b"\0" + d.encode() for d in docs)
    with pytest.raises(support.UserError, match="a byte shard already"):
        tokenize.convert(str(tmp_path / "y" / "fwb_*.bin"), str(tmp_path / "z"), "again")
    before = {p.name: p.read_bytes() for p in (tmp_path / "g").iterdir()}
    with pytest.raises(
        support.UserError, match="is an input, and corpus 'fw' in .* would replace it"
    ):
        tokenize.convert(str(tmp_path / "g" / "fw_*.bin"), str(tmp_path / "g"), "fw")  # in place
    assert {p.name: p.read_bytes() for p in (tmp_path / "g").iterdir()} == before
    for args, message in (
        (["--encoding=bytes"], "--encoding does not apply to the embedded sample"),
        (
            [
                f"--from_shards={tmp_path}/g/fw_*.bin",
                "--encoding=bytes",
                "--val_every=2",
                f"--out={tmp_path}/w",
            ],
            "--val_every does not apply to --from_shards",
        ),
        ([f"--check={tmp_path}/g", "--encoding=bytes"], "--encoding does not apply to --check"),
    ):
        with pytest.raises(support.UserError, match=message):
            tokenize.main(args)
    assert not (tmp_path / "w").exists()


def test_a_model_refuses_shards_of_the_other_encoding_and_trains_and_samples_bytes(
    tmp_path, capsys
):
    tokenize = load_command("data/tokenize_corpus.py")
    (tmp_path / "a.txt").write_bytes((Path(REPO) / "README.md").read_bytes()[:60000])
    (tmp_path / "b.txt").write_bytes((Path(REPO) / "train_gpt.py").read_bytes()[:20000])
    tokenize.tokenize(
        [str(tmp_path / "b.txt"), str(tmp_path / "a.txt")],
        str(tmp_path / "s"),
        "t",
        1 << 20,
        1,
        "bytes",
        is_val=lambda i: i % 2 == 0,
    )
    capsys.readouterr()  # (the tokenizer's progress line)
    files = [f"--train_files={tmp_path}/s/t_train_*.bin", f"--val_files={tmp_path}/s/t_val_*.bin"]
    byte_model = TINY_RUN + [
        "--encoding=bytes",
        "--vocab_size=256",
        "--train_tokens=5120",
        "--val_every=0",
        "--val_tokens=512",
    ]
    for args, message in (
        (byte_model, "sample_train_000001.bin holds gpt2 tokens, but encoding=bytes"),
        (TINY_RUN + files, "t_train_000001.bin holds bytes tokens, but encoding=gpt2"),
        (TINY_RUN + ["--encoding=bytes"], "encoding=bytes has 256 token ids"),
    ):
        code, out, err = run_main(args + [f"--run_dir={tmp_path / 'refused'}"], capsys)
        assert code == 2 and err.count("\n") == 1 and message in err, err
        assert not (tmp_path / "refused").exists()
    code, _, err = run_main(byte_model + files + [f"--run_dir={tmp_path / 'run'}"], capsys)
    assert code == 0, err[-2000:]
    val = [m for m in read_metrics(tmp_path / "run") if m["kind"] == "val"]
    assert val[-1]["val_loss"] < math.log(256)  # better than uniform over the bytes
    argv = [str(tmp_path / "run"), "--prompt=The ", "--tokens=20", "--seed=1"]
    code, out, err = run_main(argv, capsys, load_command("sample.py").main)
    assert code == 0, err
    assert out.startswith("The ") and len(out.split("\n--- KV")[0].encode()) >= 20


def test_convert_never_replaces_its_inputs_even_through_a_link_and_refuses_a_nul(tmp_path):
    # --out a link to the inputs' folder is that folder: refused, the inputs as they were;
    # another --name there is fine. A GPT-2 document holding a NUL byte has no byte-shard form,
    # and a token past GPT-2's vocabulary (another's, or damage) none at all
    tokenize = load_command("data/tokenize_corpus.py")
    (tmp_path / "d.jsonl").write_text(json.dumps({"text": "a document of some words " * 3}))
    tokenize.tokenize([str(tmp_path / "d.jsonl")], str(tmp_path / "g"), "fw", 9, 1)
    (tmp_path / "link").symlink_to(tmp_path / "g")
    before = {p.name: p.read_bytes() for p in (tmp_path / "g").iterdir()}
    with pytest.raises(support.UserError, match="is an input, and corpus 'fw' in .* would repl"):
        tokenize.convert(str(tmp_path / "g" / "fw_*.bin"), str(tmp_path / "link"), "fw")
    assert {p.name: p.read_bytes() for p in (tmp_path / "g").iterdir()} == before
    converted = tokenize.convert(str(tmp_path / "g" / "fw_*.bin"), str(tmp_path / "g"), "fwb")
    assert len(converted) == len(list((tmp_path / "g").glob("fw_*.bin")))
    assert all((tmp_path / "g" / n).read_bytes() == data for n, data in before.items())
    write_shard(tmp_path / "nul_val_000000.bin", [50256, *gpt2().encode_ordinary("a\0b")])
    with pytest.raises(support.UserError, match="nul_val_000000.bin: a document holds a NUL"):
        tokenize.convert(str(tmp_path / "nul_val_000000.bin"), str(tmp_path / "y"), "nul")
    assert not (tmp_path / "y").exists()
    write_shard(tmp_path / "big_val_000000.bin", [50256, 97, 60000])
    with pytest.raises(support.UserError, match=r"token id 60000 .* \(vocab_size=50257\)"):
        tokenize.convert(str(tmp_path / "big_val_000000.bin"), str(tmp_path / "y"), "big")
    assert not (tmp_path / "y").exists()


def test_from_shards_takes_its_own_options_and_needs_an_out(tmp_path, capsys):
    # --name applies to --from_shards, --shard_tokens does not; no --out is an error line (not
    # a traceback); --check's own path is checked before any option
    tokenize = load_command("data/tokenize_corpus.py")
    (tmp_path / "d.jsonl").write_text(json.dumps({"text": "some words " * 5}))
    tokenize.tokenize([str(tmp_path / "d.jsonl")], str(tmp_path / "g"), "fw", 9, 1)
    shards_ = f"--from_shards={tmp_path}/g/fw_*.bin"
    capsys.readouterr()
    tokenize.main([shards_, "--encoding=bytes", f"--out={tmp_path}/b", "--name=x"])
    capsys.readouterr()  # (a line for each shard converted)
    assert sorted(p.name for p in (tmp_path / "b").glob("*.bin")) == [
        "x_train_000001.bin",
        "x_val_000000.bin",
    ]
    for argv, message in (
        (
            [shards_, "--encoding=bytes", f"--out={tmp_path}/c", "--shard_tokens=5"],
            "--shard_tokens does not apply to --from_shards",
        ),
        ([shards_, "--encoding=bytes"], "give --encoding=bytes and --out=DIR"),
        ([f"--check={tmp_path}/none", "--encoding=bytes"], "none: no such folder"),
    ):
        assert tokenize.run(argv) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and err.count("\n") == 1 and message in err, err
    assert not (tmp_path / "c").exists()
