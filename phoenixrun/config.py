"""Every setting of a phoenixrun job, defined once: validated frozen dataclasses with one doc per field.

- `MasterConfig`: the job as the master runs it (size, layout, recovery policy, persistence).
- `AgentConfig`: one node's agent (and what its workers are told).
- `LaunchConfig`: what `phoenixrun` (the torchrun-style launcher) starts: a master and/or agents.
- `WorkerSettings`: what a worker's runtime (phoenixrun.init/protect) reads from its environment.

Each field carries a `Setting`: its doc (the `--help` text), its command-line flag and/or environment
variable, and its bounds. From that one definition come the validation (`__post_init__`: a bad value raises
`ConfigError` naming the flag or variable and what to give instead), `to_argv()` (the launcher starts
`phoenixrun master` / `phoenixrun agent` with it), `from_options()` (the CLI builds a config from its parsed
flags; phoenixrun/cli.py generates those flags from the same fields), and `to_env()` / `from_env()` (the
worker settings). tests/test_config.py checks config -> argv -> config and config -> env -> config.

Torch-free and side-effect free: the master imports it (`import phoenixrun.control.master` pulls no torch).
"""
from __future__ import annotations

import math
import os
from dataclasses import MISSING, Field, dataclass, field, fields, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping, Self, cast

from phoenixrun.agents.phases import QUIESCE_GRACE_CAP_S
from phoenixrun.topology import Layout

if TYPE_CHECKING:   # the agent's worker spec: agents/workers.py (psutil), only a type here
    from phoenixrun.agents.workers import WorkerSpec


class ConfigError(ValueError):
    """A setting with a bad value. The message names the flag (or variable) and what to give instead."""


_SAME = object()   # Setting.cli_default: the command line's default is the field's


@dataclass(frozen=True)
class Setting:
    """What one config field is: its doc, where it is set from, its bounds."""
    doc: str                          # one line of help: the flag's --help text
    flag: str | None = None           # the long flag that sets it (None: not settable from the command line)
    env: str | None = None            # the environment variable that sets it (worker settings)
    min: float | None = None          # inclusive bounds of a number
    max: float | None = None
    cli_default: Any = _SAME          # the flag's default, where it deliberately differs from the field's
    negate: bool = False              # a boolean field set by a flag that turns it off (--no-tee)
    travels: str = ""                 # how a field without a flag reaches a process started with to_argv()
    choices: tuple[str, ...] = ()     # the values a str field may take (empty: any)
    spellings: tuple[str, ...] = ()   # every spelling of the flag, in order, where it has a short one (-m, --module)
    launch_default: Any = _SAME       # the launcher's default, where it derives the value when the flag is absent


def setting(default: Any = MISSING, *, doc: str, factory: Any = MISSING, **kw: Any) -> Any:
    """A dataclass field with its Setting (doc, flag, env, bounds)."""
    meta = {"setting": Setting(doc=" ".join(doc.split()), **kw)}
    if factory is not MISSING:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


def group(cls: type, *, doc: str) -> Any:
    """A dataclass field holding one component's settings (a `_Settings` class whose fields all have defaults):
    its flags are the component's, on the same command line; `build()` routes each setting to its component."""
    return field(default_factory=cls, metadata={"setting": Setting(doc=" ".join(doc.split()), travels="its flags"),
                                                "group": cls})


def group_of(f: Field[Any]) -> type[_Settings] | None:
    """The component class a field holds (group()), or None for a plain setting."""
    cls: type[_Settings] | None = f.metadata.get("group")
    return cls


def setting_of(f: Field[Any]) -> Setting:
    s: Setting = f.metadata["setting"]
    return s


def _fields(x: Any) -> tuple[Field[Any], ...]:
    """dataclasses.fields of a `_Settings` dataclass (the mixin itself is not one, so say it once here)."""
    return fields(x)


def kind(f: Field[Any]) -> str:
    """The field's base type, from its annotation: int, float, str, bool, Path, ranks, mapping or object."""
    base = [t.strip() for t in str(f.type).split("|") if t.strip() != "None"][0]
    return {"int": "int", "float": "float", "str": "str", "bool": "bool", "Path": "Path",
            "frozenset[int]": "ranks", "dict[int, str]": "mapping"}.get(base, "object")


def optional(f: Field[Any]) -> bool:
    return "None" in [t.strip() for t in str(f.type).split("|")]


def default_of(f: Field[Any]) -> Any:
    """The field's default (MISSING when required)."""
    if f.default is not MISSING:
        return f.default
    if f.default_factory is not MISSING:
        return f.default_factory()
    return MISSING


