"""`phoenixrun`: a torchrun-compatible launcher, plus `master`, `agent`, `status`, `simulate`.

    phoenixrun [torchrun flags] [phoenixrun flags] script.py [script args]
    phoenixrun master|agent|status|simulate ...

The CLI only parses and validates; the work lives in launcher.py, control/, agents/ and sim/.
"""
from __future__ import annotations

import logging
import os
import sys
import uuid
from pathlib import Path

import click

from phoenixrun import auth, netaddr
from phoenixrun.protocol.messages import FAULTS, valid_fault  # noqa: F401  (the master checks the same)

SUBCOMMANDS = ("master", "agent", "status", "simulate", "inject")


def _opt(*names, env: str | None = None, **kw):
    """An option spelled with dashes and with underscores (torchrun accepts both), PET_* env."""
    decls = list(names)
    for n in names:
        if n.startswith("--") and "-" in n[2:]:
            decls.append("--" + n[2:].replace("-", "_"))
    if env:
        kw.setdefault("envvar", env)
        kw.setdefault("show_envvar", True)
    return click.option(*decls, **kw)


def _parse_nnodes(value: str) -> tuple[int, int]:
    """`N` or torchrun's `MIN:MAX` -> (active nodes, extra nodes admitted as spares)."""
    lo, _, hi = value.partition(":")
    try:
        lo_n, hi_n = int(lo), int(hi or lo)
    except ValueError:
        raise click.BadParameter(f"{value!r} is not a node count (N or MIN:MAX)", param_hint="--nnodes") from None
    if lo_n < 1:
        raise click.BadParameter("must be >= 1", param_hint="--nnodes")
    if hi_n < lo_n:
        raise click.BadParameter(f"{value!r}: MAX is below MIN", param_hint="--nnodes")
    return lo_n, hi_n - lo_n


def _parse_ranks_filter(value: str | None) -> str:
    """torchrun's --local-ranks-filter: comma-separated local ranks (empty: all). Normalised, validated."""
    if not value:
        return ""
    try:
        ranks = sorted({int(x) for x in value.split(",") if x.strip()})
    except ValueError:
        raise click.BadParameter(f"{value!r} is not a comma-separated list of local ranks",
                                 param_hint="--local-ranks-filter") from None
    if any(r < 0 for r in ranks):
        raise click.BadParameter("local ranks are >= 0", param_hint="--local-ranks-filter")
    return ",".join(map(str, ranks))


def _parse_nproc(value: str) -> int:
    if value == "cpu":
        return os.cpu_count() or 1
    if value == "auto":   # torchrun: one per GPU when CUDA is there, else one per CPU
        import torch
        return torch.cuda.device_count() if torch.cuda.is_available() else (os.cpu_count() or 1)
    if value == "gpu":
        import torch
        if not torch.cuda.is_available():
            raise click.BadParameter("'gpu' given but no CUDA device is visible", param_hint="--nproc-per-node")
        return torch.cuda.device_count()
    try:
        n = int(value)
    except ValueError:
        raise click.BadParameter(f"{value!r} is not a number (or auto/cpu/gpu)", param_hint="--nproc-per-node") from None
    if n < 1:
        raise click.BadParameter("must be >= 1", param_hint="--nproc-per-node")
    return n


def _tee(tee: str | None, redirects: str | None) -> bool:
    """Print worker output too? torchrun's --redirects/--tee take 0 (none), 1 (stdout), 2 (stderr), 3 (both)."""
    if tee not in (None, "0"):
        return True
    return redirects in (None, "0")


def _options(*opts):
    """One decorator for a group of options (shared by the commands that take them)."""
    def apply(f):
        for opt in reversed(opts):
            f = opt(f)
        return f
    return apply


