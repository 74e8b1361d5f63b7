"""The docs build as a site with MkDocs, strictly: every page in the navigation, none left out, every
link between pages found."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.docs.pages import DOCS, ROOT


def test_the_docs_build_as_a_site(tmp_path: Path) -> None:
    site = tmp_path / "site"
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-4000:]
    for page in DOCS.rglob("*.md"):
        relative = page.relative_to(DOCS).with_suffix("")
        built = site / ("index.html" if relative == Path("index") else relative / "index.html")
        assert built.exists(), built
    assert (site / "pictures" / "pod.svg").exists()
