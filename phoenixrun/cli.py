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
from dataclasses import MISSING, Field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Protocol

import click

from phoenixrun import auth, config, netaddr, runid
from phoenixrun.config import AgentConfig, ConfigError, LaunchConfig, MasterConfig, TorchrunFlags
from phoenixrun.protocol.client import split_endpoints
from phoenixrun.protocol.messages import FAULTS, valid_fault  # noqa: F401  (the master checks the same)

# what click.option and a group of options are: a decorator of a command's function
Decorator = Callable[[Callable[..., Any]], Callable[..., Any]]


class _Configurable(Protocol):
    """A config class of phoenixrun/config.py: its fields, each with its Setting."""
    @classmethod
    def settings(cls) -> dict[str, Field[Any]]: ...


SUBCOMMANDS = ("master", "agent", "status", "simulate", "inject", "drain")


def _opt(*names: str, env: str | None = None, **kw: Any) -> Decorator:
    """An option spelled with dashes and with underscores (torchrun accepts both), PET_* env."""
    decls = list(names)
    for n in names:
        if n.startswith("--") and "-" in n[2:]:
            decls.append("--" + n[2:].replace("-", "_"))
    if env:
        kw.setdefault("envvar", env)
        kw.setdefault("show_envvar", True)
    return click.option(*decls, **kw)


def _field(cls: type[_Configurable], name: str, *, help: str | None = None, env: str | None = None, alias: bool = True,
           launch: bool = False) -> Decorator:
    """The click option of a config field: its flag, type and bounds, default and help all come from the field's
    Setting (phoenixrun/config.py), so the command line and the config cannot drift. `help` only where the
    flag means more on this command (the launcher's --node-rank also decides who runs the master); `launch`:
    the launcher's option, with the field's launch default (the launcher derives --rdzv-id when it is absent)."""
    f = cls.settings()[name]
    s, k = config.setting_of(f), config.kind(f)
    default = config.launch_default(f) if launch else config.cli_default(f)
    kw: dict[str, Any] = {"help": help or s.doc}
    if k == "bool":
        kw["is_flag"] = True
    else:
        kw["type"] = {"int": click.IntRange(_whole(s.min), _whole(s.max)), "float": click.FloatRange(s.min, s.max),
                      "Path": click.Path(file_okay=False, path_type=Path), "str": click.Choice(s.choices) if s.choices else None, "ranks": RANKS}[k]
        if default is MISSING:
            kw["required"] = True
        else:
            kw["default"] = default
            kw["show_default"] = default not in (None, "") and "[default:" not in kw["help"]
    names = s.spellings or (s.flag,)
    return _opt(*names, env=env, **kw) if alias else click.option(*names, envvar=env, show_envvar=bool(env), **kw)


def _whole(bound: float | None) -> int | None:
    return None if bound is None else int(bound)


if TYPE_CHECKING:    # generic in recent click (8.5.1 here), not in 8.1 (the floor): subscripted for the checker alone
    _ParamType = click.ParamType[Any]
else:
    _ParamType = click.ParamType


class _Ranks(_ParamType):
    """torchrun's --local-ranks-filter: comma-separated local ranks -> frozenset (empty: None, every rank)."""
    name = "ranks"

    def get_metavar(self, *args: Any, **kw: Any) -> str:
        return "TEXT"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> frozenset[int] | None:
        if value is None or isinstance(value, frozenset):
            return value
        try:
            ranks = frozenset(int(x) for x in str(value).split(",") if x.strip())
        except ValueError:
            self.fail(f"{value!r} is not a comma-separated list of local ranks", param, ctx)
        if any(r < 0 for r in ranks):
            self.fail("local ranks are >= 0", param, ctx)
        return ranks or None


RANKS = _Ranks()


def nnodes_refusal(lo: int, hi: int) -> str | None:
    """Why torchrun's elastic `--nnodes MIN:MAX` is refused, with what to type instead; None for N:N. Pure.

    torchrun starts with any MIN..MAX nodes and restarts every worker in a smaller or larger world as nodes come
    and go. phoenixrun's world is fixed (--nnodes): a lost node's slot is filled from warm spares (--spares) and
    the job starts only once every slot is filled; the closest it has to shrinking (--on-no-spare shrink) works
    for scripts that use its API, not for the torchrun scripts MIN:MAX comes from. Reading MIN:MAX as anything
    else (it used to mean MIN nodes + MAX-MIN spares) would run a different job from the one the user asked for."""
    if lo == hi:
        return None
    return (f"{lo}:{hi} is torchrun's elastic world, which phoenixrun does not run: it keeps a fixed world and "
            f"fills a lost node's slot from warm spares; type --nnodes {lo} --spares {hi - lo} ({lo} nodes train, "
            f"{hi - lo} wait as spares), or --nnodes {hi} --on-no-spare shrink ({hi} nodes, going on with fewer "
            "when one is lost and no spare is left)")