# The job's shape and the master's recovery policy: `phoenixrun` (which runs a master) and `phoenixrun master`.
_job_shape = _options(
    _opt("--replicas", type=click.IntRange(min=0), default=1, show_default=True,
         help="Peer copies of each rank's optimizer shard."),
    _opt("--tp", type=click.IntRange(min=1), default=1, show_default=True, help="Tensor-parallel size."),
    _opt("--pp", type=click.IntRange(min=1), default=1, show_default=True, help="Pipeline-parallel size."),
)
_recovery_policy = _options(
    _opt("--max-restarts", type=click.IntRange(min=0), default=0, show_default=True, env="PET_MAX_RESTARTS",
         help="Full restarts allowed when in-memory recovery is impossible (and for scripts without the API)."),
    _opt("--node-timeout", type=click.FloatRange(min=0.1), default=5.0, show_default=True,
         help="A node whose agent misses heartbeats this long is lost."),
    _opt("--spare-wait", type=click.FloatRange(min=0), default=30.0, show_default=True,
         help="How long a recovery waits for a spare to register before giving up."),
    _opt("--recovery-timeout", type=click.FloatRange(min=1), default=60.0, show_default=True,
         help="Deadline of each recovery phase."),
    _opt("--max-local-resets", type=click.IntRange(min=0), default=3, show_default=True,
         help="Local resets of one node before it is replaced instead."),
)
# what the agents watch: `phoenixrun` only (`phoenixrun agent` takes its own --heartbeat-interval)
_agent_timeouts = _options(
    _opt("--heartbeat-interval", type=click.FloatRange(min=0.01), default=0.5, show_default=True,
         help="Seconds between agent heartbeats."),
    _opt("--hang-timeout", type=click.FloatRange(min=0.1), default=20.0, show_default=True,
         help="A worker making no progress this long (outside a recovery) is hung: its agent kills it "
              "and the node gets a local reset."),
)
_persistence = _options(
    _opt("--persist-every", type=click.IntRange(min=0), default=0, show_default=True,
         help="Agents write each rank's committed snapshot to --persist-dir every N steps, in the "
              "background (0: only when an agent gets SIGTERM). The fallback when in-memory recovery "
              "is impossible, and what a job started on the same directory resumes from."),
    _opt("--persist-dir", type=click.Path(file_okay=False, path_type=Path), default=None,
         help="Persistent checkpoints (DCP format, one directory per step) [default: RUN_DIR/checkpoints "
              "when --persist-every is set]. Must be reachable from every node."),
    _opt("--persist-keep", type=click.IntRange(min=1), default=2, show_default=True,
         help="Complete checkpoints kept; older ones are pruned."),
    _opt("--max-fallbacks", type=click.IntRange(min=0), default=3, show_default=True,
         help="Restarts from the persistent checkpoint before the job gives up."),
)


def _persist_dir(persist_dir: Path | None, persist_every: int, run_dir: Path) -> Path | None:
    if persist_dir is not None:
        return persist_dir.resolve()
    return (run_dir / "checkpoints").resolve() if persist_every else None


@click.command("phoenixrun", context_settings={"allow_interspersed_args": False, "help_option_names": ["-h", "--help"]},
               epilog="Subcommands: phoenixrun master|agent|status|simulate --help")
@_opt("--nnodes", default="1", show_default=True, env="PET_NNODES", help="Active nodes (N; N:N also accepted).")
@_opt("--nproc-per-node", default="1", show_default=True, env="PET_NPROC_PER_NODE",
      help="Workers per node (a number, or auto/cpu/gpu).")
@_opt("--standalone", is_flag=True, env="PET_STANDALONE",
      help="Run the master and nnodes + spares agents on this machine (each agent simulates one node).")
@_opt("--rdzv-endpoint", default="", env="PET_RDZV_ENDPOINT", help="host:port of the phoenixrun master.")
@_opt("--rdzv-id", default="", env="PET_RDZV_ID", help="Job id (TORCHELASTIC_RUN_ID).")
@_opt("--rdzv-backend", default="c10d", show_default=True, env="PET_RDZV_BACKEND",
      help="c10d or static; both mean phoenixrun's own master.")
@_opt("--rdzv-conf", default="", env="PET_RDZV_CONF", help="Accepted for compatibility; ignored.")
@_opt("--node-rank", type=click.IntRange(min=0), default=None, env="PET_NODE_RANK",
      help="Rank of this node: its slot, whatever the order nodes join in; node 0 also runs the master "
           "[default: slots in order of joining; the rendezvous host runs the master].")
