"""JSON Schema of the sidecar's YAML config, read off the settings dataclasses in `watchdog.core.settings`.

The Helm chart embeds it under `watchdog.config` in `values.schema.json`, so a misspelt key or a
wrong type fails `helm install` with the key path instead of crash-looping the sidecar at start.
The schema is derived at generation time, never written by hand: a setting added to
`watchdog.config` reaches the chart with one command,

    python -m gpu_watchdog.watchdog.core.config_schema          # rewrite the chart's values.schema.json
    python -m gpu_watchdog.watchdog.core.config_schema --check  # exit 1 when the chart's copy is stale

(`make chart-schema` runs the first). Cross-field rules (`_check` in `watchdog.edge.config`) stay with
the sidecar: JSON Schema cannot say "retry_max >= retry_initial" in a way Helm reports clearly.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import types
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from gpu_watchdog.watchdog.core import names, settings

CHART_SCHEMA = Path(__file__).resolve().parents[2] / "helm" / "gpu-watchdog" / "values.schema.json"
REGENERATE = "`python -m gpu_watchdog.watchdog.core.config_schema` (or `make chart-schema`)"

# Keys the chart fills in from its own values (ports, paths, the downward API); a value set for
# them under watchdog.config would be overwritten, so the chart refuses it instead.
CHART_OWNED = frozenset({
    "server",
    "kubernetes.pod_name", "kubernetes.namespace", "kubernetes.node_name", "kubernetes.kubeconfig",
    "kubernetes.pod_resources_socket", "kubernetes.workload", "policy.escalation.node_event",
    "target.control_url", "target.token_file", "target.openai_url", "target.metrics_url", "target.api_key_file",
    "recorder.path",
})
# Choices that cannot work in a pod: `local` restarts a child process only `gpu-watchdog up` owns.
CHART_EXCLUDED_CHOICES: Mapping[str, frozenset[str]] = {"restart.strategy": frozenset({"local"})}

_DURATION_PATTERN = r"^\s*\d+(\.\d+)?\s*(ms|s|m|h|d)?\s*$"
_RATIO_PATTERN = r"^\s*\d+(\.\d+)?\s*%?\s*$"
# Shared by every duration and ratio field; `$ref`s to these resolve against the schema's root.
DEFINITIONS: dict[str, Any] = {
    "configDuration": {"anyOf": [{"type": "number", "minimum": 0}, {"type": "string", "pattern": _DURATION_PATTERN}],
                       "description": "a duration: 30s, 10m, 24h, 250ms, or a number of seconds"},
    "configPositiveDuration": {"anyOf": [{"type": "number", "exclusiveMinimum": 0},
                                         {"type": "string", "pattern": _DURATION_PATTERN}],
                               "description": "a duration above zero: 30s, 10m, 24h, 250ms, or a number of seconds"},
    "configRatio": {"anyOf": [{"type": "number", "minimum": 0, "maximum": 1},
                              {"type": "string", "pattern": _RATIO_PATTERN}],
                    "description": "a ratio: 0.12 or 12%"},
}


def _nullable(schema: dict[str, Any]) -> dict[str, Any]:
    return {"anyOf": [schema, {"type": "null"}]}


def _scalar(tp: Any, meta: Mapping[str, Any], path: str, excluded: Mapping[str, frozenset[str]]) -> dict[str, Any]:
    kind = meta.get("kind")
    if kind == "duration":
        return {"$ref": f"#/definitions/{'configPositiveDuration' if meta.get('positive') else 'configDuration'}"}
    if kind == "ratio":
        return {"$ref": "#/definitions/configRatio"}
    if kind == "size":
        return {"anyOf": [{"type": "integer", "minimum": meta.get("min", 0)},
                          {"type": "string", "pattern": r"^\s*\d+(\.\d+)?\s*([KkMmGgTt]i?[Bb]|[Bb])?\s*$"}]}
    if kind == "share":
        return {"anyOf": [{"type": "integer", "minimum": 1},
                          {"type": "string", "pattern": r"^\s*\d+(\.\d+)?\s*%?\s*$"}],
                "description": "a count of replicas (2) or a share of them (25%)"}
    if kind == "enforce":
        word = {"type": "string", "enum": list(names.ENFORCEABLE)}
        return {"anyOf": [word, {"type": "array", "items": word}],
                "description": "all, shadow, or a list of the actions and reasons enforced"}
    if tp is bool:
        return {"type": "boolean"}
    if tp is int:
        return {"type": "integer", "minimum": meta.get("min", 0),
                **({"maximum": meta["max"]} if "max" in meta else {})}
    if tp is float:
        low = {"exclusiveMinimum": meta["gt"]} if "gt" in meta else {"minimum": meta.get("min", 0)}
        high = {"exclusiveMaximum": meta["lt"]} if "lt" in meta else {"maximum": meta["max"]} if "max" in meta else {}
        return {"type": "number", **low, **high}
    if tp is str:
        choices = meta.get("choices")
        if choices:
            drop = excluded.get(path, frozenset())
            return {"type": "string", "enum": [c for c in choices if c not in drop]}
        return {"type": "string"}
    return _generic(tp, path, excluded)


def _generic(tp: Any, path: str, excluded: Mapping[str, frozenset[str]]) -> dict[str, Any]:
    """Containers and literals: settings others add need not be plain scalars."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin is typing.Literal:
        return {"enum": list(args)}
    if origin in (dict, Mapping) or tp is dict:
        value = _type_schema(args[1], {}, path + ".*", excluded, set()) if len(args) == 2 else {}
        return {"type": "object", "additionalProperties": value} if value else {"type": "object"}
    if origin in (list, tuple, Sequence) or tp in (list, tuple):
        items = [a for a in args if a is not Ellipsis]
        if len(items) == 1:
            return {"type": "array", "items": _type_schema(items[0], {}, path + "[]", excluded, set())}
        return {"type": "array"}
    # Any or a type this generator does not know: accepted here, checked by the sidecar at start.
    return {}


