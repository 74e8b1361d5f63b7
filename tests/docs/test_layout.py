"""docs/development.md's layout of the sidecar is the tree: every module and folder of each layer is
named under it, and nothing it names is missing, so a newcomer's map cannot drift from the code."""

from __future__ import annotations

import re

from tests.docs.pages import ROOT

LAYERS = ("cli", "runtime", "edge", "core")


def layout_block() -> list[str]:
    text = (ROOT / "docs" / "development.md").read_text()
    block = re.search(r"^## Layout\n.*?```text\n(.*?)```", text, re.S | re.M)
    assert block is not None, "docs/development.md has no layout block under ## Layout"
    return block.group(1).splitlines()


def documented() -> dict[str, set[str]]:
    """Each layer's names as the layout lists them: modules bare, folders with their slash."""
    lines = layout_block()
    start = next(i for i, line in enumerate(lines) if line.startswith("watchdog/"))
    layers: dict[str, set[str]] = {}
    layer = None
    for line in lines[start + 1:]:
        if not line.startswith("  "):
            break  # the next top-level folder
        header = re.match(r"^  (\w+)/\s", line)
        if header:
            layer = header.group(1)
            layers[layer] = set()
            continue
        if layer is None or not line.startswith("    ") or line[4:5] == " ":
            continue  # a description running on
        left = re.split(r"\s{2,}", line[4:].rstrip(), maxsplit=1)[0]
        names = [n.strip() for n in left.split(",") if n.strip()]
        assert all(re.fullmatch(r"\w+/?", n) for n in names), f"not a row of names: {line!r}"
        layers[layer] |= set(names)
    return layers


def in_tree(layer: str) -> set[str]:
    folder = ROOT / "watchdog" / layer
    return {p.stem for p in folder.glob("*.py") if p.stem != "__init__"} | \
        {f"{p.name}/" for p in folder.iterdir() if p.is_dir() and (p / "__init__.py").exists()}


def test_the_sidecar_is_its_four_layers_and_nothing_beside_them() -> None:
    top = ROOT / "watchdog"
    assert {p.stem for p in top.glob("*.py")} == {"__init__"}, "a module beside the layers"
    assert {p.name for p in top.iterdir() if p.is_dir() and (p / "__init__.py").exists()} == set(LAYERS)


def test_the_layout_names_every_module_of_each_layer_and_only_those() -> None:
    docs = documented()
    assert sorted(docs) == sorted(LAYERS), docs.keys()
    for layer in LAYERS:
        missing, stale = in_tree(layer) - docs[layer], docs[layer] - in_tree(layer)
        assert not missing and not stale, f"watchdog/{layer}/: not in the layout {sorted(missing)}," \
                                          f" in the layout but not the tree {sorted(stale)}"


def test_the_layout_reader_reads_names_on_continued_lines_and_folders() -> None:
    """The reader itself: a row of names that runs on over several lines, and folders by their slash."""
    docs = documented()
    assert {"xid_catalog", "idle_memory", "correctness", "config_schema"} <= docs["core"]
    assert "policy" in docs["core"] and "samplers/" in docs["edge"] and "run" in docs["cli"]
    assert "commands" in docs["cli"] and "app" in docs["runtime"]


def test_the_tests_keep_to_their_folders() -> None:
    """What docs/development.md says of the test folders holds: a unit test starts no process (those
    that need one live in tests/cli or tests/integration), and no test module imports another (shared
    helpers live in modules of their own)."""
    starts = re.compile(r"^\s*(import subprocess|from subprocess|import multiprocessing|from multiprocessing)"
                        r"|create_subprocess_(exec|shell)|Popen\(", re.M)
    unit = sorted(p.name for p in (ROOT / "tests" / "unit").glob("*.py") if starts.search(p.read_text()))
    assert unit == [], f"unit tests that start a process: {unit}"
    imports = re.compile(r"^\s*(from|import)\s+tests(\.\w+)*\.(test_\w+|conftest)\b", re.M)
    crossing = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests").rglob("*.py")
                      if imports.search(p.read_text()))
    assert crossing == [], f"modules that import a test module: {crossing}"