@_opt("--master-addr", default="127.0.0.1", show_default=True, env="PET_MASTER_ADDR",
      help="Master address when no --rdzv-endpoint is given.")
@_opt("--master-port", type=click.IntRange(0, 65535), default=29500, show_default=True, env="PET_MASTER_PORT",
      help="Master port when no --rdzv-endpoint is given.")
@_opt("--local-addr", default=None, env="PET_LOCAL_ADDR",
      help="Address other nodes use to reach this node's agent [default: the local address that routes to the "
           "master].")
@_opt("--log-dir", default=None, env="PET_LOG_DIR", help="Write each worker's output under this directory.")
@_opt("--tee", "-t", default=None, env="PET_TEE", help="With --log-dir, also print worker output (torchrun: 0-3).")
@_opt("--redirects", "-r", default=None, env="PET_REDIRECTS", help="With --log-dir, only write files (torchrun: 0-3).")
@_opt("--monitor-interval", type=click.FloatRange(min=0.01), default=0.1, show_default=True,
      env="PET_MONITOR_INTERVAL", help="Accepted for compatibility (agents watch workers every 50 ms).")
@_opt("--local-ranks-filter", default="", env="PET_LOCAL_RANKS_FILTER",
      help="Only these local ranks' output reaches the console, e.g. 0 or 0,1 (log files get all).")
@_opt("--start-method", type=click.Choice(["spawn", "fork", "forkserver"]), default="spawn", show_default=True,
      env="PET_START_METHOD", help="Accepted for compatibility: workers are always fresh processes.")
@_opt("--shutdown-timeout", type=click.FloatRange(min=0), default=None, env="PET_SHUTDOWN_TIMEOUT",
      help="Seconds from SIGTERM to SIGKILL when workers are stopped [default: 2].")
@click.option("-m", "--module", is_flag=True, help="Run the entry point as a Python module (python -m).")
@_opt("--no-python", is_flag=True, help="Run the entry point as an executable, not with python.")
@_opt("--spares", type=click.IntRange(min=0), default=0, show_default=True,
      help="Warm spare nodes: with --standalone started here; on a cluster, the nodes beyond --nnodes that join "
           "(more are told they are not needed and exit 0).")
@_opt("--run-dir", type=click.Path(file_okay=False, path_type=Path), default=None,
      help="Events, master.json and the job secret go here [default: .phoenixrun/RUN_ID].")
@_opt("--fault-domain", default="", help="Fault-domain label of this node (replicas avoid sharing one).")
@_opt("--collective-timeout", type=click.FloatRange(min=1), default=60.0, show_default=True,
      help="Timeout of the workers' process groups (keep it above --hang-timeout).")
