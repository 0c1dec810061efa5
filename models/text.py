"""English sentence sets for calibrating and judging surrogates, from text that lies on the machine.

No model hub and no download: every source is text this repository ships or that Python or a
Debian package installs. Each source's sentences come in a fixed order, deduplicated, so a
seeded split is reproducible on one Python version:

* ``"repository"`` — ``models/data/sentences.txt``, written for this repository (~230 sentences
  on varied topics, some with related sentences for nearest-neighbour checks);
* ``"docstrings"`` — sentences of the docstrings of Python's standard library (``STDLIB``;
  ~2,000 sentences of technical English; the exact set depends on the Python version);
* ``"fortunes"`` — the quotation collection of Debian's ``fortunes`` and ``fortunes-min``
  packages (``apt-get install fortunes``), ~3,000 entries of general English; absent elsewhere.

``split(...)`` gives a ``SentenceSplit``: the sentences that *decide* (calibration: fitting and
selection) and those that *measure* (judgement), disjoint by construction, from one source or two::

    from normpass.models import text
    s = text.split("fortunes", decide=60, measure=200, seed=3)
    text.write(s.decide, "calib.txt")   # normpass replace ... --calib calib.txt --tokenizer ...
"""

from __future__ import annotations

import importlib
import inspect
import pathlib
import random
import re
import warnings
from dataclasses import dataclass

REPOSITORY = pathlib.Path(__file__).with_name("data") / "sentences.txt"
FORTUNES = pathlib.Path("/usr/share/games/fortunes")
SOURCES = ("repository", "docstrings", "fortunes")
# Modules of the standard library whose docstrings are read, in this order (no GUI, no deprecated ones).
STDLIB = [
    "abc",
    "argparse",
    "array",
    "ast",
    "asyncio",
    "base64",
    "bisect",
    "bz2",
    "calendar",
    "cmath",
    "codecs",
    "collections",
    "colorsys",
    "compileall",
    "concurrent.futures",
    "configparser",
    "contextlib",
    "copy",
    "csv",
    "ctypes",
    "dataclasses",
    "datetime",
    "decimal",
    "difflib",
    "dis",
    "doctest",
    "email",
    "enum",
    "errno",
    "filecmp",
    "fnmatch",
    "fractions",
    "ftplib",
    "functools",
    "gc",
    "getopt",
    "getpass",
    "gettext",
    "glob",
    "graphlib",
    "gzip",
    "hashlib",
    "heapq",
    "hmac",
    "html",
    "html.parser",
    "http.client",
    "imaplib",
    "importlib",
    "inspect",
    "io",
    "ipaddress",
    "itertools",
    "json",
    "keyword",
    "linecache",
    "locale",
    "logging",
    "lzma",
    "mailbox",
    "math",
    "mimetypes",
    "mmap",
    "modulefinder",
    "multiprocessing",
    "netrc",
    "numbers",
    "operator",
    "optparse",
    "os",
    "pathlib",
    "pdb",
    "pickle",
    "pkgutil",
    "platform",
    "plistlib",
    "poplib",
    "pprint",
    "profile",
    "pstats",
    "py_compile",
    "pyclbr",
    "queue",
    "quopri",
    "random",
    "re",
    "runpy",
    "sched",
    "secrets",
    "select",
    "selectors",
    "shelve",
    "shlex",
    "shutil",
    "signal",
    "site",
    "smtplib",
    "socket",
    "sqlite3",
    "ssl",
    "stat",
    "statistics",
    "string",
    "struct",
    "subprocess",
    "symtable",
    "sysconfig",
    "tabnanny",
    "tarfile",
    "tempfile",
    "textwrap",
    "threading",
    "timeit",
    "token",
    "tokenize",
    "tomllib",
    "trace",
    "traceback",
    "tracemalloc",
    "types",
    "typing",
    "unicodedata",
    "unittest",
    "urllib.parse",
    "uuid",
    "warnings",
    "wave",
    "weakref",
    "wsgiref",
    "xml.dom.minidom",
    "zipfile",
    "zipimport",
    "zlib",
    "zoneinfo",
]
SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z])")
CODE_LIKE = re.compile(r"[<>{}\[\]=_\\|`#@$]|\(\)|::|\w\.\w")