def _parse_nnodes(value: str) -> int:
    """`N` (or `N:N`) -> N; torchrun's elastic `MIN:MAX` is refused (nnodes_refusal)."""
    lo, _, hi = value.partition(":")
    try:
        lo_n, hi_n = int(lo), int(hi or lo)
    except ValueError:
        raise click.BadParameter(f"{value!r} is not a node count (N)", param_hint="--nnodes") from None
    if lo_n < 1:
        raise click.BadParameter("must be >= 1", param_hint="--nnodes")
    if hi_n < lo_n:
        raise click.BadParameter(f"{value!r}: MAX is below MIN", param_hint="--nnodes")
    refusal = nnodes_refusal(lo_n, hi_n)
    if refusal:
        raise click.BadParameter(refusal, param_hint="--nnodes")
    return lo_n


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


def _options(*opts: Decorator) -> Decorator:
    """One decorator for a group of options (shared by the commands that take them)."""
    def apply(f: Callable[..., Any]) -> Callable[..., Any]:
        for opt in reversed(opts):
            f = opt(f)
        return f
    return apply


def _component(cls: type[_Configurable], **env: str) -> Decorator:
    """The options of one MasterConfig component, in its field order: the CLI's groups of flags are the config's
    components (phoenixrun/config.py), shared by the commands that take them."""
    return _options(*(_field(cls, f.name, env=env.get(f.name)) for f in cls.settings().values()
                      if config.setting_of(f).flag))


# The job's shape, the master's recovery policy, its straggler detector and persistence: `phoenixrun` (which runs
# a master) and `phoenixrun master`.
_job_shape = _component(config.JobShape)
_recovery_policy = _component(config.RecoveryPolicy, max_restarts="PET_MAX_RESTARTS")
_stragglers = _component(config.StragglerPolicy)
_persistence = _component(config.Persistence)
# what the agents watch: `phoenixrun` and `phoenixrun agent`
_agent_timeouts = _options(_field(AgentConfig, "heartbeat_interval"), _field(AgentConfig, "hang_timeout"))


def _persist_dir(persist_dir: Path | None, persist_every: int, run_dir: Path) -> Path | None:
    if persist_dir is not None:
        return persist_dir.resolve()
    return (run_dir / "checkpoints").resolve() if persist_every else None


@click.command("phoenixrun", context_settings={"allow_interspersed_args": False, "help_option_names": ["-h", "--help"]},
               epilog="Subcommands: phoenixrun master|agent|status|simulate --help")
@_field(TorchrunFlags, "nnodes", env="PET_NNODES", alias=False)
@_field(TorchrunFlags, "nproc_per_node", env="PET_NPROC_PER_NODE")
@_field(LaunchConfig, "standalone", env="PET_STANDALONE", alias=False)
@_field(AgentConfig, "endpoint", env="PET_RDZV_ENDPOINT", launch=True, help="host:port of the phoenixrun master.")
@_field(MasterConfig, "run_id", env="PET_RDZV_ID", launch=True)
@_field(TorchrunFlags, "rdzv_backend", env="PET_RDZV_BACKEND")
@_field(TorchrunFlags, "rdzv_conf", env="PET_RDZV_CONF")
@_field(AgentConfig, "node_rank", env="PET_NODE_RANK",
        help="Rank of this node: its slot, whatever the order nodes join in; node 0 also runs the master "
             "[default: slots in order of joining; the rendezvous host runs the master].")