@_job_shape
@_recovery_policy
@_agent_timeouts
@_persistence
@click.argument("entry", nargs=-1, type=click.UNPROCESSED, required=True, metavar="SCRIPT [ARGS]...")
def launch(nnodes, nproc_per_node, standalone, rdzv_endpoint, rdzv_id, rdzv_backend, rdzv_conf, max_restarts,
           node_rank, master_addr, master_port, local_addr, log_dir, tee, redirects, monitor_interval,
           local_ranks_filter, start_method, shutdown_timeout, module, no_python,
           spares, run_dir, replicas, tp, pp, fault_domain, collective_timeout, heartbeat_interval, node_timeout,
           hang_timeout, spare_wait, recovery_timeout, max_local_resets, persist_every, persist_dir, persist_keep,
           max_fallbacks, entry):
    """Launch SCRIPT on every worker, torchrun-style, with PHOENIX hot-swap recovery."""
    from phoenixrun.config import MasterConfig
    from phoenixrun.launcher import LaunchConfig, run
    from phoenixrun.topology import Layout

    n, elastic_extra = _parse_nnodes(nnodes)
    ranks_filter = _parse_ranks_filter(local_ranks_filter)
    spares = spares or elastic_extra
    nproc = _parse_nproc(nproc_per_node)
    if rdzv_backend not in ("c10d", "static"):
        raise click.BadParameter(f"{rdzv_backend!r} is not supported: phoenixrun runs its own rendezvous master; "
                                 "use c10d (the default) or static", param_hint="--rdzv-backend")
    if module and no_python:
        raise click.UsageError("-m/--module and --no-python cannot be combined")
    if not module and not no_python and not Path(entry[0]).is_file():
        raise click.UsageError(f"training script {entry[0]!r} not found")
    try:
        Layout(n, nproc, tp, pp)
    except ValueError as e:
        raise click.UsageError(str(e)) from None
    if replicas > n - 1 and n > 1:
        raise click.BadParameter(f"{replicas} replicas need at least {replicas + 1} nodes (have {n})",
                                 param_hint="--replicas")
    run_id = rdzv_id or ("standalone-" + uuid.uuid4().hex[:8] if standalone else "phoenixrun")
    run_dir = run_dir or Path(".phoenixrun") / run_id
    endpoint = rdzv_endpoint or f"{master_addr}:{master_port}"
    host, _, port = ("127.0.0.1:0" if standalone else endpoint).rpartition(":")
    if not port.isdigit():
        raise click.BadParameter(f"{endpoint!r} is not host:port", param_hint="--rdzv-endpoint")
    if standalone:
        host_master = True
    elif node_rank is not None:
        host_master = node_rank == 0
    else:   # every node runs the same command: the rendezvous host runs the master (the first there, if several)
        host_master = netaddr.is_this_host(host) and netaddr.port_free(host, int(port))
    job = MasterConfig(
        run_dir=run_dir, nnodes=n, nproc_per_node=nproc, run_id=run_id, tp=tp, pp=pp,
        replicas=min(replicas, max(0, n - 1)), max_restarts=max_restarts, host=host, port=int(port),
        node_timeout=node_timeout, spare_wait=spare_wait, recovery_timeout=recovery_timeout,
        max_local_resets=max_local_resets, persist_dir=_persist_dir(persist_dir, persist_every, run_dir),
        persist_every=persist_every, persist_keep=persist_keep, max_fallbacks=max_fallbacks,
        spares=None if standalone else spares)   # standalone: spares started by hand may join too
    cfg = LaunchConfig(
        master=job, entry=list(entry), module=module, no_python=no_python, standalone=standalone, spares=spares,
        endpoint=None if standalone else endpoint, node_rank=node_rank, host_master=host_master,
        local_addr="127.0.0.1" if standalone else netaddr.node_addr(local_addr, endpoint), fault_domain=fault_domain,
        log_dir=log_dir, tee=_tee(tee, redirects), heartbeat_interval=heartbeat_interval,
        collective_timeout=collective_timeout, hang_timeout=hang_timeout, local_ranks_filter=ranks_filter,
        shutdown_timeout=shutdown_timeout)
    sys.exit(run(cfg))


@click.group("phoenixrun")
def commands():
    """phoenixrun subcommands."""


@commands.command("master")
@_opt("--nnodes", type=click.IntRange(min=1), required=True)
@_opt("--nproc-per-node", type=click.IntRange(min=1), required=True)
@_opt("--run-dir", type=click.Path(file_okay=False, path_type=Path), required=True)
@_opt("--rdzv-id", default="phoenixrun")
@click.option("--host", default=netaddr.ALL_INTERFACES, show_default=True,
              help="Address to listen on (the default: every interface, so that other machines' nodes reach it).")
@click.option("--port", type=click.IntRange(0, 65535), default=29500, show_default=True)
@click.option("--store-port", type=click.IntRange(0, 65535), default=0, help="TCPStore port [default: any].")
@click.option("--spares", type=click.IntRange(min=0), default=None,
              help="Spare nodes admitted at a time; more are told they are not needed [default: any number].")
