"""The README and docs/ pages link to each other: every relative link names a file that exists and, with a
#anchor, a heading that page has (GitHub's anchor rule); every docs page is reachable from the README, and
every repo path a page quotes in backticks exists."""
from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import unquote

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = sorted([ROOT / "README.md", ROOT / "DEVELOPERS.md", *(ROOT / "docs").rglob("*.md")])
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)|!\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^(```|~~~)")
CODE_SPAN = re.compile(r"`([^`]+)`")
# a repo path quoted in code: starts with one of the repo's top-level folders (globs and placeholders aside)
REPO_PATH = re.compile(r"^(?:shared|router|prefill_svc|decode_svc|colocated_svc|pdserve|tests|benchmarks"
                       r"|scripts|k8s|proto|docs)/[\w./-]*$")


def prose_lines(page: Path) -> list[str]:
    """The page's lines outside fenced code blocks."""
    lines, in_fence = [], False
    for line in page.read_text(encoding="utf-8").splitlines():
        if FENCE.match(line.strip()):
            in_fence = not in_fence
        elif not in_fence:
            lines.append(line)
    return lines


def anchors(page: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens, repeats numbered."""
    seen: dict[str, int] = {}
    result = set()
    for line in prose_lines(page):
        match = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not match:
            continue
        slug = re.sub(r"[^\w\- ]", "", match.group(1).lower()).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        result.add(slug if count == 0 else f"{slug}-{count}")
    return result


def relative_links(page: Path) -> list[str]:
    targets = []
    for line in prose_lines(page):
        for match in LINK.finditer(line):
            target = match.group(1) or match.group(2)
            if not re.match(r"^[a-z][a-z0-9+.-]*:", target):   # http:, https:, mailto: are not ours
                targets.append(target)
    return targets


def resolve(page: Path, target: str) -> tuple[Path, str]:
    path_part, _, anchor = target.partition("#")
    file = (page.parent / unquote(path_part)).resolve() if path_part else page
    return file, anchor


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_names_a_file_and_heading_that_exist(page):
    broken = []
    for target in relative_links(page):
        file, anchor = resolve(page, target)
        if not file.exists():
            broken.append(f"{target}: no file {file.relative_to(ROOT) if file.is_relative_to(ROOT) else file}")
        elif anchor and file.suffix == ".md" and anchor not in anchors(file):
            broken.append(f"{target}: {file.name} has no heading with anchor #{anchor}")
    assert not broken, f"{page.relative_to(ROOT)}: broken links:\n" + "\n".join(broken)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_repo_path_quoted_in_a_page_exists(page):
    missing = []
    for line in page.read_text(encoding="utf-8").splitlines():
        for span in CODE_SPAN.finditer(line):
            for word in span.group(1).split():
                path = word.rstrip(".,:;)")
                if REPO_PATH.match(path) and not (ROOT / path).exists():
                    missing.append(path)
    assert not missing, (f"{page.relative_to(ROOT)} names paths that do not exist (moved? update the page): "
                         + ", ".join(sorted(set(missing))))


def test_every_docs_page_is_reachable_from_the_readme():
    reached, queue = set(), [ROOT / "README.md"]
    while queue:
        page = queue.pop()
        if page in reached:
            continue
        reached.add(page)
        for target in relative_links(page):
            file, _ = resolve(page, target)
            if file.suffix == ".md" and file.exists():
                queue.append(file)
    unreached = [str(p.relative_to(ROOT)) for p in PAGES if p not in reached]
    assert not unreached, f"pages no link from the README leads to: {unreached}"


def test_the_readme_is_a_front_page():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(readme.splitlines()) <= 150, "the README is a front page: 150 lines at most, the rest in docs/"
    # CI runs the README's test command (.ci/run); the README must show it
    assert "python -m pytest -q\n" in readme or "python -m pytest -q " in readme
