"""The type checker CI runs (make lint): mypy over phoenixrun/ and agents/, strict, with a ratchet.

Two passes, configured in pyproject.toml ([tool.mypy]):
1. as configured: strict everywhere except the modules listed in the NOT_YET_STRICT override block, which are held
   to mypy's default level - every error here fails;
2. strict everywhere: a listed module with no error left fails too ("drop it from the list"), so the list only shrinks.

Why a script and not a bare `mypy phoenixrun agents`: agents/ installs as phoenixrun.agents (setup.cfg package_dir),
an editable-install import hook mypy cannot follow, so plain mypy would check agents/ as a top-level `agents` package
and every `from phoenixrun.agents...` import would be unresolved. Here each agents/ file is handed to mypy under its
installed name.

    python tools/typecheck.py            # both passes; exit 1 on an error or a stale list entry
    python tools/typecheck.py --strict   # the strict pass only, every error printed (what is left to fix)
"""
from __future__ import annotations

import os
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from mypy import build
from mypy.main import process_options
from mypy.modulefinder import BuildSource
from mypy.options import Options

if sys.version_info >= (3, 11):
    import tomllib
else:  # mypy depends on tomli below 3.11
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {"phoenixrun": "phoenixrun", "agents": "phoenixrun.agents"}  # folder -> the module prefix it installs as
RATCHET = "NOT_YET_STRICT"  # the comment naming the ratchet block in pyproject.toml: the one override that relaxes
# strictness (disallow_untyped_defs = false); mypy refuses unknown keys, so the block is found by that setting


def source_files(root: Path) -> list[str]:
    """Every .py file under the checked folders, relative to root, symlinks not followed (a worktree may link
    phoenixrun/agents -> ../agents; agents/ is handed over once, under its installed name)."""
    found: list[str] = []
    for folder in PACKAGES:
        for base, dirs, files in os.walk(root / folder):
            dirs[:] = sorted(d for d in dirs if d != "__pycache__" and not (Path(base) / d).is_symlink())
            found += [os.path.relpath(Path(base) / f, root) for f in sorted(files) if f.endswith(".py")]
    return found


def installed_name(source: BuildSource) -> BuildSource:
    """The source under the module name it has once installed (agents.x -> phoenixrun.agents.x)."""
    module = source.module
    for folder, prefix in PACKAGES.items():
        if module == folder or module.startswith(folder + "."):
            module = prefix + module[len(folder):]
            break
    return BuildSource(source.path, module, None, source.base_dir)


def ratchet_modules(pyproject: dict[str, Any]) -> list[str]:
    """The modules the ratchet block lists (the one [[tool.mypy.overrides]] with disallow_untyped_defs = false);
    none once every module is strict-clean (the block is gone: a module that needs relaxing brings it back)."""
    overrides: list[dict[str, Any]] = pyproject["tool"]["mypy"].get("overrides", [])
    blocks = [b for b in overrides if b.get("disallow_untyped_defs") is False]
    if len(blocks) > 1:
        raise SystemExit(f"typecheck: expected at most one override block relaxing strictness (the {RATCHET} "
                         f"list) in pyproject.toml, found {len(blocks)}")
    if not blocks:
        return []
    modules = blocks[0]["module"]
    return [modules] if isinstance(modules, str) else [str(m) for m in modules]


def module_file(root: Path, module: str) -> Path | None:
    """The source file of a phoenixrun module in this tree (agents/ for phoenixrun.agents), None if none."""
    for folder, prefix in sorted(PACKAGES.items(), key=lambda kv: -len(kv[1])):
        if module == prefix or module.startswith(prefix + "."):
            base = root / folder / Path(*module[len(prefix) + 1:].split(".")) if module != prefix else root / folder
            for candidate in (base.with_suffix(".py"), base / "__init__.py"):
                if candidate.is_file():
                    return candidate
    return None


