"""YAML reading that remembers where every key came from, for errors with file:line:col.

Only plain data is read: strings, numbers, booleans, null, dates, lists and mappings (and
``<<`` merge keys). Any other tag (``!!python/...``, ``!!binary``, ``!local``) is an error, and
so are aliases that refer to themselves or that expand past ``MAX_ALIAS_COPIES`` values.
"""

from __future__ import annotations

import errno
from pathlib import Path

import yaml
from yaml.nodes import MappingNode, ScalarNode, SequenceNode

from draftflow.core.errors import SpecError

MAX_ALIAS_COPIES = 100_000  # values an alias (*name) may copy in all; nested aliases grow exponentially
MAX_DEPTH = 100  # levels of nested lists and mappings
MAX_FILE_BYTES = 64 * 2**20  # a graph file is a few KB; a bound keeps `check /dev/zero` from eating memory

_CORE = "tag:yaml.org,2002:"
SCALAR_TAGS = {_CORE + t for t in ("str", "int", "float", "bool", "null", "timestamp")}
_MERGE, _VALUE = _CORE + "merge", _CORE + "value"  # implicit tags of plain `<<` and `=`


class Located:
    """Maps a key path like ('nodes', 'target', 'params', 'path') to 'file:line:col'."""

    def __init__(self, source: str):
        self.source = source
        self.marks: dict[tuple, str] = {}
        self.files: dict[tuple, str] = {}  # key path -> the source (a file's path) that wrote it; none for overrides

    def at(self, *path) -> str:
        # Fall back to the nearest parent that has a mark, then the file itself.
        for end in range(len(path), -1, -1):
            mark = self.marks.get(tuple(path[:end]))
            if mark:
                return mark
        return self.source

    def merge(self, other: "Located") -> None:
        for key, mark in other.marks.items():
            if key not in self.marks:
                self.marks[key] = mark
                if key in other.files:
                    self.files[key] = other.files[key]

    def file_of(self, *path) -> str | None:
        """The source that wrote exactly this key path (for a file, its path); None for an override or unknown."""
        return self.files.get(tuple(path))

    def replace(self, path: tuple, mark: str) -> None:
        """``path`` (and everything under it) now comes from ``mark``, e.g. a ``--set`` on the command line."""
        n = len(path)
        for key in [k for k in self.marks if k[:n] == path]:
            del self.marks[key]
            self.files.pop(key, None)
        self.marks[path] = mark


def key_path(path: tuple) -> str:
    """('nodes', 'target', 'params', 'x') -> 'nodes.target.params.x'; ('edges', 2) -> 'edges[2]'."""
    out = ""
    for p in path:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out


def _tag_name(tag: str) -> str:
    return "!!" + tag[len(_CORE):] if tag.startswith(_CORE) else tag


def shorten(text: str, limit: int = 40) -> str:
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


class _Reader:
    """Turns a composed node tree into Python data, refusing unsafe tags, cycles and alias bombs."""

    def __init__(self, loc: Located, positions: bool = True):
        self.loc = loc
        self.positions = positions  # False for a one-line value: its source alone says where
        self.constructor = yaml.constructor.SafeConstructor()
        self.seen: set = set()  # nodes read at least once; reading one again is an alias copy
        self.on_path: set = set()  # nodes being read right now: meeting one again is a recursive alias
        self.copies = 0
        self.copying = None  # (node, path) of the outermost value being copied through an alias

    def mark(self, node) -> str:
        if not self.positions:
            return self.loc.source
        m = node.start_mark
        return f"{self.loc.source}:{m.line + 1}:{m.column + 1}"

    def fail(self, node, path: tuple, problem: str) -> SpecError:
        what = shorten(key_path(path), 60)
        return SpecError(f"{self.mark(node)}: {what + ': ' if what else ''}{problem}")

    def read(self, node, path: tuple = ()):
        if node in self.on_path:
            raise self.fail(node, path, "this alias refers to a value that contains it (a recursive alias); "
                                        "write the value out instead of the alias")
        if len(path) > MAX_DEPTH:
            raise self.fail(node, path, f"lists and mappings are nested more than {MAX_DEPTH} levels deep; a graph needs a few")
        outermost = False
        if node in self.seen:
            self.copies += 1
            if self.copying is None:
                self.copying, outermost = (node, path), True
            if self.copies > MAX_ALIAS_COPIES:
                raise self.fail(*self.copying, f"aliases (*name) expand to more than {MAX_ALIAS_COPIES:,} copied values "
                                               "(nested aliases grow exponentially); write the values out or use fewer aliases")
        self.seen.add(node)
        self.on_path.add(node)
        try:
            if isinstance(node, MappingNode):
                self.check_tag(node, path, _CORE + "map")
                return self.mapping(node, path)
            if isinstance(node, SequenceNode):
                self.check_tag(node, path, _CORE + "seq")
                return self.sequence(node, path)
            return self.scalar(node, path)
        finally:
            self.on_path.discard(node)
            if outermost:
                self.copying = None

    def check_tag(self, node, path: tuple, *allowed: str) -> None:
        if node.tag not in allowed:
            raise self.fail(node, path, f"the YAML tag {_tag_name(node.tag)} is not allowed in a graph file; remove it "
                                        "(only strings, numbers, booleans, null, lists and mappings are read)")

    def mapping(self, node, path: tuple) -> dict:
        out: dict = {}
        # `<<: *base` (or `<<: [*a, *b]`) first, so that keys written here override merged ones.
        for key_node, value_node in node.value:
            if key_node.tag == _MERGE and isinstance(key_node, ScalarNode):
                sources = value_node.value if isinstance(value_node, SequenceNode) else [value_node]
                for src in reversed(sources):  # the first mapping listed wins
                    if not isinstance(src, MappingNode):
                        raise self.fail(src, path, "'<<' merges mappings only; give it *alias of a mapping (or a list of them)")
                    out.update(self.read(src, path))
        written: set = set()
        for key_node, value_node in node.value:
            if key_node.tag == _MERGE and isinstance(key_node, ScalarNode):
                continue
            key = self.key(key_node, path)
            if key in written:
                raise SpecError(f"{self.mark(key_node)}: key {key!r} appears twice; keep one")
            written.add(key)
            self.loc.marks[path + (key,)] = self.mark(key_node)
            self.loc.files[path + (key,)] = self.loc.source
            out[key] = self.read(value_node, path + (key,))
        return out

    def key(self, key_node, path: tuple) -> str:
        if not isinstance(key_node, ScalarNode):
            raise self.fail(key_node, path, "a mapping key must be a plain name, not a list or mapping")
        self.check_tag(key_node, path, *SCALAR_TAGS, _VALUE)
        return key_node.value

    def sequence(self, node, path: tuple) -> list:
        items = []
        for i, item in enumerate(node.value):
            self.loc.marks[path + (i,)] = self.mark(item)
            items.append(self.read(item, path + (i,)))
        return items

    def scalar(self, node, path: tuple):
        if node.tag in (_MERGE, _VALUE):  # a plain `<<` or `=` outside a key is just text
            return node.value
        self.check_tag(node, path, *SCALAR_TAGS)
        try:
            return self.constructor.construct_object(node, deep=True)
        except Exception as exc:  # the text does not fit its tag, e.g. `!!int "abc"`, or a 5000-digit number
            if "digits" in str(exc):
                raise self.fail(node, path, f"a number of {len(node.value)} digits is too long to read; write a smaller one") from None
            raise self.fail(node, path, f"{shorten(node.value)!r} is not a valid {_tag_name(node.tag)} value; "
                                        "write a valid one (or remove the tag)") from None


