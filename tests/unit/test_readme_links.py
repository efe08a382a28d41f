"""The README stays a front door and its map into docs/ stays true.

* README.md is at most 12 KiB: what kvlens is, one picture, the two
  commands, production's one flag and a table of contents; everything else
  lives in docs/ by topic (issue 33).
* Every relative link in README.md and docs/*.md names a file that exists,
  and every ``#anchor`` into a markdown file (or within one) matches one of
  its headings under GitHub's slug rules.
* The image the README shows exists and is a PNG.
"""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path
from urllib.parse import unquote

import pytest

REPO = Path(__file__).resolve().parents[2]
README_MAX_BYTES = 12 * 1024

FENCE = re.compile(r"^(\s*)(```|~~~)")
INLINE_CODE = re.compile(r"(`+)(?:(?!\1).)+?\1")
#: [text](target) and ![alt](target), with an optional "title"
LINK = re.compile(r"(!?)\[((?:[^\[\]]|\[[^\]]*\])*)\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^\s{0,3}(#{1,6})\s+(.*?)(?:\s+#+)?\s*$")
HTML_ANCHOR = re.compile(r"<a\s+(?:name|id)=\"([^\"]+)\"", re.I)


def prose_lines(text: str) -> list[tuple[int, str]]:
    """(line number, line) outside fenced code blocks."""
    out, fence = [], None
    for n, line in enumerate(text.split("\n"), 1):
        m = FENCE.match(line)
        if m:
            if fence is None:
                fence = m.group(2)
            elif m.group(2) == fence:
                fence = None
            continue
        if fence is None:
            out.append((n, line))
    return out


def slug(heading: str) -> str:
    """GitHub's anchor for a heading's text (github-slugger): markdown
    markup dropped, lower case, every character but letters, digits, ``_``,
    ``-`` and spaces removed, spaces turned into hyphens (runs kept)."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's text only
    text = text.replace("`", "").replace("*", "")
    text = re.sub(r"<[^>]+>", "", text)
    text = re.sub(r"[^\w\- ]", "", text.strip().lower())
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every anchor a markdown file offers: its headings' slugs (repeats get
    -1, -2, ... as on GitHub) and explicit <a name/id> tags."""
    seen: Counter[str] = Counter()
    out = set()
    for _, line in prose_lines(path.read_text(encoding="utf-8")):
        m = HEADING.match(line)
        if m:
            s = slug(m.group(2))
            out.add(s if not seen[s] else f"{s}-{seen[s]}")
            seen[s] += 1
        out.update(a for a in HTML_ANCHOR.findall(line))
    return out


def links(path: Path) -> list[tuple[int, bool, str]]:
    """(line, is_image, target) of every markdown link outside code."""
    out = []
    for n, line in prose_lines(path.read_text(encoding="utf-8")):
        for m in LINK.finditer(INLINE_CODE.sub("", line)):
            out.append((n, m.group(1) == "!", m.group(3)))
    return out


def broken_links(path: Path, root: Path) -> list[str]:
    """What is wrong with ``path``'s relative links, one line each."""
    bad = []
    for n, _, target in links(path):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):  # http:, https:, mailto:, ...
            continue
        file_part, _, anchor = target.partition("#")
        dest = (path.parent / unquote(file_part)).resolve() if file_part else path.resolve()
        where = f"{path.relative_to(root)}:{n}: {target}"
        if not dest.is_relative_to(root.resolve()):
            bad.append(f"{where}: points outside the repository")
        elif not dest.exists():
            bad.append(f"{where}: no such file")
        elif anchor and dest.suffix == ".md" and unquote(anchor) not in anchors(dest):
            bad.append(f"{where}: no heading with anchor #{anchor} in {dest.relative_to(root.resolve())}")
    return bad


def markdown_files(root: Path = REPO) -> list[Path]:
    return [root / "README.md", *sorted((root / "docs").glob("*.md"))]


def test_readme_is_at_most_12_kib():
    size = (REPO / "README.md").stat().st_size
    assert size <= README_MAX_BYTES, (
        f"README.md is {size} bytes, over {README_MAX_BYTES}: move the detail to docs/ and link it"
    )


@pytest.mark.parametrize("md", markdown_files(), ids=lambda p: str(p.relative_to(REPO)))
def test_relative_links_and_anchors_resolve(md):
    assert not broken_links(md, REPO), "\n".join(broken_links(md, REPO))


def test_readme_shows_an_image_that_exists():
    images = [t for _, is_image, t in links(REPO / "README.md") if is_image and not re.match(r"^[a-z]+:", t)]
    assert images, "README.md shows no picture (the dashboard screenshot, docs/dashboard.png)"
    for target in images:
        img = REPO / unquote(target.partition("#")[0])
        assert img.is_file(), f"README.md shows {target}, which does not exist"
        assert img.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", f"{target} is not a PNG"


def test_readme_links_every_docs_page():
    """The README's table of contents names every page of docs/."""
    linked = {(REPO / t.partition("#")[0]).resolve() for _, _, t in links(REPO / "README.md")}
    missing = [p.name for p in sorted((REPO / "docs").glob("*.md")) if p.resolve() not in linked]
    assert not missing, f"docs/ pages the README does not link: {missing}"


@pytest.mark.parametrize(
    "heading, expected",
    [
        ("One collector's CPU per span", "one-collectors-cpu-per-span"),
        ("What `kvlens up --tp` does (kvlens/stack)", "what-kvlens-up---tp-does-kvlensstack"),
        ("A store the fleet shares: PostgreSQL", "a-store-the-fleet-shares-postgresql"),
        (
            "Fleet scale: a summary of every request, spans of the slow ones",
            "fleet-scale-a-summary-of-every-request-spans-of-the-slow-ones",
        ),
        ("Where to add …", "where-to-add-"),
        (
            "P/D pairs (stock `NixlConnector`, pull, through `kvlens proxy`)",
            "pd-pairs-stock-nixlconnector-pull-through-kvlens-proxy",
        ),
        ("**Bold** and [a link](x.md)", "bold-and-a-link"),
    ],
)
def test_slug_follows_github(heading, expected):
    assert slug(heading) == expected


def test_the_checker_catches_broken_links(tmp_path):
    """A missing file, a missing anchor and a repeated heading's anchor."""
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.md").write_text("# A\n\n## Same\n\ntext\n\n## Same\n\n```\n## not a heading\n```\n")
    (tmp_path / "README.md").write_text(
        "[ok](docs/a.md#same-1) [ok2](#top) [gone](docs/b.md) [bad](docs/a.md#not-a-heading)\n"
        '`[in code](docs/c.md)` [web](https://example.com/x.md) <a name="top"></a>\n'
        "```\n[fenced](docs/d.md)\n```\n"
    )
    bad = broken_links(tmp_path / "README.md", tmp_path)
    assert len(bad) == 2, bad
    assert "docs/b.md: no such file" in bad[0]
    assert "#not-a-heading" in bad[1]
