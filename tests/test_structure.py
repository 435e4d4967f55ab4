"""The package's shape, read from the source (AST), nothing imported: no library function longer
than MAX_LINES in the folders listed, and no module writing the fields of an engine part it does
not own (docs/architecture.md, "The decode step": each part owns its state)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import exactspec

ROOT = Path(exactspec.__file__).parent
MAX_LINES = 60  # def line to last line
SHORT_FOLDERS = ["engine", "drafters"]  # folders of exactspec/ whose functions stay short

# an engine part: its class, its module, and the names other code holds it by (a variable or
# an attribute: `policy`, `self.policy`); its fields are the attributes its own methods assign
PARTS = {
    "RowBatch": ("engine/rows.py", {"batch", "rows"}),
    "DraftSide": ("engine/drafting.py", {"draft"}),
    "Verifier": ("engine/verifier.py", {"verifier"}),
    "DraftLengthPolicy": ("engine/policy.py", {"policy", "pol"}),
    "Clock": ("engine/commit.py", {"clock"}),
    "Decoder": ("engine/decoder.py", {"decoder", "dec"}),
}
# methods that change a container or a tensor in place: `policy.forced.extend(...)` writes too
MUTATORS = {"append", "extend", "clear", "pop", "popleft", "update", "add", "discard",
            "remove", "insert", "setdefault", "zero_", "fill_", "copy_", "add_", "scatter_"}


def _functions(folder: str):
    for path in sorted((ROOT / folder).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                yield path.relative_to(ROOT.parent), node


@pytest.mark.parametrize("folder", SHORT_FOLDERS)
def test_no_function_is_longer_than_sixty_lines(folder):
    long = [f"{path}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1} lines)"
            for path, node in _functions(folder)
            if node.end_lineno - node.lineno + 1 > MAX_LINES]
    assert not long, f"split these (at most {MAX_LINES} lines each): {long}"


def _fields(cls: str, module: str) -> set[str]:
    """The attributes `cls`'s own methods assign on `self`."""
    tree = ast.parse((ROOT / module).read_text())
    node = next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == cls)
    out = set()
    for sub in ast.walk(node):
        for target in _targets(sub):
            if isinstance(target.value, ast.Name) and target.value.id == "self":
                out.add(target.attr)
    return out


def _targets(node: ast.AST) -> list[ast.Attribute]:
    """The attributes an assignment statement writes (tuple targets unpacked)."""
    if isinstance(node, ast.Assign):
        targets = node.targets
    elif isinstance(node, ast.AugAssign | ast.AnnAssign):
        targets = [node.target]
    else:
        return []
    flat = []
    while targets:
        t = targets.pop()
        if isinstance(t, ast.Tuple | ast.List):
            targets += t.elts
        elif isinstance(t, ast.Attribute):
            flat.append(t)
    return flat


def _holder(node: ast.AST) -> str | None:
    """The name an expression holds a part by: `policy` in `policy` or `self.policy`."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return None


def foreign_writes(source: str, module: str, parts: dict[str, tuple[str, set[str], set[str]]]
                   ) -> list[str]:
    """`part.field = ...` (or a mutator called on `part.field`) in `module` for a part that
    `module` does not own; parts: class -> (its module, the names it is held by, its fields)."""
    out = []
    for node in ast.walk(ast.parse(source)):
        written = list(_targets(node))
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr in MUTATORS and isinstance(node.func.value, ast.Attribute)):
            written.append(node.func.value)
        for target in written:
            for cls, (home, names, fields) in parts.items():
                if (home != module and _holder(target.value) in names
                        and target.attr in fields):
                    out.append(f"{module}:{target.lineno} writes {cls}.{target.attr}")
    return out


def _parts() -> dict[str, tuple[str, set[str], set[str]]]:
    return {cls: (module, names, _fields(cls, module))
            for cls, (module, names) in PARTS.items()}


def test_no_module_writes_the_fields_of_an_engine_part_it_does_not_own():
    parts = _parts()
    bad = []
    for path in sorted(ROOT.rglob("*.py")):
        module = str(path.relative_to(ROOT))
        bad += foreign_writes(path.read_text(), module, parts)
    assert not bad, ("a part's fields are written by its own methods only; add a method to "
                     f"the part: {bad}")


def test_the_ownership_check_finds_a_foreign_write():
    """The check has power: the writes the engine had before its parts were split (the batch
    setting the policy's `lagging`, the decoder extending its `forced` queue) are found."""
    parts = _parts()
    source = ("def admit(self, dec):\n"
              "    self.policy.lagging = False\n"
              "    dec.policy.forced.extend([1, 2])\n"
              "    self.policy.lagging, x = True, 1\n")
    found = foreign_writes(source, "engine/rows.py", parts)
    assert sorted(found) == ["engine/rows.py:2 writes DraftLengthPolicy.lagging",
                             "engine/rows.py:3 writes DraftLengthPolicy.forced",
                             "engine/rows.py:4 writes DraftLengthPolicy.lagging"]
    assert not foreign_writes(source, "engine/policy.py", parts)  # its own module may
