"""A Prometheus series named in config: `name` or `name{label="value",...}`. Pure.

`target.progress_metric` names the target's counter of finished work; its advance while canaries
time out means saturated, not hung.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_NAME = r"[a-zA-Z_:][a-zA-Z0-9_:]*"
_SELECTOR = re.compile(rf"^\s*(?P<name>{_NAME})\s*(?:\{{(?P<labels>.*)\}})?\s*$")
_LABEL = re.compile(r'\s*(?P<key>[a-zA-Z_][a-zA-Z0-9_]*)\s*=\s*"(?P<value>(?:[^"\\]|\\.)*)"\s*(?:,|$)')


@dataclass(frozen=True)
class Selector:
    name: str
    labels: tuple[tuple[str, str], ...] = ()

    def matches(self, sample_name: str, labels: dict[str, str]) -> bool:
        """A counter matches with or without its `_total` suffix (exporters differ)."""
        if sample_name not in (self.name, self.name + "_total") and self.name != sample_name.removesuffix("_total"):
            return False
        return all(labels.get(k) == v for k, v in self.labels)

    def __str__(self) -> str:
        if not self.labels:
            return self.name
        return self.name + "{" + ",".join(f'{k}="{v}"' for k, v in self.labels) + "}"


def parse(text: str) -> Selector:
    """The selector, or ValueError saying what is wrong with it."""
    m = _SELECTOR.match(text)
    if m is None:
        raise ValueError(f'expected a metric name with optional labels, like name{{label="value"}}, got {text!r}')
    labels: list[tuple[str, str]] = []
    rest = (m.group("labels") or "").strip()
    while rest:
        lm = _LABEL.match(rest)
        if lm is None:
            raise ValueError(f"cannot read the labels in {text!r}: expected label=\"value\" pairs")
        labels.append((lm.group("key"), lm.group("value").replace('\\"', '"')))
        rest = rest[lm.end():].strip()
    return Selector(m.group("name"), tuple(labels))
