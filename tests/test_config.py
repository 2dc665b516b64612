"""phoenixrun/config.py: validation, config -> argv -> config and config -> env -> config, and the CLI generated
from the same fields (the launcher starts `phoenixrun master` / `phoenixrun agent` with to_argv())."""
import dataclasses
import subprocess
from pathlib import Path

import click
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from phoenixrun import config
from phoenixrun.agents.workers import WorkerSpec
from phoenixrun.cli import agent_cmd, from_argv, launch, launch_config, master_cmd
from phoenixrun.config import AgentConfig, ConfigError, LaunchConfig, MasterConfig, WorkerSettings
from tests.harness import BIN, EXAMPLE, env

# what a command line can hold: no NUL; the rest is fair game (values starting with '-', spaces, unicode)
text = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"), max_size=12)
words = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"), min_size=1, max_size=12)
# absolute, no '..' or symlinks: `phoenixrun master` resolves --persist-dir, as the launcher always has
abs_paths = st.lists(st.text("abc_-. 0", min_size=1, max_size=6).filter(lambda s: s not in (".", "..")),
                     min_size=1, max_size=3).map(lambda parts: Path("/phx-config-test", *parts))
seconds = st.floats(min_value=0.0, max_value=1e7, allow_nan=False, allow_infinity=False)


def secs(lo: float) -> st.SearchStrategy[float]:
    return seconds.filter(lambda x: x >= lo)


masters = st.builds(
    MasterConfig.build, run_dir=abs_paths, nnodes=st.integers(1, 1 << 20), nproc_per_node=st.integers(1, 1024),
    run_id=text, tp=st.integers(1, 64), pp=st.integers(1, 64), replicas=st.integers(0, 8),
    max_restarts=st.integers(0, 100), host=text, port=st.integers(0, 65535), store_port=st.integers(0, 65535),
    node_timeout=secs(0.1), spare_wait=secs(0), on_no_spare=st.sampled_from(["stop", "shrink"]),
    recovery_timeout=secs(1), max_local_resets=st.integers(0, 100),
    persist_dir=st.none() | abs_paths, persist_every=st.integers(0, 1000), persist_keep=st.integers(1, 100),
    max_fallbacks=st.integers(0, 100), spares=st.none() | st.integers(0, 100))

specs = st.builds(WorkerSpec, entrypoint=words, args=st.lists(text, max_size=4).map(tuple), module=st.booleans(),
                  no_python=st.booleans())
agents = st.builds(
    AgentConfig, endpoint=text, secret=st.just("s3cret"), spec=specs, nproc_per_node=st.integers(1, 1024),
    host=words, fault_domain=text, heartbeat_interval=secs(0.01), log_dir=st.none() | abs_paths, tee=st.booleans(),
    hang_timeout=secs(0.1), node_rank=st.none() | st.integers(0, 1 << 20),
    local_ranks_filter=st.none() | st.frozensets(st.integers(0, 1024), min_size=1),
    shutdown_timeout=secs(0), collective_timeout=secs(1), standby_worker=st.booleans())

workers = st.builds(
    WorkerSettings, agent_sock=text, protect=st.booleans(), tp=st.integers(1, 64), pp=st.integers(1, 64),
    collective_timeout=secs(1), protect_every=st.none() | st.integers(1, 1000), adaptive=st.booleans(),
    stats_dir=st.none() | abs_paths)


@settings(max_examples=150, deadline=None)
@given(masters)
def test_master_config_argv_round_trip(cfg):
    """The launcher's `phoenixrun master` command line gives the master exactly the launcher's config - or,
    where a command line cannot say it, to_argv refuses instead of dropping a setting."""
    try:
        argv = cfg.to_argv()
    except ConfigError as e:
        assert cfg.persistence.persist_every and cfg.persistence.persist_dir is None, e
        return
    assert from_argv("master", argv) == cfg


@settings(max_examples=150, deadline=None)
@given(agents)
def test_agent_config_argv_round_trip(cfg):
    argv = cfg.to_argv()
    assert "s3cret" not in argv   # the secret travels in the environment, never on a command line (ps shows it)
    assert from_argv("agent", argv, secret="s3cret") == cfg


