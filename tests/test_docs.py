"""The docs are plain Markdown (they render where the code is hosted, and need no site generator);
these checks stand in for a strict site build: every relative link and anchor resolves, every
repository file the docs cite exists, every `make` target and `specdec` command they name is real,
and the README stays short."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = sorted([ROOT / "README.md", ROOT / "CONTRIBUTING.md", *(ROOT / "docs").glob("*.md")])
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)|!\[[^\]]*\]\(([^)\s]+)\)")
CITED_FILE = re.compile(r"(?<![\w/.-])((?:src|tests|docs|scripts|\.ci)/[\w./-]*\w\.(?:py|md|jsonl|json|png|toml))(?!\w)")
CODE = re.compile(r"```.*?```", re.S)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lowercase, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"`|\*\*|\[([^\]]*)\]\([^)]*\)", lambda m: m.group(1) or "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    found, seen = set(), {}
    for line in CODE.sub("", page.read_text()).splitlines():
        if line.startswith("#"):
            base = slug(line.lstrip("#"))
            count = seen.get(base, 0)
            found.add(base if count == 0 else f"{base}-{count}")
            seen[base] = count + 1
    return found


def code_spans(text: str) -> str:
    """The text of fenced blocks and inline code spans, one per line."""
    blocks = [block.split("\n", 1)[1].rsplit("```", 1)[0] if "\n" in block else "" for block in CODE.findall(text)]
    return "\n".join(re.findall(r"`([^`\n]+)`", CODE.sub("", text)) + blocks)


def links(page: Path) -> list[str]:
    return [a or b for a, b in LINK.findall(page.read_text())]


def broken_links(page: Path) -> list[str]:
    broken = []
    for target in links(page):
        if re.match(r"[a-z]+:", target):  # http(s), mailto: not checked (no network in CI)
            continue
        path, _, anchor = target.partition("#")
        resolved = (page.parent / path).resolve() if path else page
        if not resolved.exists():
            broken.append(f"{target} (no such file)")
        elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
            broken.append(f"{target} (no such heading)")
    return broken


def test_the_docs_exist():
    names = {page.name for page in PAGES}
    assert {"README.md", "CONTRIBUTING.md", "methods.md", "exactness.md", "kernels.md", "benchmarks.md"} <= names


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_links_and_anchors_resolve(page):
    assert broken_links(page) == []


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_cited_files_exist(page):
    cited = set(CITED_FILE.findall(page.read_text()))
    assert sorted(path for path in cited if not (ROOT / path).exists()) == []


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_make_targets_and_commands_are_real(page):
    from typer.main import get_command

    from specdec.cli import app

    code = code_spans(page.read_text())  # commands, not prose ("make sure", "specdec is")
    targets = set(re.findall(r"^([\w-]+):", (ROOT / "Makefile").read_text(), re.M))
    commands = set(get_command(app).commands)
    assert sorted(set(re.findall(r"\bmake ([a-z][\w-]*)", code)) - targets) == []
    assert sorted(set(re.findall(r"\bspecdec ([a-z][\w-]*)", code)) - commands) == []


def test_the_readme_is_short():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 250


def test_the_checks_catch_a_broken_link_a_missing_anchor_and_a_gone_file(tmp_path):
    (tmp_path / "a.md").write_text("# Title here\n\n[ok](#title-here) [bad](#nope) [gone](b.md) [b](c.md#x)\n")
    (tmp_path / "c.md").write_text("# X\n")
    assert broken_links(tmp_path / "a.md") == ["#nope (no such heading)", "b.md (no such file)"]
    assert CITED_FILE.findall("see `scripts/row_cost.py` and docs/benchmarks/trees-9.json.") == \
        ["scripts/row_cost.py", "docs/benchmarks/trees-9.json"]
    assert CITED_FILE.findall("--dataset docs/benchmarks/vllm/short-prompts.jsonl --max") == \
        ["docs/benchmarks/vllm/short-prompts.jsonl"]
    assert slug("Token trees: the `mixed` default (2.4×)") == "token-trees-the-mixed-default-24"
    assert code_spans("make sure `make bench` runs\n```\nspecdec serve\n```\n") == "make bench\nspecdec serve\n"


def test_the_makefile_s_python_snippets_run():
    """The one-line Python programs the bench targets run for a model's path (`GGUF_PATHS`,
    `HF_TARGET`): a module they import that moved would end those targets in an ImportError."""
    import subprocess
    import sys

    snippets = re.findall(r"^[A-Z_]+ := (from specdec[^\n]*)$", (ROOT / "Makefile").read_text(), re.M)
    assert len(snippets) >= 2
    for snippet in snippets:
        done = subprocess.run([sys.executable, "-c", snippet], capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, f"{snippet}\n{done.stderr[-2000:]}"
        assert done.stdout.strip()
