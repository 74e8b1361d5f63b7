"""The project's Markdown read as a reader's browser would: pages, their headings' anchors, links and
code blocks with the check each shell block is marked for (`<!-- check: run|run-any|parse -->`)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent
DOCS = ROOT / "docs"
SHELL = ("bash",)
REFUSED_SHELLS = ("sh", "shell", "console", "zsh")
CHECKS = ("run", "run-any", "parse")
_FENCE = re.compile(r"^(\s*)(`{3,}|~{3,})\s*([\w+-]*)")
_MARKER = re.compile(r"^\s*<!--\s*check:\s*([\w-]+)\s*-->\s*$")
_LINK = re.compile(r"!?\[(?:[^\]\[]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
_ANCHOR_TAG = re.compile(r"<a\s+(?:id|name)=\"([^\"]+)\"")


@dataclass(frozen=True)
class Block:
    page: Path
    line: int  # of the opening fence, 1-based
    lang: str
    text: str
    check: str | None  # the marker on the line before the fence

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def pages() -> list[Path]:
    """Every page a reader meets: the README, docs/ and the other Markdown the docs link to."""
    found = [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]
    return [*found, ROOT / "helm" / "gpu-watchdog" / "README.md", ROOT / "dashboards" / "RUNBOOK.md"]


def doc_pages() -> list[Path]:
    """The pages whose blocks and names are ours to check: the README and docs/."""
    return [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]


def blocks(page: Path) -> list[Block]:
    out: list[Block] = []
    lines = page.read_text(encoding="utf-8").splitlines()
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        fence, lang, start = m.group(2), m.group(3).lower(), i
        body: list[str] = []
        i += 1
        while i < len(lines) and not lines[i].strip().startswith(fence):
            body.append(lines[i])
            i += 1
        prev = lines[start - 1] if start > 0 else ""
        marker = _MARKER.match(prev)
        out.append(Block(page, start + 1, lang, "\n".join(body) + "\n", marker.group(1) if marker else None))
        i += 1
    return out


def prose(page: Path) -> str:
    """The page without its code blocks (links and names inside code are not the page's own)."""
    lines = page.read_text(encoding="utf-8").splitlines()
    out, fence = [], None
    for line in lines:
        m = _FENCE.match(line)
        if fence is None and m:
            fence = m.group(2)
            out.append("")
            continue
        if fence is not None:
            if line.strip().startswith(fence):
                fence = None
            out.append("")
            continue
        out.append(line)
    return "\n".join(out)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: inline markup dropped, lower case, punctuation out, spaces to -."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)
    text = re.sub(r"<[^>]+>", "", text).replace("`", "").lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    out: set[str] = set()
    for line in prose(page).splitlines():
        m = _HEADING.match(line)
        if m:
            base = slug(m.group(2))
            n = seen.get(base, 0)
            out.add(base if n == 0 else f"{base}-{n}")
            seen[base] = n + 1
        out.update(_ANCHOR_TAG.findall(line))
    return out


def links(page: Path) -> list[tuple[int, str]]:
    """(line, target) of every link and image in the page's prose."""
    out = []
    for n, line in enumerate(prose(page).splitlines(), 1):
        out.extend((n, target) for target in _LINK.findall(line))
    return out
