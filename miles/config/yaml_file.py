"""Reading a user's YAML file strictly (torch-free): recipes, `--custom-config-path`, `--eval-config`.

PyYAML's SafeLoader keeps the last of two equal keys in a mapping without a word; here a key given twice, at
any depth, is a ConfigError naming both lines. Syntax errors name the file and line too.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from miles.core.errors import ConfigError

if TYPE_CHECKING:
    from yaml import Node

_MERGE_TAG = "tag:yaml.org,2002:merge"


def load_yaml(text: str, label: str) -> tuple[Any, Node | None]:
    """(data, root node) of one YAML document; `label` names the file in messages ("my.yaml", "recipe x").

    The node tree keeps the line of every key (`node.start_mark.line` is 0-based)."""
    import yaml  # only when a file is read: keeps `miles --help` lean

    loader = yaml.SafeLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None, None
        check_cycles(node, label)
        check_expanded_size(node, label)  # first: the walks below visit an alias's target at every use
        check_depth(node, label)
        check_duplicate_keys(node, label)
        return loader.construct_document(node), node
    except RecursionError:  # PyYAML composes recursively: nesting deeper than Python's stack ends there
        raise ConfigError(f"{label}: nested deeper than {MAX_DEPTH} levels") from None
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark
        line = f":{mark.line + 1}" if mark is not None else ""
        raise ConfigError(f"{label}{line}: invalid YAML: {exc.problem}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{label}: invalid YAML: {str(exc).splitlines()[0]}") from None
    finally:
        loader.dispose()


MAX_DEPTH = 64  # levels of nesting a document may have (a config needs a handful)


def _children(node: Node) -> list[Node]:
    from yaml import MappingNode, SequenceNode

    if isinstance(node, MappingNode):
        return [part for pair in node.value for part in pair]
    if isinstance(node, SequenceNode):
        return list(node.value)
    return []


def check_cycles(root: Node, label: str) -> None:
    """ConfigError when an alias refers to a mapping or list that contains it (`a: &x {b: *x}`): the value
    would be infinite, and every reader of it (printing, copying, comparing the args) would never end."""
    state: dict[int, int] = {}  # id -> 1 while its children are walked, 2 once done
    stack: list[tuple[Node, bool]] = [(root, False)]
    while stack:
        node, leaving = stack.pop()
        if leaving:
            state[id(node)] = 2
            continue
        if state.get(id(node)) == 2:
            continue
        state[id(node)] = 1
        stack.append((node, True))
        for child in _children(node):
            if state.get(id(child)) == 1:
                raise ConfigError(
                    f"{label}:{child.start_mark.line + 1}: a YAML alias (*x) refers to the mapping or list that "
                    "contains it: the value would be infinite"
                )
            if id(child) not in state:
                stack.append((child, False))


def check_depth(root: Node, label: str) -> None:
    """ConfigError when the document nests deeper than MAX_DEPTH levels (naming the line where it does)."""
    stack: list[tuple[Node, int]] = [(root, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise ConfigError(f"{label}:{node.start_mark.line + 1}: nested deeper than {MAX_DEPTH} levels")
        stack.extend((child, depth + 1) for child in _children(node))


def check_duplicate_keys(root: Node, label: str) -> None:
    """ConfigError at the first mapping key given twice under `root`: `label:LINE: key 'a.b' is given twice
    (first at line N)`, with the dotted path of the key for a nested mapping."""
    from yaml import MappingNode, SequenceNode

    seen_nodes: set[int] = set()
    stack: list[tuple[Node, str]] = [(root, "")]
    while stack:
        node, path = stack.pop()
        if id(node) in seen_nodes:  # an alias repeats a node already checked
            continue
        seen_nodes.add(id(node))
        if isinstance(node, MappingNode):
            first_line: dict[tuple[str, str], int] = {}
            children = []
            for key_node, value_node in node.value:
                if key_node.tag == _MERGE_TAG:
                    children.append((value_node, path))
                    continue
                key = _key_text(key_node)
                line = key_node.start_mark.line + 1
                name = f"{path}.{key}" if path else key
                # flag keys: `global-batch-size` and `global_batch_size` are the same key
                spelled = key.replace("-", "_") if _holds_flags(path) else key
                identity = (key_node.tag, spelled)
                if identity in first_line:
                    raise ConfigError(
                        f"{label}:{line}: key {name!r} is given twice (first at line {first_line[identity]})"
                    )
                first_line[identity] = line
                children.append((value_node, name))
            stack.extend(reversed(children))
        elif isinstance(node, SequenceNode):
            stack.extend((item, f"{path}[{i}]") for i, item in reversed(list(enumerate(node.value))))


def _holds_flags(path: str) -> bool:
    """The top level and `trainers.<role>` hold flag names (either spelling); anything else is user data."""
    parts = path.split(".") if path else []
    return not parts or (len(parts) == 2 and parts[0] == "trainers")


MAX_VALUES = 100_000  # values a document may expand to through its aliases


def check_expanded_size(root: Node, label: str) -> None:
    """ConfigError when aliases make the document expand past MAX_VALUES values (an 'alias bomb': a few lines
    that every later reader, printing or copying the args, would expand into billions)."""
    from yaml import MappingNode, SequenceNode

    sizes: dict[int, int] = {}

    def size(node: Node) -> int:
        known = sizes.get(id(node))
        if known is not None:
            return known
        sizes[id(node)] = 1  # a cycle counts once
        if isinstance(node, MappingNode):
            total = 1 + sum(size(k) + size(v) for k, v in node.value)
        elif isinstance(node, SequenceNode):
            total = 1 + sum(size(item) for item in node.value)
        else:
            total = 1
        sizes[id(node)] = min(total, MAX_VALUES + 1)
        return sizes[id(node)]

    if size(root) > MAX_VALUES:
        raise ConfigError(f"{label}: expands to more than {MAX_VALUES:,} values through YAML aliases (&x / *x)")


def _key_text(key_node: Node) -> str:
    from yaml import ScalarNode

    if isinstance(key_node, ScalarNode):
        return str(key_node.value)
    return f"<{type(key_node).__name__} at line {key_node.start_mark.line + 1}>"