@_field(TorchrunFlags, "master_addr", env="PET_MASTER_ADDR")
@_field(TorchrunFlags, "master_port", env="PET_MASTER_PORT")
@_field(TorchrunFlags, "local_addr", env="PET_LOCAL_ADDR")
@_field(AgentConfig, "log_dir", env="PET_LOG_DIR")
@_field(TorchrunFlags, "tee", env="PET_TEE")
@_field(TorchrunFlags, "redirects", env="PET_REDIRECTS")
@_field(TorchrunFlags, "monitor_interval", env="PET_MONITOR_INTERVAL")
@_field(AgentConfig, "local_ranks_filter", env="PET_LOCAL_RANKS_FILTER")
@_field(TorchrunFlags, "start_method", env="PET_START_METHOD")
@_field(AgentConfig, "shutdown_timeout", env="PET_SHUTDOWN_TIMEOUT")
@_field(TorchrunFlags, "module", alias=False)
@_field(TorchrunFlags, "no_python")
@_field(LaunchConfig, "spares", alias=False)
@_field(MasterConfig, "run_dir", launch=True,
        help="Events, master.json and the job secret go here [default: .phoenixrun/RUN_ID]; naming it names the "
             "run (its id is the directory's name unless --rdzv-id is given): the same directory again resumes it.")
@_field(LaunchConfig, "resume")
@_field(AgentConfig, "fault_domain")
@_field(AgentConfig, "collective_timeout")
@_field(AgentConfig, "standby_worker")
@_job_shape
@_recovery_policy
@_stragglers
@_agent_timeouts
@_persistence
@click.argument("entry", nargs=-1, type=click.UNPROCESSED, required=True, metavar="SCRIPT [ARGS]...")
def launch(entry: tuple[str, ...], **o: Any) -> None:
    """Launch SCRIPT on every worker, torchrun-style, with PHOENIX hot-swap recovery."""
    from phoenixrun.launcher import run
    cfg = launch_config(o, entry)
    config.validate(cfg)
    _check_dirs(_launch_dirs(cfg, o["run_dir"] is not None))
    _announce_backend()
    sys.exit(run(cfg))


def _announce_backend() -> None:
    """Say which backend carries CUDA tensors on this node, once (phoenixrun/backend_choice.py); UsageError for a
    backend phoenixrun does not rebuild. The agents this process starts inherit that it was said."""
    from phoenixrun import backend_choice as bc
    if os.environ.get(bc.ANNOUNCED_ENV):
        return
    choice = bc.choose(os.environ.get(bc.ENV), bc.visible_cuda_devices(dict(os.environ)))
    if choice.error:
        raise click.UsageError(choice.error)
    if choice.line:
        click.echo(f"phoenixrun: {choice.line}", err=True)
    os.environ[bc.ANNOUNCED_ENV] = "1"


def _launch_dirs(c: LaunchConfig, run_dir_named: bool) -> list[tuple[str, Path, str]]:
    """(how the user named it, path, the fix) of each directory this launch writes on this machine. Pure."""
    dirs = []
    if c.host_master:
        dirs.append(("--run-dir", c.master.run_dir, "give --run-dir a directory you can write") if run_dir_named
                    else ("the run directory", c.master.run_dir, "run from a directory you can write, or give "
                          "--run-dir DIR"))
    if c.agent.log_dir is not None:
        dirs.append(("--log-dir", c.agent.log_dir, "give --log-dir a directory you can write, or leave it out "
                     "(worker output then goes to the console)"))
    if c.master.persistence.persist_every and c.master.persistence.persist_dir is not None:
        dirs.append(("--persist-dir", c.master.persistence.persist_dir, "give --persist-dir a directory every node can write"))
    return dirs


def _check_dirs(dirs: list[tuple[str, Path, str]]) -> None:
    """UsageError (exit 2) naming the first directory that cannot be written, before anything starts."""
    from phoenixrun import preflight
    for what, path, fix in dirs:
        problem = preflight.dir_problem(what, path, preflight.try_dir(path), fix)
        if problem:
            raise click.UsageError(problem)


