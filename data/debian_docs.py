"""Build a byte-level corpus of real English text from Debian documentation packages.

    python data/debian_docs.py                       # -> data/debian_docs/docs_{val,train}_*.bin
    python data/debian_docs.py --debs=DIR            # the pinned .deb files from a folder
    python data/debian_docs.py --unpinned            # today's versions: not the pinned corpus

Downloads the .deb files of PACKAGES at their pinned versions with `apt-get download` (no root
needed; a Debian 12 machine's package lists), checks each file's sha256 against the pin, reads
its HTML pages from the file tree `dpkg-deb --fsys-tarfile` streams, strips the markup with the
standard library's html.parser (the text of each page; scripts and styles dropped, block
elements on lines of their own) and writes the pages as byte shards through tokenize_corpus.py
(--encoding=bytes), one document per page. The pages are shuffled (SHUFFLE_SEED) first, so that
any prefix of either split samples every package; every TRAIN_EVERY-th page trains, and each of
the others is held out for validation as one excerpt of EXCERPT characters at a random start, so
that a validation averages over thousands of pages (sweep.py reports its standard error over
documents). 7,478 pages: 748 training pages (8,403,267 bytes) and 6,730 validation excerpts
(5,040,014 bytes), in about 90 s on 2 cores. The corpus is not committed; its shards' sha256
are (SHA256, checked at the end; the inputs' sha256 go into the corpus's manifest). Nothing is
extracted to disk: the downloads (~96 MB) go into a temporary folder inside --out, removed at
the end, on an error or a signal (kill -9 leaves it: .debian_docs.<random>); a shard-named file
there that is not this corpus's is refused first. Mirrors drop a version once it is superseded:
then --debs takes the pinned files from a folder (snapshot.debian.org keeps every version), and
--unpinned builds from the versions offered now, printed as NOT the pinned corpus (sweep.py's
records say the same).
"""

import glob
import hashlib
import html.parser
import json
import os
import random
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # the repository: support, fileio and data/ (no torch)
from fileio import (  # noqa: E402
    MAX_RECORD_BYTES,
    first_missing,
    kind_of,
    need,
    remove_made,
    writable_dir,
)
from support import (  # noqa: E402
    ArgParser,
    UserError,
    cli,
    exit_quietly_on_signals,
    path_arg,
    signals_held,
)

if __name__ == "__main__":
    exit_quietly_on_signals()

from data import tokenize_corpus  # noqa: E402

PACKAGES = {  # name=version: the .deb's sha256 (Debian 12, bookworm)
    "python3.11-doc=3.11.2-6+deb12u8": "50eb63e7f636c4281e9ce1b8f10386f1def42159eddce34fc1f41c46261df71b",  # noqa: E501
    "postgresql-doc-15=15.18-0+deb12u1": "3c598277a463c44d672daa2c335deb8d8252e1852fb025fd4578ea2d9a1b90f0",  # noqa: E501
    "git-doc=1:2.39.5-0+deb12u3": "3c89668a11053a6bafade3de1f611f4613db31e082af63f43d8c5b69ad8795ec",  # noqa: E501
    "linux-doc-6.1=6.1.176-1": "0d843674607703b9ef8c1db5e715c38ed52ff23574feabfe0d961d552126859f",
    "apache2-doc=2.4.68-1~deb12u1": "cee8fe80ffb5de2744cd690c3d795b489e43a1c44c4e3a634c521642f22d7835",  # noqa: E501
    "sqlite3-doc=3.40.1-2+deb12u2": "466e30d7066e2641fa13e56bc662a2ad521b8cc9c17dde9c9dac3d4f105e32f2",  # noqa: E501
    "python-django-doc=3:3.2.25-0+deb12u3": "33319c8e45b95693603213442ccf9bcee933ef338488115203ad25a0e01c696f",  # noqa: E501
    "maxima-doc=5.46.0-11": "01a726b693a7e465a62040ac5ade4762194d7553524231d77cd1fcd4a69a75b9",
    "python-sqlalchemy-doc=1.4.46+ds1-1": "8805c3167ef75278ac6fd58ed9856321c2b2e3a7e441edba84b2eb955216d0fd",  # noqa: E501
    "sphinx-doc=5.3.0-4": "1da3d08bb3a0bc82a4b8b8109410e223054bf5fb13904557ec8ea869046f65b4",
    "octave-doc=7.3.0-2": "b27897cc7e3d688daa5cb8f8d1ea47077f3fbd205ce32e22522200ff0c1eadd5",
    "debian-reference-en=2.100": "9f31d3a17df505de09689ca255512ea58c1fc47c59bb1b0c7bf1c23362e9743f",
}
NOT_PAGES = re.compile(  # paths whose HTML is not an English page of its own: hidden files, the
    r"/\.[^./]|/translations/|/apache2-doc/manual/(?!en/)"  # translations (linux's, apache2's),
    r"|/_modules/|/(genindex[^/]*|py-modindex|search)\.html$"  # Sphinx's source listings, indexes,
    r"|/maxima_singlepage\.html$"  # and maxima's manual again as one page
)
MIN_TEXT = 100  # characters: a shorter page is a redirect ("The node you are looking for is at
#                 XREFfft.": octave's 2,324 Texinfo stubs and its figure and table ones; sqlite's
#                 sqlite.html); the shortest page kept has 149 (training) or 102 (an excerpt)
SHA256 = {  # the shards these packages give (Python 3.11.7's html.parser)
    "docs_val_000000.bin": "7e8b3f8318490b06e5151af31bb34c6d632f696fbf2af1e9e16ade71b69c235d",
    "docs_train_000001.bin": "dc17cf0a24cb5357f14a47a45ebb874c0e3d8a1037db1575e3cece15c3116021",
}
OURS = dict(retry="--out", writer="data/debian_docs.py")  # (the corpus's manifest names it)
SHUFFLE_SEED = 0  # random.Random(SHUFFLE_SEED): the pages' order, then the excerpts' starts
TRAIN_EVERY = 10  # pages 0, 10, 20, ... of the shuffled order train; the others are held out
EXCERPT = 768  # for validation, each as one excerpt of at most EXCERPT characters at a random
#                   start: 6,730 documents, for a validation SE below 0.005 nats (docs/data.md)
BLOCKS = {
    "p",
    "div",
    "br",
    "li",
    "tr",
    "pre",
    "dt",
    "dd",
    "h1",
    "h2",
    "h3",
    "h4",
    "h5",
    "h6",
    "table",
    "blockquote",
    "section",
}