def config_problems(pyproject: dict[str, Any], root: Path) -> list[str]:
    """What is wrong with the ratchet as written, before mypy runs: the list sorted, without duplicates, naming
    modules that exist; a module with error codes disabled is listed; nothing switched off wholesale."""
    listed = ratchet_modules(pyproject)
    problems = []
    if listed != sorted(set(listed)):
        problems.append(f"the {RATCHET} list is not sorted or repeats a module")
    problems += [f"{m} (in the {RATCHET} list) is no module of this tree" for m in listed if not module_file(root, m)]
    for block in pyproject["tool"]["mypy"].get("overrides", []):
        modules = block["module"] if isinstance(block["module"], list) else [block["module"]]
        if block.get("ignore_errors"):
            problems.append(f"ignore_errors for {', '.join(modules)}: list the module in {RATCHET} instead")
        if "disable_error_code" in block:
            problems += [f"{m} disables error codes but is not in the {RATCHET} list" for m in modules
                         if m not in listed]
    return problems


def stale_entries(listed: Iterable[str], strict_error_modules: set[str]) -> list[str]:
    """Listed modules the strict pass found clean: they must leave the list."""
    return sorted(m for m in listed if m not in strict_error_modules)


def run(files: Sequence[str], strict_everywhere: bool) -> tuple[list[str], dict[str, str]]:
    """One mypy pass: (error lines, path -> module of every source)."""
    sources, options = process_options(list(files))
    sources = [installed_name(s) for s in sources]
    if strict_everywhere:
        options = without_relaxations(options)
        options.cache_dir = os.path.join(options.cache_dir, "strict")  # each pass keeps its own incremental cache
    result = build.build(sources, options)
    # a listed module's untyped bodies go unchecked at the default level; mypy notes each, which is no error
    messages = [m for m in result.errors if not m.endswith("[annotation-unchecked]")]
    return messages, {s.path: s.module for s in sources if s.path}


def has_errors(messages: Iterable[str]) -> bool:
    return any(": error:" in m for m in messages)


def without_relaxations(options: Options) -> Options:
    """The options with the per-module relaxations of strictness dropped (third-party import settings kept)."""
    strict_keys = {"disallow_untyped_defs", "disallow_incomplete_defs", "check_untyped_defs", "disallow_untyped_calls",
                   "disallow_any_generics", "disallow_subclassing_any", "disallow_untyped_decorators",
                   "warn_return_any", "warn_unused_ignores", "implicit_reexport", "strict_equality", "extra_checks",
                   "disable_error_code"}
    options.per_module_options = {
        pattern: {k: v for k, v in opts.items() if k not in strict_keys}
        for pattern, opts in options.per_module_options.items()}
    return options


def error_modules(errors: Iterable[str], modules: dict[str, str]) -> set[str]:
    """The modules that own at least one error line ("path:line: error: ...")."""
    owners = set()
    for line in errors:
        path, _, rest = line.partition(":")
        if ": error:" in rest and path in modules:
            owners.add(modules[path])
    return owners


def main(argv: Sequence[str]) -> int:
    os.chdir(ROOT)
    files = source_files(ROOT)
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    listed = ratchet_modules(pyproject)
    problems = config_problems(pyproject, ROOT)
    if problems:
        print("\n".join(f"typecheck: pyproject.toml: {p}" for p in problems))
        return 1
    if "--strict" in argv:
        errors, _ = run(files, strict_everywhere=True)
        print("\n".join(errors))
        return 1 if has_errors(errors) else 0
    errors, _ = run(files, strict_everywhere=False)
    if has_errors(errors):
        print("\n".join(errors))
        print(f"typecheck: mypy found errors ({len(files)} files); fix them - new code passes mypy --strict")
        return 1
    if not listed:      # every module strict as configured: the pass above was the strict pass
        print(f"typecheck: clean ({len(files)} files, every module strict)")
        return 0
    strict_errors, modules = run(files, strict_everywhere=True)
    stale = stale_entries(listed, error_modules(strict_errors, modules))
    if stale:
        print(f"typecheck: now strict-clean, drop from the {RATCHET} list in pyproject.toml: {', '.join(stale)}")
        return 1
    print(f"typecheck: clean ({len(files)} files; {len(listed)} modules still below strict, listed in pyproject.toml)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