def _type_schema(tp: Any, meta: Mapping[str, Any], path: str, excluded: Mapping[str, frozenset[str]],
                 omit: set[str]) -> dict[str, Any]:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        rest = [a for a in args if a is not type(None)]
        inner = (_type_schema(rest[0], meta, path, excluded, omit) if len(rest) == 1
                 else {"anyOf": [_type_schema(a, meta, path, excluded, omit) for a in rest]})
        return _nullable(inner) if type(None) in args else inner
    if dataclasses.is_dataclass(tp) and isinstance(tp, type):
        return dataclass_schema(tp, path, excluded, omit)
    return _scalar(tp, meta, path, excluded)


def dataclass_schema(cls: type[Any], path: str = "", excluded: Mapping[str, frozenset[str]] | None = None,
                     omit: set[str] | frozenset[str] = frozenset()) -> dict[str, Any]:
    """An object schema: every field of `cls` optional (all have defaults), nothing else allowed."""
    excluded = excluded or {}
    hints = typing.get_type_hints(cls)
    properties: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        where = f"{path}.{f.name}" if path else f.name
        if where in omit:
            continue
        schema = _type_schema(hints[f.name], f.metadata, where, excluded, set(omit))
        meaning = f.metadata.get("help") or section_meaning(hints[f.name])
        properties[f.name] = {**schema, "description": meaning} if meaning else schema
    return {"type": "object", "additionalProperties": False, "properties": properties}


def section_meaning(tp: Any) -> str:
    """A section's meaning: its settings class's docstring, if it has one."""
    args = [a for a in typing.get_args(tp) if a is not type(None)] or [tp]
    cls = args[0]
    doc = cls.__doc__ if dataclasses.is_dataclass(cls) and isinstance(cls, type) else None
    if not doc or doc.startswith(f"{cls.__name__}("):  # dataclasses write a signature where there is none
        return ""
    return " ".join(doc.split())