def cli_default(f: Field[Any]) -> Any:
    """The flag's default: the field's, unless the command line deliberately defaults otherwise."""
    s = setting_of(f)
    return default_of(f) if s.cli_default is _SAME else s.cli_default


def launch_default(f: Field[Any]) -> Any:
    """The default of the flag on the launcher (`phoenixrun`): the command line's, unless the launcher derives
    the value itself when the flag is absent (--rdzv-id: from --run-dir, $SLURM_JOB_ID or a new id)."""
    s = setting_of(f)
    return cli_default(f) if s.launch_default is _SAME else s.launch_default


def where(cls: type, f: Field[Any]) -> str:
    """How a user names the setting: its flag, else its variable, else Class.field."""
    s = setting_of(f)
    return s.flag or s.env or f"{cls.__name__}.{f.name}"


def _bound_text(s: Setting) -> str:
    if s.min is not None and s.max is not None:
        return f"between {s.min:g} and {s.max:g}"
    return f"of at least {s.min:g}" if s.min is not None else f"of at most {s.max:g}"


def _check(cls: type, f: Field[Any], v: Any) -> Any:
    """The value, normalised (int -> float, str -> Path, iterable -> frozenset), or ConfigError."""
    s, k, name = setting_of(f), kind(f), where(cls, f)
    if v is None:
        if optional(f):
            return None
        raise ConfigError(f"{name}: a value is required")
    if k == "float":
        if isinstance(v, bool) or not isinstance(v, (int, float)) or math.isnan(v):
            raise ConfigError(f"{name}: {v!r} is not a number; give a number of seconds")
        v = float(v)
    elif k == "int":
        if isinstance(v, bool) or not isinstance(v, int):
            raise ConfigError(f"{name}: {v!r} is not a whole number; give an integer")
    elif k in ("str", "bool") and not isinstance(v, {"str": str, "bool": bool}[k]):
        raise ConfigError(f"{name}: {v!r} is not a {k}")
    elif k == "Path":
        if not isinstance(v, (str, os.PathLike)):
            raise ConfigError(f"{name}: {v!r} is not a path")
        v = Path(v)
    elif k == "ranks":
        try:
            v = frozenset(v)
        except TypeError:
            raise ConfigError(f"{name}: {v!r} is not a set of local ranks") from None
        if any(isinstance(r, bool) or not isinstance(r, int) or r < 0 for r in v):
            raise ConfigError(f"{name}: {sorted(v, key=str)!r}: local ranks are integers >= 0")
    elif k == "mapping":
        if not isinstance(v, Mapping):
            raise ConfigError(f"{name}: {v!r} is not a mapping")
        v = dict(v)
    if s.choices and v not in s.choices:
        raise ConfigError(f"{name}: {v!r} is not one of {', '.join(s.choices)}")
    if k in ("int", "float") and ((s.min is not None and v < s.min) or (s.max is not None and v > s.max)):
        raise ConfigError(f"{name}: {v!r} is out of range; give a value {_bound_text(s)}")
    return v


