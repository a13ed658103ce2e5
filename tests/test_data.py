"""The data scripts under data/: fetching FineWeb, Debian's documentation as a corpus, the shard
format by hand; none of them imports torch (tokenizing a corpus: tests/test_tokenize.py)."""

import contextlib
import errno
import hashlib
import http.server
import json
import os
import re
import shutil
import signal
import threading
import time
import types
from pathlib import Path

import numpy as np
import pytest

import support
import train_gpt as tg
from conftest import (
    another_job_locks,
    gpt2,
    load_command,
    note_syncs,
    run_command,
    run_main,
    signal_self,
    write_shard,
)
from data import shards

# ------------------------------------------------------------- cached_fineweb10B.py


def fake_hub_cache(root, files):
    """A Hugging Face cache holding `files` (name -> tokens) for the FineWeb dataset repo, laid
    out as huggingface_hub lays it out: each file a blob, named by its hash, and a link to it
    under the commit's snapshot."""
    repo = root / "datasets--kjj0--fineweb10B-gpt2"
    commit = "0123456789abcdef0123456789abcdef01234567"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    snap, blobs = repo / "snapshots" / commit, repo / "blobs"
    snap.mkdir(parents=True)
    blobs.mkdir()
    for name, tokens in files.items():
        write_shard(blobs / name, tokens)
        blob = blobs / hashlib.sha256((blobs / name).read_bytes()).hexdigest()
        (blobs / name).rename(blob)
        (snap / name).symlink_to(os.path.relpath(blob, snap))
    return snap


def test_fetch_uses_the_hub_cache_offline_and_resumes(tmp_path):
    snap = fake_hub_cache(
        tmp_path / "hub",
        {"fineweb_val_000000.bin": range(100), "fineweb_train_000001.bin": range(50, 300)},
    )
    out = tmp_path / "data"
    env = dict(HF_HUB_CACHE=str(tmp_path / "hub"), HF_HUB_OFFLINE="1")
    r = run_command("data/cached_fineweb10B.py", "1", f"--out={out}", env=env)
    assert r.returncode == 0, r.stderr
    for name in ("fineweb_val_000000.bin", "fineweb_train_000001.bin"):
        assert (out / name).read_bytes() == (snap / name).read_bytes()
    assert "250 tokens" in r.stdout
    r = run_command("data/cached_fineweb10B.py", "1", f"--out={out}", env=env)
    assert r.returncode == 0 and r.stdout.count("present, skipped") == 2
    # a file of a shard's name that is not a whole one was not written here (this command
    # renames whole ones into place): refused before anything is fetched, left as it is; once
    # moved away, fetched (a new file: the good one may be a hard link to the cache, which
    # must stay intact)
    damaged = (out / "fineweb_train_000001.bin").read_bytes()[:1200]
    (out / "fineweb_train_000001.bin").unlink()
    (out / "fineweb_train_000001.bin").write_bytes(damaged)
    (out / "fineweb_val_000000.bin").unlink()
    r = run_command("data/cached_fineweb10B.py", "1", f"--out={out}", env=env)
    assert r.returncode == 2 and r.stdout == "" and r.stderr.count("\n") == 1, r.stderr
    assert r.stderr.startswith(
        f"error: {out / 'fineweb_train_000001.bin'}: "
    ) and r.stderr.endswith(
        ": it is there and is not a whole FineWeb shard, so this command did not write it: move "
        "it away and run this again; nothing was fetched\n"
    )
    assert (out / "fineweb_train_000001.bin").read_bytes() == damaged
    # a whole shard of bytes under that name is not FineWeb's either: refused the same way
    write_shard(out / "fineweb_train_000001.bin", range(0, 200, 7), encoding=1)
    r = run_command("data/cached_fineweb10B.py", "1", f"--out={out}", env=env)
    assert r.returncode == 2 and r.stderr == (
        f"error: {out / 'fineweb_train_000001.bin'} holds bytes tokens, not FineWeb's GPT-2: it "
        f"is there and is not a whole FineWeb shard, so this command did not write it: move it "
        f"away and run this again; nothing was fetched\n"
    ), r.stderr
    assert not (out / "fineweb_val_000000.bin").exists()
    (out / "fineweb_train_000001.bin").unlink()
    r = run_command("data/cached_fineweb10B.py", "1", f"--out={out}", env=env)
    assert r.returncode == 0, r.stderr
    for name in ("fineweb_val_000000.bin", "fineweb_train_000001.bin"):
        assert (out / name).read_bytes() == (snap / name).read_bytes()
    # a link to a whole shard (the user's own) is one: kept as it is
    (out / "fineweb_val_000000.bin").unlink()
    (out / "fineweb_val_000000.bin").symlink_to(snap / "fineweb_val_000000.bin")
    r = run_command("data/cached_fineweb10B.py", "1", f"--out={out}", env=env)
    assert r.returncode == 0 and r.stdout.count("present, skipped") == 2, r.stdout + r.stderr
    assert (out / "fineweb_val_000000.bin").is_symlink()
    # a file neither online nor cached: one clear line, exit 1 (the input was good), nothing
    # under its name
    r = run_command("data/cached_fineweb10B.py", "2", f"--out={out}", env=env)
    assert r.returncode == 1 and r.stderr.count("\n") == 1
    assert r.stderr.startswith("error: 1 of 3 files missing (fineweb_train_000002.bin")
    assert "; not in the Hugging Face cache, and the Hub cannot be reached)" in r.stderr
    assert f"Rerun `python data/cached_fineweb10B.py 2 --out={out}` once" in r.stderr  # (as given)
    assert sorted(p.name for p in out.iterdir()) == [
        "fineweb_train_000001.bin",
        "fineweb_val_000000.bin",
    ]
    # the first file alone is tried first: when it cannot be had, no other is tried (offline,
    # each would wait through the hub's retries), though the cache holds one of them
    fake_hub_cache(tmp_path / "hub2", {"fineweb_train_000001.bin": range(50, 300)})
    r = run_command(
        "data/cached_fineweb10B.py",
        "1",
        f"--out={tmp_path / 'data2'}",
        env={**env, "HF_HUB_CACHE": str(tmp_path / "hub2")},
    )
    assert r.returncode == 1 and r.stderr.count("\n") == 1, r.stderr
    assert "(fineweb_val_000000.bin; " in r.stderr and "; the others were not tried)" in r.stderr
    assert not (tmp_path / "data2").exists()


