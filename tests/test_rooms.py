"""The package's rooms (docs/architecture.md): no pass imports another pass's driver, and the shared rooms
(`graph/`, `runtime/`, `calibrate/`) import no pass at all. Imports are read with `ast`, relative ones resolved."""

from __future__ import annotations

import ast
from pathlib import Path

import normpass.onnx

ONNX = Path(normpass.onnx.__file__).parent
PACKAGE = "normpass.onnx"
SHARED = ("graph", "runtime", "calibrate")


def passes() -> list[str]:
    """The rooms under normpass/onnx/ that are passes: those with a driver."""
    return sorted(p.parent.name for p in ONNX.glob("*/driver.py"))


def imported_modules(source: str, module: str, is_package: bool = False) -> set[str]:
    """Every module `source` (the text of `module`) imports, absolute; `from a import b` counts as `a` and `a.b`
    (b may be a submodule), at any depth of the file (imports inside functions too)."""
    parts = module.split(".") if is_package else module.split(".")[:-1]
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = ".".join(parts[: len(parts) - node.level + 1] if node.level else [])
            name = ".".join(p for p in (base, node.module or "") if p)
            found |= {name} | {f"{name}.{alias.name}" for alias in node.names}
    return found


def room_imports() -> dict[tuple[str, str], set[str]]:
    """(room, file) → the modules it imports, for every module under normpass/onnx/<room>/."""
    imports = {}
    for path in sorted(ONNX.glob("*/*.py")):
        module = f"{PACKAGE}.{path.parent.name}.{path.stem}"
        package = path.stem == "__init__"
        if package:
            module = f"{PACKAGE}.{path.parent.name}"
        imports[(path.parent.name, path.name)] = imported_modules(path.read_text(), module, package)
    return imports


def other_drivers(room: str, modules: set[str]) -> set[str]:
    """The drivers of passes other than `room` among `modules`."""
    return {m for m in modules if m in {f"{PACKAGE}.{p}.driver" for p in passes() if p != room}}


def test_imports_are_resolved():
    source = "from ..replace.driver import Runner\nfrom . import cut\nimport normpass.onnx.fold.driver\n"
    found = imported_modules(source, "normpass.onnx.slice.recover")
    assert "normpass.onnx.replace.driver" in found
    assert "normpass.onnx.slice.cut" in found
    assert "normpass.onnx.fold.driver" in found
    inside = "def f():\n    from ..rotate import driver\n"
    assert "normpass.onnx.rotate.driver" in imported_modules(inside, "normpass.onnx.slice", is_package=True)
    assert other_drivers("slice", found) == {"normpass.onnx.replace.driver", "normpass.onnx.fold.driver"}
    assert other_drivers("fold", found) == {"normpass.onnx.replace.driver"}


def test_the_passes_are_found():
    assert {"fold", "replace", "rotate", "slice"} <= set(passes())
    assert not set(SHARED) & set(passes())


def test_no_pass_imports_another_pass_driver():
    offenders = {
        f"{room}/{file}": sorted(found)
        for (room, file), modules in room_imports().items()
        if room in passes() and (found := other_drivers(room, modules))
    }
    assert not offenders, f"a pass imports another pass's driver: {offenders}"


def test_shared_rooms_import_no_pass():
    rooms = tuple(f"{PACKAGE}.{p}" for p in passes())
    offenders = {
        f"{room}/{file}": sorted(m for m in modules if m in rooms or m.startswith(tuple(r + "." for r in rooms)))
        for (room, file), modules in room_imports().items()
        if room in SHARED
    }
    assert not any(offenders.values()), f"a shared room imports a pass: {offenders}"
