"""YAML loading with a bound on alias expansion (the "billion laughs" document).

PyYAML's ``SafeLoader`` shares an aliased node instead of copying it, so loading is cheap; the
blow-up comes later, when the audit walks the loaded lists.  Before constructing a document this
loader counts the nodes the document would have if every alias were expanded (memoised per node,
so counting is linear in the document) and refuses more than :data:`MAX_EXPANDED_NODES` or a
recursive alias.  Deep nesting is refused by :func:`load_all` as well (RecursionError).
"""

from __future__ import annotations

from typing import Any

import yaml

from kvtier.core.errors import UserError

MAX_EXPANDED_NODES = 1_000_000
"""Most YAML nodes a document may expand to; real manifests hold a few thousand."""


def expanded_size(root: yaml.Node) -> int | None:
    """Nodes under ``root`` with every alias expanded; None when an alias refers to itself (a cycle)."""
    sizes: dict[int, int] = {}
    on_path: set[int] = set()
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    while stack:
        node, done = stack.pop()
        key = id(node)
        children = _children(node)
        if done:
            on_path.discard(key)
            sizes[key] = min(MAX_EXPANDED_NODES + 1, 1 + sum(sizes[id(c)] for c in children))
            continue
        if key in sizes:
            continue
        if key in on_path:
            return None
        on_path.add(key)
        stack.append((node, True))
        for child in children:
            if id(child) in on_path:
                return None
            if id(child) not in sizes:
                stack.append((child, False))
    return sizes[id(root)]


def _children(node: yaml.Node) -> list[yaml.Node]:
    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    if isinstance(node, yaml.MappingNode):
        return [part for pair in node.value for part in pair]
    return []


class _BoundedLoader(yaml.SafeLoader):
    def compose_document(self) -> yaml.Node:  # type: ignore[override]
        node = super().compose_document()
        size = expanded_size(node)
        if size is None:
            raise UserError("the YAML holds a recursive alias (an anchor that contains itself); remove it.")
        if size > MAX_EXPANDED_NODES:
            raise UserError(f"the YAML expands to more than {MAX_EXPANDED_NODES:,} nodes through its aliases "
                            "(a 'billion laughs' document); expand the anchors by hand.")
        return node


def load_all(text: str, origin: str) -> list[Any]:
    """The non-null documents of ``text``.

    Raises:
        UserError: invalid YAML, nesting too deep for the parser, or aliases over the bound.
        yaml.YAMLError is turned into UserError naming the line.
    """
    try:
        return [d for d in yaml.load_all(text, Loader=_BoundedLoader) if d is not None]
    except UserError as exc:
        raise UserError(f"{origin}: {exc}") from None
    except RecursionError:
        raise UserError(f"{origin} is nested too deeply to be a Kubernetes manifest.") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        raise UserError(f"{origin} is not valid YAML{where}; fix the manifest and retry.") from None
