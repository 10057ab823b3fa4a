"""The documentation's shape and references (issue 55).

* no Markdown file under ``docs/`` nor ``README.md`` is over 600 lines;
* every relative link ``[text](path)`` / ``[text](path#anchor)`` / ``[text](#anchor)`` in ``README.md`` and
  ``docs/**/*.md`` points to an existing file, and its anchor to a heading of that file (GitHub's slugs);
* every repository path written in backticks (``docs/...``, ``scripts/...``, ``models/...``,
  ``pipelines/...``, ``mmspec/...``, ``evaluation/...``, ``tests/...``) exists (in fenced code blocks,
  whose recipe commands name outputs still to be written, the ``docs/`` and ``scripts/`` ones);
* no file cites documents that are not in the repository (the design notes, the environment and style
  guides, a ``../shared`` folder).

Text only: no model is loaded, the whole module runs in well under a second.
"""

from __future__ import annotations

import re
import unicodedata
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MAX_LINES = 600

#: Top-level folders whose paths the docs may name; ``mmspec/<x>`` also names the zoo id of
#: ``models/zoo/<x>`` and, for the folders ``setup.py`` maps into the package, ``<x>/...``.
PATH_ROOTS = ("docs", "scripts", "models", "pipelines", "mmspec", "evaluation", "tests")
PACKAGE_MAPPED = ("models", "pipelines", "evaluation", "demos")

#: Names of documents outside the repository that earlier docs cited.
FOREIGN = re.compile(r"DESIGN\.md|ENVIRONMENT\.md|STYLE\.md|\.\./shared|DESIGN section")

FENCE = re.compile(r"^\s*(```|~~~)")
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
CODE_SPAN = re.compile(r"(`+)(.+?)\1")
PATH_TOKEN = re.compile(r"(?<![\w./~-])(?:" + "|".join(PATH_ROOTS) + r")/[\w./+-]*")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")


def markdown_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def _rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def split_fences(text: str) -> tuple[list[str], list[str]]:
    """(prose lines, lines inside fenced code blocks)."""
    prose, code, fenced = [], [], False
    for line in text.splitlines():
        if FENCE.match(line):
            fenced = not fenced
            continue
        (code if fenced else prose).append(line)
    return prose, code