@_job_shape
@_recovery_policy
@_persistence
def master_cmd(nnodes, nproc_per_node, run_dir, rdzv_id, host, port, store_port, spares, replicas, tp, pp, max_restarts,
               node_timeout, spare_wait, recovery_timeout, max_local_resets, persist_every, persist_dir, persist_keep,
               max_fallbacks):
    """Run the rendezvous master (control plane) in the foreground."""
    from phoenixrun.config import MasterConfig
    from phoenixrun.control.master import Master
    _logging()
    run_dir.mkdir(parents=True, exist_ok=True)
    secret = auth.read_secret(run_dir) or auth.new_secret()
    auth.write_secret(run_dir, secret)
    try:
        cfg = MasterConfig(run_dir=run_dir, nnodes=nnodes, nproc_per_node=nproc_per_node, run_id=rdzv_id, tp=tp,
                           pp=pp, replicas=replicas, max_restarts=max_restarts, host=host, port=port,
                           store_port=store_port, node_timeout=node_timeout, spare_wait=spare_wait,
                           recovery_timeout=recovery_timeout, max_local_resets=max_local_resets,
                           persist_dir=_persist_dir(persist_dir, persist_every, run_dir), persist_every=persist_every,
                           persist_keep=persist_keep, max_fallbacks=max_fallbacks, spares=spares)
        m = Master(cfg, secret)
        m.start()
    except (ValueError, OSError) as e:
        raise click.UsageError(str(e)) from None
    sys.exit(m.wait())


@commands.command("agent")
@_opt("--rdzv-endpoint", required=True, help="host:port of the master.")
@_opt("--nproc-per-node", type=click.IntRange(min=1), required=True)
@click.option("--host", default=None,
              help="Address the master and peers use to reach this node [default: the local address that routes "
                   "to the master].")
@_opt("--fault-domain", default="")
@_opt("--heartbeat-interval", type=click.FloatRange(min=0.01), default=0.5)
@_opt("--log-dir", default=None)
@click.option("--no-tee", is_flag=True, help="With --log-dir, do not also print worker output.")
@_opt("--secret-file", type=click.Path(dir_okay=False, path_type=Path), default=None,
      help="File holding the job secret [default: $PHOENIXRUN_SECRET].")
@_opt("--collective-timeout", type=click.FloatRange(min=1), default=None, envvar="PHOENIXRUN_COLLECTIVE_TIMEOUT",
      help="Timeout of the workers' process groups, seconds [default: 60].")
@_opt("--hang-timeout", type=click.FloatRange(min=0.1), default=20.0, show_default=True,
      help="Kill (and report) a worker that makes no progress this long outside a recovery.")
@_opt("--node-rank", type=click.IntRange(min=0), default=None,
      help="Slot this node asks for (as torchrun's --node-rank); a rank >= nnodes joins as a spare [default: the "
           "lowest free slot, in order of registration].")
@_opt("--local-ranks-filter", default="", help="Only these local ranks' output reaches the console (e.g. 0,1).")
@_opt("--shutdown-timeout", type=click.FloatRange(min=0), default=2.0, show_default=True,
      help="Seconds from SIGTERM to SIGKILL when workers are stopped.")
@click.option("-m", "--module", is_flag=True)
@_opt("--no-python", is_flag=True)
@click.argument("entry", nargs=-1, type=click.UNPROCESSED, required=True, metavar="SCRIPT [ARGS]...")
def agent_cmd(rdzv_endpoint, nproc_per_node, host, fault_domain, heartbeat_interval, log_dir, no_tee, secret_file,
              collective_timeout, hang_timeout, node_rank, local_ranks_filter, shutdown_timeout, module, no_python,
              entry):
    """Run one node's agent: it joins the master as an active node or a spare."""
    from phoenixrun.agents.agent import Agent
    from phoenixrun.config import AgentConfig
    from phoenixrun.agents.workers import WorkerSpec
    _logging()
    secret = auth.read_secret(secret_file=secret_file)
    if not secret:
        raise click.UsageError(f"no job secret: set ${auth.SECRET_ENV} or pass --secret-file "
                               "(the master writes it to RUN_DIR/secret)")
    if collective_timeout is not None:   # the workers' runtime reads it
        os.environ["PHOENIXRUN_COLLECTIVE_TIMEOUT"] = str(collective_timeout)
    spec = WorkerSpec(entry[0], tuple(entry[1:]), module=module, no_python=no_python)
    ranks = _parse_ranks_filter(local_ranks_filter)
    agent = Agent(AgentConfig(endpoint=rdzv_endpoint, secret=secret, spec=spec, nproc_per_node=nproc_per_node,
                              host=netaddr.node_addr(host, rdzv_endpoint), fault_domain=fault_domain,
                              heartbeat_interval=heartbeat_interval, hang_timeout=hang_timeout, node_rank=node_rank,
                              shutdown_timeout=shutdown_timeout,
                              local_ranks_filter=frozenset(map(int, ranks.split(","))) if ranks else None,
                              log_dir=Path(log_dir) if log_dir else None, tee=not no_tee))
    sys.exit(agent.run())


