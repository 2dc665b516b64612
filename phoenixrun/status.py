"""`phoenixrun status`: the master's state as rich tables (or raw JSON)."""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from phoenixrun import auth, final_state
from phoenixrun.control.events import read_events
from phoenixrun.protocol.client import ControlClient, ControlError
from phoenixrun.status_columns import Column, fit, widths


def client_for(run_dir: Path | None, endpoint: str | None, secret_file: Path | None) -> ControlClient:
    if run_dir is not None and endpoint is None:
        info = Path(run_dir) / "master.json"
        if not info.exists():
            raise ControlError(f"{info} not found: is a job running with --run-dir {run_dir}?")
        endpoint = json.loads(info.read_text())["endpoint"]
    if endpoint is None:
        raise ControlError("give --run-dir DIR or --endpoint HOST:PORT")
    secret = auth.read_secret(run_dir=run_dir, secret_file=secret_file)
    if not secret:
        raise ControlError("no job secret found: pass --secret-file or set $PHOENIXRUN_SECRET")
    return ControlClient(endpoint, secret, timeout=3.0)


def refusal_text(e: ControlError) -> str:
    """What the master said when it refused a call (its JSON `error`), else the error itself. Pure."""
    body = str(e).partition(": HTTP ")[2].partition(" ")[2]
    try:
        msg = json.loads(body).get("error")
    except (ValueError, AttributeError):
        msg = None
    return msg.removeprefix("refused: ") if isinstance(msg, str) else str(e)


def role_text(node: dict[str, Any]) -> str:
    """A node's role as status shows it: an active node being drained is "draining"; a spare is "spare (warm)"
    once its pre-started workers are up (a drain or a promotion onto it resumes without starting Python),
    "spare (starting)" before. Pure."""
    if node.get("draining") and node["role"] == "active":
        return "draining"
    if node["role"] == "spare" and "warm_ready" in node:
        return "spare (warm)" if node["warm_ready"] else "spare (starting)"
    return str(node["role"])


def ranks_text(ranks: list[int]) -> str:
    """[0, 1, 2, 3] -> "0-3", [0, 2] -> "0,2", [] -> "-". Pure."""
    if not ranks:
        return "-"
    if ranks == list(range(ranks[0], ranks[-1] + 1)) and len(ranks) > 2:
        return f"{ranks[0]}-{ranks[-1]}"
    return ",".join(map(str, ranks))


def shrunk_text(state: dict[str, Any]) -> str | None:
    """While the job is shrunk (--on-no-spare shrink): how many of its nodes it runs on."""
    active, nnodes = state.get("active_nnodes", state["nnodes"]), state["nnodes"]
    if active >= nnodes:
        return None
    return (f"shrunk: {active} of {nnodes} nodes, world size {state['world_size']}; grows back when a spare "
            "registers (phoenixrun agent --rdzv-endpoint HOST:PORT)")


def spares_left(state: dict[str, Any]) -> int:
    """Spare nodes the job can still take a lost node's place from. Pure."""
    return sum(1 for n in state["nodes"] if n["role"] == "spare")


def _text(v: object) -> str:
    return "-" if v is None else str(v)


def _table(title: str, columns: list[Column], rows: list[list[str]], width: int) -> Table:
    """A rich table of the columns that fit `width`, naming those left out."""
    kept, need = fit(columns, rows, width), widths(columns, rows)
    left_out = [c.header for i, c in enumerate(columns) if i not in kept]
    table = Table(title=title, caption=f"not shown at {width} columns: {', '.join(left_out)} (wider terminal, or "
                  "--json)" if left_out else None, caption_justify="left")
    for i in kept:
        table.add_column(columns[i].header, no_wrap=not columns[i].wrap, overflow="fold", min_width=need[i])
    for r in rows:
        table.add_row(*(r[i] for i in kept))
    return table


JOB_COLUMNS = [Column("phase", 0), Column("step", 0), Column("world", 1), Column("spares left", 1),
               Column("recoveries", 2), Column("restarts", 2), Column("steps/s", 3), Column("generation", 4),
               Column("refused requests", 5), Column("master", 6, wrap=True)]
NODE_COLUMNS = [Column("slot", 0), Column("role", 0), Column("ranks", 1), Column("node", 1),
                Column("last fault", 2, wrap=True), Column("committed step", 3), Column("heartbeat age", 4),
                Column("straggler", 5), Column("agent pid", 6), Column("replica lag", 7), Column("worker pids", 8),
                Column("every", 9), Column("stall ms", 10), Column("d2h ms", 11), Column("h2h ms", 12)]


def job_row(state: dict[str, Any]) -> list[str]:
    master = (f"{state['endpoint']} pid {state['master_pid']}"
              + (f" epoch {state['master_epoch']}" if state.get("master_epoch") else "")
              + "".join(f", standby {sb['endpoint']}" for sb in state.get("standbys") or []))
    return [state["phase"] if state.get("exit_code") in (None, 0) else f"{state['phase']} (exit {state['exit_code']})",
            _text(state["step"]), _text(state["world_size"]), str(spares_left(state)), str(state["recoveries"]),
            str(state["restart_count"]), _text(state["steps_per_s"]), str(state["generation"]),
            str((state.get("rejected_requests") or {}).get("total", 0)), master]