def launch_config(o: dict[str, Any], entry: tuple[str, ...]) -> LaunchConfig:
    """The launcher's config from its parsed options (click's params) and SCRIPT [ARGS]; UsageError if bad."""
    from phoenixrun.agents.workers import WorkerSpec

    t: TorchrunFlags = TorchrunFlags.from_options(o)
    n = _parse_nnodes(t.nnodes)
    standalone = o["standalone"]
    spares = o["spares"]
    nproc = _parse_nproc(t.nproc_per_node)
    if t.rdzv_backend not in ("c10d", "static"):
        raise click.BadParameter(f"{t.rdzv_backend!r} is not supported: phoenixrun runs its own rendezvous "
                                 "master; use c10d (the default) or static", param_hint="--rdzv-backend")
    if not t.module and not t.no_python and not Path(entry[0]).is_file():
        raise click.UsageError(f"training script {entry[0]!r} not found")
    try:
        ident = runid.identity(o["rdzv_id"], o["run_dir"], o["resume"], standalone, os.environ.get("SLURM_JOB_ID"),
                               runid.runs_under(runid.RUNS), uuid.uuid4().hex[:8])
    except runid.RunIdError as e:
        raise click.UsageError(str(e)) from None
    run_id, run_dir = ident.run_id, ident.run_dir
    endpoint = o["rdzv_endpoint"] or f"{t.master_addr}:{t.master_port}"
    host, _, port = ("127.0.0.1:0" if standalone else endpoint).rpartition(":")
    if not port.isdigit():
        raise click.BadParameter(f"{endpoint!r} is not host:port", param_hint="--rdzv-endpoint")
    if standalone:
        host_master = True
    elif o["node_rank"] is not None:
        host_master = o["node_rank"] == 0
    else:   # every node runs the same command: the rendezvous host runs the master (the first there, if several)
        host_master = netaddr.is_this_host(host) and netaddr.port_free(host, int(port))
    if host_master:
        try:
            runid.resume_note(run_id, run_dir, o["resume"], runid.has_state(
                run_dir, _persist_dir(o["persist_dir"], o["persist_every"], run_dir)))
        except runid.RunIdError as e:
            raise click.UsageError(str(e)) from None
    master = MasterConfig.from_options(
        o, run_dir=run_dir, nnodes=n, nproc_per_node=nproc, run_id=run_id,
        host=host, port=int(port),
        persist_dir=_persist_dir(o["persist_dir"], o["persist_every"], run_dir),
        spares=None if standalone else spares)   # standalone: spares started by hand may join too
    agent = AgentConfig.from_options(
        o, endpoint="", secret="", nproc_per_node=nproc,   # the master's endpoint and the secret: at run time
        spec=WorkerSpec(entry[0], tuple(entry[1:]), module=t.module, no_python=t.no_python),
        host="127.0.0.1" if standalone else netaddr.node_addr(t.local_addr, endpoint),
        node_rank=None if standalone else o["node_rank"], tee=_tee(t.tee, t.redirects))
    return LaunchConfig(master=master, agent=agent, standalone=standalone, spares=spares,
                        endpoint=None if standalone else endpoint, host_master=host_master, resume=o["resume"],
                        torchrun=t)


@click.group("phoenixrun")
def commands() -> None:
    """phoenixrun subcommands."""


@commands.command("master")
@_field(MasterConfig, "nnodes")
@_field(MasterConfig, "nproc_per_node")
@_field(MasterConfig, "run_dir")
@_field(MasterConfig, "run_id")
@_field(MasterConfig, "host", alias=False)
@_field(MasterConfig, "port", alias=False)
@_field(MasterConfig, "store_port", alias=False)
@_field(MasterConfig, "spares", alias=False)
@_field(MasterConfig, "lease_ttl")
@_field(MasterConfig, "max_clock_skew")
@_job_shape
@_recovery_policy
@_stragglers
@_persistence
def master_cmd(**o: Any) -> None:
    """Run the rendezvous master (control plane) in the foreground."""
    from phoenixrun.control.master import Master
    _logging()
    cfg = master_config(o)
    config.validate(cfg)
    _check_dirs([("--run-dir", cfg.run_dir, "give --run-dir a directory you can write")])
    cfg.run_dir.mkdir(parents=True, exist_ok=True)
    # created exactly once, whoever starts first: a standby started together with the holder serves the same secret
    secret = auth.master_secret(cfg.run_dir)
    try:
        m = Master(cfg, secret)
        finished = m.acquire_lease()    # with --lease-ttl: a standby waits here until it takes over
        if finished is not None:        # the job finished under another master: exit as it did
            sys.exit(finished)
        m.start()
    except (ValueError, OSError) as e:
        raise click.UsageError(str(e)) from None
    sys.exit(m.wait())


def master_config(o: dict[str, Any]) -> MasterConfig:
    """`phoenixrun master`'s config from its parsed options (click's params)."""
    return MasterConfig.from_options(o, persist_dir=_persist_dir(o["persist_dir"], o["persist_every"], o["run_dir"]))


