"""The command-line surface, frozen: every command's flags (all spellings), defaults and environment variables.

Adding, removing or re-defaulting a flag must be a deliberate edit of SURFACE below (the pattern of torchtitan's
test_no_new_cli_options.py): a default that changes by accident (one copy of a setting drifting from another)
fails here. After a deliberate change, also regenerate docs/cli.md (python tools/gen_cli_doc.py).
"""
import click

from phoenixrun.cli import register_simulate, commands, launch

REQUIRED, FLAG = "<required>", "<flag>"

# command -> {spellings: (default, env var)}; "entry" is the SCRIPT [ARGS] argument
SURFACE = {
    "phoenixrun": {
        ("--nnodes",): ("1", "PET_NNODES"),
        ("--nproc-per-node", "--nproc_per_node"): ("1", "PET_NPROC_PER_NODE"),
        ("--standalone",): (FLAG, "PET_STANDALONE"),
        ("--rdzv-endpoint", "--rdzv_endpoint"): ("", "PET_RDZV_ENDPOINT"),
        ("--rdzv-id", "--rdzv_id"): ("", "PET_RDZV_ID"),
        ("--rdzv-backend", "--rdzv_backend"): ("c10d", "PET_RDZV_BACKEND"),
        ("--rdzv-conf", "--rdzv_conf"): ("", "PET_RDZV_CONF"),
        ("--node-rank", "--node_rank"): (None, "PET_NODE_RANK"),
        ("--master-addr", "--master_addr"): ("127.0.0.1", "PET_MASTER_ADDR"),
        ("--master-port", "--master_port"): (29500, "PET_MASTER_PORT"),
        ("--local-addr", "--local_addr"): (None, "PET_LOCAL_ADDR"),
        ("--log-dir", "--log_dir"): (None, "PET_LOG_DIR"),
        ("--tee", "-t"): (None, "PET_TEE"),
        ("--redirects", "-r"): (None, "PET_REDIRECTS"),
        ("--monitor-interval", "--monitor_interval"): (0.1, "PET_MONITOR_INTERVAL"),
        ("--local-ranks-filter", "--local_ranks_filter"): (None, "PET_LOCAL_RANKS_FILTER"),
        ("--start-method", "--start_method"): ("spawn", "PET_START_METHOD"),
        ("--shutdown-timeout", "--shutdown_timeout"): (2.0, "PET_SHUTDOWN_TIMEOUT"),
        ("-m", "--module"): (FLAG, None),
        ("--no-python", "--no_python"): (FLAG, None),
        ("--spares",): (0, None),
        ("--run-dir", "--run_dir"): (None, None),
        ("--resume",): (FLAG, None),
        ("--fault-domain", "--fault_domain"): ("", None),
        ("--collective-timeout", "--collective_timeout"): (60.0, None),
        ("--no-standby-worker", "--no_standby_worker"): (FLAG, None),
        ("--replicas",): (1, None),
        ("--tp",): (1, None),
        ("--pp",): (1, None),
        ("--max-restarts", "--max_restarts"): (0, "PET_MAX_RESTARTS"),
        ("--join-timeout", "--join_timeout"): (600.0, None),
        ("--node-timeout", "--node_timeout"): (5.0, None),
        ("--spare-wait", "--spare_wait"): (30.0, None),
        ("--on-no-spare", "--on_no_spare"): ("stop", None),
        ("--recovery-timeout", "--recovery_timeout"): (60.0, None),
        ("--max-local-resets", "--max_local_resets"): (3, None),
        ("--relay-threshold", "--relay_threshold"): (256, None),
        ("--straggler-ratio", "--straggler_ratio"): (2.0, None),
        ("--straggler-window", "--straggler_window"): (20, None),
        ("--replace-stragglers", "--replace_stragglers"): (FLAG, None),
        ("--heartbeat-interval", "--heartbeat_interval"): (0.5, None),
        ("--hang-timeout", "--hang_timeout"): (20.0, None),
        ("--persist-every", "--persist_every"): (0, None),
        ("--persist-dir", "--persist_dir"): (None, None),
        ("--persist-keep", "--persist_keep"): (2, None),
        ("--max-fallbacks", "--max_fallbacks"): (3, None),
        ("entry",): (REQUIRED, None),
    },
    "master": {
        ("--nnodes",): (REQUIRED, None),
        ("--nproc-per-node", "--nproc_per_node"): (REQUIRED, None),
        ("--run-dir", "--run_dir"): (REQUIRED, None),
        ("--rdzv-id", "--rdzv_id"): ("phoenixrun", None),
        ("--host",): ("0.0.0.0", None),
        ("--port",): (29500, None),
        ("--store-port",): (0, None),
        ("--spares",): (None, None),
        ("--lease-ttl", "--lease_ttl"): (0.0, None),
        ("--max-clock-skew", "--max_clock_skew"): (2.0, None),
        ("--replicas",): (1, None),
        ("--tp",): (1, None),
        ("--pp",): (1, None),
        ("--max-restarts", "--max_restarts"): (0, "PET_MAX_RESTARTS"),
        ("--join-timeout", "--join_timeout"): (600.0, None),
        ("--node-timeout", "--node_timeout"): (5.0, None),
        ("--spare-wait", "--spare_wait"): (30.0, None),
        ("--on-no-spare", "--on_no_spare"): ("stop", None),
        ("--recovery-timeout", "--recovery_timeout"): (60.0, None),
        ("--max-local-resets", "--max_local_resets"): (3, None),
        ("--relay-threshold", "--relay_threshold"): (256, None),
        ("--straggler-ratio", "--straggler_ratio"): (2.0, None),
        ("--straggler-window", "--straggler_window"): (20, None),
        ("--replace-stragglers", "--replace_stragglers"): (FLAG, None),
        ("--persist-every", "--persist_every"): (0, None),
        ("--persist-dir", "--persist_dir"): (None, None),
        ("--persist-keep", "--persist_keep"): (2, None),
        ("--max-fallbacks", "--max_fallbacks"): (3, None),
    },
    "agent": {
        ("--rdzv-endpoint", "--rdzv_endpoint"): (REQUIRED, None),
        ("--nproc-per-node", "--nproc_per_node"): (REQUIRED, None),
        ("--host",): (None, None),
        ("--fault-domain", "--fault_domain"): ("", None),
        ("--heartbeat-interval", "--heartbeat_interval"): (0.5, None),
        ("--log-dir", "--log_dir"): (None, None),
        ("--no-tee",): (FLAG, None),
        ("--secret-file", "--secret_file"): (None, None),
        ("--collective-timeout", "--collective_timeout"): (60.0, "PHOENIXRUN_COLLECTIVE_TIMEOUT"),
        ("--hang-timeout", "--hang_timeout"): (20.0, None),
        ("--node-rank", "--node_rank"): (None, None),
        ("--local-ranks-filter", "--local_ranks_filter"): (None, None),
        ("--shutdown-timeout", "--shutdown_timeout"): (2.0, None),
        ("--no-standby-worker", "--no_standby_worker"): (FLAG, None),
        ("-m", "--module"): (FLAG, None),
        ("--no-python", "--no_python"): (FLAG, None),
        ("entry",): (REQUIRED, None),
    },
    "status": {
        ("--run-dir", "--run_dir"): (None, None),
        ("--endpoint",): (None, None),
        ("--secret-file", "--secret_file"): (None, None),
        ("--json",): (FLAG, None),
        ("--watch",): (FLAG, None),
        ("--interval",): (1.0, None),
    },
    "inject": {
        ("--run-dir", "--run_dir"): (None, None),
        ("--endpoint",): (None, None),
        ("--secret-file", "--secret_file"): (None, None),
        ("--node",): (REQUIRED, None),
        ("--fault",): (REQUIRED, None),
    },
    "drain": {
        ("--run-dir", "--run_dir"): (None, None),
        ("--endpoint",): (None, None),
        ("--secret-file", "--secret_file"): (None, None),
        ("--node",): (REQUIRED, None),
        ("--reason",): ("operator request", None),
    },
    "simulate": {
        ("--example",): ("paper", None),
        ("--mttf",): (None, None),
        ("--t-step",): (None, None),
        ("--steps",): (None, None),
        ("--ckpt-every",): (None, None),
        ("--ckpt-cost",): (None, None),
        ("--restart",): (None, None),
        ("--hotswap",): (None, None),
        ("--phi",): (None, None),
        ("--trials",): (5000, None),
        ("--seed",): (0, None),
        ("--trace",): (None, None),
        ("--json",): (FLAG, None),
        ("--plot",): (None, None),
        ("--scale-result",): ((), None),
        ("--rank-result",): (None, None),
        ("--gpu-mttf",): (108000000, None),
        ("--sizing",): (FLAG, None),
        ("--nodes",): (64, None),
        ("--p-fault",): (None, None),
        ("--domain-fault",): (0.0, None),
        ("--domains",): (0, None),
        ("--window",): (1, None),
        ("--target",): (0.01, None),
    },
}