def node_row(n: dict[str, Any]) -> list[str]:
    prot = n.get("protection") or {}
    snaps = n.get("snapshots") or {}
    committed = [p.get("committed_step") for p in prot.values() if p.get("committed_step") is not None]
    lag = [max(snaps.get(str(r), [0]) or [0]) - p.get("committed_step", 0) for r, p in prot.items()]

    def ms(key: str) -> str:
        vals = [p.get(key) for p in prot.values() if p.get(key) is not None]
        return f"{1000 * max(vals):.1f}" if vals else "-"
    age = n.get("heartbeat_age_s")
    return [_text(n["slot"]), role_text(n), ranks_text(n.get("ranks") or []), n["node_id"],
            n.get("last_fault") or (f"drain: {n['draining']}" if n.get("draining") else ""),
            str(min(committed)) if committed else "-", "-" if age is None else f"{age:.1f}s",
            f"{n['straggler']}x slower" if n.get("straggler") else "-", _text(n.get("agent_pid")),
            str(max(lag)) if lag else "-", ",".join(map(str, n.get("worker_pids") or [])) or "-",
            str(max((p.get("every", 1) for p in prot.values()), default="-")), ms("stall_s"), ms("d2h_s"), ms("h2h_s")]


def render(state: dict[str, Any], width: int = 400) -> Group:
    """The job, its nodes and recent events as tables `width` characters wide at most."""
    job = _table(f"phoenixrun job {state['run_id']}", JOB_COLUMNS, [job_row(state)], width)
    nodes = _table("nodes", NODE_COLUMNS, [node_row(n) for n in state["nodes"]], width)
    events = Table(title="recent events")
    for col in ("time", "gen", "event", "details"):
        events.add_column(col, no_wrap=col != "details", overflow="fold")
    for e in state["events"][-10:]:
        details = {k: v for k, v in e.items() if k not in ("t", "event", "generation")}
        events.add_row(time.strftime("%H:%M:%S", time.localtime(e["t"])), str(e["generation"]), e["event"],
                       json.dumps(details)[:120])
    notes = [t for t in (shrunk_text(state), state.get("note")) if t]
    return Group(job, *(Text(t, style="bold yellow") for t in notes), nodes, events)


def recorded_state(run_dir: Path) -> dict[str, Any] | None:
    """The run's state as RUN_DIR/events.jsonl records it (final_state.py), or None without a log."""
    path = Path(run_dir) / "events.jsonl"
    if not path.is_file():
        return None
    try:
        run_id = json.loads((Path(run_dir) / "master.json").read_text()).get("run_id")
    except (OSError, ValueError):
        run_id = None
    return final_state.from_events(read_events(path), run_id or Path(run_dir).name)


def offline_note(state: dict[str, Any], run_dir: Path, why: ControlError) -> str:
    """The line above a state read from the event log: where it comes from, and how the job ended. Pure."""
    log = Path(run_dir) / "events.jsonl"
    if state["phase"] == final_state.UNKNOWN:
        return (f"the master is not reachable ({why}) and {log} has no job_finished event: the master was "
                "killed, or runs where this machine cannot reach it; state as the log last recorded it")
    return (f"the job has ended ({state['phase']}, exit code {state['exit_code']}: {state['reason']}); final "
            f"state from {log}")


def show(run_dir: Path | None, endpoint: str | None, secret_file: Path | None, as_json: bool, watch: bool,
         interval: float) -> int:
    console = Console()
    client = None
    try:
        client = client_for(run_dir, endpoint, secret_file)
        state = client.get_json("/v1/state")
    except ControlError as e:
        # not reached (a refusal: the master answered, its state is not ours to guess): the job may have ended
        recorded = recorded_state(run_dir) if run_dir is not None and e.status is None else None
        if recorded is None or run_dir is None:
            hint = "; if the job has ended, --run-dir RUN_DIR shows its final state" if run_dir is None else ""
            print(f"phoenixrun status: {e}{hint}", file=sys.stderr)
            return 1
        state = recorded
        state["note"] = offline_note(state, run_dir, e)
        watch = False
    if as_json:
        print(json.dumps(state, indent=2))
        return 0
    if not watch:
        console.print(render(state, console.width))
        return 0
    assert client is not None   # watching: the master answered the first read
    with Live(render(state, console.width), console=console, refresh_per_second=4) as live:
        try:
            while state["phase"] not in ("finished", "failed"):
                time.sleep(interval)
                try:
                    state = client.get_json("/v1/state")
                except ControlError as e:
                    recorded = recorded_state(run_dir) if run_dir is not None else None
                    if recorded is not None and run_dir is not None:
                        state = {**recorded, "note": offline_note(recorded, run_dir, e)}
                        live.update(render(state, console.width))
                    break
                live.update(render(state, console.width))
        except KeyboardInterrupt:
            pass
    return 0
