"""Every relative link and anchor in README.md and docs/*.md resolves.

A link `[text](path)`, `[text](path#heading)` or `[text](#heading)` (images too) must name an
existing file or directory, relative to the page that holds it, and its anchor must be a
heading of the target Markdown page, slugged as GitHub does. Links to other sites are not
followed; text inside code blocks and inline code is not a link.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

_FENCE = re.compile(r"^\s*(```|~~~)")
_HEADING = re.compile(r"^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_INLINE_CODE = re.compile(r"(`+).*?\1")
_SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: markup dropped, lowercase, every character other than
    letters, digits, '-', '_' and spaces removed, spaces turned into '-'."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading keeps its text
    text = re.sub(r"<[^>]+>", "", text).strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def _prose_lines(text: str):
    """(line number, line) of the lines outside fenced code blocks."""
    fenced = False
    for n, line in enumerate(text.splitlines(), 1):
        if _FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            yield n, line


def anchors(path: Path) -> set[str]:
    """The anchors of a Markdown page's headings; a repeated heading gets -1, -2, ... as on GitHub."""
    seen: dict[str, int] = {}
    out = set()
    for _, line in _prose_lines(path.read_text(encoding="utf-8")):
        m = _HEADING.match(line)
        if not m:
            continue
        base = slug(m.group(2))
        k = seen.get(base, 0)
        seen[base] = k + 1
        out.add(base if k == 0 else f"{base}-{k}")
    return out


def links(path: Path):
    """(line number, target) of every link on a page, code excluded."""
    for n, line in _prose_lines(path.read_text(encoding="utf-8")):
        for m in _LINK.finditer(_INLINE_CODE.sub("", line)):
            yield n, m.group(1)


def broken_links(pages: list[Path], root: Path = ROOT) -> list[str]:
    """One message per link on `pages` that names a missing file or heading."""
    errors, cache = [], {}
    for page in pages:
        for n, target in links(page):
            if _SCHEME.match(target) or target.startswith("//"):
                continue  # another site
            where = f"{page.relative_to(root)}:{n}: {target}"
            file_part, _, anchor = target.partition("#")
            dest = (page.parent / file_part).resolve() if file_part else page.resolve()
            if not dest.exists():
                errors.append(f"{where}: no such file")
                continue
            if not anchor:
                continue
            if dest.suffix.lower() != ".md" or not dest.is_file():
                errors.append(f"{where}: an anchor into a file that is not a Markdown page")
                continue
            if dest not in cache:
                cache[dest] = anchors(dest)
            if anchor not in cache[dest]:
                errors.append(f"{where}: no heading with the anchor '#{anchor}'")
    return errors


def doc_pages(root: Path = ROOT) -> list[Path]:
    return [root / "README.md", *sorted((root / "docs").glob("*.md"))]


def test_slug_follows_githubs_rules():
    assert slug("Whole rounds at 1.5B (`benchmarks/real_scale.py`)") == "whole-rounds-at-15b-benchmarksreal_scalepy"
    assert slug("What a run shows, and checking a launch first") == "what-a-run-shows-and-checking-a-launch-first"
    assert slug("How long `make run` takes") == "how-long-make-run-takes"
    assert slug("verl keys refused, and why") == "verl-keys-refused-and-why"
    assert slug("A [linked](x.md) title_part - two") == "a-linked-title_part---two"


def test_every_link_and_anchor_resolves():
    pages = doc_pages()
    assert len(pages) > 5 and all(p.exists() for p in pages)
    assert sum(1 for p in pages for _ in links(p)) > 20  # the pages do link to each other
    errors = broken_links(pages)
    assert not errors, "broken links:\n" + "\n".join(errors)


def test_the_check_fails_on_a_broken_link(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "A.md").write_text("# Page A\n\n## Some section: here\n\n```\n# not a heading\n```\n")
    (tmp_path / "README.md").write_text(
        "# Top\n\n"
        "[ok](docs/A.md) [ok](docs/A.md#some-section-here) [ok](#top) [web](https://example.com/x.md)\n"
        "`[in code](missing.md)`\n\n"
        "```\n[in a block](missing.md)\n```\n"
        "[gone](docs/B.md) [bad anchor](docs/A.md#not-a-heading) [bad local](#nowhere)\n"
        "![img](docs/missing.png)\n")
    errors = broken_links(doc_pages(tmp_path), tmp_path)
    assert len(errors) == 4, errors
    assert any("docs/B.md: no such file" in e for e in errors)
    assert any("#not-a-heading" in e for e in errors) and any("#nowhere" in e for e in errors)
    assert any("docs/missing.png" in e for e in errors)
