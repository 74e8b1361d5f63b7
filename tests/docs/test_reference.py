"""The generated references say what their definitions say: the configuration reference is read off
the settings dataclasses, the values reference and the chart README's table off values.yaml and
values.schema.json, and a test fails the moment a committed copy differs."""

from __future__ import annotations

import dataclasses
import importlib.util
import shutil
import typing
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import yaml

from gpu_watchdog.watchdog.edge import config
from tests.docs.pages import ROOT


def _load(root: Path = ROOT) -> ModuleType:
    spec = importlib.util.spec_from_file_location("reference", root / "tools" / "reference.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


reference = _load()


def test_the_committed_references_are_the_generated_ones() -> None:
    assert reference.stale() == [], "run `make docs` (python tools/reference.py) and commit the result"


def _keys(cls: type[Any], prefix: str = "") -> list[str]:
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        inner = [a for a in typing.get_args(hints[f.name]) if a is not type(None)] or [hints[f.name]]
        if dataclasses.is_dataclass(inner[0]) and isinstance(inner[0], type):
            out += _keys(inner[0], f"{prefix}{f.name}.")
        else:
            out.append(prefix + f.name)
    return out


def test_every_setting_is_in_the_configuration_reference_with_its_meaning() -> None:
    page = (ROOT / reference.CONFIG_PAGE).read_text()
    keys = _keys(config.Settings)
    assert len(keys) > 70
    for key in keys:
        row = next((line for line in page.splitlines() if line.startswith(f"| `{key}` |")), None)
        assert row is not None, key
        assert row.rstrip(" |").split(" | ")[-1].strip(), f"{key}: no meaning"


def test_a_bound_the_loader_enforces_is_the_one_the_reference_states() -> None:
    page = (ROOT / reference.CONFIG_PAGE).read_text()
    assert "| `policy.quarantine.failures` | integer | `2` | at least 2 |" in page
    with pytest.raises(config.ConfigError, match=r"policy\.quarantine\.failures: must be at least 2"):
        config.from_mapping({"policy": {"quarantine": {"failures": 1}}, "restart": {"strategy": "none"}})
    assert "| `target.workers` | integer | `1` | between 1 and 256 |" in page
    with pytest.raises(config.ConfigError, match=r"target\.workers: must be between 1 and 256"):
        config.from_mapping({"target": {"workers": 257}, "restart": {"strategy": "none"}})


def test_every_chart_value_is_in_the_values_reference() -> None:
    values = yaml.safe_load((ROOT / "helm" / "gpu-watchdog" / "values.yaml").read_text())
    page = (ROOT / reference.VALUES_PAGE).read_text()
    keys = [k for k, _ in reference._leaves(values)]
    assert "inference.batching.maxBatchSize" in keys and "watchdog.config" in keys
    for key in keys:
        assert f"| `{key}` |" in page, key


def test_a_stale_copy_is_named_and_regenerated(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for part in ("tools", "docs/reference", "helm/gpu-watchdog"):
        shutil.copytree(ROOT / part, tmp_path / part)
    copy = _load(tmp_path)
    page = tmp_path / copy.CONFIG_PAGE
    page.write_text(page.read_text().replace("| at least 2 |", "| at least 3 |"))
    assert copy.main(["--check"]) == 1
    assert f"{copy.CONFIG_PAGE}: differs from its definitions; run `make docs`" in capsys.readouterr().err
    assert copy.main([]) == 0 and copy.main(["--check"]) == 0
    assert "| at least 2 |" in page.read_text()


def test_a_setting_without_a_meaning_is_refused() -> None:
    @dataclasses.dataclass(frozen=True)
    class Bare:
        knob: int = 3

    with pytest.raises(SystemExit, match=r"bare\.knob: its field has no meaning"):
        reference._config_rows(Bare, "bare")


def test_the_defaults_block_of_the_configuration_page_is_the_settings_own(monkeypatch: pytest.MonkeyPatch) -> None:
    """docs/configuration.md shows every key at its default: loaded, it is the settings' defaults, and
    it leaves no key out."""
    from tests.docs import pages

    page = ROOT / "docs" / "configuration.md"
    text = page.read_text()
    heading_line = text[: text.index("## The defaults")].count("\n") + 1
    block = next(b for b in pages.blocks(page) if b.lang == "yaml" and b.line > heading_line)
    shown = yaml.safe_load(block.text)
    for var in ("POD_NAME", "POD_NAMESPACE", "NODE_NAME", "GPU_WATCHDOG_WORKLOAD"):
        monkeypatch.setenv(var, f"<{var}>")
    assert config.from_mapping(shown) == config.from_mapping({})

    def keys(d: Any, prefix: str = "") -> set[str]:
        return {k for name, v in d.items() for k in (keys(v, f"{prefix}{name}.") if isinstance(v, dict) and v
                                                     else {prefix + name})}

    # A section that is null by default (`target.http`) is shown as null, its keys with it.
    expected = {k for k in _keys(config.Settings) if not k.startswith("target.http.")} | {"target.http"}
    assert keys(shown) >= expected, sorted(expected - keys(shown))
