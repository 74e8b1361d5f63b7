"""The documentation's pictures are what tools/pictures.py writes, well-formed, and name what they must."""

from __future__ import annotations

import importlib.util
import sys
import xml.etree.ElementTree as ET
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]
SVG = "{http://www.w3.org/2000/svg}"


def _load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("docs_pictures", ROOT / "tools" / "pictures.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is made
    spec.loader.exec_module(module)
    return module


PICTURES = _load().render()


def test_three_pictures() -> None:
    assert sorted(PICTURES) == ["docs/pictures/ladder.svg", "docs/pictures/pod.svg",
                                "docs/pictures/restart-timeline.svg"]


def test_render_is_deterministic() -> None:
    assert _load().render() == PICTURES


@pytest.mark.parametrize("rel", sorted(PICTURES))
def test_committed_file_is_current(rel: str) -> None:
    path = ROOT / rel
    assert path.exists(), f"{rel} is missing: run `python tools/pictures.py`"
    assert path.read_text(encoding="utf-8") == PICTURES[rel], f"{rel} is stale: run `python tools/pictures.py`"


@pytest.mark.parametrize("rel", sorted(PICTURES))
def test_well_formed_with_a_title(rel: str) -> None:
    root = ET.fromstring(PICTURES[rel].encode("utf-8"))
    assert root.tag == f"{SVG}svg"
    title = root.find(f"{SVG}title")
    assert title is not None and (title.text or "").strip(), f"{rel} has no <title>"
    desc = root.find(f"{SVG}desc")
    assert desc is not None and (desc.text or "").strip(), f"{rel} has no <desc>"


def test_pod_names_its_ports_and_the_lease() -> None:
    root = ET.fromstring(PICTURES["docs/pictures/pod.svg"].encode("utf-8"))
    shown = " ".join("".join(t.itertext()) for t in root.iter(f"{SVG}text"))
    for must in ("8000", "8001", "9402", "Lease"):
        assert must in shown, f"the pod picture does not show {must}"