def surface(cmd: click.Command) -> dict:
    """{spellings: (default, env var)} of a command's parameters, in declaration order."""
    out = {}
    for p in cmd.params:
        if not isinstance(p, click.Option):
            out[(p.name,)] = (REQUIRED if p.required else None, None)
            continue
        if p.is_flag:
            default = FLAG
        elif p.required:
            default = REQUIRED
        else:
            default = p.get_default(click.Context(cmd), call=False)
        out[tuple(p.opts + p.secondary_opts)] = (default, p.envvar)
    return out


def commands_by_name() -> dict[str, click.Command]:
    register_simulate()
    group = click.Context(commands)
    return {"phoenixrun": launch, **{n: commands.get_command(group, n) for n in SURFACE if n != "phoenixrun"}}


def test_no_new_cli_options():
    cmds = commands_by_name()
    assert set(cmds) == set(SURFACE) and all(cmds.values())
    for name, cmd in cmds.items():
        have, want = surface(cmd), SURFACE[name]
        added = {k: v for k, v in have.items() if k not in want}
        removed = [k for k in want if k not in have]
        changed = {k: (want[k], have[k]) for k in want if k in have and want[k] != have[k]}
        assert not (added or removed or changed), (
            f"`phoenixrun {name}` flags changed: added {added}, removed {removed}, changed (was, now) {changed}. "
            "If deliberate, update SURFACE in tests/test_cli_surface.py and run python tools/gen_cli_doc.py")
        assert list(have) == list(want), f"`phoenixrun {name}`: the flags' order changed (it is the --help order)"


def test_every_subcommand_is_frozen():
    """A new subcommand must be added to SURFACE too."""
    group = click.Context(commands)
    register_simulate()
    assert set(commands.list_commands(group)) == set(SURFACE) - {"phoenixrun"}
