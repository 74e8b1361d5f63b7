"""Every `helm install` or `helm upgrade` of the chart the pages show needs a cluster to run, so it is
rendered instead: its `--set` values and the values files it names, by the real Helm SDK, as the
install would render them. A misspelt key or a value the chart refuses fails here."""

from __future__ import annotations

import re
import shlex
from typing import Any

import pytest
import yaml

from tests.chart.rendering import render
from tests.docs import pages
from tests.docs.pages import ROOT

CHART_PATHS = ("./helm/gpu-watchdog", "helm/gpu-watchdog")


def _commands(text: str) -> list[list[str]]:
    joined = re.sub(r"\\\n\s*", " ", text)
    out = []
    for line in joined.splitlines():
        line = line.split(" #", 1)[0].strip()
        for part in re.split(r"&&|;", line):
            try:
                words = shlex.split(part)
            except ValueError:
                continue
            if len(words) >= 4 and words[0] == "helm" and words[1] in ("install", "upgrade") \
                    and any(w in CHART_PATHS for w in words):
                out.append(words)
    return out


INSTALLS = [(b, words) for page in pages.doc_pages() for b in pages.blocks(page) if b.lang in pages.SHELL
            for words in _commands(b.text)]


def _typed(value: str) -> Any:
    """A `--set` value as Helm reads it: numbers, booleans and null typed, `{a,b}` a list."""
    if value.startswith("{") and value.endswith("}"):
        return [_typed(v) for v in value[1:-1].split(",") if v]
    if value in ("true", "false"):
        return value == "true"
    if value == "null":
        return None
    if re.fullmatch(r"-?\d+", value):
        return int(value)
    return value


def _set(values: dict[str, Any], assignment: str, typed: bool = True) -> None:
    key, _, raw = assignment.partition("=")
    node = values
    parts = key.split(".")
    for part in parts[:-1]:
        node = node.setdefault(part, {})
    node[parts[-1]] = _typed(raw) if typed else raw


def values_of(words: list[str]) -> dict[str, Any]:
    values: dict[str, Any] = {}
    args = iter(words[2:])
    for word in args:
        flag, eq, inline = word.partition("=")
        if flag in ("--set", "--set-string"):
            text = inline if eq else next(args)
            for assignment in re.split(r",(?![^{]*})", text):
                _set(values, assignment, typed=flag == "--set")
        elif flag in ("-f", "--values"):
            path = ROOT / (inline if eq else next(args))
            if path.exists():
                values.update(yaml.safe_load(path.read_text()) or {})
    return values


def test_the_pages_show_how_to_install_the_chart() -> None:
    assert any(b.page.name == "README.md" for b, _ in INSTALLS)
    assert values_of(["helm", "install", "m", "./helm/gpu-watchdog", "--set", "a.b=2,c={x,y}",
                      "--set-string", "d=3"]) == {"a": {"b": 2}, "c": ["x", "y"], "d": "3"}


@pytest.mark.parametrize(("block", "words"), INSTALLS, ids=[f"{b.where}:{i}" for i, (b, _) in enumerate(INSTALLS)])
def test_the_install_renders(block: pages.Block, words: list[str]) -> None:
    docs = render(values_of(words))
    kinds = {d["kind"] for d in docs}
    assert "Deployment" in kinds, (block.where, sorted(kinds))