def settings_schema() -> dict[str, Any]:
    """The whole config file, as `gpu-watchdog run --config` reads it."""
    return {"$schema": "http://json-schema.org/draft-07/schema#", **dataclass_schema(settings.Settings),
            "definitions": DEFINITIONS}


def chart_schema() -> dict[str, Any]:
    """`watchdog.config` in the chart's values: the config less what the chart fills in itself."""
    schema = dataclass_schema(settings.Settings, excluded=CHART_EXCLUDED_CHOICES, omit=CHART_OWNED)
    schema["$comment"] = f"Generated from watchdog/core/settings.py by {REGENERATE}; do not edit by hand."
    schema["description"] = ("the sidecar's config (docs/reference/configuration.md), checked against this schema,"
                             " generated from its settings; the chart fills in `server`, `recorder.path` and the URLs,"
                             " paths and names under `target` and `kubernetes` itself")
    return schema


def embedded(values_schema: Mapping[str, Any]) -> tuple[Any, dict[str, Any]]:
    """The config schema and its definitions as the chart's values.schema.json holds them."""
    config_schema = values_schema.get("properties", {}).get("watchdog", {}).get("properties", {}).get("config")
    definitions = values_schema.get("definitions", {})
    return config_schema, {k: definitions.get(k) for k in DEFINITIONS}


def is_stale(values_schema: Mapping[str, Any]) -> bool:
    return embedded(values_schema) != (chart_schema(), DEFINITIONS)


def _keys(schema: Any, prefix: str = "") -> dict[str, Any]:
    """Every config key path in an object schema, with its schema."""
    out: dict[str, Any] = {}
    for name, sub in ((schema or {}).get("properties") or {}).items():
        path = f"{prefix}{name}"
        out[path] = sub
        if isinstance(sub, dict) and "properties" in sub:
            out.update(_keys(sub, path + "."))
    return out


def stale_keys(values_schema: Mapping[str, Any]) -> list[str]:
    """What the chart's copy lacks, has extra, or has differently: `+key`, `-key`, `~key`."""
    held, fresh = _keys(embedded(values_schema)[0]), _keys(chart_schema())
    leaves = {k for k, v in {**held, **fresh}.items() if not (isinstance(v, dict) and "properties" in v)}
    return sorted([f"+{k}" for k in fresh.keys() - held.keys()] + [f"-{k}" for k in held.keys() - fresh.keys()]
                  + [f"~{k}" for k in leaves & held.keys() & fresh.keys() if held[k] != fresh[k]])


def write(path: Path = CHART_SCHEMA) -> bool:
    """Put the fresh config schema into the chart's values schema; True when it changed."""
    doc = json.loads(path.read_text())
    if not is_stale(doc):
        return False
    doc["properties"]["watchdog"]["properties"]["config"] = chart_schema()
    doc.setdefault("definitions", {}).update(DEFINITIONS)
    path.write_text(json.dumps(doc, indent=2) + "\n")
    return True


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m gpu_watchdog.watchdog.core.config_schema",
                                description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="only compare; exit 1 when the chart's copy is stale")
    p.add_argument("--print", action="store_true", help="print the whole config's schema and exit")
    p.add_argument("--chart-schema", type=Path, default=CHART_SCHEMA, help="the chart's values.schema.json")
    args = p.parse_args(argv)
    if args.print:
        print(json.dumps(settings_schema(), indent=2))
        return 0
    if args.check:
        stale = is_stale(json.loads(args.chart_schema.read_text()))
        if stale:
            what = ", ".join(stale_keys(json.loads(args.chart_schema.read_text()))) or "definitions"
            print(f"{args.chart_schema}: watchdog.config schema is stale ({what}); run {REGENERATE}", file=sys.stderr)
        return 1 if stale else 0
    changed = write(args.chart_schema)
    print(f"{args.chart_schema}: {'updated' if changed else 'up to date'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