@settings(max_examples=150, deadline=None)
@given(workers)
def test_worker_settings_env_round_trip(s):
    assert WorkerSettings.from_env(s.to_env()) == s


def test_settings_without_a_flag_are_refused_by_to_argv():
    base = MasterConfig(run_dir="/r", nnodes=2, nproc_per_node=1)
    for change in ({"correlation_window": 0.1}, {"fault_domains": {0: "rack1"}}):
        with pytest.raises(ConfigError, match="no command-line flag"):
            base.updated(**change).to_argv()
    agent = AgentConfig(endpoint="h:1", secret="s", spec=WorkerSpec("t.py"), nproc_per_node=1)
    with pytest.raises(ConfigError, match="empty set of local ranks"):
        dataclasses.replace(agent, local_ranks_filter=frozenset()).to_argv()
    with pytest.raises(ConfigError, match="no command-line flag"):
        dataclasses.replace(agent, node_id="n1").to_argv()


@pytest.mark.parametrize("cls,kw,needle", [
    (MasterConfig, {"nnodes": 0}, "--nnodes: 0 is out of range; give a value of at least 1"),
    (MasterConfig, {"node_timeout": 0.05}, "--node-timeout: 0.05 is out of range; give a value of at least 0.1"),
    (MasterConfig, {"port": 70000}, "--port: 70000 is out of range; give a value between 0 and 65535"),
    (MasterConfig, {"nnodes": "2"}, "--nnodes: '2' is not a whole number"),
    (MasterConfig, {"tp": True}, "--tp: True is not a whole number"),
    (MasterConfig, {"spare_wait": float("nan")}, "--spare-wait: nan is not a number"),
    (MasterConfig, {"on_no_spare": "grow"}, "--on-no-spare: 'grow' is not one of stop, shrink"),
    (MasterConfig, {"correlation_window": -1.0}, "RecoveryPolicy.correlation_window: -1.0 is out of range"),
    (MasterConfig, {"run_dir": None}, "--run-dir: a value is required"),
    (AgentConfig, {"hang_timeout": 0}, "--hang-timeout: 0.0 is out of range; give a value of at least 0.1"),
    (AgentConfig, {"local_ranks_filter": [0, -1]}, "--local-ranks-filter: [-1, 0]: local ranks are integers >= 0"),
    (AgentConfig, {"collective_timeout": 0.5}, "--collective-timeout: 0.5 is out of range"),
    (WorkerSettings, {"tp": 0}, "PHOENIXRUN_TP: 0 is out of range; give a value of at least 1"),
])
def test_bad_values_name_the_setting(cls, kw, needle):
    base = {MasterConfig: {"run_dir": "/r", "nnodes": 1, "nproc_per_node": 1},
            AgentConfig: {"endpoint": "h:1", "secret": "s", "spec": WorkerSpec("t.py"), "nproc_per_node": 1},
            WorkerSettings: {}}[cls]
    with pytest.raises(ConfigError) as e:
        cls.build(**{**base, **kw})
    assert needle in str(e.value)


def test_values_are_normalised():
    m = MasterConfig.build(run_dir="r", nnodes=1, nproc_per_node=1, node_timeout=2, persist_dir="p")
    assert m.run_dir == Path("r") and m.persistence.persist_dir == Path("p") and type(m.recovery.node_timeout) is float
    a = AgentConfig(endpoint="h:1", secret="s", spec=WorkerSpec("t.py"), nproc_per_node=1, local_ranks_filter=[1, 0])
    assert a.local_ranks_filter == frozenset({0, 1})
    with pytest.raises(dataclasses.FrozenInstanceError):
        m.nnodes = 2


@pytest.mark.parametrize("env_,needle", [
    ({"PHOENIXRUN_TP": "two"}, "PHOENIXRUN_TP='two' is not a whole number"),
    ({"PHOENIXRUN_COLLECTIVE_TIMEOUT": "soon"}, "PHOENIXRUN_COLLECTIVE_TIMEOUT='soon' is not a number"),
    ({"PHOENIXRUN_PROTECT_EVERY": "0"}, "PHOENIXRUN_PROTECT_EVERY: 0 is out of range"),
])
def test_bad_environment_names_the_variable(env_, needle):
    with pytest.raises(ConfigError) as e:
        WorkerSettings.from_env(env_)
    assert needle in str(e.value)