class _Settings:
    """Validation, argv and env for a frozen dataclass whose fields are `setting(...)`s."""

    def __post_init__(self) -> None:
        for f in _fields(self):
            cls = group_of(f)
            if cls is not None:
                if not isinstance(getattr(self, f.name), cls):
                    raise ConfigError(f"{type(self).__name__}.{f.name} must be a {cls.__name__}")
                continue
            object.__setattr__(self, f.name, _check(type(self), f, getattr(self, f.name)))

    @classmethod
    def settings(cls) -> dict[str, Field[Any]]:
        """name -> dataclass Field of every setting, its components' included (names are unique across them)."""
        out: dict[str, Field[Any]] = {}
        for f in _fields(cls):
            sub = group_of(f)
            out.update(sub.settings() if sub is not None else {f.name: f})
        return out

    @classmethod
    def flag_fields(cls) -> list[Field[Any]]:
        return [f for f in cls.settings().values() if setting_of(f).flag]

    @classmethod
    def build(cls, **flat: Any) -> Self:
        """The config from every setting by name, whichever component holds it (`nnodes=2, node_timeout=3.0`);
        a name no component has raises TypeError, as a dataclass does."""
        kw: dict[str, Any] = {}
        for f in _fields(cls):
            sub = group_of(f)
            if sub is not None and f.name not in flat:
                own = {k: flat.pop(k) for k in list(flat) if k in sub.settings()}
                kw[f.name] = sub.build(**own)
        kw.update(flat)
        return cls(**kw)

    def updated(self, **flat: Any) -> Self:
        """A copy with the settings named changed, whichever component holds them (dataclasses.replace, routed)."""
        kw: dict[str, Any] = {}
        for f in _fields(self):
            sub = group_of(f)
            if sub is not None and f.name not in flat:
                own = {k: flat.pop(k) for k in list(flat) if k in sub.settings()}
                if own:
                    kw[f.name] = getattr(self, f.name).updated(**own)
        kw.update(flat)
        new: Self = replace(cast(Any, self), **kw)   # every subclass is a dataclass
        return new

    def to_argv(self) -> list[str]:
        """The flags that give exactly this config (every flag-settable field, in field order, its components'
        where they stand). A field that no flag sets must be at its default: ConfigError otherwise (a command line
        would silently drop it)."""
        argv: list[str] = []
        for f in _fields(self):
            s, v = setting_of(f), getattr(self, f.name)
            if group_of(f) is not None:
                argv += v.to_argv()
                continue
            if s.flag is None:
                if not s.travels and v != default_of(f):
                    raise ConfigError(f"{type(self).__name__}.{f.name} = {v!r} has no command-line flag: "
                                      "a process started with this config's argv would not get it")
                continue
            if v is None:
                continue
            if kind(f) == "bool":
                argv += [s.flag] if v != s.negate else []
                continue
            if kind(f) == "ranks" and not v:
                raise ConfigError(f"{s.flag}: an empty set of local ranks cannot be given on a command line "
                                  "(an empty value means every rank)")
            argv += [s.flag, _text(f, v)]
        return argv

    @classmethod
    def from_options(cls, params: Mapping[str, Any], **given: Any) -> Self:
        """The config from parsed CLI options (click's params: the flag's name with underscores), plus `given`
        for fields the caller derives itself. A flag that is not among `params` leaves its field's default."""
        kw: dict[str, Any] = {}
        for f in cls.flag_fields():
            s = setting_of(f)
            key = (s.flag or "")[2:].replace("-", "_")
            if key in params:
                kw[f.name] = (not params[key]) if s.negate else params[key]
        kw.update(given)
        return cls.build(**kw)

    def to_env(self, *names: str) -> dict[str, str]:
        """The environment variables that give exactly this config (fields with a variable; None: unset), or
        only those of the fields `names`."""
        return {env: _text(f, getattr(self, f.name)) for f in _fields(self) if (env := setting_of(f).env)
                and getattr(self, f.name) is not None and (not names or f.name in names)}

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Any:
        """The config from the environment (os.environ by default); an unset or empty variable: the default.
        A value that does not parse raises ConfigError naming the variable."""
        env = os.environ if env is None else env
        kw: dict[str, Any] = {}
        for f in _fields(cls):
            s = setting_of(f)
            raw = env.get(s.env) if s.env else None
            if raw is None or (raw == "" and kind(f) != "str"):
                continue
            kw[f.name] = _parse(cls, f, raw)
        return cls(**kw)


def _text(f: Field[Any], v: Any) -> str:
    k = kind(f)
    if k == "bool":
        return "1" if v else "0"
    if k == "float":
        return repr(v)          # repr round-trips a float exactly
    if k == "ranks":
        return ",".join(map(str, sorted(v)))
    return str(v)


def _parse(cls: type, f: Field[Any], raw: str) -> Any:
    k = kind(f)
    try:
        if k == "bool":
            return raw != "0"   # as the runtime always read PHOENIXRUN_PROTECT / PHOENIXRUN_ADAPTIVE
        if k == "int":
            return int(raw)
        if k == "float":
            return float(raw)
        if k == "ranks":
            return frozenset(int(x) for x in raw.split(",") if x.strip())
    except ValueError:
        raise ConfigError(f"{where(cls, f)}={raw!r} is not {'a whole number' if k == 'int' else 'a number'}; "
                          f"set it to one or unset it") from None
    return raw


# The workers' process-group timeout, seconds: `phoenixrun --collective-timeout`, `phoenixrun agent
# --collective-timeout` and the runtime's default when the variable is unset. 60, as the CLI always said (the
# runtime alone said 30, and only where `phoenixrun agent` ran without the flag).
COLLECTIVE_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class JobShape(_Settings):
    """How the job's ranks are laid out and copied (`--replicas`, `--tp`, `--pp`): `phoenixrun`, `phoenixrun master`."""
    replicas: int = setting(
        1, flag="--replicas", min=0,
        doc="Peer copies of each rank's optimizer shard, each on another node: at most --nnodes - 1 (a single "
            "node keeps none; a shrunk job as many as its nodes allow).")
    tp: int = setting(1, flag="--tp", min=1, doc="Tensor-parallel size.")
    pp: int = setting(1, flag="--pp", min=1, doc="Pipeline-parallel size.")
    fault_domains: dict[int, str] = setting(
        factory=dict, doc="Fault-domain label of each slot, for replica placement (agents also report theirs).")

    def replicas_on(self, nnodes: int) -> int:
        """The peer copies a job of `nnodes` nodes keeps: --replicas, but never more than the other nodes there
        are (validate() refuses --replicas above --nnodes - 1; a single node or a shrunk job has fewer). Pure."""
        return max(0, min(self.replicas, nnodes - 1))