def available(source: str) -> bool:
    """Whether `source` has text on this machine."""
    if source == "fortunes":
        return any(_fortune_files())
    return source in SOURCES


def sentences(source: str) -> list[str]:
    """Every sentence of `source`, in a fixed order, without duplicates."""
    if source == "repository":
        lines = REPOSITORY.read_text(encoding="utf-8").splitlines()
        found = [line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")]
    elif source == "docstrings":
        found = [s for doc in _docstrings() for s in _sentences_of(doc)]
    elif source == "fortunes":
        found = [s for entry in _fortunes() for s in [_quotation(entry)] if s]
    else:
        raise ValueError(f"unknown sentence source {source!r}; choose one of {', '.join(SOURCES)}")
    if not found:
        raise FileNotFoundError(f"no sentences in {source!r} on this machine (fortunes: apt-get install fortunes)")
    return list(dict.fromkeys(found))


@dataclass(frozen=True)
class SentenceSplit:
    """Sentences that decide (calibration) and sentences that measure (judgement); never the same."""

    decide: list[str]
    measure: list[str]
    source: str
    seed: int


def split(source: str, decide: int, measure: int, seed: int = 0, measure_source: str | None = None) -> SentenceSplit:
    """`decide` and `measure` sentences after a seeded shuffle: from `source` alone (consecutive,
    disjoint slices), or the measured ones from `measure_source` (less any sentence in both)."""
    pool = sentences(source)
    random.Random(seed).shuffle(pool)
    chosen = pool[:decide]
    if measure_source is None or measure_source == source:
        rest = pool[decide:]
    else:
        taken = set(chosen)
        rest = [s for s in sentences(measure_source) if s not in taken]
        random.Random(seed + 1).shuffle(rest)
    if len(chosen) < decide or len(rest) < measure:
        raise ValueError(
            f"{source}: {len(pool)} sentences, fewer than the {decide} + {measure} asked for; ask for fewer"
        )
    return SentenceSplit(
        chosen, rest[:measure], source if measure_source is None else f"{source}/{measure_source}", seed
    )


def write(texts: list[str], path: str | pathlib.Path) -> pathlib.Path:
    """`texts` as a .txt calibration file (one sentence per line)."""
    path = pathlib.Path(path)
    path.write_text("".join(t.replace("\n", " ") + "\n" for t in texts), encoding="utf-8")
    return path


def _sentences_of(text: str) -> list[str]:
    flat = re.sub(r"\s+", " ", text)
    return [
        s.strip()
        for s in SENTENCE_END.split(flat)
        if 40 <= len(s.strip()) <= 220 and s.strip()[-1] in ".!?" and not CODE_LIKE.search(s)
    ]


def _docstrings() -> list[str]:
    docs = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name in STDLIB:
            try:
                module = importlib.import_module(name)
            except ImportError:  # a module this Python was built without
                continue
            docs.append(inspect.getdoc(module) or "")
            for attr, value in sorted(vars(module).items()):
                if not attr.startswith("_") and getattr(value, "__module__", None) == module.__name__:
                    docs.append(inspect.getdoc(value) or "")
    return docs


def _fortune_files() -> list[pathlib.Path]:
    if not FORTUNES.is_dir():
        return []
    return sorted(p for p in FORTUNES.iterdir() if p.is_file() and not p.suffix and not p.is_symlink())


def _fortunes() -> list[str]:
    entries = []
    for path in _fortune_files():
        entries += path.read_text(encoding="utf-8", errors="replace").split("\n%\n")
    return entries


def _quotation(entry: str) -> str | None:
    """The quotation of a fortune, without its attribution, on one line; None if not plain prose."""
    lines = [line for line in entry.strip().splitlines() if not line.strip().startswith("--")]
    text = re.sub(r"\s+", " ", " ".join(lines)).strip()
    if not 30 <= len(text) <= 250 or CODE_LIKE.search(text) or not text.isascii() or ":" in text[:20]:
        return None
    return text