@commands.command("status")
@_opt("--run-dir", type=click.Path(file_okay=False, path_type=Path), default=None)
@click.option("--endpoint", default=None, help="host:port of the master (with --secret-file or $PHOENIXRUN_SECRET).")
@_opt("--secret-file", type=click.Path(dir_okay=False, path_type=Path), default=None)
@click.option("--json", "as_json", is_flag=True, help="Print the raw state JSON.")
@click.option("--watch", is_flag=True, help="Refresh live.")
@click.option("--interval", type=click.FloatRange(min=0.1), default=1.0, show_default=True)
def status_cmd(run_dir, endpoint, secret_file, as_json, watch, interval):
    """Show the job, its nodes and recent events."""
    from phoenixrun.status import show
    sys.exit(show(run_dir, endpoint, secret_file, as_json, watch, interval))


@commands.command("inject")
@_opt("--run-dir", type=click.Path(file_okay=False, path_type=Path), default=None)
@click.option("--endpoint", default=None, help="host:port of the master (with --secret-file or $PHOENIXRUN_SECRET).")
@_opt("--secret-file", type=click.Path(dir_okay=False, path_type=Path), default=None)
@click.option("--node", "slot", type=click.IntRange(min=0), required=True, help="Node slot to hit.")
@click.option("--fault", required=True, metavar="FAULT",
              help="crash-worker | kill-node | hang | xid:N | ecc | partition[:SECONDS] | comm-timeout | nan. "
                   "xid and ecc go through the agent's injected health source, as NVML would report them; "
                   "partition drops the node's traffic (for SECONDS, or until its agent gets SIGUSR1); "
                   "comm-timeout makes one worker's collectives fail; nan makes one worker's next observed loss NaN")
def inject_cmd(run_dir, endpoint, secret_file, slot, fault):
    """Inject a fault into a running job (tests, demos, fire drills). Authenticated like every control call."""
    from phoenixrun.protocol.client import ControlError
    from phoenixrun.status import client_for
    if not valid_fault(fault):
        raise click.BadParameter(f"unknown fault {fault!r}", param_hint="--fault")
    try:
        reply = client_for(run_dir, endpoint, secret_file).post("/v1/inject", {"slot": slot, "fault": fault})
    except ControlError as e:
        click.echo(f"phoenixrun inject: {e}", err=True)
        sys.exit(1)
    if reply.get("error"):
        click.echo(f"phoenixrun inject: {reply['error']}", err=True)
        sys.exit(1)
    click.echo(f"injected {fault} into slot {slot} (node {reply['node']})")


def _register_simulate() -> None:
    from phoenixrun.sim.cli import simulate
    commands.add_command(simulate)


def _logging() -> None:
    logging.basicConfig(level=os.environ.get("PHOENIXRUN_LOG_LEVEL", "INFO"),
                        format="[phoenixrun %(name)s %(asctime)s] %(levelname)s %(message)s", stream=sys.stderr)


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    cmd = launch
    if argv and argv[0] in SUBCOMMANDS:
        _register_simulate()
        cmd = commands
    try:
        cmd.main(args=argv, prog_name="phoenixrun", standalone_mode=False)
    except click.exceptions.NoArgsIsHelpError as e:
        click.echo(e.ctx.get_help())
        sys.exit(2)
    except click.UsageError as e:
        click.echo(f"phoenixrun: error: {e.format_message()}", err=True)
        sys.exit(2)
    except click.exceptions.Exit as e:
        sys.exit(e.exit_code)
    except click.Abort:
        sys.exit(130)


if __name__ == "__main__":
    main()