@dataclass(frozen=True)
class RecoveryPolicy(_Settings):
    """How the master detects faults and recovers from them: `phoenixrun` and `phoenixrun master`."""
    max_restarts: int = setting(
        0, flag="--max-restarts", min=0,
        doc="Full restarts allowed when in-memory recovery is impossible (and for scripts without the API).")
    join_timeout: float = setting(
        600.0, flag="--join-timeout", min=0,
        doc="Seconds to wait for every active node to join before the job gives up, naming the slots still missing "
            "(torchrun's rdzv join_timeout; spares do not count; 0: wait forever). Joining progress is logged every "
            "10 s meanwhile.")
    node_timeout: float = setting(
        5.0, flag="--node-timeout", min=0.1, doc="A node whose agent misses heartbeats this long is lost.")
    spare_wait: float = setting(
        30.0, flag="--spare-wait", min=0,
        doc="How long a recovery waits for a spare to register before giving up.")
    on_no_spare: str = setting(
        "stop", flag="--on-no-spare", choices=("stop", "shrink"),
        doc="When no spare registers within --spare-wait for a lost node: stop (exit code 75), or shrink - go on "
            "without the node's data-parallel replica (ZeRO shards re-partitioned from memory) and grow back when "
            "a spare registers (docs/operations.md, \"Shrink and grow\").")
    recovery_timeout: float = setting(60.0, flag="--recovery-timeout", min=1, doc="Deadline of each recovery phase.")
    correlation_window: float = setting(
        0.5, min=0, doc="Seconds the master waits for more reports of a fault before it decides.")
    max_local_resets: int = setting(
        3, flag="--max-local-resets", min=0, doc="Local resets of one node before it is replaced instead.")
    relay_threshold: int = setting(
        256, flag="--relay-threshold", min=0,
        doc="From this many nodes on, directives and their acks go through ~sqrt(N) relay agents, so a broadcast "
            "costs the master O(sqrt N) writes (0: every agent polls the master).")


@dataclass(frozen=True)
class StragglerPolicy(_Settings):
    """The straggler detector (control/jobstate.py, decide.stragglers): `phoenixrun` and `phoenixrun master`."""
    straggler_ratio: float = setting(
        2.0, flag="--straggler-ratio", min=1.0,
        doc="A node whose compute per step (before its first collective; the median over --straggler-window "
            "steps) is at least this many times its peers' median is a straggler: `straggler` event, status.")
    straggler_window: int = setting(
        20, flag="--straggler-window", min=1, doc="Steps of each node the straggler detector looks at.")
    replace_stragglers: bool = setting(
        False, flag="--replace-stragglers",
        doc="Drain a straggler to a spare (a planned drain: nothing replayed) when one is registered.")


@dataclass(frozen=True)
class Persistence(_Settings):
    """Persistent checkpoints, the fallback when in-memory recovery is impossible: `phoenixrun`, `phoenixrun master`."""
    persist_every: int = setting(
        0, flag="--persist-every", min=0,
        doc="Agents write each rank's committed snapshot to --persist-dir every N steps, in the background (0: "
            "only when an agent leaves on SIGTERM). The fallback when in-memory recovery is impossible, and what a "
            "job started on the same directory resumes from.")
    persist_dir: Path | None = setting(
        None, flag="--persist-dir",
        doc="Persistent checkpoints (DCP format, one directory per step) [default: RUN_DIR/checkpoints when "
            "--persist-every is set]. Must be reachable from every node.")
    persist_keep: int = setting(
        2, flag="--persist-keep", min=1, doc="Complete checkpoints kept; older ones are pruned.")
    max_fallbacks: int = setting(
        3, flag="--max-fallbacks", min=0, doc="Restarts from the persistent checkpoint before the job gives up.")


@dataclass(frozen=True)
class Listen(_Settings):
    """Where the master listens (`phoenixrun master`; the launcher picks them)."""
    # library default loopback (tests run masters in-process); the command's: every interface
    host: str = setting(
        "127.0.0.1", flag="--host", cli_default="0.0.0.0",
        doc="Address to listen on (the default: every interface, so that other machines' nodes reach it).")
    # library default 0 (any free port); the command's: torchrun's 29500
    port: int = setting(0, flag="--port", min=0, max=65535, cli_default=29500, doc="Port to listen on.")
    store_port: int = setting(0, flag="--store-port", min=0, max=65535, doc="TCPStore port (0: any).")