class TooManyRequests(http.server.BaseHTTPRequestHandler):
    def do_HEAD(self):  # (the Hub's answer to a client over its rate limit)
        self.send_response(429)
        self.send_header("Content-Length", "0")
        self.end_headers()

    do_GET = do_HEAD

    def log_message(self, *args):
        pass


@pytest.mark.slow
@pytest.mark.parametrize("hub", ["closed port", "answers 429"])
def test_a_hub_that_cannot_be_reached_or_refuses_is_one_error_line(tmp_path, hub):
    # not offline, but nothing answers (a closed port), or the Hub refuses (429): its retries
    # (~23 s) said no warning of their own, only the command's line, which says which
    endpoint, said = "http://127.0.0.1:9", "the Hub cannot be reached"
    with contextlib.ExitStack() as stack:
        if hub == "answers 429":
            server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), TooManyRequests)
            threading.Thread(target=server.serve_forever, daemon=True).start()
            stack.callback(server.server_close)
            stack.callback(server.shutdown)
            endpoint, said = f"http://127.0.0.1:{server.server_port}", "the Hub answered HTTP 429"
        env = dict(HF_HUB_CACHE=str(tmp_path / "hub"), HF_ENDPOINT=endpoint)
        r = run_command("data/cached_fineweb10B.py", "0", f"--out={tmp_path / 'out'}", env=env)
    assert r.returncode == 1 and r.stderr.count("\n") == 1, r.stderr
    assert r.stderr.startswith(
        f"error: 1 of 1 files missing (fineweb_val_000000.bin; not in the Hugging Face cache, "
        f"and {said}). Rerun "
    )
    assert not (tmp_path / "out").exists()


def test_a_bad_download_is_fetched_once_more_then_reported(tmp_path, monkeypatch, capsys):
    import huggingface_hub

    from data import cached_fineweb10B

    bad, calls = tmp_path / "bad.bin", []
    bad.write_bytes(b"not a shard")

    def download(repo, name, repo_type, force_download):
        calls.append(force_download)
        return str(bad)

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", download)
    why = cached_fineweb10B.fetch("fineweb_val_000000.bin", str(tmp_path / "out"), "[1/1]")
    assert calls == [False, True], calls
    truncated = "truncated shard (11 bytes, shorter than the 1024-byte header)"
    assert why == f"{bad}: {truncated}, after a fresh download too", why
    assert capsys.readouterr().out.count("; fetching it again\n") == 1  # (not after the last)
    assert not (tmp_path / "out").exists()

    class Refused(Exception):  # the Hub's answer to the forced download (huggingface_hub's
        response = types.SimpleNamespace(status_code=429)  # ValueError is from it)

    for cause, said in ((Refused, "answered HTTP 429"), (OSError, "cannot be reached")):

        def forced_fails(repo, name, repo_type, force_download, cause=cause):  # (offline alike)
            if force_download:
                raise ValueError("Force download failed due to the above error.") from cause()
            return str(bad)

        monkeypatch.setattr(huggingface_hub, "hf_hub_download", forced_fails)
        why = cached_fineweb10B.fetch("fineweb_val_000000.bin", str(tmp_path / "out"), "[1/1]")
        assert why == f"damaged in the Hugging Face cache, and the Hub {said}", why


# ------------------------------------------------------------------- debian_docs.py


def test_debian_docs_keeps_a_pages_text_and_drops_its_markup(tmp_path):
    docs = load_command("data/debian_docs.py")
    page = (
        "<html><head><title>T</title><style>p {}</style></head><body><h1>Title</h1>"
        "<p>One  &amp; <b>two</b>\tthree</p><script>var x = 1;</script><ul><li>a</li>"
        "<li>b &lt;c&gt;</li></ul><pre>  kept\n</pre>caf\u00e9</body></html>"
    ).encode()
    assert docs.page_text(page) == "Title\nOne & two three\na\nb <c>\nkept\ncaf\u00e9"


def test_debian_docs_reads_a_package_whose_stream_goes_on_past_its_archive(tmp_path):
    # a damaged .deb: dpkg-deb streams a tar archive, then far more than a pipe holds (64 KiB)
    # after its end, and a reason on stderr; the pages are read, the rest drained (before:
    # stderr read while dpkg-deb waited on a full stdout, for ever), in the order of their
    # paths, not the archive's (the pinned corpus's order)
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    (bin_ / "dpkg-deb").write_text(
        "#!/usr/bin/env python3\nimport io, sys, tarfile\nbuf = io.BytesIO()\n"
        "with tarfile.open(fileobj=buf, mode='w') as tar:\n"
        "    for name in 'b', 'a':\n"
        "        info = tarfile.TarInfo(f'./usr/share/doc/x/{name}.html'); info.size = 8\n"
        "        tar.addfile(info, io.BytesIO(f'<p>{name}</p>'.encode()))\n"
        "sys.stderr.write('warning: trailing data\\n' * 5000)\n"
        "sys.stdout.buffer.write(buf.getvalue() + b'junk' * 100000)\n"
    )
    (bin_ / "dpkg-deb").chmod(0o755)
    code = "from data import debian_docs; print(debian_docs.package_pages('x.deb', 'x.deb'))"
    r = run_command("-c", code, env={"PATH": f"{bin_}{os.pathsep}{os.environ['PATH']}"}, timeout=60)
    assert r.returncode == 0 and r.stdout == "[b'<p>a</p>', b'<p>b</p>']\n", r.stderr[-2000:]