@commands.command("agent")
@_field(AgentConfig, "endpoint")
@_field(AgentConfig, "nproc_per_node")
@_field(AgentConfig, "host", alias=False)
@_field(AgentConfig, "fault_domain")
@_field(AgentConfig, "heartbeat_interval")
@_field(AgentConfig, "log_dir")
@_field(AgentConfig, "tee", alias=False)
@_opt("--secret-file", type=click.Path(dir_okay=False, path_type=Path), default=None,
      help="File holding the job secret [default: $PHOENIXRUN_SECRET].")
@_field(AgentConfig, "collective_timeout", env="PHOENIXRUN_COLLECTIVE_TIMEOUT")
@_field(AgentConfig, "hang_timeout")
@_field(AgentConfig, "node_rank")
@_field(AgentConfig, "local_ranks_filter")
@_field(AgentConfig, "shutdown_timeout")
@_field(AgentConfig, "standby_worker")
@click.option("-m", "--module", is_flag=True)
@_opt("--no-python", is_flag=True)
@click.argument("entry", nargs=-1, type=click.UNPROCESSED, required=True, metavar="SCRIPT [ARGS]...")
def agent_cmd(secret_file: Path | None, **o: Any) -> None:
    """Run one node's agent: it joins the master as an active node or a spare."""
    from phoenixrun.agents.agent import Agent
    _logging()
    secret = auth.read_secret(secret_file=secret_file)
    if not secret:
        raise click.UsageError(f"no job secret: set ${auth.SECRET_ENV} or pass --secret-file "
                               "(the master writes it to RUN_DIR/secret)")
    cfg = agent_config(o, secret)
    config.validate(cfg)
    if cfg.log_dir is not None:
        _check_dirs([("--log-dir", cfg.log_dir, "give --log-dir a directory you can write, or leave it out "
                      "(worker output then goes to the console)")])
    _announce_backend()
    os.environ.update(cfg.worker_env())   # the workers' runtime reads its settings from there
    sys.exit(Agent(cfg).run())


def agent_config(o: dict[str, Any], secret: str) -> AgentConfig:
    """`phoenixrun agent`'s config from its parsed options (click's params) and the job secret."""
    from phoenixrun.agents.workers import WorkerSpec
    entry = o["entry"]
    try:
        # the route to the first endpoint (the master; a standby's, if any, follows it); none named (a blank
        # --rdzv-endpoint): as if it were not given
        endpoints = split_endpoints(o["rdzv_endpoint"] or "")
        host = netaddr.node_addr(o["host"], endpoints[0] if endpoints else "")
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--rdzv-endpoint") from None
    return AgentConfig.from_options(
        o, secret=secret, host=host,
        spec=WorkerSpec(entry[0], tuple(entry[1:]), module=o["module"], no_python=o["no_python"]))


def from_argv(command: str, argv: list[str], secret: str = "") -> MasterConfig | AgentConfig:
    """The config `phoenixrun master ARGV` or `phoenixrun agent ARGV` runs with, parsed as the CLI parses it
    (the inverse of MasterConfig.to_argv / AgentConfig.to_argv)."""
    cmd = {"master": master_cmd, "agent": agent_cmd}[command]
    params = cmd.make_context(command, list(argv)).params
    return master_config(params) if command == "master" else agent_config(params, secret)


@commands.command("status")
@_opt("--run-dir", type=click.Path(file_okay=False, path_type=Path), default=None)
@click.option("--endpoint", default=None, help="host:port of the master (with --secret-file or $PHOENIXRUN_SECRET).")
@_opt("--secret-file", type=click.Path(dir_okay=False, path_type=Path), default=None)
@click.option("--json", "as_json", is_flag=True, help="Print the raw state JSON.")
@click.option("--watch", is_flag=True, help="Refresh live.")
@click.option("--interval", type=click.FloatRange(min=0.1), default=1.0, show_default=True)
def status_cmd(run_dir: Path | None, endpoint: str | None, secret_file: Path | None, as_json: bool, watch: bool,
               interval: float) -> None:
    """Show the job, its nodes and recent events."""
    from phoenixrun.status import show
    sys.exit(show(run_dir, endpoint, secret_file, as_json, watch, interval))