@dataclass(frozen=True)
class LeasePolicy(_Settings):
    """A master's lease on its run directory, for a standby master (`phoenixrun master`)."""
    lease_ttl: float = setting(
        0.0, flag="--lease-ttl", min=0,
        doc="Seconds a master's lease in RUN_DIR/master-lease lives (renewed every third of it); with it, a second "
            "master started on the same run directory waits as a standby and takes over once the lease is stale "
            "(0: no lease, one master).")
    max_clock_skew: float = setting(
        2.0, flag="--max-clock-skew", min=0,
        doc="Seconds the masters' clocks may differ; a standby takes over a lease not renewed for --lease-ttl "
            "plus this.")


@dataclass(frozen=True)
class MasterConfig(_Settings):
    """The job as the master runs it, one component per group of flags. `phoenixrun master` takes these as flags;
    `phoenixrun` builds one. `MasterConfig.build(nnodes=2, node_timeout=3.0, ...)` takes every setting by name."""
    run_dir: Path = setting(
        flag="--run-dir", launch_default=None, doc="Events, master.json and the job secret go here.")
    nnodes: int = setting(flag="--nnodes", min=1, doc="Active nodes.")
    nproc_per_node: int = setting(flag="--nproc-per-node", min=1, doc="Workers per node.")
    # the launcher's default "": it names the run itself (runid.identity); `phoenixrun master` needs no name
    run_id: str = setting(
        "phoenixrun", flag="--rdzv-id", launch_default="", doc="Job id (TORCHELASTIC_RUN_ID).")
    spares: int | None = setting(
        None, flag="--spares", min=0,
        doc="Spare nodes admitted at a time; more are told they are not needed [default: any number].")
    shape: JobShape = group(JobShape, doc="Layout and replica placement.")
    recovery: RecoveryPolicy = group(RecoveryPolicy, doc="Fault detection and recovery.")
    stragglers: StragglerPolicy = group(StragglerPolicy, doc="The straggler detector.")
    persistence: Persistence = group(Persistence, doc="Persistent checkpoints.")
    listen: Listen = group(Listen, doc="Where the master listens.")
    lease: LeasePolicy = group(LeasePolicy, doc="The master's lease (a standby master).")

    def to_argv(self) -> list[str]:
        """`phoenixrun master` flags that give exactly this config."""
        if self.persistence.persist_every and self.persistence.persist_dir is None:
            raise ConfigError("--persist-every without --persist-dir: `phoenixrun master` would write to "
                              "RUN_DIR/checkpoints, this config to nowhere; set persist_dir")
        return super().to_argv()