def test_debian_docs_takes_from_debs_the_file_of_the_pinned_sha256_whatever_its_name(
    tmp_path, monkeypatch
):
    # --debs=DIR: a .deb named as the package's other version is not the pinned file; one of
    # the pinned sha256 is, whatever it is called
    docs = load_command("data/debian_docs.py")
    spec = next(iter(docs.PACKAGES))
    (tmp_path / f"{spec.split('=')[0]}_0.1_all.deb").write_bytes(b"another version")
    pinned = re.escape(f"no .deb there has {spec}'s pinned sha256 {'0' * 64}")
    with pytest.raises(support.UserError, match=pinned):
        docs.download(spec, "0" * 64, str(tmp_path / "work"), str(tmp_path))
    (tmp_path / "z.deb").write_bytes(b"the pinned one")
    sha = hashlib.sha256(b"the pinned one").hexdigest()
    assert docs.download(spec, sha, str(tmp_path / "work"), str(tmp_path)) == (
        str(tmp_path / "z.deb"),
        sha,
    )
    # a folder of many (apt's cache, say): the file named as the package's is hashed first
    (tmp_path / f"{spec.split('=')[0]}_0.1_all.deb").write_bytes(b"the pinned one")
    (tmp_path / "0.deb").write_bytes(b"another package")  # (first by name)
    hashed, sha256_of = [], docs.tokenize_corpus.sha256_of

    def noted(path):
        hashed.append(path)
        return sha256_of(path)

    monkeypatch.setattr(docs.tokenize_corpus, "sha256_of", noted)
    assert docs.download(spec, sha, str(tmp_path / "work"), str(tmp_path))[1] == sha
    assert hashed == [str(tmp_path / f"{spec.split('=')[0]}_0.1_all.deb")]


def fake_debian(tmp_path, apt_get: str) -> dict:
    """PATH with an apt-get running apt_get (bash) and a dpkg-deb whose --fsys-tarfile streams
    12 pages of 2,000 characters, each naming its package and number, from any .deb, and pages
    NOT_PAGES drops (translations, Sphinx's source listings and indexes, maxima's single page)
    and a redirect shorter than MIN_TEXT."""
    bin_ = tmp_path / "bin"
    bin_.mkdir(parents=True)
    (bin_ / "apt-get").write_text("#!/bin/bash\n" + apt_get)
    (bin_ / "dpkg-deb").write_text(
        '#!/bin/bash\nname=$(basename "$2"); name=${name%%_*}; t=$(mktemp -d); mkdir "$t/html"\n'
        'for i in $(seq 0 11); do printf "<p>%.0s$name page $i </p>" $(seq 100) '
        '> "$t/html/$i.html"; done\n'
        'mkdir -p "$t/html/translations/it" "$t/html/_modules" "$t/apache2-doc/manual/it"\n'
        "for p in translations/it/a _modules/m genindex-A search maxima_singlepage \\\n"
        "  ../apache2-doc/manual/it/a; do\n"
        '  printf "<p>%.0snot a page </p>" $(seq 100) > "$t/html/$p.html"; done\n'
        'echo "<p>The node you are looking for is at XREFfft.</p>" > "$t/html/XREFfft.html"\n'
        'tar -cf - -C "$t" .; rm -r "$t"\n'
    )
    for tool in bin_.iterdir():
        tool.chmod(0o755)
    return {"PATH": f"{bin_}:{os.environ['PATH']}"}


def test_debian_docs_takes_back_all_it_wrote_through_a_second_signal(tmp_path, monkeypatch):
    # Ctrl-C during the downloads, and again while their folder is removed: it is removed all
    # the same, and so is the folder made for --out; a signal while a whole build removes it
    docs = load_command("data/debian_docs.py")
    monkeypatch.setenv("PATH", fake_debian(tmp_path / "a", "exit 1\n")["PATH"])
    signal.signal(signal.SIGINT, support.interrupted)  # (as support.cli sets it)

    def first_signal(spec, sha, folder, *args):
        (Path(folder) / "part.deb").write_bytes(b"half a download")
        raise support.Interrupted(signal.SIGINT)

    rmtree = shutil.rmtree

    def second_signal(path, **kwargs):
        signal_self()
        rmtree(path, **kwargs)

    monkeypatch.setattr(docs, "download", first_signal)
    monkeypatch.setattr(shutil, "rmtree", second_signal)
    with pytest.raises(support.Interrupted):
        docs.build(str(tmp_path / "out" / "docs"), 1)
    assert not (tmp_path / "out").exists()
    # a signal as a whole build removes its work folder: removed all the same, the corpus kept

    def fake_deb(spec, sha, folder, *args):
        (Path(folder) / "p.deb").write_bytes(spec.encode())
        return str(Path(folder) / "p.deb"), sha

    monkeypatch.setattr(docs, "download", fake_deb)
    with pytest.raises(support.Interrupted):
        docs.build(str(tmp_path / "out" / "docs"), 1)
    monkeypatch.undo()
    left = sorted(p.name for p in (tmp_path / "out" / "docs").iterdir())
    assert left == ["docs.manifest.json", "docs_train_000001.bin", "docs_val_000000.bin"], left


