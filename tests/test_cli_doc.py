"""docs/cli.md is generated from the real `--help` output (tools/gen_cli_doc.py) and must not drift."""
import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _generator():
    spec = importlib.util.spec_from_file_location("gen_cli_doc", ROOT / "tools" / "gen_cli_doc.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_cli_doc_is_up_to_date():
    msg = _generator().check()
    assert msg is None, f"{msg}, then commit docs/cli.md"


def test_cli_doc_lists_every_launch_flag():
    import click

    from phoenixrun.cli import launch
    gen = _generator()
    doc = (ROOT / "docs" / "cli.md").read_text(encoding="utf-8")
    tables = doc.split("## `--help` of each command")[0]
    for p in launch.params:
        if isinstance(p, click.Option) and p.name != "help":
            assert f"`{gen._primary(p)}`" in tables, f"{gen._primary(p)} missing from the flag tables"


def test_check_reports_a_stale_page(tmp_path):
    gen = _generator()
    stale = tmp_path / "cli.md"
    stale.write_text("# old\n", encoding="utf-8")
    msg = gen.check(stale)
    assert msg and "\n" not in msg and "python tools/gen_cli_doc.py" in msg
    stale.write_text(gen.render(), encoding="utf-8")
    assert gen.check(stale) is None