@dataclass(frozen=True)
class AgentConfig(_Settings):
    """One node's agent. `phoenixrun agent` takes these as flags (the secret from a file or the environment)."""
    endpoint: str = setting(
        flag="--rdzv-endpoint", launch_default="",
        doc="host:port of the master; HOST:PORT,HOST:PORT for a master and its standby (the agent uses whichever "
            "holds the lease).")
    secret: str = setting(travels="the environment", doc="The job secret ($PHOENIXRUN_SECRET or --secret-file).")
    spec: WorkerSpec = setting(travels="SCRIPT [ARGS]", doc="What every worker runs: SCRIPT [ARGS] after the flags.")
    nproc_per_node: int = setting(flag="--nproc-per-node", min=1, doc="Workers on this node.")
    host: str = setting(
        "127.0.0.1", flag="--host", cli_default=None,
        doc="Address the master and peers use to reach this node [default: the local address that routes to "
            "the master].")
    fault_domain: str = setting("", flag="--fault-domain", doc="Fault-domain label of this node (replicas avoid "
                                                               "sharing one).")
    heartbeat_interval: float = setting(
        0.5, flag="--heartbeat-interval", min=0.01, doc="Seconds between agent heartbeats.")
    log_dir: Path | None = setting(None, flag="--log-dir", doc="Write each worker's output under this directory.")
    tee: bool = setting(True, flag="--no-tee", negate=True, doc="With --log-dir, do not also print worker output.")
    node_id: str = setting("", doc="This agent's id [default: host-pid-random].")
    # 20, as the CLI (`phoenixrun`, `phoenixrun agent`) and docs/cli.md always said; the class said 30
    hang_timeout: float = setting(
        20.0, flag="--hang-timeout", min=0.1,
        doc="Per step: a worker whose step (outside a recovery) runs this long and that does not answer its "
            "agent's liveness check is hung: its agent kills it and the node gets a local reset.")
    node_rank: int | None = setting(
        None, flag="--node-rank", min=0,
        doc="Slot this node asks for (as torchrun's --node-rank); a rank >= nnodes joins as a spare [default: the "
            "lowest free slot, in order of registration].")
    local_ranks_filter: frozenset[int] | None = setting(
        None, flag="--local-ranks-filter",
        doc="Only these local ranks' output reaches the console, e.g. 0 or 0,1 (log files get all).")
    shutdown_timeout: float = setting(
        2.0, flag="--shutdown-timeout", min=0, doc="Seconds from SIGTERM to SIGKILL when workers are stopped.")
    collective_timeout: float = setting(
        COLLECTIVE_TIMEOUT_S, flag="--collective-timeout", min=1,
        doc="Timeout of the workers' process groups, seconds (keep it above --hang-timeout); the workers get it "
            "as $PHOENIXRUN_COLLECTIVE_TIMEOUT.")
    standby_worker: bool = setting(
        True, flag="--no-standby-worker", negate=True,
        doc="Keep no pre-started standby worker on each active node. With one (the default, for scripts that use "
            "the phoenixrun API), a worker that dies is replaced by a process already waiting in "
            "phoenixrun.init(), not a new one; it costs one idle process per node.")

    def to_argv(self) -> list[str]:
        """`phoenixrun agent` flags, then -m/--no-python and `-- SCRIPT ARGS`. The secret is not among them: it
        travels in the environment ($PHOENIXRUN_SECRET)."""
        spec = self.spec
        return (super().to_argv() + (["-m"] if spec.module else []) + (["--no-python"] if spec.no_python else [])
                + ["--", spec.entrypoint, *spec.args])

    def worker_env(self) -> dict[str, str]:
        """What this agent's workers read from it through their environment (WorkerSettings)."""
        return WorkerSettings(collective_timeout=self.collective_timeout).to_env("collective_timeout")


@dataclass(frozen=True)
class TorchrunFlags(_Settings):
    """The launcher's torchrun flags that no master or agent setting holds, as given: launch_config()
    (phoenixrun/cli.py) reads the world, the master's endpoint and the workers' entry point from them."""
    nnodes: str = setting("1", flag="--nnodes", doc="Active nodes (N; N:N also accepted).")
    nproc_per_node: str = setting(
        "1", flag="--nproc-per-node", doc="Workers per node (a number, or auto/cpu/gpu).")
    rdzv_backend: str = setting(
        "c10d", flag="--rdzv-backend", doc="c10d or static; both mean phoenixrun's own master.")
    rdzv_conf: str = setting("", flag="--rdzv-conf", doc="Accepted for compatibility; ignored.")
    master_addr: str = setting(
        "127.0.0.1", flag="--master-addr", doc="Master address when no --rdzv-endpoint is given.")
    master_port: int = setting(
        29500, flag="--master-port", min=0, max=65535, doc="Master port when no --rdzv-endpoint is given.")
    local_addr: str | None = setting(
        None, flag="--local-addr",
        doc="Address other nodes use to reach this node's agent [default: the local address that routes to the "
            "master].")
    tee: str | None = setting(
        None, flag="--tee", spellings=("--tee", "-t"),
        doc="With --log-dir, also print worker output (torchrun: 0-3).")
    redirects: str | None = setting(
        None, flag="--redirects", spellings=("--redirects", "-r"),
        doc="With --log-dir, only write files (torchrun: 0-3).")
    monitor_interval: float = setting(
        0.1, flag="--monitor-interval", min=0.01,
        doc="Accepted for compatibility (agents watch workers every 50 ms).")
    start_method: str = setting(
        "spawn", flag="--start-method", choices=("spawn", "fork", "forkserver"),
        doc="Accepted for compatibility: workers are always fresh processes.")
    module: bool = setting(
        False, flag="--module", spellings=("-m", "--module"),
        doc="Run the entry point as a Python module (python -m).")
    no_python: bool = setting(
        False, flag="--no-python", doc="Run the entry point as an executable, not with python.")


