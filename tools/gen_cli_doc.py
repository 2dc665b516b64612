"""Render docs/cli.md from the real click commands in phoenixrun/cli.py.

    python tools/gen_cli_doc.py           # (re)write docs/cli.md
    python tools/gen_cli_doc.py --check   # exit 1 if docs/cli.md is stale

The flag tables are built from the `launch` command's options (spellings, env vars, defaults) with a
hand-written note for each torchrun flag on what it means under phoenixrun; every command's `--help`
is rendered at a fixed width so the page is deterministic. tests/test_cli_doc.py runs the check.
"""
from __future__ import annotations

import argparse
import inspect
import sys
from pathlib import Path

import click

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "cli.md"
REGEN = "python tools/gen_cli_doc.py"
WIDTH = 100

# torchrun's own flags (torch.distributed.run), by primary spelling; a launch option named here goes in
# the torchrun table, any other in the phoenixrun table.
TORCHRUN_FLAGS = {
    "--nnodes", "--nproc-per-node", "--standalone", "--rdzv-endpoint", "--rdzv-id", "--rdzv-backend",
    "--rdzv-conf", "--max-restarts", "--node-rank", "--master-addr", "--master-port", "--log-dir", "--tee",
    "--redirects", "--module", "--no-python", "--monitor-interval", "--start-method", "--role", "--run-path",
    "--local-addr", "--logs-specs", "--local-ranks-filter", "--event-log-handler", "--numa-binding",
    "--signals-to-handle", "--virtual-local-rank", "--shutdown-timeout", "--duplicate-stdout-filters",
    "--duplicate-stderr-filters",
}

# What each torchrun flag means under phoenixrun (falls back to the option's help text when absent).
TORCHRUN_NOTES = {
    "--nnodes": "Active (training) nodes: `N` (`N:N` is accepted too). torchrun's elastic `MIN:MAX` is refused "
                "with a message saying what to type instead: phoenixrun keeps the world size fixed and fills a "
                "lost node's slot from warm spares (`--nnodes MIN --spares MAX-MIN`), or goes on with fewer nodes "
                "when none is left (`--on-no-spare shrink`). The job starts once N nodes joined; spares may join "
                "later.",
    "--nproc-per-node": "Workers per node: a number, `gpu` (visible CUDA devices; an error without one), or "
                        "`auto`/`cpu` (the CPU count; note torchrun's `auto` picks the GPU count when CUDA "
                        "is present).",
    "--standalone": "Run the master and `nnodes + spares` agents on this machine, each agent standing in for "
                    "one node (own fault domain), on a free port.",
    "--rdzv-endpoint": "`host:port` of the phoenixrun master (its own control plane, not a c10d store). "
                       "Without it, `--master-addr:--master-port` is used.",
    "--rdzv-id": "Job id: exported to workers as `TORCHELASTIC_RUN_ID` and naming the run directory "
                 "`.phoenixrun/RUN_ID`. The same id again resumes that run; without it a launch is a new run "
                 "(`run-XXXXXXXX`, `standalone-XXXXXXXX`; `slurm-JOBID` under Slurm; the directory's name with "
                 "`--run-dir`): [operations.md](operations.md#which-run-a-launch-is-and-resuming-one).",
    "--rdzv-backend": "`c10d` or `static`, both meaning phoenixrun's own master; any other backend "
                      "(`etcd`, `etcd-v2`, ...) is refused with a clear error.",
    "--rdzv-conf": "Accepted for compatibility; ignored (torchrun's `join_timeout=` is `--join-timeout` here).",
    "--max-restarts": "Full torchrun-style restarts (every worker restarted) allowed when in-memory recovery "
                      "is impossible, and on any failure of a script that does not use the phoenixrun API. "
                      "Exported as `TORCHELASTIC_MAX_RESTARTS`.",
    "--node-rank": "This node's slot (its workers get ranks `node_rank * nproc .. + nproc - 1`), whatever the "
                   "order nodes join in, as under torchrun; node 0 also runs the master. A rank >= nnodes joins "
                   "as a spare; two nodes with one rank: the second is refused. Without it, nodes get slots in "
                   "the order they join and the node the `--rdzv-endpoint` host names runs the master.",
    "--master-addr": "Master address when no `--rdzv-endpoint` is given (the phoenixrun master, not a "
                     "TCPStore).",
    "--master-port": "Master port when no `--rdzv-endpoint` is given.",
    "--log-dir": "Write each worker's stdout/stderr to files under this directory.",
    "--tee": "With `--log-dir`: output goes to the files (`stdout.log`, `stderr.log`) and the console (the "
             "default). torchrun's 0-3 stream selector is accepted but not applied per stream.",
    "--local-ranks-filter": "Only these local ranks' output reaches the console (e.g. `0` or `0,1`); log files "
                            "get every rank's, as under torchrun.",
    "--start-method": "Accepted (`spawn`, `fork`, `forkserver`) for compatibility: workers are always fresh "
                      "`python SCRIPT` processes, as torchrun runs a script entry point.",
    "--shutdown-timeout": "Seconds from SIGTERM to SIGKILL when workers are stopped (torchrun: 30; phoenixrun's "
                          "default 2 s, since every restart and recovery waits for it).",
    "--redirects": "With `--log-dir` and without `--tee`: output goes only to the files. torchrun's 0-3 "
                   "stream selector is accepted but not applied per stream.",
    "--module": "Run SCRIPT as a module (`python -m SCRIPT`).",
    "--no-python": "Execute SCRIPT directly instead of with python. Cannot be combined with `-m`.",
    "--monitor-interval": "Accepted for compatibility; ignored (agents watch their workers every 50 ms).",
}