def test_worker_settings_read_as_the_runtime_always_did():
    """Unset or empty: the default; PHOENIXRUN_PROTECT / _ADAPTIVE are off only for '0'."""
    s = WorkerSettings.from_env({})
    assert (s.agent_sock, s.protect, s.tp, s.pp, s.protect_every, s.adaptive, s.stats_dir) == \
        ("", True, 1, 1, None, True, None) and not s.managed
    s = WorkerSettings.from_env({"PHOENIXRUN_AGENT_SOCK": "/a.sock", "PHOENIXRUN_PROTECT": "yes",
                                 "PHOENIXRUN_ADAPTIVE": "0", "PHOENIXRUN_STATS_DIR": "", "PHOENIXRUN_PP": "2"})
    assert s.managed and not s.adaptive and s.stats_dir is None and s.pp == 2
    assert not WorkerSettings.from_env({"PHOENIXRUN_AGENT_SOCK": "/a.sock", "PHOENIXRUN_PROTECT": "0"}).managed


def test_collective_timeout_has_one_default():
    """The drift this module removed: the CLI said 60, the runtime used 30 where `phoenixrun agent` ran without
    the flag. Now the agent always exports its value, and every copy is the one constant."""
    agent = AgentConfig(endpoint="h:1", secret="s", spec=WorkerSpec("t.py"), nproc_per_node=1)
    assert agent.collective_timeout == WorkerSettings().collective_timeout == config.COLLECTIVE_TIMEOUT_S == 60.0
    assert WorkerSettings.from_env(agent.worker_env()).collective_timeout == 60.0
    assert WorkerSettings.from_env(dataclasses.replace(agent, collective_timeout=7.5).worker_env()) \
        .collective_timeout == 7.5


@pytest.mark.parametrize("cls,cmd", [(MasterConfig, master_cmd), (AgentConfig, agent_cmd)])
def test_each_flag_field_is_its_commands_option(cls, cmd):
    """Every field a flag sets is an option of its command, with the field's doc as help and the field's
    (command-line) default: the options are generated from the fields, and this keeps it so."""
    opts = {p.opts[0]: p for p in cmd.params if isinstance(p, click.Option)}
    for f in cls.flag_fields():
        s = config.setting_of(f)
        opt = opts.get(s.flag)
        assert opt is not None, f"{cls.__name__}.{f.name}: {s.flag} is not an option of `phoenixrun {cmd.name}`"
        assert opt.help == s.doc
        if opt.is_flag:   # absent, the field keeps its default: on for --no-tee's tee
            assert config.default_of(f) is s.negate
        elif opt.required:
            assert config.default_of(f) is dataclasses.MISSING
        else:
            assert opt.get_default(click.Context(cmd), call=False) == config.cli_default(f), f.name


def test_launcher_starts_processes_with_its_config(tmp_path):
    """`phoenixrun ...` -> LaunchConfig -> the argv of the master and the agents it starts -> the configs those
    commands parse: the same (the four copies this replaced drifted: hang_timeout 30 vs 20)."""
    argv = ["--standalone", "--nnodes", "2", "--nproc-per-node", "2", "--spares", "1", "--hang-timeout", "3",
            "--collective-timeout", "45", "--local-ranks-filter", "1,0", "--log-dir", str(tmp_path / "logs"),
            "--tee", "0", "--redirects", "3", "--persist-every", "5", "--run-dir", str(tmp_path / "run"),
            "--node-timeout", "2.5", "--no-standby-worker", str(EXAMPLE), "--steps", "3"]
    c = launch_config(launch.make_context("phoenixrun", argv).params, (str(EXAMPLE), "--steps", "3"))
    assert isinstance(c, LaunchConfig) and c.standalone and c.spares == 1 and c.master.spares is None
    assert c.master.persistence.persist_dir == (tmp_path / "run" / "checkpoints").resolve() and c.master.recovery.node_timeout == 2.5
    assert from_argv("master", c.master.to_argv()) == c.master
    for i in range(3):
        a = c.agent_for("127.0.0.1:1234", i)
        assert a.fault_domain == f"local{i}" and a.endpoint == "127.0.0.1:1234" and a.hang_timeout == 3.0
        assert a.collective_timeout == 45.0 and a.local_ranks_filter == {0, 1} and not a.tee
        assert not a.standby_worker
        assert from_argv("agent", a.to_argv(), secret="") == a