def _compose(text: str, source: str):
    try:
        return yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        where = f"{source}:{mark.line + 1}:{mark.column + 1}" if mark else source
        raise SpecError(f"{where}: malformed YAML: {exc.problem or exc.context}; fix the syntax at that line") from None
    except yaml.reader.ReaderError as exc:
        line = text.count("\n", 0, exc.position) + 1
        col = exc.position - (text.rfind("\n", 0, exc.position) + 1) + 1
        code = exc.character if isinstance(exc.character, int) else ord(exc.character or "\0")
        raise SpecError(f"{source}:{line}:{col}: the control character U+{code:04X} is not allowed in YAML; "
                        "is this a text file? remove the character") from None
    except yaml.YAMLError as exc:
        raise SpecError(f"{source}: malformed YAML: {' '.join(str(exc).split())}") from None
    except RecursionError:
        raise SpecError(f"{source}: lists and mappings are nested too deeply to read; a graph needs a few levels") from None


def load_yaml_text(text: str, source: str):
    """Parse YAML text; return (data, Located); data is None for an empty document. Errors raise SpecError with line and column."""
    loc = Located(source)
    root = _compose(text, source)
    if root is None:
        return None, loc
    return _Reader(loc).read(root), loc


def load_yaml_value(text: str, source: str):
    """A value typed on the command line (``--set KEY=VALUE``): YAML under the rules of a graph file.

    Text that does not parse as YAML (``a: b: c``) is taken as the string it is.
    """
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError:
        return text
    except RecursionError:
        raise SpecError(f"{source}: the value is nested too deeply to read") from None
    return None if root is None else _Reader(Located(source), positions=False).read(root)


def read_error(exc: OSError) -> str:
    """What an OSError from opening or reading a file means, in words, with the fix."""
    reasons = {
        errno.ENOENT: "no such file; check the path",
        errno.EACCES: "permission denied; make the file readable (chmod u+r) or run as a user who may read it",
        errno.EPERM: "operation not permitted; make the file readable or run as a user who may read it",
        errno.EISDIR: "is a directory, not a file; pass the path of a .yaml file",
        errno.ENOTDIR: "a part of the path is a file, not a folder; check the path",
        errno.ELOOP: "the symbolic links of the path form a loop; point them at a real file",
        errno.ENAMETOOLONG: "the path is too long",
    }
    return reasons.get(exc.errno) or f"{exc.strerror or type(exc).__name__}"


def read_text(path: Path, what: str = "graph file", cited: str = "") -> str:
    """The UTF-8 text of ``path``; unreadable files raise SpecError saying why. ``cited`` prefixes where the path was named."""
    prefix = f"{cited}: " if cited else ""
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_FILE_BYTES + 1)
    except FileNotFoundError:
        raise SpecError(f"{prefix}{path}: no such {what}; check the path (shipped graphs are in graphs/)") from None
    except OSError as exc:
        raise SpecError(f"{prefix}{path}: cannot read the {what}: {read_error(exc)}") from None
    if len(data) > MAX_FILE_BYTES:
        raise SpecError(f"{prefix}{path}: larger than {MAX_FILE_BYTES // 2**20} MiB, not a {what}; check the path")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise SpecError(f"{prefix}{path}: not UTF-8 text (byte 0x{data[exc.start]:02x} at offset {exc.start}), so not a {what}; "
                        "check the path, or save the file as UTF-8") from None


def load_yaml_file(path: Path, cited: str = ""):
    """Read and parse a graph file; return (data, Located). ``cited``: where another file named it (``extends:``)."""
    return load_yaml_text(read_text(Path(path), cited=cited), str(path))