class PageText(html.parser.HTMLParser):
    """The text of an HTML page: scripts, styles and the head dropped, blocks on new lines."""

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.parts, self.hidden = [], 0

    def handle_starttag(self, tag, attrs):
        self.hidden += tag in ("script", "style", "head")
        if tag in BLOCKS:
            self.parts.append("\n")

    def handle_endtag(self, tag):
        self.hidden -= tag in ("script", "style", "head") and self.hidden > 0

    def handle_data(self, data):
        if not self.hidden:
            self.parts.append(data)

    def text(self) -> str:
        lines = (re.sub(r"[ \t]+", " ", line).strip() for line in "".join(self.parts).split("\n"))
        return re.sub(r"\n{3,}", "\n\n", "\n".join(lines)).strip().replace("\0", "")


def page_text(page: bytes) -> str:
    parser = PageText()
    parser.feed(page.decode("utf-8", errors="replace"))  # (the pages are UTF-8)
    return parser.text()


def package_pages(deb: str, shown: str) -> list:
    """The HTML pages of a .deb, in the order of their paths, read from the file tree dpkg-deb
    streams: nothing is extracted to disk. Each page once: a link is not a page of its own (the
    packages link folders and files to one another), nor is a path NOT_PAGES matches. A damaged
    .deb is one UserError naming it as shown (the user's file, not a temporary copy), with
    dpkg-deb's own reason when it gave one."""
    pages, broken = {}, None
    with (
        tempfile.TemporaryFile() as errors,  # (not a pipe: one that filled would stall dpkg-deb)
        subprocess.Popen(
            ["dpkg-deb", "--fsys-tarfile", deb], stdout=subprocess.PIPE, stderr=errors
        ) as p,
    ):
        try:
            with tarfile.open(fileobj=p.stdout, mode="r|") as tar:
                for m in tar:
                    if m.isfile() and m.name.endswith(".html") and not NOT_PAGES.search(m.name):
                        pages[m.name] = tar.extractfile(m).read()
        except tarfile.TarError as e:  # a cut or empty stream: dpkg-deb failed, or a bad .deb
            broken = str(e)
        while p.stdout.read(1 << 16):  # what follows the archive's end: drained, or dpkg-deb
            pass  # would wait on a full pipe for ever
        p.wait()
        errors.seek(0)
        said = errors.read(1 << 16).decode(errors="replace").strip().splitlines()  # (bounded)
    if p.returncode or broken is not None:  # dpkg-deb's reason first: the stream's is a symptom
        why = said[0].replace(deb, os.path.basename(deb)) if said else broken  # (no temp path)
        why = why or f"dpkg-deb status {p.returncode}"
        raise UserError(f"{shown}: not a readable .deb ({why})")
    return [pages[name] for name in sorted(pages)]


