"""Label and field selectors, compiled into predicates as the API server applies them to lists and watches.

What they imitate (Kubernetes v1.31): label selectors as ``staging/src/k8s.io/apimachinery/pkg/labels/selector.go``
parses them (``Parse``: comma-separated requirements, ``=``/``==``/``!=``, ``in``/``notin`` with parenthesised value
sets, bare ``key`` for exists and ``!key`` for does-not-exist); field selectors as ``.../fields/selector.go``
(``ParseSelector``: ``=``/``==``/``!=`` terms ANDed). A known gap, kinder than a real server: any dotted path is
matched here, where Kubernetes accepts only the fields a resource registers (``metadata.name`` and
``metadata.namespace``, a CRD's ``selectableFields``, a built-in's own such as a Pod's ``status.phase``) and answers
another with 400 ``field label not supported``.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any

from universal_simcluster.apiserver.paths import get_path
from universal_simcluster.apiserver.resources import Path_


def _split_terms(selector: str) -> list[str]:
    terms, depth, current = [], 0, ""
    for char in selector:
        depth += (char == "(") - (char == ")")
        if char == "," and depth == 0:
            terms.append(current)
            current = ""
        else:
            current += char
    terms.append(current)
    return [term.strip() for term in terms if term.strip()]


_SET_TERM = re.compile(r"^\s*([^\s!=()]+)\s+(in|notin)\s+\(([^)]*)\)\s*$")


#: One term of a label selector, over an object's labels.
LabelCheck = Callable[[Mapping[str, str]], bool]


def _value_in(key: str, values: frozenset[str], *, negate: bool) -> LabelCheck:
    return lambda labels: (labels.get(key) in values) != negate


def _value_is(key: str, value: str, *, negate: bool) -> LabelCheck:
    return lambda labels: (labels.get(key) == value) != negate


def _present(key: str, *, negate: bool) -> LabelCheck:
    return lambda labels: (key in labels) != negate


def parse_label_selector(selector: str) -> LabelCheck:
    """Compile ``k=v,k!=v,k,!k,k in (a,b),k notin (a,b)`` into a predicate over labels."""
    checks: list[LabelCheck] = []
    for term in _split_terms(selector):
        if m := _SET_TERM.match(term):
            key, op, raw = m.group(1), m.group(2), m.group(3)
            values = frozenset(v.strip() for v in raw.split(",") if v.strip())
            checks.append(_value_in(key, values, negate=op == "notin"))
        elif "!=" in term:
            key, value = (s.strip() for s in term.split("!=", 1))
            checks.append(_value_is(key, value, negate=True))
        elif "=" in term:
            key, value = (s.strip() for s in term.replace("==", "=").split("=", 1))
            checks.append(_value_is(key, value, negate=False))
        elif term.startswith("!"):
            checks.append(_present(term[1:].strip(), negate=True))
        else:
            checks.append(_present(term, negate=False))
    return lambda labels: all(check(labels) for check in checks)


def parse_field_selector(selector: str) -> Callable[[Mapping[str, Any]], bool]:
    """Compile ``path=v,path==v,path!=v`` (dotted paths, e.g. ``metadata.name``) into a predicate."""
    checks: list[Callable[[Mapping[str, Any]], bool]] = []
    for term in _split_terms(selector):
        negate = "!=" in term
        key, value = (s.strip() for s in term.replace("!=", "=").replace("==", "=").split("=", 1))
        path = tuple(key.split("."))

        def check(obj: Mapping[str, Any], p: Path_ = path, v: str = value, neg: bool = negate) -> bool:
            actual = get_path(obj, p)
            text = "" if actual is None else str(actual).lower() if isinstance(actual, bool) else str(actual)
            return (text != v) if neg else (text == v)

        checks.append(check)
    return lambda obj: all(check(obj) for check in checks)


def matcher(params: Mapping[str, str], name: str | None = None) -> Callable[[Mapping[str, Any]], bool]:
    """A request's ``labelSelector`` and ``fieldSelector`` (and, for a watch of one object, its name) together."""
    labels = parse_label_selector(params.get("labelSelector", ""))
    fields = parse_field_selector(params.get("fieldSelector", ""))
    return lambda obj: (
        (name is None or obj.get("metadata", {}).get("name") == name)
        and labels(obj.get("metadata", {}).get("labels") or {})
        and fields(obj)
    )
