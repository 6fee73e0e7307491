"""YAML reading that remembers where every key came from, for errors with file:line:col."""

from __future__ import annotations

from pathlib import Path

import yaml

from draftflow.core.errors import SpecError


class Located:
    """Maps a key path like ('nodes', 'target', 'params', 'path') to 'file:line:col'."""

    def __init__(self, source: str):
        self.source = source
        self.marks: dict[tuple, str] = {}

    def at(self, *path) -> str:
        # Fall back to the nearest parent that has a mark, then the file itself.
        for end in range(len(path), -1, -1):
            mark = self.marks.get(tuple(path[:end]))
            if mark:
                return mark
        return self.source

    def merge(self, other: "Located") -> None:
        for key, mark in other.marks.items():
            self.marks.setdefault(key, mark)


def _walk(node, path: tuple, loc: Located):
    if isinstance(node, yaml.MappingNode):
        out = {}
        for key_node, value_node in node.value:
            key = key_node.value
            if not isinstance(key, str):
                raise SpecError(f"{_mark(loc, key_node)}: mapping keys must be strings, got {key!r}")
            if key in out:
                raise SpecError(f"{_mark(loc, key_node)}: key {key!r} appears twice; keep one")
            loc.marks[path + (key,)] = _mark(loc, key_node)
            out[key] = _walk(value_node, path + (key,), loc)
        return out
    if isinstance(node, yaml.SequenceNode):
        items = []
        for i, item in enumerate(node.value):
            loc.marks[path + (i,)] = _mark(loc, item)
            items.append(_walk(item, path + (i,), loc))
        return items
    return _scalar(node)


def _scalar(node: yaml.ScalarNode):
    loader = yaml.SafeLoader("")
    try:
        return loader.construct_object(node, deep=True)
    finally:
        loader.dispose()


def _mark(loc: Located, node) -> str:
    m = node.start_mark
    return f"{loc.source}:{m.line + 1}:{m.column + 1}"


def load_yaml_text(text: str, source: str):
    """Parse YAML text; return (data, Located). Malformed YAML raises SpecError with line and column."""
    loc = Located(source)
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        where = f"{source}:{mark.line + 1}:{mark.column + 1}" if mark else source
        raise SpecError(f"{where}: malformed YAML: {exc.problem or exc.context}; fix the syntax at that line") from exc
    except yaml.YAMLError as exc:
        raise SpecError(f"{source}: malformed YAML: {exc}") from exc
    if root is None:
        return {}, loc
    return _walk(root, (), loc), loc


def load_yaml_file(path: Path):
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise SpecError(f"{path}: no such graph file; check the path (shipped graphs are in graphs/)") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise SpecError(f"{path}: cannot read graph file: {exc}") from None
    return load_yaml_text(text, str(path))