def test_debian_docs_says_when_a_pin_is_gone_and_records_unpinned_inputs(tmp_path):
    docs = load_command("data/debian_docs.py")
    gone = fake_debian(
        tmp_path / "a", "echo \"E: Version '${2#*=}' for '${2%%=*}' was not found\" >&2; exit 100\n"
    )
    r = run_command("data/debian_docs.py", f"--out={tmp_path / 'out'}", env=gone)
    assert (
        r.returncode == 2
        and r.stderr.count("\n") == 1
        and r.stderr.startswith(
            "error: apt-get "
            "download python3.11-doc=3.11.2-6+deb12u8 failed (E: Version '3.11.2-6+deb12u8' for "
            "'python3.11-doc' was not found): the pinned version is not offered here"
        )
    ), r.stderr
    assert "--debs=DIR" in r.stderr and "--unpinned" in r.stderr and not (tmp_path / "out").exists()
    # the pinned version offered, but not the pinned file (rebuilt, or tampered with): refused
    other = fake_debian(tmp_path / "m", 'n=${2%%=*}; printf "%s" "$n" > "${n}_9.9_all.deb"\n')
    r = run_command("data/debian_docs.py", f"--out={tmp_path / 'out'}", env=other)
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert "differs from the pinned" in r.stderr and not (tmp_path / "out").exists()
    # today's versions instead: each .deb holds its name; the build says it is not the pinned one
    today = fake_debian(tmp_path / "b", 'printf "%s" "$2" > "$2_9.9_all.deb"\n')
    r = run_command("data/debian_docs.py", f"--out={tmp_path / 'out'}", "--unpinned", env=today)
    assert r.returncode == 0 and r.stdout.count("NOT the pinned corpus") == 2, r.stderr
    manifest = json.loads((tmp_path / "out" / "docs.manifest.json").read_text())
    names = [spec.split("=")[0] for spec in docs.PACKAGES]
    assert manifest["inputs"] == {n: hashlib.sha256(n.encode()).hexdigest() for n in names}
    # 12 pages a package, shuffled: all but every TRAIN_EVERY-th held out as an excerpt of its page;
    # neither split in package order, and the first half of the validation split samples every one
    split = {}
    for kind in ("val", "train"):
        tokens = shards.read_shard(str(next((tmp_path / "out").glob(f"docs_{kind}_*.bin"))), 256)
        split[kind] = bytes(tokens.astype(np.uint8)).decode().split("\0")[1:]
    pages = {"\n".join([f"{n} page {i}"] * 100) for n in names for i in range(12)}
    train = -(-len(pages) // docs.TRAIN_EVERY)  # pages 0, TRAIN_EVERY, ...
    assert (len(split["val"]), len(split["train"])) == (len(pages) - train, train)
    assert set(split["train"]) < pages
    assert all(len(t) == docs.EXCERPT and any(t in p for p in pages) for t in split["val"])
    for kind, texts in split.items():  # (the shuffle is seeded: this holds or fails every time)
        order = [next(i for i, n in enumerate(names) if n in t) for t in texts]
        assert order != sorted(order), kind  # not package by package
    assert all(any(n in t for t in split["val"][: len(split["val"]) // 2]) for n in names)
    # the same inputs give the same corpus (a seeded shuffle), into a folder of its own
    shas = dict(manifest["shards"])
    r = run_command("data/debian_docs.py", f"--out={tmp_path / 'again'}", "--unpinned", env=today)
    assert (
        r.returncode == 0
        and json.loads((tmp_path / "again" / "docs.manifest.json").read_text())["shards"] == shas
    )
    # neither this corpus nor one of tokenize_corpus.py's replaces the other (a user's corpus
    # named docs was deleted; the pinned corpus replaced)
    again = {p.name: p.read_bytes() for p in (tmp_path / "again").iterdir()}
    (tmp_path / "a.jsonl").write_text("".join(f'{{"text": "my text {i}"}}\n' for i in range(3)))
    user = ["--name=docs", "--encoding=bytes", "--val_every=2"]
    r = run_command(
        "data/tokenize_corpus.py", tmp_path / "a.jsonl", f"--out={tmp_path}/again", *user
    )
    assert r.returncode == 2 and "not written by data/tokenize_corpus.py" in r.stderr, r.stderr
    assert {p.name: p.read_bytes() for p in (tmp_path / "again").iterdir()} == again
    r = run_command(
        "data/tokenize_corpus.py", tmp_path / "a.jsonl", f"--out={tmp_path}/user", *user
    )
    assert r.returncode == 0, r.stderr
    mine = {p.name: p.read_bytes() for p in (tmp_path / "user").iterdir()}
    r = run_command("data/debian_docs.py", f"--out={tmp_path / 'user'}", "--unpinned", env=today)
    assert r.returncode == 2 and "not written by data/debian_docs.py" in r.stderr, r.stderr
    assert {p.name: p.read_bytes() for p in (tmp_path / "user").iterdir()} == mine
    # one it wrote before manifests named their command (its inputs, the packages, tell) is its
    # own still, and not tokenize_corpus.py's
    legacy = json.loads((tmp_path / "again" / "docs.manifest.json").read_text())
    assert legacy.pop("written_by") == "data/debian_docs.py" and legacy["inputs"]
    (tmp_path / "again" / "docs.manifest.json").write_text(
        json.dumps({**legacy, "written_by": "data/tokenize_corpus.py"})
    )
    r = run_command(
        "data/tokenize_corpus.py", tmp_path / "a.jsonl", f"--out={tmp_path}/again", *user
    )
    assert r.returncode == 2 and "not written by data/tokenize_corpus.py" in r.stderr, r.stderr
    r = run_command("data/debian_docs.py", f"--out={tmp_path / 'again'}", "--unpinned", env=today)
    assert r.returncode == 0, r.stderr
    # a folder holding the pinned corpus is not replaced by an unpinned one
    (tmp_path / "again" / "docs.manifest.json").write_text(
        json.dumps({"written_by": "data/debian_docs.py", "shards": docs.SHA256})
    )
    r = run_command("data/debian_docs.py", f"--out={tmp_path / 'again'}", "--unpinned", env=today)
    assert r.returncode == 2 and r.stderr.startswith(
        f"error: {tmp_path / 'again'} holds the pinned corpus, which --unpinned would replace"
    )
    # a shard that is not ours in --out: refused before any download (apt-get would leave a mark)
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "docs_train_000001.bin").write_bytes(b"my own")
    marks = fake_debian(tmp_path / "c", f"touch {tmp_path}/downloaded; exit 100\n")
    r = run_command("data/debian_docs.py", f"--out={tmp_path / 'mine'}", env=marks)
    assert r.returncode == 2 and "named like a shard of corpus 'docs'" in r.stderr, r.stderr
    assert not (tmp_path / "downloaded").exists() and os.listdir(tmp_path / "mine") == [
        "docs_train_000001.bin"
    ]
    # SIGTERM while a package streams its pages: status 143, and the folder it made is gone
    (tmp_path / "b" / "bin" / "dpkg-deb").write_text("#!/bin/bash\nkill -TERM $PPID; sleep 1\n")
    r = run_command(
        "data/debian_docs.py", f"--out={tmp_path / 'sig' / 'out'}", "--unpinned", env=today
    )
    assert r.returncode == 143 and r.stderr == "" and not (tmp_path / "sig").exists(), r.stderr
    # a damaged .deb, as dpkg-deb streams it or refuses it: one line naming the package (not a
    # temporary path, deleted by then), dpkg-deb's own reason first, nothing left
    for script, reason in (
        ('printf ""', "empty file"),
        ('printf "cut"', "truncated"),
        (
            "echo \"dpkg-deb: error: '$2' is not a Debian archive\" >&2; echo more >&2; exit 2",
            "not a D",
        ),
    ):
        (tmp_path / "b" / "bin" / "dpkg-deb").write_text(f"#!/bin/bash\n{script}\n")
        r = run_command(
            "data/debian_docs.py", f"--out={tmp_path / 'bad' / 'out'}", "--unpinned", env=today
        )
        assert (
            r.returncode == 2
            and r.stderr.startswith("error: the .deb apt-get downloaded for ")
            and ": not a readable .deb (" in r.stderr
            and reason in r.stderr
            and ".debian_docs." not in r.stderr  # (the temporary folder, deleted by then)
            and r.stderr.count("\n") == 1
            and not (tmp_path / "bad").exists()
        ), r.stderr


# -------------------------------------------------------------------- without torch


# runs a script as `python SCRIPT ARGS...` would, then fails if torch was imported on the way
NO_TORCH = """import runpy, sys
sys.argv = sys.argv[1:]
try:
    runpy.run_path(sys.argv[0], run_name="__main__")
except SystemExit as e:
    status = e.code
assert "torch" not in sys.modules, "torch was imported"
sys.exit(status)
"""


def test_the_shard_library_run_as_a_script_says_so_in_one_line():
    # data/shards.py is the format's library (the loader and tokenize_corpus.py import it): run
    # as a command, one error line that names the command to use, status 2, no traceback
    r = run_command("data/shards.py", "--help")
    said = r.stderr.splitlines()
    assert r.returncode == 2 and len(said) == 1 and said[0].startswith("error: "), r.stderr
    assert "data/tokenize_corpus.py" in said[0]


def test_data_scripts_run_without_importing_torch(tmp_path):
    fake_hub_cache(tmp_path / "hub", {"fineweb_val_000000.bin": range(100)})
    (tmp_path / "a.txt").write_text("a few words")
    env = dict(HF_HUB_CACHE=str(tmp_path / "hub"), HF_HUB_OFFLINE="1")
    for args, status in (
        (["data/tokenize_corpus.py", "--check=data/sample"], 0),
        (
            [
                "data/tokenize_corpus.py",
                str(tmp_path / "a.txt"),
                f"--out={tmp_path / 's'}",
                "--workers=1",
                "--shard_tokens=2",  # (4 tokens: a validation and a training shard)
            ],
            0,
        ),
        (["data/tokenize_corpus.py", "--workers=0"], 2),
        (["data/tokenize_corpus.py", "--help"], 0),
        (["data/cached_fineweb10B.py", "0", f"--out={tmp_path / 'f'}"], 0),
        (["data/cached_fineweb10B.py", "--bogus"], 2),
    ):
        r = run_command("-c", NO_TORCH, *args, env=env, timeout=300)
        assert r.returncode == status and "torch was imported" not in r.stderr, (args, r.stderr)
    assert list(tg.read_shard(str(tmp_path / "f" / "fineweb_val_000000.bin"))) == list(range(100))
    written = [
        tg.read_shard(str(tmp_path / "s" / f"corpus_{n}.bin"))
        for n in ("val_000000", "train_000001")
    ]
    assert [t for shard in written for t in shard] == [50256] + gpt2().encode_ordinary(
        "a few words"
    )


# ------------------------------------------------------------- the shard format, by hand


def test_a_shard_header_is_refused_for_each_field_it_gets_wrong(tmp_path):
    # headers written by hand: magic, version, count, encoding; a version or an encoding this
    # reader does not know is a UserError naming it (not an IndexError, not read as version 1);
    # a count the file's size does not match either way (a shard cut short, or two joined by
    # `cat`: the second would never be read); every token id is below vocab_size
    def shard(name, head, tokens=(1, 2, 3)):
        h = np.zeros(256, dtype=np.int32)
        h[:4] = head
        (tmp_path / name).write_bytes(h.tobytes() + np.asarray(tokens, np.uint16).tobytes())
        return str(tmp_path / name)

    assert shards.shard_header(shard("ok.bin", (20240520, 1, 3, 1))) == (3, "bytes")
    for name, head, message in (
        ("magic.bin", (20240521, 1, 3, 0), r"bad magic number 20240521 \(expected 20240520\)"),
        ("version.bin", (20240520, 2, 3, 0), "unsupported shard version 2 "),
        ("enc.bin", (20240520, 1, 3, 2), "unknown encoding 2 "),
        ("neg.bin", (20240520, 1, 3, -1), "unknown encoding -1 "),
        ("count.bin", (20240520, 1, 4, 0), r"header says 4 tokens \(1032 bytes\)"),
        ("joined.bin", (20240520, 1, 2, 0), r"says 2 tokens \(1028 bytes\) but the file has 1030"),
    ):
        with pytest.raises(support.UserError, match=message):
            shards.shard_header(shard(name, head))
    ids = shard("ids.bin", (20240520, 1, 3, 0), (0, 96, 5))
    assert shards.read_shard(ids, 97).tolist() == [0, 96, 5]
    with pytest.raises(support.UserError, match="token id 96 is outside the vocabulary"):
        shards.read_shard(ids, 96)


def test_a_fingerprint_hashes_the_first_and_last_fingerprint_tokens_read_or_given(tmp_path):
    # sha256 of the first FINGERPRINT_TOKENS tokens then the last as many, by hand; the same
    # from the file as from the tokens the loader holds; a change in the last token alone is
    # seen. A shard shorter than that: its tokens twice
    n = shards.FINGERPRINT_TOKENS
    tokens = (np.arange(n + 5) % 50000).astype(np.uint16)
    path = tmp_path / "big.bin"
    write_shard(path, tokens)
    ends = hashlib.sha256(tokens[:n].tobytes() + tokens[5:].tobytes()).hexdigest()
    assert shards.shard_fingerprint(str(path)) == ["big.bin", n + 5, ends]
    assert shards.shard_fingerprint(str(path), tokens) == ["big.bin", n + 5, ends]
    tokens[-1] += 1
    write_shard(path, tokens)
    assert shards.shard_fingerprint(str(path))[2] != ends
    small = np.array([7, 8, 9], dtype=np.uint16)
    write_shard(tmp_path / "small.bin", small)
    twice = hashlib.sha256(small.tobytes() * 2).hexdigest()
    assert shards.shard_fingerprint(str(tmp_path / "small.bin")) == ["small.bin", 3, twice]


def test_check_fingerprints_refuses_a_record_it_cannot_hold_to(tmp_path):
    # a record (state()'s form) of 2 shards: the same passes, an older checkpoint's ({}) is not
    # checked; an index past the shards now matched, a non-int count, a record that is not a
    # dict, and more shards once round them all, are each a UserError
    for i in range(2):
        write_shard(tmp_path / f"t_{i}.bin", range(10 * i, 10 * i + 9))
    files = shards.find_shards(str(tmp_path / "t_*.bin"))
    read = [[i, *shards.shard_fingerprint(f)] for i, f in enumerate(files)]
    shards.check_fingerprints(files, {"read": read, "laps": 1, "files": 2})
    shards.check_fingerprints(files, {})
    gone = [[2, "t_2.bin", 9, "0" * 64]]
    for state, message in (
        ({"read": gone, "laps": 0, "files": 3}, "had read t_2.bin as training shard 2, and 2 m"),
        ({"read": read, "laps": 1.0, "files": 2}, "is not one this trainer writes"),
        ({"read": read, "laps": 0, "files": "2"}, "is not one this trainer writes"),
        ([read], "is not one this trainer writes"),
        ({"read": read, "laps": 1, "files": 3}, "been round its 3 training shards"),
    ):
        with pytest.raises(support.UserError, match=message):
            shards.check_fingerprints(files, state)


def test_find_shards_names_what_a_path_is_and_advises_by_the_folder(tmp_path):
    # a name with [ ] in it that is a broken link: said so (not "no shards match"); the advice
    # for a folder with no shards follows its name
    (tmp_path / "d[1].bin").symlink_to(tmp_path / "gone.bin")
    with pytest.raises(support.UserError, match=r"d\[1\]\.bin, which is a broken symbolic link"):
        shards.find_shards(str(tmp_path / "d[1].bin"))
    for folder, hint in (
        ("fineweb10B_bytes", "--encoding=bytes"),
        ("fineweb10B", "fetch FineWeb"),
        ("debian_docs", "python data/debian_docs.py"),
        ("my_bytes", "check the path"),
    ):
        with pytest.raises(support.UserError, match=f"no shards match .*: .*{hint}"):
            shards.find_shards(str(tmp_path / folder / "*.bin"))


def test_first_tokens_are_read_on_past_an_empty_or_short_shard(tmp_path):
    # skipview's text and sweep's timed batch: the validation shards' first tokens, across
    # shards in order (an empty first one, which --check passes, gave skipview a traceback);
    # fewer where all of them hold fewer; none, one line
    for name, tokens in (("v_0.bin", []), ("v_1.bin", [5, 6]), ("v_2.bin", [7, 8, 9])):
        write_shard(tmp_path / name, tokens)
    pattern = str(tmp_path / "v_*.bin")
    assert shards.first_tokens(pattern, 97, 4).tolist() == [5, 6, 7, 8]
    assert shards.first_tokens(pattern, 97, 9).tolist() == [5, 6, 7, 8, 9]
    with pytest.raises(support.UserError, match=r"v_0\.bin matches hold no tokens$"):
        shards.first_tokens(str(tmp_path / "v_0.bin"), 97, 4)


def test_a_byte_encoding_refuses_a_model_vocabulary_other_than_256():
    assert shards.encoding("bytes", 256).n_vocab == 256
    for vocab in (255, 512):
        with pytest.raises(support.UserError, match=f"vocab_size={vocab} cannot use encoding=b"):
            shards.encoding("bytes", vocab)


def test_shard_bytes_and_corpus_sha256_by_hand():
    # a header of 256 int32 (magic, version, count, encoding) then uint16 tokens; an id past
    # uint16 is refused, not wrapped; corpus_sha256 hashes "name sha\n" lines in name order
    tokenize = load_command("data/tokenize_corpus.py")
    head = np.zeros(256, dtype=np.int32)
    head[:4] = 20240520, 1, 2, 1
    assert tokenize.shard_bytes([65535, 3], "bytes") == head.tobytes() + b"\xff\xff\x03\x00"
    for bad in ([65536], [-1]):
        with pytest.raises(support.UserError, match="token ids must fit uint16"):
            tokenize.shard_bytes(bad)
    lines = b"a_val_000000.bin 11\nb_train_000001.bin 22\n"
    assert (
        tokenize.corpus_sha256({"b_train_000001.bin": "22", "a_val_000000.bin": "11"})
        == hashlib.sha256(lines).hexdigest()
    )


def test_each_shard_is_named_by_its_own_split_in_the_order_written(tmp_path):
    # bytes, shards of 4 tokens, document 1 to validation: document 0 (NUL + 3 bytes) fills the
    # first shard, a training one; then the partial validation shard, then the training one
    tokenize = load_command("data/tokenize_corpus.py")
    (tmp_path / "d.jsonl").write_text(
        "".join(json.dumps({"text": t}) + "\n" for t in "abc xy p".split())
    )
    written = tokenize.tokenize(
        [str(tmp_path / "d.jsonl")],
        str(tmp_path / "s"),
        "b",
        4,
        1,
        "bytes",
        is_val=lambda i: i == 1,
    )
    got = {os.path.basename(p): bytes(tg.read_shard(p, 256).tolist()) for p in written}
    assert got == {
        "b_train_000000.bin": b"\0abc",
        "b_val_000001.bin": b"\0xy",
        "b_train_000002.bin": b"\0p",
    }


def test_a_commit_cut_short_before_the_old_shards_go_leaves_them_known_as_its_own(
    tmp_path, monkeypatch
):
    # the manifest written before the shards move lists the previous version's ("previous"):
    # when removing the stale ones fails, the next run still knows them as this corpus's
    tokenize = load_command("data/tokenize_corpus.py")
    (tmp_path / "long.txt").write_text("many words make many tokens " * 20)
    (tmp_path / "short.txt").write_text("few words " * 12)  # 26 tokens: two shards of 20
    out, real = tmp_path / "s", os.remove
    assert len(tokenize.tokenize([str(tmp_path / "long.txt")], str(out), "c", 20, 1)) > 2

    def remove(path, *a, **kw):
        if str(path).endswith(".bin"):
            raise OSError(errno.EACCES, "Permission denied", path)
        real(path, *a, **kw)

    monkeypatch.setattr(os, "remove", remove)
    with pytest.raises(OSError):
        tokenize.tokenize([str(tmp_path / "short.txt")], str(out), "c", 20, 1)
    monkeypatch.undo()
    assert len(list(out.glob("c_*.bin"))) > 2  # the stale ones are still there
    assert len(tokenize.tokenize([str(tmp_path / "short.txt")], str(out), "c", 20, 1)) == 2
    assert sorted(p.name for p in out.glob("c_*.bin")) == ["c_train_000001.bin", "c_val_000000.bin"]


def test_val_every_sends_documents_0_k_2k_to_validation_and_convert_keeps_each_split(
    tmp_path, capsys
):
    # the command's --val_every=2 over 3 documents: 0 and 2 validate, 1 trains (bytes by hand);
    # converting training shards alone gives training shards alone (none named validation),
    # whatever their corpus's name holds (a shard's split is its name's end)
    tokenize = load_command("data/tokenize_corpus.py")
    (tmp_path / "d.jsonl").write_text(
        "".join(json.dumps({"text": t}) + "\n" for t in "ab cd ef".split())
    )
    argv = [str(tmp_path / "d.jsonl"), f"--out={tmp_path / 'b'}", "--encoding=bytes", "--workers=1"]
    code, _, err = run_main([*argv, "--val_every=2"], capsys, tokenize.main)
    assert code == 0, err
    got = {
        p.name: bytes(tg.read_shard(str(p), 256).tolist()) for p in (tmp_path / "b").glob("*.bin")
    }
    assert got == {"corpus_val_000000.bin": b"\0ab\0ef", "corpus_train_000001.bin": b"\0cd"}
    tokenize.tokenize([str(tmp_path / "d.jsonl")], str(tmp_path / "g"), "fw_val_set", 3, 1)
    pattern = str(tmp_path / "g" / "fw_val_set_train_*.bin")
    converted = tokenize.convert(pattern, str(tmp_path / "y"), "x")
    assert converted and all(
        re.fullmatch(r"x_train_\d{6}\.bin", os.path.basename(p)) for p in converted
    )


def test_fineweb_damage_and_place_by_hand(tmp_path):
    # damage: a folder or a named pipe is named by its kind, never opened (a pipe would wait for
    # a writer); place: a .part a killed fetch left is replaced, and the shard is a hard link to
    # the cache's blob, not a second copy; a .part it did not leave is the user's
    fetch = load_command("data/cached_fineweb10B.py")
    (tmp_path / "dir.bin").mkdir()
    assert fetch.damage(str(tmp_path / "dir.bin")) == f"{tmp_path / 'dir.bin'} is a folder"
    os.mkfifo(tmp_path / "fifo.bin")
    assert fetch.damage(str(tmp_path / "fifo.bin")) == f"{tmp_path / 'fifo.bin'} is a named pipe"
    write_shard(tmp_path / "blob", range(10))
    (tmp_path / "link").symlink_to(tmp_path / "blob")
    dest, blob = tmp_path / "out" / "x.bin", (tmp_path / "blob").read_bytes()
    dest.parent.mkdir()
    part = tmp_path / "out" / "x.bin.part"
    leftovers = {  # what a killed place() leaves: a copy cut short, or a link to the file
        "a cut copy": lambda: part.write_bytes(blob[:1030]),
        "a link": lambda: os.link(tmp_path / "blob", part),
    }
    for what, leave in leftovers.items():
        leave()
        fetch.place(str(tmp_path / "link"), str(dest))
        assert os.path.samefile(tmp_path / "blob", dest), what
        assert os.listdir(dest.parent) == ["x.bin"], what
        dest.unlink()  # (fetch places only a shard that is not there)
    # any other file of that name is the user's: refused, kept
    mine = {
        "notes": b"my notes, not a shard",
        "longer": blob + b"more",
        "other bytes": blob[:1024] + bytes(6),
    }
    for what, data in mine.items():
        part.write_bytes(data)
        with pytest.raises(support.UserError, match=f"^{part} is there and is not this shard, "):
            fetch.place(str(tmp_path / "link"), str(dest))
        assert part.read_bytes() == data and not dest.exists(), what
    part.unlink()
    part.symlink_to(tmp_path / "blob")  # (a link of the user's, to the very file)
    with pytest.raises(support.UserError, match="is not this shard, cut short"):
        fetch.place(str(tmp_path / "link"), str(dest))
    assert part.is_symlink()


def test_fineweb_refuses_a_broken_link_named_as_a_shard_before_fetching(tmp_path, monkeypatch):
    fetch, calls = load_command("data/cached_fineweb10B.py"), []
    monkeypatch.setattr(fetch, "fetch", lambda *a: calls.append(a))
    (tmp_path / "fineweb_val_000000.bin").symlink_to(tmp_path / "gone")
    with pytest.raises(support.UserError, match="is a broken symbolic link: it is there and is n"):
        fetch.main(["0", f"--out={tmp_path}"])
    assert calls == [] and os.path.islink(tmp_path / "fineweb_val_000000.bin")


def test_one_fetch_at_a_time_writes_a_folder(tmp_path, monkeypatch):
    # a folder another fetch holds: refused before anything is fetched; a new one is held from
    # its first shard (place), so that no other fetch takes this one's .part files
    fetch, calls = load_command("data/cached_fineweb10B.py"), []
    monkeypatch.setattr(fetch, "fetch", lambda *a: calls.append(a))
    other = another_job_locks(tmp_path)
    try:
        with pytest.raises(support.UserError, match=f"{tmp_path} is in use by another job"):
            fetch.main(["0", f"--out={tmp_path}"])
    finally:
        os.close(other)
    assert calls == [] and os.listdir(tmp_path) == []
    write_shard(tmp_path / "blob", range(10))
    fetch.place(str(tmp_path / "blob"), str(tmp_path / "new" / "x.bin"))
    assert another_job_locks(tmp_path / "new") is None


def test_a_signal_stops_the_fetch_starting_no_more_downloads(tmp_path, monkeypatch, capsys):
    # SIGTERM (a scheduler's) as the second of 21 downloads runs: it ends, no other starts, and
    # the command stops with the signal's status (not after every queued download: 20 GB)
    fetch, started = load_command("data/cached_fineweb10B.py"), []

    def download(name, out, counter):
        started.append(name)
        if len(started) == 2:  # (once every download is queued: the main thread waits)
            time.sleep(0.3)
            os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.1)

    monkeypatch.setattr(fetch, "fetch", download)
    code = run_main(["20", "--workers=1", f"--out={tmp_path}"], capsys, fetch.main)[0]
    assert code == 128 + signal.SIGTERM
    assert started == ["fineweb_val_000000.bin", "fineweb_train_000001.bin"]


def test_fineweb_says_the_others_were_not_tried_only_when_there_are_others(tmp_path, monkeypatch):
    fetch = load_command("data/cached_fineweb10B.py")
    monkeypatch.setattr(fetch, "fetch", lambda name, out, counter: "offline")
    for count, untried in (("0", False), ("1", True)):
        with pytest.raises(support.RunStopped) as e:
            fetch.main([count, f"--out={tmp_path}"])
        assert ("the others were not tried" in str(e.value)) == untried, str(e.value)


def test_fineweb_a_shard_that_cannot_be_written_is_a_reason_not_a_traceback(tmp_path, monkeypatch):
    import huggingface_hub

    from data import cached_fineweb10B

    write_shard(tmp_path / "blob", range(10))
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", lambda *a, **k: str(tmp_path / "blob"))

    def place(src, dest):
        raise OSError(errno.ENOSPC, "No space left on device", dest)

    monkeypatch.setattr(cached_fineweb10B, "place", place)
    dest = tmp_path / "out" / "fineweb_val_000000.bin"
    why = cached_fineweb10B.fetch(dest.name, str(dest.parent), "[1/1]")
    assert why == f"cannot write {dest}: No space left on device", why
    # a file of the user's in the way (its .part): a reason too, as the other shards go on
    monkeypatch.undo()
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", lambda *a, **k: str(tmp_path / "blob"))
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "fineweb_val_000000.bin.part").write_text("my notes")
    why = cached_fineweb10B.fetch(dest.name, str(dest.parent), "[1/1]")
    assert why.startswith(f"{dest}.part is there and is not this shard, cut short: "), why
    assert (tmp_path / "out" / "fineweb_val_000000.bin.part").read_text() == "my notes"


def test_fineweb_fetches_the_validation_shard_and_103_training_shards_by_default(
    tmp_path, monkeypatch
):
    fetch, asked = load_command("data/cached_fineweb10B.py"), []
    monkeypatch.setattr(fetch, "fetch", lambda name, out, counter: asked.append(name))
    fetch.main([f"--out={tmp_path}"])
    expected = ["fineweb_val_000000.bin"] + [f"fineweb_train_{i:06d}.bin" for i in range(1, 104)]
    assert sorted(asked) == sorted(expected) and len(asked) == 104


def test_fineweb_names_the_first_three_missing_files_then_dots(tmp_path, monkeypatch):
    fetch = load_command("data/cached_fineweb10B.py")
    monkeypatch.setattr(
        fetch, "fetch", lambda name, out, counter: None if "_val_" in name else "gone"
    )
    for count, listed in (
        (3, "train_000001.bin, fineweb_train_000002.bin, fineweb_train_000003.bin; gone)"),
        (4, "train_000001.bin, fineweb_train_000002.bin, fineweb_train_000003.bin ...; gone)"),
    ):
        with pytest.raises(support.RunStopped) as e:
            fetch.main([str(count), f"--out={tmp_path}"])
        assert str(e.value).startswith(f"{count} of {count + 1} files missing (fineweb_"), e.value
        assert listed in str(e.value), e.value


def test_fineweb_a_download_error_is_its_reason_and_a_shard_is_copied_where_links_fail(
    tmp_path, monkeypatch
):
    # a download that fails in its own words (here, no right to the cache): a one-line reason,
    # not a traceback. Where a hard link is refused (another filesystem), the shard is a copy,
    # all of it synced before the rename names it, and the folder (the name) after
    import huggingface_hub

    fetch = load_command("data/cached_fineweb10B.py")

    def refused(*args, **kwargs):
        raise PermissionError(errno.EACCES, "Permission denied", "/hub/blobs/x")

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", refused)
    why = fetch.fetch("fineweb_val_000000.bin", str(tmp_path / "out"), "[1/1]")
    assert why == "PermissionError: [Errno 13] Permission denied: '/hub/blobs/x'", why
    write_shard(tmp_path / "blob", range(10))

    def cross_device(src, dst):
        raise OSError(errno.EXDEV, "Invalid cross-device link")

    events, replace = [], os.replace

    def renamed(src, dst):
        events.append(("rename", os.stat(src).st_ino))
        replace(src, dst)

    monkeypatch.setattr(fetch.os, "link", cross_device)
    monkeypatch.setattr(os, "replace", renamed)
    note_syncs(monkeypatch, events)
    dest = tmp_path / "out" / "x.bin"
    fetch.place(str(tmp_path / "blob"), str(dest))
    monkeypatch.undo()
    assert dest.read_bytes() == (tmp_path / "blob").read_bytes()
    assert not os.path.samefile(dest, tmp_path / "blob") and os.listdir(dest.parent) == ["x.bin"]
    copy, folder = dest.stat().st_ino, dest.parent.stat().st_ino
    assert events == [(copy, dest.stat().st_size), ("rename", copy), (folder, None)], events
    # another fetch into the folder links its .part to the cache's file between this one's
    # removal of a .part and its own link: refused (a reason), that file never truncated
    blob, link = (tmp_path / "blob").read_bytes(), os.link

    def raced(src, dst):
        link(src, dst)  # (the other fetch's)
        raise FileExistsError(errno.EEXIST, "File exists", dst)

    monkeypatch.setattr(fetch.os, "link", raced)
    with pytest.raises(FileExistsError):
        fetch.place(str(tmp_path / "blob"), str(tmp_path / "out" / "y.bin"))
    monkeypatch.undo()
    assert (tmp_path / "blob").read_bytes() == blob


def test_fineweb_a_shard_it_cannot_read_is_named_not_a_traceback(tmp_path, monkeypatch, capsys):
    # (as root no permission stops a read: the read itself fails here) one line naming it and
    # why, status 2, nothing fetched; not "not a whole shard" (a good one would be moved away)
    fetch, calls = load_command("data/cached_fineweb10B.py"), []
    shard = tmp_path / "fineweb_val_000000.bin"
    write_shard(shard, range(10))

    def unreadable(path):
        raise PermissionError(errno.EACCES, "Permission denied", path)

    monkeypatch.setattr(fetch, "shard_header", unreadable)
    monkeypatch.setattr(fetch, "fetch", lambda *args: calls.append(args))
    code, _, err = run_main(["0", f"--out={tmp_path}"], capsys, fetch.main)
    assert code == 2 and err == f"error: {shard}: Permission denied\n" and calls == []


def test_debian_docs_page_text_by_hand():
    # a stray </script> hides nothing after it; 3 or more line breaks become one blank line;
    # a NUL (the byte shards' separator) is dropped
    debian_docs = load_command("data/debian_docs.py")
    page = b"<p>a</p></script><br><br><br>b\0c<script>x</script>e"
    assert debian_docs.page_text(page) == "a\n\nbce"