def test_bad_collective_timeout_from_the_environment_is_one_line():
    """A user mistake through an environment variable the agent reads: one line naming the flag, exit 2."""
    r = subprocess.run([str(BIN / "phoenixrun"), "agent", "--rdzv-endpoint", "127.0.0.1:1", "--nproc-per-node",
                        "1", str(EXAMPLE)], capture_output=True, text=True, timeout=60,
                       env=env(PHOENIXRUN_COLLECTIVE_TIMEOUT="0.5", PHOENIXRUN_SECRET="x"))
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert r.returncode == 2 and len(lines) == 1 and "--collective-timeout" in lines[0], r.stderr
    assert "Traceback" not in r.stderr


# --------------------------------------------------------------------------------------------------- validate()
def _master(**kw: object) -> MasterConfig:
    return MasterConfig.build(**{"run_dir": "/r", "nnodes": 2, "nproc_per_node": 2, **kw})


def _agent(**kw: object) -> AgentConfig:
    return AgentConfig(**{"endpoint": "h:1", "secret": "s", "spec": WorkerSpec("t.py"), "nproc_per_node": 1, **kw})


@pytest.mark.parametrize("cfg,needle", [
    (_master(), None),
    (_master(nnodes=1, replicas=1), None),          # the default on one node: it keeps no copy (replicas_on)
    (_master(nnodes=4, replicas=3), None),
    (_master(nnodes=1, replicas=2), "--replicas 2: 2 replicas need at least 3 nodes (--nnodes is 1); give "
                                    "--replicas 0 or fewer, or more nodes"),
    (_master(nnodes=2, replicas=2), "--replicas 2: 2 replicas need at least 3 nodes (--nnodes is 2); give "
                                    "--replicas 1 or fewer"),
    (_master(nnodes=3, nproc_per_node=1, tp=2), "--tp 2 --pp 1: world size 3"),
    (_master(nnodes=2, nproc_per_node=3, pp=4), "is not divisible by tp x pp = 4"),
    (_master(recovery_timeout=30.0), "--recovery-timeout 30: an agent's quiesce grace may reach 45 s"),
    (_master(recovery_timeout=45.0), "give --recovery-timeout above 45"),
    (_master(recovery_timeout=45.5), None),
    (_agent(), None),
    (_agent(hang_timeout=60.0), "--collective-timeout 60 is not above --hang-timeout 60"),
    (_agent(hang_timeout=3.0, collective_timeout=3.5), None),
    (_agent(hang_timeout=120.0, collective_timeout=90.0), "give --collective-timeout above 120, or a shorter "
                                                          "--hang-timeout"),
    (_agent(spec=WorkerSpec("t", module=True, no_python=True)), "-m/--module and --no-python cannot be combined"),
    (LaunchConfig(master=_master(), agent=_agent()), None),
    (LaunchConfig(master=_master(node_timeout=0.4), agent=_agent()),
     "--heartbeat-interval 0.5 is not below --node-timeout 0.4"),
    (LaunchConfig(master=_master(recovery_timeout=10.0), agent=_agent()), "--recovery-timeout 10"),
    (LaunchConfig(master=_master(), agent=_agent(collective_timeout=5.0)), "--collective-timeout 5 is not above"),
])
def test_validate(cfg, needle):
    """Every rule between settings, as validate() states it: one line naming the flags and the fix."""
    found = config.problems(cfg)
    if needle is None:
        assert found == []
        config.validate(cfg)
        return
    assert found and needle in found[0], found
    with pytest.raises(ConfigError) as e:
        config.validate(cfg)
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_every_rule_is_exercised_and_names_its_flags():
    """Each rule of RULES refuses something above, and its message names the flags the rule lists."""
    bad = {"_layout_problem": _master(nnodes=3, nproc_per_node=1, tp=2), "_replicas_problem": _master(replicas=5),
           "_recovery_timeout_problem": _master(recovery_timeout=2.0),
           "_collective_timeout_problem": _agent(hang_timeout=90.0),
           "_entry_problem": _agent(spec=WorkerSpec("t", module=True, no_python=True)),
           "_heartbeat_problem": LaunchConfig(master=_master(node_timeout=0.2), agent=_agent())}
    assert {r.check.__name__ for r in config.RULES} == set(bad)
    for rule in config.RULES:
        problem = rule.check(bad[rule.check.__name__])
        assert problem is not None and any(flag in problem for flag in rule.flags), (rule.doc, problem)


