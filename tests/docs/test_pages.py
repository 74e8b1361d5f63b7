"""The README and docs/ as a reader meets them: every link resolves, every shell block is marked and
parses, every metric, alert and endpoint a page names exists, and the README is a front door."""

from __future__ import annotations

import ast
import re
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.docs import pages
from tests.docs.pages import ROOT

# --- links -----------------------------------------------------------------------------------------


def _rel(page: Path) -> Path | str:
    return page.relative_to(ROOT) if page.is_relative_to(ROOT) else page.name


def _broken_links(page: Path) -> list[str]:
    broken = []
    for line, target in pages.links(page):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto: - not ours to fetch
            continue
        path_part, _, anchor = target.partition("#")
        dest = (page.parent / path_part).resolve() if path_part else page
        where = f"{_rel(page)}:{line}: {target}"
        if not dest.exists():
            broken.append(f"{where} (no such file)")
        elif anchor and dest.suffix == ".md" and anchor not in pages.anchors(dest):
            broken.append(f"{where} (no heading #{anchor} in {_rel(dest)})")
    return broken


@pytest.mark.parametrize("page", pages.pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_link_resolves(page: Path) -> None:
    assert _broken_links(page) == []


def test_a_broken_link_or_anchor_is_caught(tmp_path: Path) -> None:
    (tmp_path / "other.md").write_text("# Other page\n\n## The `fleet` rules, in short\n")
    page = tmp_path / "page.md"
    page.write_text("[ok](other.md#the-fleet-rules-in-short) [gone](missing.md) [bad](other.md#nowhere)\n"
                    "```bash\n[not a link](nowhere.md)\n```\n")
    broken = [b.split(": ", 1)[1] for b in _broken_links(page)]
    assert broken == ["missing.md (no such file)", "other.md#nowhere (no heading #nowhere in other.md)"]


# --- shell blocks ----------------------------------------------------------------------------------

ALL_BLOCKS = [b for page in pages.doc_pages() for b in pages.blocks(page)]
SHELL_BLOCKS = [b for b in ALL_BLOCKS if b.lang in pages.SHELL]


def test_every_shell_block_says_how_it_is_checked() -> None:
    unmarked = [b.where for b in SHELL_BLOCKS if b.check not in pages.CHECKS]
    assert unmarked == [], f"shell blocks without <!-- check: run|run-any|parse --> before them: {unmarked}"
    other = [f"{b.where} ({b.lang})" for b in ALL_BLOCKS if b.lang in pages.REFUSED_SHELLS]
    assert other == [], f"write shell blocks as ```bash (and output as ```text): {other}"
    stray = [b.where for b in ALL_BLOCKS if b.check is not None and b.lang not in pages.SHELL]
    assert stray == [], f"a check marker before a block that is not bash: {stray}"


@pytest.mark.parametrize("block", SHELL_BLOCKS, ids=lambda b: b.where)
def test_every_shell_block_parses(block: pages.Block) -> None:
    done = subprocess.run(["bash", "-n"], input=block.text, capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, f"{block.where}: {done.stderr}"


@pytest.mark.parametrize("block", [b for b in ALL_BLOCKS if b.lang in ("yaml", "json")], ids=lambda b: b.where)
def test_every_yaml_and_json_block_parses(block: pages.Block) -> None:
    text = block.text
    if block.lang == "json":
        import json

        json.loads(text)
    else:
        list(yaml.safe_load_all(text))


# --- names -----------------------------------------------------------------------------------------

_SUFFIXES = ("_total", "_bucket", "_count", "_sum", "_created")


def _literals(paths: list[Path]) -> set[str]:
    out: set[str] = set()
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                out.add(node.value)
    return out


def known_metrics() -> set[str]:
    """Every metric name the sidecar and the servers can expose (their definitions' literals)."""
    wd = _literals([ROOT / "watchdog" / "edge" / "metrics.py"])
    inference = _literals(sorted((ROOT / "inference").rglob("*.py")))
    names = {"gpu_watchdog_" + s for s in wd if re.fullmatch(r"[a-z][a-z0-9_]*", s)}
    names |= {s for s in wd | inference if re.fullmatch(r"gpu_(watchdog|inference)_[a-z0-9_]+", s)}
    return names


def known_alerts() -> set[str]:
    doc = yaml.safe_load((ROOT / "dashboards" / "alerts.yaml").read_text())
    return {rule["alert"] for group in doc["groups"] for rule in group["rules"] if "alert" in rule}


def known_routes() -> set[str]:
    files = [ROOT / "gpu_watchdog" / "contract.py", ROOT / "watchdog" / "edge" / "server.py",
             *sorted((ROOT / "inference").glob("http_*.py")), ROOT / "inference" / "front.py",
             *sorted((ROOT / "inference").glob("agent*.py"))]
    return {s for s in _literals(files) if s.startswith("/")}


def _named(pattern: str, page: Path) -> set[str]:
    return set(re.findall(pattern, page.read_text(encoding="utf-8")))


def _metric_base(name: str) -> str:
    for suffix in _SUFFIXES:
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return name


@pytest.mark.parametrize("page", pages.doc_pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_metric_a_page_names_exists(page: Path) -> None:
    known = known_metrics()
    named = {n for n in _named(r"\bgpu_(?:watchdog|inference)_[a-z0-9_]*[a-z0-9]", page)}
    missing = sorted(n for n in named if n not in known and _metric_base(n) not in known)
    assert missing == [], f"{_rel(page)} names metrics no code defines: {missing}"


@pytest.mark.parametrize("page", pages.doc_pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_alert_a_page_names_exists(page: Path) -> None:
    named = _named(r"\b(GPU(?:Watchdog|Inference|Memory|Xid)[A-Z][A-Za-z]*)\b", page)
    missing = sorted(named - known_alerts())
    assert missing == [], f"{_rel(page)} names alerts dashboards/alerts.yaml lacks: {missing}"


@pytest.mark.parametrize("page", pages.doc_pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_endpoint_a_page_names_exists(page: Path) -> None:
    routes = known_routes()
    named = _named(r"\b(?:GET|POST|PUT|DELETE|PATCH)\s+(/[A-Za-z0-9_./{}-]*[A-Za-z0-9_}])", page)
    named |= _named(r"(/control/[a-z_.]*[a-z_])", page)
    missing = sorted(n for n in named if n.split("?")[0] not in routes)
    assert missing == [], f"{_rel(page)} names endpoints no server routes: {missing}"


def test_the_name_checks_catch_what_does_not_exist(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text("`gpu_watchdog_restarts_total` `gpu_watchdog_restarts_totl` `GPUWatchdogContextLoss` "
                    "`GPUWatchdogContextLost` `GET /control/memory` `POST /control/reboot`\n")
    assert "gpu_watchdog_restarts" in known_metrics() and "gpu_watchdog_restarts_totl" not in known_metrics()
    with pytest.raises(AssertionError, match="restarts_totl"):
        test_every_metric_a_page_names_exists(page)
    with pytest.raises(AssertionError, match="GPUWatchdogContextLost'"):
        test_every_alert_a_page_names_exists(page)
    with pytest.raises(AssertionError, match="/control/reboot"):
        test_every_endpoint_a_page_names_exists(page)


# --- the front door --------------------------------------------------------------------------------

README = ROOT / "README.md"


def test_the_readme_is_short_and_has_its_picture_table_and_first_commands() -> None:
    text = README.read_text(encoding="utf-8")
    assert len(text.splitlines()) <= 200, len(text.splitlines())
    images = [t for _, t in pages.links(README) if t.endswith((".svg", ".png"))]
    assert any((ROOT / t).exists() for t in images), images
    first_screen = "\n".join(text.splitlines()[:60])
    assert "make up" in first_screen and "make test" in first_screen
    assert "helm install" in text
    table = [line for line in text.splitlines() if line.startswith("|") and "](docs/" in line]
    for setup in ("serve", "vLLM", "agent", "HTTP"):
        assert any(setup in row for row in table), (setup, table)


def test_every_docs_page_is_reachable_from_the_readme_or_the_docs_home() -> None:
    linked = {(README.parent / t.partition("#")[0]).resolve() for _, t in pages.links(README)}
    home = ROOT / "docs" / "index.md"
    linked |= {(home.parent / t.partition("#")[0]).resolve() for _, t in pages.links(home)}
    unlinked = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").rglob("*.md")
                      if p.resolve() not in linked and p != home)
    assert unlinked == []


def test_each_docs_page_begins_with_its_title_and_what_the_reader_wants() -> None:
    for page in sorted((ROOT / "docs").rglob("*.md")):
        lines = [line for line in page.read_text(encoding="utf-8").splitlines() if line.strip()]
        assert lines[0].startswith("# "), page
        first = next(line for line in lines[1:] if not line.startswith("<!--"))
        assert not first.startswith(("#", "|", "```", "-", "!")), f"{page}: begin with a sentence, not {first!r}"