def download(spec: str, sha: str, folder: str, debs: str = None, unpinned: bool = False) -> tuple:
    """One package's .deb and its sha256: the pinned file from the folder debs, else apt-get
    download of the pinned version into folder (unpinned: of the version offered now)."""
    if debs:  # (those named as apt names the package's first: a folder of many is hashed once)
        named = spec.split("=")[0] + "_"
        paths = glob.glob(os.path.join(glob.escape(debs), "*.deb"))
        for path in sorted(paths, key=lambda p: (not os.path.basename(p).startswith(named), p)):
            if os.path.isfile(path) and tokenize_corpus.sha256_of(path) == sha:  # (no pipe)
                return path, sha
        raise UserError(f"--debs={debs}: no .deb there has {spec}'s pinned sha256 {sha}")
    r = subprocess.run(
        ["apt-get", "download", spec.split("=")[0] if unpinned else spec],
        cwd=folder,
        capture_output=True,
        text=True,
    )
    found = glob.glob(os.path.join(folder, spec.split("=")[0] + "_*.deb"))
    if r.returncode or len(found) != 1:
        tail = (r.stderr.strip().splitlines() or ["no .deb"])[-1]
        raise UserError(
            f"apt-get download {spec} failed ({tail}): the pinned version is not offered "
            f"here (superseded, or not Debian 12?); download the .deb files PACKAGES pins "
            f"(snapshot.debian.org keeps every version) into a folder and give "
            f"--debs=DIR, or build from the versions offered now with --unpinned (not "
            f"the pinned corpus; their sha256 go into the manifest)"
        )
    got = tokenize_corpus.sha256_of(found[0])
    if got != sha and not unpinned:
        raise UserError(
            f"{found[0]}: sha256 {got} differs from the pinned {sha}: not the same "
            f"text; give the pinned file with --debs=DIR, or build with --unpinned"
        )
    return found[0], got


def build(out: str, workers: int, debs: str = None, unpinned: bool = False) -> list:
    writable_dir(out)
    for tool in ("dpkg-deb",) + (() if debs else ("apt-get",)):
        if shutil.which(tool) is None:
            raise UserError(f"{tool} not found: this command builds the corpus on Debian or Ubuntu")
    manifest = os.path.join(out, "docs.manifest.json")
    try:  # the pinned corpus may no longer be buildable: an unpinned one is never put in its place
        if kind_of(manifest) != "a file":  # (a pipe or a device is never opened: Corpus refuses)
            raise ValueError
        with open(manifest, "rb") as f:
            pinned = json.loads(f.read(MAX_RECORD_BYTES)).get("shards") == SHA256
    except (OSError, ValueError, AttributeError, RecursionError):
        pinned = False
    if unpinned and pinned:
        raise UserError(
            f"{out} holds the pinned corpus, which --unpinned would replace; give "
            f"another --out (and train on it with --train_files/--val_files)"
        )
    tokenize_corpus.Corpus(out, "docs", "bytes", check_only=True, **OURS)  # now, not later
    made = first_missing(out)
    os.makedirs(out, exist_ok=True)
    work = tempfile.mkdtemp(prefix=".debian_docs.", dir=out)
    try:
        pages, inputs = [], {}
        for spec, sha in PACKAGES.items():
            deb, inputs[spec.split("=")[0]] = download(spec, sha, work, debs, unpinned)
            shown = deb if debs else f"the .deb apt-get downloaded for {spec}"
            pages += package_pages(deb, shown)
        rng = random.Random(SHUFFLE_SEED)
        rng.shuffle(pages)  # so that any prefix of either split samples every package
        docs, held_out = os.path.join(work, "pages.jsonl"), lambda i: i % TRAIN_EVERY != 0
        with open(docs, "w", encoding="utf-8") as f:
            for i, text in enumerate(t for t in map(page_text, pages) if len(t) >= MIN_TEXT):
                if held_out(i):  # tokenize's validation documents: an excerpt of each
                    start = rng.randrange(max(1, len(text) - EXCERPT + 1))
                    text = text[start : start + EXCERPT]
                f.write(json.dumps({"text": text}) + "\n")
        return tokenize_corpus.tokenize(
            [docs], out, "docs", 100_000_000, workers, "bytes", held_out, inputs, **OURS
        )
    except BaseException:
        with signals_held():  # (a second Ctrl-C: not with half of it left)
            shutil.rmtree(work, ignore_errors=True)
            remove_made(out, made)
        raise
    finally:
        with signals_held():
            shutil.rmtree(work, ignore_errors=True)


def parser() -> ArgParser:
    p = ArgParser("python data/debian_docs.py", __doc__)
    p.add_argument(
        "--out",
        type=path_arg,
        default=os.path.join(HERE, "debian_docs"),
        metavar="DIR",
        help="folder for the shards (default: data/debian_docs)",
    )
    p.add_argument(
        "--debs",
        type=path_arg,
        metavar="DIR",
        help="take the pinned .deb files from this folder (found by sha256), not apt-get",
    )
    p.add_argument(
        "--unpinned",
        action="store_true",
        help="build from the versions apt-get offers now: not the pinned corpus; the "
        ".deb files' sha256 go into the corpus's manifest",
    )
    return p


def main(argv):
    args = parser().parse_args(argv)
    if args.debs and args.unpinned:
        raise UserError("--debs and --unpinned: give one (--debs holds the pinned files)")
    for path in build(args.out, 1, args.debs and need(args.debs, "a folder"), args.unpinned):
        with open(path, "rb") as f:
            sha, name = hashlib.sha256(f.read()).hexdigest(), os.path.basename(path)
        print(
            f"{name} sha256 {sha}: "
            + (
                "the pinned corpus"
                if SHA256.get(name) == sha
                else "NOT the pinned corpus (other inputs, or another Python's html.parser)"
            )
        )


if __name__ == "__main__":
    sys.exit(
        cli(
            main,
            sys.argv[1:],
            lambda: tokenize_corpus.Progress.open_line and print(file=sys.stderr),
        )
    )