def test_replicas_on_is_explicit():
    """The copies a job keeps: --replicas, never more than the other nodes there are (one node, a shrunk job)."""
    m = _master(nnodes=4, replicas=2)
    assert [m.shape.replicas_on(n) for n in (1, 2, 3, 4)] == [0, 1, 2, 2]
    assert _master(nnodes=1, replicas=1).shape.replicas_on(1) == 0


def test_the_defaults_are_valid():
    assert config.problems(LaunchConfig(master=_master(), agent=_agent())) == []


def test_master_config_is_nested_as_the_cli_groups_its_flags():
    """One component per group of flags; every setting has one name across them (build() and from_options()
    route by it), and build() / updated() reach a setting in whichever component holds it."""
    leaves = [f.name for f in dataclasses.fields(MasterConfig) if config.group_of(f) is None]
    for f in dataclasses.fields(MasterConfig):
        sub = config.group_of(f)
        if sub is not None:
            leaves += [g.name for g in dataclasses.fields(sub)]
    assert len(leaves) == len(set(leaves)) == len(MasterConfig.settings())
    m = _master(node_timeout=3.0, tp=2, lease_ttl=9.0)
    assert (m.recovery.node_timeout, m.shape.tp, m.lease.lease_ttl) == (3.0, 2, 9.0)
    moved = m.updated(port=7, nnodes=4)
    assert (moved.listen.port, moved.nnodes, moved.shape.tp) == (7, 4, 2) and m.listen.port == 0
    with pytest.raises(TypeError):
        MasterConfig.build(run_dir="/r", nnodes=1, nproc_per_node=1, no_such_setting=1)


def test_every_launcher_flag_is_a_config_field():
    """Each option of `phoenixrun` is generated from a config field (none written by hand with a default of its
    own): its help is the field's doc unless the launcher says more, its default the field's launch default."""
    by_flag: dict[str, list] = {}
    for cls in (MasterConfig, AgentConfig, LaunchConfig):
        for f in cls.flag_fields():
            by_flag.setdefault(config.setting_of(f).flag, []).append(f)
    for p in launch.params:
        if not isinstance(p, click.Option) or p.name == "help":
            continue
        long = next(n for n in p.opts if n.startswith("--"))
        assert long in by_flag, f"{long}: the launcher's option is no config field"
        if p.is_flag:     # off unless given; the field's default is what absent means (on, for --no-tee's tee)
            assert all(config.kind(f) == "bool" for f in by_flag[long]), long
            continue
        defaults = [config.launch_default(f) for f in by_flag[long]]
        assert p.get_default(click.Context(launch), call=False) in defaults, (long, defaults)
    run_id = MasterConfig.settings()["run_id"]
    assert config.launch_default(run_id) == "" and config.cli_default(run_id) == "phoenixrun"


def test_launch_config_keeps_the_torchrun_flags_as_given(tmp_path):
    argv = ["--standalone", "--nnodes", "2:2", "--master-port", "29511", "--tee", "3", "--start-method", "fork",
            "--run-dir", str(tmp_path / "run"), str(EXAMPLE)]
    c = launch_config(launch.make_context("phoenixrun", argv).params, (str(EXAMPLE),))
    t = c.torchrun
    assert (t.nnodes, t.master_port, t.tee, t.start_method, t.module) == ("2:2", 29511, "3", "fork", False)
    assert c.master.nnodes == 2 and c.agent.tee
