"""The documentation cannot go stale unnoticed.

* The table of what each verb buys (README.md, docs/BENCHMARKS.md) is the one `tools/readme_table.py`
  computes from the records in docs/results/.
* Every JSON example marked `<!-- schema: normpass ARGS -->` in docs/ has the keys the command prints (or
  writes to `--report`) on the model its `"model"` names, at every depth.
* Every relative link in README.md and docs/ reaches a file, and its `#anchor` a heading of that file.
* The README stays one screen's worth (≤ 200 lines) and writes no figure that changes with every commit
  (a test count, the suite's time).
"""

from __future__ import annotations

import json
import pathlib
import re
import shlex

import onnx
import pytest
from conftest import load_module, rng
from test_patterns import post_ln, pre_ln_block

from normpass.cli.main import build_parser, main

ROOT = pathlib.Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
readme_table = load_module(ROOT / "tools" / "readme_table.py")

# The models the schema examples are printed for, by the file name their "model" key gives.
EXAMPLE_MODELS = {"post.onnx": lambda: post_ln(rng(2)), "pre.onnx": lambda: pre_ln_block(rng(1))}
SCHEMA = re.compile(r"<!-- schema: normpass (?P<args>[^>]*?) -->\s*```json\n(?P<example>.*?)\n```", re.S)
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)|!\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)
COMMENT = re.compile(r"<!--.*?-->", re.S)


def test_the_table_is_the_records():
    assert readme_table.stale_pages() == [], "run python tools/readme_table.py"


def test_every_round_is_in_the_table():
    """A new round's records enter the table: none lies in docs/results/ unread."""
    results = ROOT / "docs" / "results"
    committed = {path.relative_to(results).as_posix() for path in results.glob("*/records-*.json")}
    assert committed - readme_table.records_read() == set(), "add them to the cells of tools/readme_table.py"


def test_a_changed_record_changes_the_table(monkeypatch):
    """The check can fail: the same records with one ratio changed give another table."""
    original = readme_table.load

    def load(record: str) -> dict:
        data = original(record)
        if record.endswith("records-ort.json"):
            for point in data["records"]:
                for variant in point["variants"].values():
                    variant["ratio"] *= 0.5
        return data

    monkeypatch.setattr(readme_table, "load", load)
    assert set(readme_table.stale_pages()) == set(readme_table.PAGES)


def test_the_verdicts_follow_the_rule():
    assert readme_table.verdict([0.85, 0.96]) == "**faster**"
    assert readme_table.verdict([0.93, 1.0, 1.003]) == "**nothing**"
    assert readme_table.verdict([0.88, 1.05, 1.13]) == "**slower**"
    assert readme_table.verdict([0.85, 0.9, 0.99, 1.0]) == "**mixed**"


def schema_examples() -> list[tuple[str, str, str]]:
    found = []
    for page in PAGES:
        for match in SCHEMA.finditer(page.read_text()):
            found.append((page.relative_to(ROOT).as_posix(), match["args"], match["example"]))
    return found


def test_the_schemas_are_documented():
    commands = {args for _page, args, _example in schema_examples()}
    assert {
        "inspect MODEL --json",
        "inspect MODEL --json --rotation",
        "fold MODEL -o OUT --report REPORT",
        "rotate MODEL -o OUT --report REPORT",
    } <= commands


def assert_same_keys(documented, printed, where: str) -> None:
    """`documented` has the keys of `printed` at every depth (a list's documented entry stands for each)."""
    if isinstance(documented, dict):
        assert isinstance(printed, dict), where
        assert set(documented) == set(printed), f"{where}: documented {sorted(documented)}, printed {sorted(printed)}"
        for key in documented:
            assert_same_keys(documented[key], printed[key], f"{where}.{key}")
    elif isinstance(documented, list):
        assert isinstance(printed, list), where
        if documented:
            for entry in printed:
                assert_same_keys(documented[0], entry, f"{where}[]")
        else:
            assert not any(isinstance(entry, dict) for entry in printed), f"{where}: entries printed, none documented"


@pytest.mark.parametrize(("page", "args", "example"), schema_examples(), ids=lambda v: str(v)[:40])
def test_a_documented_schema_is_what_the_command_prints(page, args, example, tmp_path, capsys):
    documented = json.loads(example)
    name = documented["model"]
    assert name in EXAMPLE_MODELS, f"{page}: no test model {name!r} (EXAMPLE_MODELS)"
    model = tmp_path / name
    onnx.save(EXAMPLE_MODELS[name](), str(model))
    paths = {"MODEL": model, "OUT": tmp_path / "out.onnx", "REPORT": tmp_path / "report.json"}
    argv = [str(paths.get(arg, arg)) for arg in shlex.split(args)]
    capsys.readouterr()
    assert main(argv) == 0
    printed = json.loads(paths["REPORT"].read_text() if "REPORT" in args else capsys.readouterr().out)
    assert_same_keys(documented, printed, f"{page}: normpass {args}")


def links(page: pathlib.Path) -> list[str]:
    """The link targets of `page`, outside code blocks and HTML comments."""
    text = COMMENT.sub("", FENCE.sub("", page.read_text()))
    return [a or b for a, b in LINK.findall(text)]


def anchors(page: pathlib.Path) -> set[str]:
    """GitHub's anchors for the headings of `page`: lower case, punctuation dropped, spaces as hyphens."""
    found: set[str] = set()
    for line in FENCE.sub("", page.read_text()).splitlines():
        if line.startswith("#"):
            title = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", line.lstrip("#").strip()).lower()
            slug = "".join(c for c in title if c.isalnum() or c in " -_").replace(" ", "-")
            found.add(slug)
    return found


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_links_resolve(page):
    broken = []
    for target in links(page):
        if re.match(r"[a-z]+:", target):
            continue  # https:, mailto:
        path, _, anchor = target.partition("#")
        resolved = (page.parent / path).resolve() if path else page
        if not resolved.exists() or (anchor and resolved.suffix == ".md" and anchor not in anchors(resolved)):
            broken.append(target)
    assert broken == [], f"{page.relative_to(ROOT)}: links that reach nothing: {broken}"


def test_the_readme_is_one_screen():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 200


@pytest.mark.parametrize("page", ["README.md", "docs/install.md"])
def test_no_figure_that_changes_with_every_commit(page):
    text = (ROOT / page).read_text()
    assert not re.search(r"\b\d[\d,]* tests\b", text), "a test count: pytest prints it"
    assert not re.search(r"\b(about|in) \d+ minutes\b", text), "the suite's time: pytest prints it"


def documented_commands(page: pathlib.Path) -> list[str]:
    """The `normpass …` commands in the shell blocks of `page`, continuation lines joined."""
    commands = []
    for block in re.findall(r"^```(?:bash|sh|shell)\n(.*?)^```", page.read_text(), re.S | re.M):
        for line in block.replace("\\\n", " ").splitlines():
            for part in re.split(r"&&|\|\||;|\|", line):
                words = shlex.split(part, comments=True)
                if words[:1] == ["normpass"]:
                    commands.append(shlex.join(words[1:]))
    return commands


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_documented_commands_parse(page, capsys):
    """Every documented `normpass` command is one the command line accepts (its verb, options and values)."""
    parser = build_parser()
    refused = []
    for command in documented_commands(page):
        try:
            parser.parse_args(shlex.split(command))
        except SystemExit:
            refused.append(f"normpass {command}: {capsys.readouterr().err.strip().splitlines()[-1]}")
    assert refused == [], "\n".join(refused)