@dataclass(frozen=True)
class LaunchConfig(_Settings):
    """What `phoenixrun` starts on this machine: a master (standalone, node rank 0 or the rendezvous host) and
    this node's agent(s). The torchrun flags are parsed into it by phoenixrun/cli.py."""
    master: MasterConfig = setting(doc="The job as the master runs it.")
    agent: AgentConfig = setting(
        doc="This node's agent, as the launcher starts it (the endpoint is replaced by the master's once it is "
            "up; standalone agents get fault domains local0, local1, ... when none is given).")
    standalone: bool = setting(
        False, flag="--standalone",
        doc="Run the master and nnodes + spares agents on this machine (each agent simulates one node).")
    spares: int = setting(
        0, flag="--spares", min=0,
        doc="Warm spare nodes: with --standalone started here; on a cluster, the nodes beyond --nnodes that join "
            "(more are told they are not needed and exit 0).")
    endpoint: str | None = setting(None, doc="host:port of the master (not standalone).")
    host_master: bool = setting(
        False, doc="Run the master here (standalone, node rank 0, or the rendezvous host).")
    extra_env: dict[str, str] = setting(factory=dict, doc="Added to the environment of every process started.")
    resume: bool = setting(
        False, flag="--resume",
        doc="Resume an earlier run: the one --rdzv-id or --run-dir names, else the newest under .phoenixrun/ "
            "(an error if it holds no events or checkpoints). Without it, a launch that names no run "
            "(--rdzv-id, --run-dir, $SLURM_JOB_ID) starts a new one in a new run directory.")
    torchrun: TorchrunFlags = group(TorchrunFlags, doc="The torchrun flags as given.")

    def __post_init__(self) -> None:
        super().__post_init__()
        if not isinstance(self.master, MasterConfig) or not isinstance(self.agent, AgentConfig):
            raise ConfigError("LaunchConfig: master must be a MasterConfig and agent an AgentConfig")

    def agent_for(self, endpoint: str, index: int) -> AgentConfig:
        """The agent the launcher starts as number `index` on this machine, once the master is at `endpoint`."""
        domain = self.agent.fault_domain or (f"local{index}" if self.standalone else "")
        return replace(self.agent, endpoint=endpoint, fault_domain=domain)


@dataclass(frozen=True)
class WorkerSettings(_Settings):
    """What a worker's runtime (phoenixrun.init / protect) reads from its environment, set by its agent (or by
    the user: PHOENIXRUN_PROTECT=0, PHOENIXRUN_PROTECT_EVERY, PHOENIXRUN_ADAPTIVE, PHOENIXRUN_STATS_DIR)."""
    agent_sock: str = setting(
        "", env="PHOENIXRUN_AGENT_SOCK", doc="The agent's worker-channel socket (empty: not under a phoenixrun agent).")
    protect: bool = setting(
        True, env="PHOENIXRUN_PROTECT",
        doc="0: no protection: init() is dist.init_process_group and protect() a pass-through (plain torchrun).")
    tp: int = setting(1, env="PHOENIXRUN_TP", min=1, doc="Tensor-parallel size of the job.")
    pp: int = setting(1, env="PHOENIXRUN_PP", min=1, doc="Pipeline-parallel size of the job.")
    collective_timeout: float = setting(
        COLLECTIVE_TIMEOUT_S, env="PHOENIXRUN_COLLECTIVE_TIMEOUT", min=1,
        doc="Timeout of the workers' process groups, seconds.")
    backend: str = setting(
        "gloo", env="PHOENIXRUN_BACKEND",
        doc="Backend of the rebuilt process groups: gloo, or nccl (CUDA tensors on a ProcessGroupNCCL per "
            "generation, CPU tensors on gloo; docs/api.md, \"GPU\").")
    protect_every: int | None = setting(
        None, env="PHOENIXRUN_PROTECT_EVERY", min=1,
        doc="Snapshot every N steps, overriding protect(every=...) [default: the script's].")
    adaptive: bool = setting(
        True, env="PHOENIXRUN_ADAPTIVE", doc="0: keep the snapshot interval fixed (no adaptive protection).")
    stats_dir: Path | None = setting(
        None, env="PHOENIXRUN_STATS_DIR", doc="Write per-step protection figures to DIR/rank{R}.jsonl (benchmarks).")

    @property
    def managed(self) -> bool:
        """Running under a phoenixrun agent with protection on."""
        return bool(self.agent_sock) and self.protect


# ---------------------------------------------------------------------------------------------------- validate()
# The rules between settings that no single field's bounds can say. Each is a pure check of one config that
# returns the problem (one line naming the flags and the fix) or None; validate() runs them all, and every entry
# point (`phoenixrun`, `phoenixrun master`, `phoenixrun agent`: the Slurm templates start those two) runs
# validate() before it starts anything. docs/cli.md lists them from RULES (tools/gen_cli_doc.py).


@dataclass(frozen=True)
class Rule:
    """One rule between settings: the config it reads, the flags it names, what it says (docs/cli.md)."""
    of: type
    flags: tuple[str, ...]
    doc: str
    check: Callable[[Any], str | None]