def github_slug(heading: str) -> str:
    """GitHub's anchor for a heading: rendered text, lower case, punctuation dropped, spaces to '-'."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)      # links and images: their text
    text = re.sub(r"<[^>]+>", "", text)                             # inline HTML
    text = text.replace("`", "").replace("*", "")
    text = unicodedata.normalize("NFC", text).strip().lower()
    text = "".join(ch for ch in text if ch.isalnum() or ch in " -_")
    return text.replace(" ", "-")


@cache
def anchors(path: Path) -> frozenset[str]:
    prose, _ = split_fences(path.read_text(encoding="utf-8"))
    seen: dict[str, int] = {}
    out = set()
    for line in prose:
        m = HEADING.match(line)
        if not m:
            continue
        slug = github_slug(m.group(2))
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return frozenset(out)


def repo_path_exists(token: str) -> bool:
    token = token.rstrip(".,;:)")
    if (ROOT / token).exists():
        return True
    head, _, rest = token.partition("/")
    if head == "mmspec" and rest:
        name = rest.rstrip("/")
        if (ROOT / "models" / "zoo" / name).is_dir():            # a zoo id: mmspec/shapes-t2i
            return True
        first = rest.split("/", 1)[0]
        if first in PACKAGE_MAPPED and (ROOT / rest).exists():  # mmspec/models/... = models/...
            return True
    return False


def test_no_markdown_file_over_600_lines():
    long = {}
    for path in markdown_files():
        n = len(path.read_text(encoding="utf-8").splitlines())
        if n > MAX_LINES:
            long[_rel(path)] = n
    assert not long, f"Markdown files over {MAX_LINES} lines (split them or move history to docs/notes/): {long}"


def test_relative_links_resolve():
    broken = []
    for path in markdown_files():
        prose, _ = split_fences(path.read_text(encoding="utf-8"))
        for line in prose:
            for target in LINK.findall(line):
                if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):   # http:, https:, mailto:
                    continue
                file_part, _, anchor = target.partition("#")
                dest = path if not file_part else (path.parent / file_part).resolve()
                if not dest.exists():
                    broken.append(f"{_rel(path)}: {target} (no such file)")
                    continue
                if anchor and dest.suffix == ".md" and anchor.lower() not in anchors(dest):
                    broken.append(f"{_rel(path)}: {target} (no heading with this anchor in {dest.name})")
    assert not broken, "dangling links:\n" + "\n".join(broken)


#: Inside fenced code blocks (recipes, whose outputs need not exist yet) only these roots are checked:
#: the docs and scripts a command reads or rewrites are committed.
FENCED_ROOTS = ("docs/", "scripts/")


def test_paths_in_backticks_exist():
    missing = []
    for path in markdown_files():
        prose, code = split_fences(path.read_text(encoding="utf-8"))
        spans = [m.group(2) for line in prose for m in CODE_SPAN.finditer(line)]
        tokens = [t for chunk in spans for t in PATH_TOKEN.findall(chunk)]
        tokens += [t for line in code for t in PATH_TOKEN.findall(line) if t.startswith(FENCED_ROOTS)]
        for token in tokens:
            if any(ch in token for ch in "*<{") or "..." in token:
                continue                                   # placeholders and globs
            if not repo_path_exists(token):
                missing.append(f"{_rel(path)}: {token}")
    assert not missing, "paths named in the docs that are not in the repository:\n" + "\n".join(sorted(set(missing)))


@pytest.mark.parametrize("where", ["README.md", "docs", "scripts"])
def test_no_citations_of_files_outside_the_repository(where):
    base = ROOT / where
    files = [base] if base.is_file() else [p for p in base.rglob("*") if p.is_file() and p.suffix in {
        ".md", ".sh", ".py", ".txt", ".json", ".toml", ".cfg", ".yml", ".yaml"}]
    hits = []
    for path in files:
        for lineno, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
            if FOREIGN.search(line):
                hits.append(f"{_rel(path)}:{lineno}: {line.strip()[:120]}")
    assert not hits, "citations of documents that are not in the repository:\n" + "\n".join(hits)


#: An absolute path on a developer's or CI machine (``/work/main/...``, ``/home/me/...``): meaningless in a clone.
MACHINE_PATH = re.compile(r"(?<![\w.~-])/(?:work|home|Users|root)/")


def test_no_absolute_paths_of_a_developers_machine():
    """The docs and scripts name paths relative to the checkout (or a variable such as ``$REPO``). The recorded
    benchmark outputs under ``docs/benchmarks/`` are left out: they log the command exactly as it ran."""
    files = [ROOT / "README.md", ROOT / "CHANGELOG.md",
             *(p for p in (ROOT / "docs").rglob("*.md") if "benchmarks" not in p.relative_to(ROOT / "docs").parts),
             *(p for p in (ROOT / "scripts").rglob("*") if p.is_file() and p.suffix in {".sh", ".py", ".md"})]
    hits = [f"{_rel(path)}:{lineno}: {line.strip()[:120]}" for path in files
            for lineno, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), 1)
            if MACHINE_PATH.search(line)]
    assert not hits, "absolute paths of a developer's machine:\n" + "\n".join(hits)


def test_slug_rules():
    assert github_slug("The full table (2026-11-28): every goal met, twice") == \
        "the-full-table-2026-11-28-every-goal-met-twice"
    assert github_slug("MuLo-SD (`method=\"mulo\"`)") == "mulo-sd-methodmulo"
    assert github_slug("`verify_tokens`") == "verify_tokens"
    assert github_slug("Local 2-D sets, reward routing") == "local-2-d-sets-reward-routing"
