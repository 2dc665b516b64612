"""The sizes the house keeps (docs/design.md; ../STYLE): a class under 350 lines, a function up to 80, read off the
source with `ast`. The rooms already past them are listed with the size they have today: they may shrink (the test
then asks to lower or drop their entry), never grow - a feature that needs room there splits the room first."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCANNED = ("phoenixrun", "agents")
CLASS_MAX, FUNCTION_MAX = 350, 80

# (file, qualified name) -> today's lines: the ceiling for that room until it is split (issue 30)
GRANDFATHERED = {
}


def oversized(base: Path, roots=SCANNED) -> dict[tuple[str, str], int]:
    """(file, qualified name) -> lines, for every class over CLASS_MAX and function over FUNCTION_MAX."""
    found: dict[tuple[str, str], int] = {}

    def visit(node: ast.AST, path: str, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                name = f"{prefix}{child.name}"
                lines = child.end_lineno - child.lineno + 1
                limit = CLASS_MAX if isinstance(child, ast.ClassDef) else FUNCTION_MAX
                if lines > limit:
                    found[(path, name)] = lines
                visit(child, path, f"{name}.")
            else:
                visit(child, path, prefix)

    for root in roots:
        for p in sorted((base / root).rglob("*.py")):
            visit(ast.parse(p.read_text(), str(p)), p.relative_to(base).as_posix(), "")
    return found


def test_no_room_grows_past_the_house_sizes():
    found = oversized(ROOT)
    new = {k: v for k, v in found.items() if k not in GRANDFATHERED}
    assert not new, f"over {CLASS_MAX} lines a class / {FUNCTION_MAX} a function: split it along its seam: {new}"
    grown = {k: (v, GRANDFATHERED[k]) for k, v in found.items() if k in GRANDFATHERED and v > GRANDFATHERED[k]}
    assert not grown, f"a room already too large grew (now, ceiling): split it before adding to it: {grown}"
    shrunk = {k: (found.get(k), v) for k, v in GRANDFATHERED.items() if found.get(k, 0) < v}
    assert not shrunk, f"a listed room shrank (now, listed): lower or drop its entry in GRANDFATHERED: {shrunk}"


def test_the_scanner_sees_a_long_method_and_a_long_class(tmp_path):
    body = "\n".join(f"        x{i} = {i}" for i in range(90))
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "m.py").write_text(f"class Big:\n    def long(self):\n{body}\n\n" +
                                           "".join(f"    def f{i}(self):\n        pass\n" for i in range(140)))
    found = oversized(tmp_path, ("pkg",))
    assert found[("pkg/m.py", "Big.long")] == 91 and found[("pkg/m.py", "Big")] > CLASS_MAX