INTRO = """\
# phoenixrun command line

<!-- Generated by tools/gen_cli_doc.py from phoenixrun/cli.py: do not edit by hand. After changing a flag,
     run `python tools/gen_cli_doc.py` (tests/test_cli_doc.py fails while this page is stale). -->

`phoenixrun` launches a training script the way `torchrun` does, and adds hot-swap recovery:

```
phoenixrun [torchrun flags] [phoenixrun flags] SCRIPT [ARGS]...
phoenixrun master|agent|status|simulate|inject|drain [OPTIONS]
```

The first form is the launcher: every flag must come before SCRIPT, and everything after SCRIPT is passed to
the script unchanged. Most torchrun command lines work as they are: multi-word flags are accepted with dashes
or underscores (`--nproc-per-node` or `--nproc_per_node`), and torchrun's flags also read the `PET_*`
environment variables torchrun reads. Bad input gives a one-line `phoenixrun: error: ...` and exit status 2.

The second form runs one part of a job by hand (for clusters and schedulers, see [slurm.md](slurm.md)):
`master` (the control plane), `agent` (one node), `status` (inspect a running job), `simulate` (the cost
model, see [simulate.md](simulate.md)), `inject` (a fault drill: crash a worker, kill or hang a node, or feed
an Xid/ECC event through the node's health source, see [fault-model.md](fault-model.md)), `drain` (move a
healthy node's ranks to a spare at a step boundary, nothing replayed, see [operations.md](operations.md)).
"""


def _registered() -> list[tuple[str, click.Command, click.Context]]:
    """(title, command, context) for the launcher and each subcommand, at a fixed width."""
    from phoenixrun.cli import register_simulate, commands, launch
    register_simulate()
    kw = {"terminal_width": WIDTH, "max_content_width": WIDTH}

    def context(cmd: click.Command, name: str, parent: click.Context | None = None) -> click.Context:
        # the command's context_settings too (e.g. -h as a help option), as cmd.main() would apply them
        return click.Context(cmd, info_name=name, parent=parent, **{**cmd.context_settings, **kw})
    out = [("phoenixrun", launch, context(launch, "phoenixrun"))]
    group = context(commands, "phoenixrun")
    for name in ("master", "agent", "status", "simulate", "inject", "drain"):
        cmd = commands.get_command(group, name)
        if cmd is None:
            raise SystemExit(f"gen_cli_doc: phoenixrun has no {name!r} subcommand")
        out.append((f"phoenixrun {name}", cmd, context(cmd, name, group)))
    return out


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def _spellings(opt: click.Option) -> str:
    names = sorted(opt.opts, key=lambda n: (n.startswith("--"), "_" in n)) + list(opt.secondary_opts)
    cell = ", ".join(f"`{n}`" for n in names)
    if isinstance(opt.envvar, str):
        cell += f", `${opt.envvar}`"
    return cell


