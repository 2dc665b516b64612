"""`phoenixrun status`: the master's state as rich tables (or raw JSON)."""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from phoenixrun import auth
from phoenixrun.protocol.client import ControlClient, ControlError


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


def role_text(node: dict) -> str:
    """A node's role as status shows it: an active node being drained is "draining"; a spare is "spare (warm)"
    once its pre-started workers are up (a drain or a promotion onto it resumes without starting Python),
    "spare (starting)" before. Pure."""
    if node.get("draining") and node["role"] == "active":
        return "draining"
    if node["role"] == "spare" and "warm_ready" in node:
        return "spare (warm)" if node["warm_ready"] else "spare (starting)"
    return node["role"]


def ranks_text(ranks: list[int]) -> str:
    """[0, 1, 2, 3] -> "0-3", [0, 2] -> "0,2", [] -> "-". Pure."""
    if not ranks:
        return "-"
    if ranks == list(range(ranks[0], ranks[-1] + 1)) and len(ranks) > 2:
        return f"{ranks[0]}-{ranks[-1]}"
    return ",".join(map(str, ranks))


def shrunk_text(state: dict) -> str | None:
    """While the job is shrunk (--on-no-spare shrink): how many of its nodes it runs on."""
    active, nnodes = state.get("active_nnodes", state["nnodes"]), state["nnodes"]
    if active >= nnodes:
        return None
    return (f"shrunk: {active} of {nnodes} nodes, world size {state['world_size']}; grows back when a spare "
            "registers (phoenixrun agent --rdzv-endpoint HOST:PORT)")


def render(state: dict) -> Group:
    job = Table(title=f"phoenixrun job {state['run_id']}", show_header=True)
    for col in ("phase", "generation", "step", "steps/s", "world", "restarts", "recoveries", "refused requests",
                "master"):
        job.add_column(col)
    job.add_row(state["phase"], str(state["generation"]), str(state["step"]), str(state["steps_per_s"]),
                str(state["world_size"]), str(state["restart_count"]), str(state["recoveries"]),
                str((state.get("rejected_requests") or {}).get("total", 0)),
                f"{state['endpoint']} pid {state['master_pid']}"
                + (f" epoch {state['master_epoch']}" if state.get("master_epoch") else "")
                + "".join(f", standby {sb['endpoint']}" for sb in state.get("standbys") or []))
    nodes = Table(title="nodes")
    for col in ("slot", "ranks", "role", "node", "agent pid", "worker pids", "heartbeat age", "committed step",
                "replica lag", "d2h ms", "h2h ms", "stall ms", "every", "straggler", "last fault"):
        nodes.add_column(col)
    for n in state["nodes"]:
        prot = n.get("protection") or {}
        committed = [p.get("committed_step") for p in prot.values() if p.get("committed_step") is not None]
        lag = [max(n["snapshots"].get(str(r), [0]) or [0]) - p.get("committed_step", 0) for r, p in prot.items()]

        def ms(key, prot=prot):
            vals = [p.get(key) for p in prot.values() if p.get(key) is not None]
            return f"{1000 * max(vals):.1f}" if vals else "-"
        nodes.add_row(str(n["slot"] if n["slot"] is not None else "-"), ranks_text(n.get("ranks") or []), role_text(n), n["node_id"], str(n["agent_pid"]),
                      ",".join(map(str, n["worker_pids"])) or "-", f"{n['heartbeat_age_s']:.1f}s",
                      str(min(committed)) if committed else "-", str(max(lag)) if lag else "-",
                      ms("d2h_s"), ms("h2h_s"), ms("stall_s"),
                      str(max((p.get("every", 1) for p in prot.values()), default="-")),
                      f"{n['straggler']}x slower" if n.get("straggler") else "-",
                      n.get("last_fault") or (f"drain: {n['draining']}" if n.get("draining") else ""))
    events = Table(title="recent events")
    for col in ("time", "gen", "event", "details"):
        events.add_column(col)
    for e in state["events"][-10:]:
        details = {k: v for k, v in e.items() if k not in ("t", "event", "generation")}
        events.add_row(time.strftime("%H:%M:%S", time.localtime(e["t"])), str(e["generation"]), e["event"],
                       json.dumps(details)[:120])
    shrunk = shrunk_text(state)
    return Group(job, *([Text(shrunk, style="bold yellow")] if shrunk else []), nodes, events)


def show(run_dir, endpoint, secret_file, as_json: bool, watch: bool, interval: float) -> int:
    try:
        client = client_for(run_dir, endpoint, secret_file)
        state = client.get_json("/v1/state")
    except ControlError as e:
        print(f"phoenixrun status: {e}", file=sys.stderr)
        return 1
    if as_json:
        print(json.dumps(state, indent=2))
        return 0
    console = Console()
    if not watch:
        console.print(render(state))
        return 0
    with Live(render(state), console=console, refresh_per_second=4) as live:
        try:
            while state["phase"] not in ("finished", "failed"):
                time.sleep(interval)
                try:
                    state = client.get_json("/v1/state")
                except ControlError:
                    break
                live.update(render(state))
        except KeyboardInterrupt:
            pass
    return 0