@commands.command("inject")
@_opt("--run-dir", type=click.Path(file_okay=False, path_type=Path), default=None)
@click.option("--endpoint", default=None, help="host:port of the master (with --secret-file or $PHOENIXRUN_SECRET).")
@_opt("--secret-file", type=click.Path(dir_okay=False, path_type=Path), default=None)
@click.option("--node", "slot", type=click.IntRange(min=0), required=True, help="Node slot to hit.")
@click.option("--fault", required=True, metavar="FAULT",
              help="crash-worker | kill-node | hang | xid:N | ecc | partition[:SECONDS] | comm-timeout | nan | slow:FACTOR. "
                   "xid and ecc go through the agent's injected health source, as NVML would report them; "
                   "partition drops the node's traffic (for SECONDS, or until its agent gets SIGUSR1); "
                   "comm-timeout makes one worker's collectives fail; nan makes one worker's next observed loss NaN; "
                   "slow:FACTOR makes the node's workers compute FACTOR times slower (a straggler, 1-100)")
def inject_cmd(run_dir: Path | None, endpoint: str | None, secret_file: Path | None, slot: int, fault: str) -> None:
    """Inject a fault into a running job (tests, demos, fire drills). Authenticated like every control call."""
    from phoenixrun.protocol.client import ControlError
    from phoenixrun.protocol.names import Endpoint
    from phoenixrun.protocol.replies import Injected
    from phoenixrun.status import client_for
    if not valid_fault(fault):
        raise click.BadParameter(f"unknown fault {fault!r}", param_hint="--fault")
    try:
        reply = Injected.from_wire(client_for(run_dir, endpoint, secret_file).post(
            Endpoint.INJECT, {"slot": slot, "fault": fault}))
    except (ControlError, ValueError) as e:
        click.echo(f"phoenixrun inject: {e}", err=True)
        sys.exit(1)
    click.echo(f"injected {fault} into slot {slot} (node {reply.node})")


@commands.command("drain")
@_opt("--run-dir", type=click.Path(file_okay=False, path_type=Path), default=None)
@click.option("--endpoint", default=None, help="host:port of the master (with --secret-file or $PHOENIXRUN_SECRET).")
@_opt("--secret-file", type=click.Path(dir_okay=False, path_type=Path), default=None)
@click.option("--node", "slot", type=click.IntRange(min=0), required=True, help="Node slot to drain.")
@click.option("--reason", default="operator request", show_default=True, help="Why (recorded in the events).")
def drain_cmd(run_dir: Path | None, endpoint: str | None, secret_file: Path | None, slot: int, reason: str) -> None:
    """Move a healthy node's ranks to a spare at a step boundary, nothing replayed; the node's agent then exits.
    Returns once the master accepted the drain: follow it with `phoenixrun status` (docs/operations.md)."""
    from phoenixrun.protocol.client import ControlError
    from phoenixrun.protocol.names import Endpoint
    from phoenixrun.protocol.replies import Draining
    from phoenixrun.status import client_for, refusal_text
    try:
        reply = Draining.from_wire(client_for(run_dir, endpoint, secret_file).post(
            Endpoint.DRAIN, {"slot": slot, "reason": reason}))
    except ControlError as e:
        click.echo(f"phoenixrun drain: {refusal_text(e)}", err=True)
        sys.exit(1)
    except ValueError as e:
        click.echo(f"phoenixrun drain: {e}", err=True)
        sys.exit(1)
    click.echo(f"draining slot {reply.slot} (node {reply.node}): its ranks move to a spare at a step boundary")


def register_simulate() -> None:
    """Add the `simulate` subcommand to `commands`: its module is imported only when a subcommand runs (and by
    tools/gen_cli_doc.py, which documents every subcommand)."""
    from phoenixrun.sim.cli import simulate
    commands.add_command(simulate)


def _logging() -> None:
    logging.basicConfig(level=os.environ.get("PHOENIXRUN_LOG_LEVEL", "INFO"),
                        format="[phoenixrun %(name)s %(asctime)s] %(levelname)s %(message)s", stream=sys.stderr)


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    cmd = launch
    if argv and argv[0] in SUBCOMMANDS:
        register_simulate()
        cmd = commands
    try:
        cmd.main(args=argv, prog_name="phoenixrun", standalone_mode=False)
    except click.exceptions.NoArgsIsHelpError as e:
        click.echo(e.ctx.get_help())
        sys.exit(2)
    except click.UsageError as e:
        click.echo(f"phoenixrun: error: {e.format_message()}", err=True)
        sys.exit(2)
    except ConfigError as e:
        click.echo(f"phoenixrun: error: {e}", err=True)
        sys.exit(2)
    except click.exceptions.Exit as e:
        sys.exit(e.exit_code)
    except click.Abort:
        sys.exit(130)


if __name__ == "__main__":
    main()