def _metavar(opt: click.Option, ctx: click.Context) -> str:
    if opt.is_flag:
        return ""
    # click >= 8.2 takes the context, older versions take nothing
    if "ctx" in inspect.signature(opt.make_metavar).parameters:
        return opt.make_metavar(ctx)
    return opt.make_metavar()


def _default(opt: click.Option) -> str:
    if opt.is_flag:
        return "off"
    d = opt.default
    if d is None or d == "" or callable(d):
        return "—"
    return f"`{d}`"


def _primary(opt: click.Option) -> str:
    longs = [n for n in opt.opts if n.startswith("--")]
    return longs[0] if longs else opt.opts[0]


def _tables(launch: click.Command, ctx: click.Context) -> str:
    head = "| Flag | Value | Default | Meaning in phoenixrun |\n|---|---|---|---|\n"
    torchrun, own = [], []
    for p in launch.params:
        if not isinstance(p, click.Option) or p.hidden or p.name == "help":
            continue
        name = _primary(p)
        note = TORCHRUN_NOTES.get(name) if name in TORCHRUN_FLAGS else None
        row = (f"| {_spellings(p)} | {_cell(_metavar(p, ctx)) or '—'} | {_default(p)} | "
               f"{_cell(note or p.help or '')} |\n")
        (torchrun if name in TORCHRUN_FLAGS else own).append(row)
    present = {_primary(p) for p in launch.params if isinstance(p, click.Option)}
    missing = ", ".join(f"`{n}`" for n in sorted(TORCHRUN_FLAGS - present))
    return ("## torchrun flags\n\n"
            "The torchrun flags phoenixrun accepts, and what each means here. The other torchrun flags ("
            + missing + ") are rejected with `No such option`; why each is left out, and every other difference "
            "from torchrun: [torchrun-compat.md](torchrun-compat.md).\n\n"
            + head + "".join(torchrun)
            + "\n## phoenixrun flags\n\n"
            "Flags torchrun does not have (the multi-word ones also accept underscores).\n\n"
            + head + "".join(own))


def _rules() -> str:
    """The rules between flags, from phoenixrun/config.py's RULES (what config.validate() enforces)."""
    from phoenixrun.config import RULES
    rows = "".join(f"| {', '.join(f'`{f}`' for f in r.flags)} | {_cell(r.doc)} |\n" for r in RULES)
    return ("## Rules between flags\n\n"
            "Checked before anything starts, by `phoenixrun`, `phoenixrun master` and `phoenixrun agent` alike "
            "(`phoenixrun/config.py::validate`); a command line that breaks one gets a one-line "
            "`phoenixrun: error: ...` naming the flags and the fix, and exit status 2.\n\n"
            "| Flags | Rule |\n|---|---|\n" + rows)


def render() -> str:
    cmds = _registered()
    _, launch, launch_ctx = cmds[0]
    parts = [INTRO, _tables(launch, launch_ctx), _rules(),
             "## `--help` of each command\n\nEach command's `--help` text, word-wrapped here at 100 columns."]
    for title, cmd, ctx in cmds:
        help_text = cmd.get_help(ctx).rstrip()
        parts.append(f"### `{title} --help`\n\n```text\n{help_text}\n```")
    return "\n".join(p.strip("\n") + "\n" for p in parts)


def check(path: Path = DOC) -> str | None:
    """None if `path` matches what render() produces, else a one-line message."""
    want = render()
    try:
        have = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return f"{path.relative_to(ROOT) if path.is_relative_to(ROOT) else path} is missing: run `{REGEN}`"
    if have != want:
        rel = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
        return f"{rel} is out of date with phoenixrun/cli.py: run `{REGEN}`"
    return None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if docs/cli.md differs from the generated page")
    args = ap.parse_args(argv)
    if args.check:
        msg = check()
        if msg:
            print(msg, file=sys.stderr)
            return 1
        return 0
    DOC.parent.mkdir(parents=True, exist_ok=True)
    DOC.write_text(render(), encoding="utf-8")
    print(f"wrote {DOC.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
