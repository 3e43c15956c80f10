"""Every relative link of the README and of the pages under `docs/` resolves: the file or folder
it names exists, and an anchor (`page.md#heading`, or `#heading` on the same page) is the slug
of one of that page's headings, as GitHub renders them. Links to other sites are not fetched."""

from __future__ import annotations

import re
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]

FENCE = re.compile(r"^```.*?^```", re.M | re.S)
INLINE_CODE = re.compile(r"`[^`\n]*`")
LINK = re.compile(r"\[[^\]\n]*\]\(([^)\s]+)\)")
HEADING = re.compile(r"^(#{1,6})\s+(.+?)\s*#*\s*$", re.M)


def pages() -> list[Path]:
    return [REPO_ROOT / "README.md", *sorted((REPO_ROOT / "docs").glob("*.md"))]


def prose(text: str) -> str:
    """The text outside fenced blocks (whose `#` lines are comments, not headings)."""
    return FENCE.sub("", text)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: its rendered text lower-cased, punctuation dropped, spaces
    as hyphens (code spans keep their text; a link keeps its text)."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).replace("`", "")
    return re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for _, heading in HEADING.findall(prose(page.read_text())):
        base = slug(heading)
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")  # GitHub numbers repeated headings
    return out


def shown(path: Path) -> str:
    return path.relative_to(REPO_ROOT).as_posix() if path.is_relative_to(REPO_ROOT) else str(path)


def broken_links(page: Path) -> list[str]:
    """Each relative link of `page` that names no existing path or no heading there."""
    broken = []
    for target in LINK.findall(INLINE_CODE.sub("", prose(page.read_text()))):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target}: no such path")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target}: no heading #{anchor} in {shown(dest)}")
    return broken


def test_every_relative_link_resolves():
    found = {shown(p): broken_links(p) for p in pages()}
    assert {page: links for page, links in found.items() if links} == {}


def test_the_docs_have_pages_and_the_readme_links_to_each():
    """The README is the front door: every page under docs/ is reachable from it."""
    linked = {
        (REPO_ROOT / target.partition("#")[0]).resolve()
        for target in LINK.findall(prose((REPO_ROOT / "README.md").read_text()))
        if target.startswith("docs/")
    }
    assert [p for p in pages()[1:] if p.resolve() not in linked] == []


def test_slugs_follow_github():
    assert slug("A note on the `kernels` package name") == "a-note-on-the-kernels-package-name"
    assert slug("Mixture of experts (Qwen3-MoE)") == "mixture-of-experts-qwen3-moe"
    assert slug("Faults, load and bad input") == "faults-load-and-bad-input"
    assert slug("Scaling out: data-parallel replicas") == "scaling-out-data-parallel-replicas"


def test_a_broken_link_is_found(tmp_path):
    (tmp_path / "other.md").write_text("# Other\n\n## Real heading\n")
    page = tmp_path / "page.md"
    page.write_text(
        "# Page\n\n```bash\n# not a heading\n```\n\n"
        "[ok](other.md#real-heading) [ok](#page) [site](https://example.com/x#y) `[code](nope.md)`\n"
        "[gone](missing.md) [bad](other.md#no-such) [here](#not-a-heading)\n"
    )
    assert broken_links(page) == [
        "missing.md: no such path",
        f"other.md#no-such: no heading #no-such in {tmp_path / 'other.md'}",
        "#not-a-heading: no heading #not-a-heading in " + str(page),
    ]
