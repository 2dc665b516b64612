"""The type checker's ratchet (tools/typecheck.py, run by make lint): the modules not yet strict-clean are listed in
one place in pyproject.toml and the list only shrinks. mypy itself runs in make lint (minutes); here, the config as
written and the decisions the tool makes from mypy's output, each against a planted case."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("typecheck", ROOT / "tools" / "typecheck.py")
typecheck = importlib.util.module_from_spec(spec)
spec.loader.exec_module(typecheck)

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib

PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def _config(listed, *more_overrides):
    ratchet = {"module": listed, "disallow_untyped_defs": False, "check_untyped_defs": False}
    return {"tool": {"mypy": {"strict": True, "overrides": [ratchet, *more_overrides]}}}


def test_the_ratchet_as_written_is_sound():
    assert PYPROJECT["tool"]["mypy"]["strict"] is True
    assert typecheck.config_problems(PYPROJECT, ROOT) == []


@pytest.mark.parametrize("listed, extra, expected", [
    (["phoenixrun.topology", "phoenixrun.auth"], (), "not sorted"),
    (["phoenixrun.auth", "phoenixrun.auth"], (), "not sorted"),
    (["phoenixrun.gone"], (), "phoenixrun.gone (in the NOT_YET_STRICT list) is no module"),
    (["phoenixrun.auth"], ({"module": "phoenixrun.topology", "disable_error_code": ["arg-type"]},),
     "phoenixrun.topology disables error codes but is not in the NOT_YET_STRICT list"),
    (["phoenixrun.auth"], ({"module": ["phoenixrun.auth"], "ignore_errors": True},),
     "ignore_errors for phoenixrun.auth"),
])
def test_a_planted_config_fault_is_named(listed, extra, expected):
    problems = typecheck.config_problems(_config(listed, *extra), ROOT)
    assert any(expected in p for p in problems), problems


def test_no_ratchet_block_is_every_module_strict_and_two_are_refused():
    no_block = {"tool": {"mypy": {"strict": True, "overrides": [{"module": ["psutil"], "ignore_missing_imports": True}]}}}
    assert typecheck.ratchet_modules(no_block) == [] and typecheck.config_problems(no_block, ROOT) == []
    relaxed = {"module": "phoenixrun.auth", "disable_error_code": ["arg-type"]}
    no_block["tool"]["mypy"]["overrides"].append(relaxed)
    assert typecheck.config_problems(no_block, ROOT) == [
        "phoenixrun.auth disables error codes but is not in the NOT_YET_STRICT list"]
    with pytest.raises(SystemExit, match="at most one override block"):
        typecheck.ratchet_modules(_config(["phoenixrun.auth"], {"module": "x", "disallow_untyped_defs": False}))


def test_agents_and_packages_map_to_their_files():
    assert typecheck.module_file(ROOT, "phoenixrun.agents.slots") == ROOT / "agents" / "slots.py"
    assert typecheck.module_file(ROOT, "phoenixrun.faults") == ROOT / "phoenixrun" / "faults" / "__init__.py"
    assert typecheck.module_file(ROOT, "phoenixrun.control.state") == ROOT / "phoenixrun" / "control" / "state.py"
    assert typecheck.module_file(ROOT, "phoenixrun.nope") is None


def test_agents_files_are_checked_under_their_installed_name():
    src = typecheck.BuildSource("agents/slots.py", "agents.slots", None, str(ROOT))
    assert typecheck.installed_name(src).module == "phoenixrun.agents.slots"
    assert typecheck.installed_name(typecheck.BuildSource("agents/__init__.py", "agents")).module == "phoenixrun.agents"
    assert typecheck.installed_name(typecheck.BuildSource("phoenixrun/auth.py", "phoenixrun.auth")).module == \
        "phoenixrun.auth"
    files = typecheck.source_files(ROOT)
    assert "agents/slots.py" in files and "phoenixrun/auth.py" in files
    assert not any(f.startswith("phoenixrun/agents/") for f in files)   # a worktree's link is not followed


def test_a_listed_module_the_strict_pass_finds_clean_must_leave_the_list():
    modules = {"phoenixrun/auth.py": "phoenixrun.auth", "agents/slots.py": "phoenixrun.agents.slots"}
    errors = ["agents/slots.py:3: error: Function is missing a type annotation  [no-untyped-def]",
              "phoenixrun/auth.py:9: note: See https://mypy.readthedocs.io",   # a note is no error
              "phoenixrun/elsewhere.py:1: error: x  [misc]"]
    owners = typecheck.error_modules(errors, modules)
    assert owners == {"phoenixrun.agents.slots"}
    assert typecheck.stale_entries(["phoenixrun.agents.slots", "phoenixrun.auth"], owners) == ["phoenixrun.auth"]
    assert typecheck.stale_entries(["phoenixrun.agents.slots"], owners) == []


def test_the_strict_pass_drops_every_relaxation_but_keeps_third_party_settings():
    options = typecheck.Options()
    options.per_module_options = {
        "phoenixrun.auth": {"disallow_untyped_defs": False, "check_untyped_defs": False,
                            "disable_error_code": ["arg-type"]},
        "psutil": {"ignore_missing_imports": True}}
    strict = typecheck.without_relaxations(options).per_module_options
    assert strict == {"phoenixrun.auth": {}, "psutil": {"ignore_missing_imports": True}}