def _layout_problem(m: MasterConfig) -> str | None:
    try:
        Layout(m.nnodes, m.nproc_per_node, m.shape.tp, m.shape.pp)
    except ValueError as e:
        return f"--tp {m.shape.tp} --pp {m.shape.pp}: {e}"
    return None


def _replicas_problem(m: MasterConfig) -> str | None:
    shape, most = m.shape, max(1, m.nnodes - 1)   # 1 on a single node: the default, which keeps none there
    if shape.replicas <= most:
        return None
    return (f"--replicas {shape.replicas}: {shape.replicas} replicas need at least {shape.replicas + 1} nodes "
            f"(--nnodes is {m.nnodes}); give --replicas {shape.replicas_on(m.nnodes)} or fewer, or more nodes")


def _recovery_timeout_problem(m: MasterConfig) -> str | None:
    if m.recovery.recovery_timeout > QUIESCE_GRACE_CAP_S:
        return None
    return (f"--recovery-timeout {m.recovery.recovery_timeout:g}: an agent's quiesce grace may reach "
            f"{QUIESCE_GRACE_CAP_S:g} s (2 x its longest recent step), and each recovery phase must outlast it "
            f"so that the agent replaces a stuck worker before the master gives up on the recovery; give "
            f"--recovery-timeout above {QUIESCE_GRACE_CAP_S:g}")


def _collective_timeout_problem(a: AgentConfig) -> str | None:
    if a.collective_timeout > a.hang_timeout:
        return None
    return (f"--collective-timeout {a.collective_timeout:g} is not above --hang-timeout {a.hang_timeout:g}: a "
            f"hung worker's collectives would fail before its agent sees the hang; give --collective-timeout "
            f"above {a.hang_timeout:g}, or a shorter --hang-timeout")


def _entry_problem(a: AgentConfig) -> str | None:
    if a.spec.module and a.spec.no_python:
        return "-m/--module and --no-python cannot be combined: give one of them"
    return None


def _heartbeat_problem(c: LaunchConfig) -> str | None:
    node_timeout = c.master.recovery.node_timeout
    if c.agent.heartbeat_interval < node_timeout:
        return None
    return (f"--heartbeat-interval {c.agent.heartbeat_interval:g} is not below --node-timeout "
            f"{node_timeout:g}: the master would declare every node lost between two heartbeats; give "
            f"a --heartbeat-interval below {node_timeout:g}")


RULES: tuple[Rule, ...] = (
    Rule(MasterConfig, ("--nnodes", "--nproc-per-node", "--tp", "--pp"),
         "The world size (nnodes x nproc-per-node) is divisible by tp x pp.", _layout_problem),
    Rule(MasterConfig, ("--replicas", "--nnodes"),
         "--replicas is at most --nnodes - 1: each copy lives on another node (on a single node, 1 - the "
         "default - keeps none).", _replicas_problem),
    Rule(MasterConfig, ("--recovery-timeout",),
         f"--recovery-timeout is above the agents' longest quiesce grace ({QUIESCE_GRACE_CAP_S:g} s, "
         "agents/phases.py): the agent replaces a worker that does not quiesce before the master gives up on "
         "the recovery.", _recovery_timeout_problem),
    Rule(AgentConfig, ("--collective-timeout", "--hang-timeout"),
         "--collective-timeout is above --hang-timeout: an agent sees a hung worker before its collectives "
         "time out.", _collective_timeout_problem),
    Rule(AgentConfig, ("-m", "--no-python"), "-m/--module and --no-python exclude each other.", _entry_problem),
    Rule(LaunchConfig, ("--heartbeat-interval", "--node-timeout"),
         "--heartbeat-interval is below --node-timeout: a node is lost only after missing heartbeats.",
         _heartbeat_problem),
)


def problems(cfg: MasterConfig | AgentConfig | LaunchConfig) -> list[str]:
    """What is wrong between the settings of `cfg` (a launcher's config: its master's, its agent's and its own
    rules), one line each, in RULES order; empty when nothing is. Pure."""
    parts: list[object] = [cfg]
    if isinstance(cfg, LaunchConfig):
        parts = [cfg.master, cfg.agent, cfg]
    found: list[str] = []
    for part in parts:
        for rule in RULES:
            if isinstance(part, rule.of):
                problem = rule.check(part)
                if problem is not None:
                    found.append(problem)
    return found


def validate(cfg: MasterConfig | AgentConfig | LaunchConfig) -> None:
    """ConfigError with the first problem (one line: the flags and the fix); every entry point runs it before it
    starts anything. The fields' own bounds are checked when a config is built (`__post_init__`)."""
    found = problems(cfg)
    if found:
        raise ConfigError(found[0])
