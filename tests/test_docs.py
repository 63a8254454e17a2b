"""The documents point only at things that exist: every link and image of README.md and docs/*.md
resolves to a file (or heading) inside the repository, every repository path and every test written
in their text exists, and every ``docs/...`` path the code names is a document that exists or a result under
docs/results/ (a benchmark's default output need not exist before its first run). A moved or
deleted file then fails CI instead of leaving a stale pointer."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
TOP_LEVEL = ("benchmarks", "configs", "docs", "flashbob", "optim", "recipes", "tests")

LINK = re.compile(r"(!?)\[[^\]]*\]\(([^)\s]+)\)")  # [text](target) and ![alt](target)
# A path that starts at a top-level folder, not inside a longer path (../flashbob is a link's business).
REPO_PATH = re.compile(rf"(?<![\w./-])((?:{'|'.join(TOP_LEVEL)})/[\w./-]*)")
HEADING = re.compile(r"^#+ (.*)$", re.MULTILINE)
CODE_BLOCK = re.compile(r"^```.*?^```", re.MULTILINE | re.DOTALL)
TEST_NAME = re.compile(r"(?<![\w/.])(test_[a-z0-9_]+)(?![\w.])")  # a test function or module, not a path
CODE_FILES = [p for folder in TOP_LEVEL if folder != "docs" for p in sorted((ROOT / folder).rglob("*"))
              if p.suffix in (".py", ".yaml") and p != Path(__file__).resolve()]


def _anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(document: Path) -> set[str]:
    return {_anchor(h) for h in HEADING.findall(document.read_text())}


def _links(document: Path) -> list[tuple[bool, str]]:
    """``(is_image, target)`` of every link to a local file or heading."""
    prose = CODE_BLOCK.sub("", document.read_text())
    return [(bang == "!", target) for bang, target in LINK.findall(prose) if not re.match(r"[a-z]+:", target)]


def _paths(text: str) -> list[str]:
    return [p.rstrip(".,") for p in REPO_PATH.findall(text)]


def _inside(path: Path) -> bool:
    return path == ROOT or ROOT in path.parents


@pytest.mark.parametrize("document", DOCUMENTS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_links_and_images_resolve_inside_the_repository(document):
    broken = []
    for is_image, target in _links(document):
        file, _, anchor = target.partition("#")
        path = (document.parent / file).resolve() if file else document
        if not _inside(path):
            broken.append(f"{target} (outside the repository)")
        elif not path.exists() or (is_image and not path.is_file()):
            broken.append(f"{target} (no such {'image' if is_image else 'file'})")
        elif anchor and path.suffix == ".md" and anchor not in _anchors(path):
            broken.append(f"{target} (no heading with that anchor)")
    assert not broken, f"{document.name}: {broken}"


@pytest.mark.parametrize("document", DOCUMENTS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_repository_paths_in_the_text_exist(document):
    text = document.read_text()
    missing = sorted({p for p in _paths(text) if not (ROOT / p).exists()})
    assert not missing, f"{document.name} names paths that do not exist: {missing}"
    outside = sorted({p for p in re.findall(r"(?<![\w./])(?:\.\./)+[\w./-]*\w", text) if _names_outside(p, document)})
    assert not outside, f"{document.name} points to files outside the repository, which users do not have: {outside}"


def _names_outside(path: str, document: Path) -> bool:
    """Whether ``path`` (``../...``) names nothing inside the repository, read from the document's folder or
    from the repository root, but leaves it from one of them towards a file (it has a suffix) or something that
    exists there. ``../flashbob/blocked.py`` in docs/ is inside; example inputs such as ``../../escape`` (a bad
    run name) name nothing."""
    targets = [(base / path).resolve() for base in (document.parent, ROOT)]
    if any(_inside(target) and target.exists() for target in targets):
        return False
    return any(not _inside(target) and (target.suffix or target.exists()) for target in targets)


def _tests() -> set[str]:
    """The test functions and test modules of tests/."""
    modules = sorted((ROOT / "tests").glob("test_*.py"))
    return {m.stem for m in modules} | {name for m in modules for name in re.findall(r"def (test_\w+)", m.read_text())}


@pytest.mark.parametrize("document", DOCUMENTS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_tests_named_in_the_text_exist(document):
    missing = sorted(set(TEST_NAME.findall(document.read_text())) - _tests())
    assert not missing, f"{document.name} names tests that do not exist: {missing}"


def _stale_docs_path(path: str) -> bool:
    """A ``docs/`` path that is neither under docs/results/ nor an existing document, folder or script (docs/api.py
    writes docs/api.md)."""
    target = ROOT / path
    return not path.startswith("docs/results/") and not (target.exists() and target.suffix in ("", ".md", ".py"))


def test_docs_paths_named_in_the_code_are_documents_or_results():
    stale = sorted({f"{f.relative_to(ROOT)}: {p}" for f in CODE_FILES for p in _paths(f.read_text())
                    if p.startswith("docs/") and _stale_docs_path(p)})
    assert not stale, f"docs paths in the code that are neither a document nor under docs/results/: {stale}"


def test_the_checks_catch_a_stale_path_and_a_broken_image(tmp_path):
    """The patterns find what the tests above rely on them to find."""
    document = tmp_path / "doc.md"
    document.write_text("See flashbob/nothing_here.py, and ![plot](results/missing.png) and [x](#a-heading).\n"
                        "```\nf(x)[0](g)\n```\n## A heading\n| `test_x.py::test_gone` (tests/test_y.py) |\n")
    assert _paths(document.read_text()) == ["flashbob/nothing_here.py", "tests/test_y.py"]
    assert TEST_NAME.findall(document.read_text()) == ["test_gone"]
    assert _links(document) == [(True, "results/missing.png"), (False, "#a-heading")]
    assert _anchors(document) == {"a-heading"}
    assert [p for p in ("docs/algorithm.md", "docs/results/new.csv", "docs/old.csv", "docs/gone.md")
            if _stale_docs_path(p)] == ["docs/old.csv", "docs/gone.md"]
    assert _anchor("Inputs of `flashbob.sdpa` (and `patch_sdpa`)") == "inputs-of-flashbobsdpa-and-patch_sdpa"
