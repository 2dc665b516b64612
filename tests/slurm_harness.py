"""A real, throw-away Slurm on one machine, for the tests of the sbatch templates.

munged + slurmctld + one slurmd per fake node (Debian 12's Slurm 22.05 is built with
multiple-slurmd, so `slurmd -N nid001` runs node nid001 on its own port), all state under one
temporary directory. Each fake node claims CPUs, memory and GPUs the machine does not have
(SlurmdParameters=config_overrides; the GPUs are mknod copies of /dev/null) and has its own
loopback address (nid001 -> 127.0.0.11, nid002 -> 127.0.0.12, ...) as Slurm's NodeAddr. The node
names do not resolve, exactly the case the templates' `node_addr` function handles with
`scontrol show node`.

    from slurm_harness import SlurmCluster, unavailable_reason
    reason = unavailable_reason()          # None, or why this machine cannot run it
    with SlurmCluster(nnodes=4) as c:       # start (~1 s + ~3 s warm-up job), stop on exit
        jid = c.sbatch(["-N", "2", "job.sbatch"], cwd=tmp)
        info = c.wait_job(jid, timeout=120)  # {"JobState": "COMPLETED", "ExitCode": "0:0", ...}

Needs root (slurmd and munged run as root, jobs run as root) and the packages slurmctld, slurmd,
slurm-client and munge; `ensure_installed()` runs tests/slurm_setup.sh (apt) when they are missing.
stop() cancels jobs, stops exactly the daemons it started (by pid), then kills any process left
that carries this cluster's SLURM_CONF in its environment (job processes slurmstepd lost track of).
"""
from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
SETUP = HERE / "slurm_setup.sh"
BINARIES = ("slurmctld", "slurmd", "sbatch", "scontrol", "munged", "mungekey")


def missing_binaries() -> list[str]:
    return [b for b in BINARIES if shutil.which(b) is None]


def ensure_installed() -> str | None:
    """Install the Slurm packages when missing (root + apt). Returns None, or why it could not."""
    if not missing_binaries():
        return None
    if os.geteuid() != 0:
        return f"not root, and {', '.join(missing_binaries())} missing (sudo tests/slurm_setup.sh installs them)"
    p = subprocess.run(["bash", str(SETUP)], capture_output=True, text=True, timeout=600)
    if p.returncode != 0 or missing_binaries():
        tail = (p.stdout + p.stderr).strip().splitlines()[-5:]
        return f"could not install Slurm (tests/slurm_setup.sh exit {p.returncode}): " + " | ".join(tail)
    return None


def unavailable_reason() -> str | None:
    """None when this machine can run a local Slurm, else the reason (for pytest.skip)."""
    if os.geteuid() != 0:
        return "a local Slurm needs root (slurmd and munged run as root); run the tests as root"
    return ensure_installed()


def _free_ports(n: int) -> list[int]:
    socks, ports = [], []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
            ports.append(s.getsockname()[1])
    finally:
        for s in socks:
            s.close()
    return ports


def _alive(pid: int | None) -> bool:
    if not pid:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie is not alive
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


class SlurmError(RuntimeError):
    pass


class SlurmCluster:
    """A local Slurm cluster of `nnodes` fake nodes. Use as a context manager, or start()/stop()."""

    def __init__(self, nnodes: int = 4, *, gpus_per_node: int = 4, cpus_per_node: int = 128,
                 mem_per_node: int = 200_000, features: str = "gpu", partitions: tuple[str, ...] = ("debug", "gh"),
                 node_prefix: str = "nid", root: Path | None = None, cred_expire: int = 10):
        self.nnodes, self.gpus_per_node, self.cpus_per_node = nnodes, gpus_per_node, cpus_per_node
        self.mem_per_node, self.features, self.partitions = mem_per_node, features, partitions
        self.cred_expire = cred_expire
        self.nodes = [f"{node_prefix}{i:03d}" for i in range(1, nnodes + 1)]
        self.addrs = {n: f"127.0.0.{10 + i}" for i, n in enumerate(self.nodes, start=1)}
        # short path: the munge socket path must fit in sun_path (108 bytes)
        self.root = Path(root) if root else Path(tempfile.mkdtemp(prefix="phx-slurm-", dir="/tmp"))
        self.etc, self.log, self.run_dir = self.root / "etc", self.root / "log", self.root / "run"
        self.conf = self.etc / "slurm.conf"
        self.munge_dir = self.root / "munge"
        self.munge_socket = self.munge_dir / "munge.socket.2"
        self.procs: dict[str, subprocess.Popen] = {}
        self.munged_pid: int | None = None
        self.started = False

    # ------------------------------------------------------------------ environment and commands
    @property
    def env(self) -> dict[str, str]:
        """The environment for Slurm client commands (and jobs): SLURM_CONF, no inherited SLURM_* job vars."""
        env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SBATCH_", "SRUN_", "SALLOC_"))}
        env["SLURM_CONF"] = str(self.conf)
        return env

    def cmd(self, *argv: str, check: bool = True, timeout: float = 30, env: dict | None = None,
            cwd: Path | None = None) -> subprocess.CompletedProcess:
        p = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout, env=env or self.env, cwd=cwd)
        if check and p.returncode != 0:
            raise SlurmError(f"{' '.join(argv)} -> {p.returncode}: {p.stderr.strip() or p.stdout.strip()}")
        return p

    # ------------------------------------------------------------------ lifecycle
    def __enter__(self) -> "SlurmCluster":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self, timeout: float = 60.0, warmup: bool = True) -> None:
        reason = unavailable_reason()
        if reason:
            raise SlurmError(reason)
        t0 = time.time()
        for d in (self.etc, self.log, self.run_dir, self.root / "state", self.root / "spool", self.root / "dev",
                  self.munge_dir):
            d.mkdir(parents=True, exist_ok=True)
        os.chmod(self.root, 0o755)
        os.chmod(self.munge_dir, 0o755)
        self.started = True  # from here on stop() cleans up whatever did start
        try:
            self._start_munge()
            self._write_config()
            self._start_daemons(t0 + timeout)
            if warmup:
                self._warmup(t0 + timeout)
        except BaseException:
            self.stop()
            raise

    def _start_munge(self) -> None:
        key = self.munge_dir / "munge.key"
        if not key.exists():
            self.cmd("mungekey", "-c", "-k", str(key), "-b", "1024")
        os.chmod(key, 0o600)
        pidfile = self.munge_dir / "munged.pid"
        # --force: munged refuses a socket whose parent directories are not o+x; make that a warning
        self.cmd("munged", "--force", f"--socket={self.munge_socket}", f"--key-file={key}",
                 f"--log-file={self.munge_dir / 'munged.log'}", f"--pid-file={pidfile}",
                 f"--seed-file={self.munge_dir / 'munged.seed'}", "--num-threads=4")
        for _ in range(100):
            if self.munge_socket.exists() and pidfile.exists() and pidfile.read_text().strip():
                break
            time.sleep(0.05)
        self.munged_pid = int(pidfile.read_text().strip())
        enc = subprocess.run(["munge", "-S", str(self.munge_socket), "-n"], capture_output=True, timeout=10)
        dec = subprocess.run(["unmunge", "-S", str(self.munge_socket)], input=enc.stdout, capture_output=True,
                             timeout=10)
        if enc.returncode or dec.returncode:
            raise SlurmError(f"munge self-test failed; see {self.munge_dir / 'munged.log'}")

    def _write_config(self) -> None:
        ports = _free_ports(1 + self.nnodes)
        self.ctld_port, self.slurmd_ports = ports[0], dict(zip(self.nodes, ports[1:]))
        host = socket.gethostname().split(".")[0]
        first, last = self.nodes[0], self.nodes[-1]
        prefix = first.rstrip("0123456789")
        nodelist = first if self.nnodes == 1 else f"{prefix}[{first[len(prefix):]}-{last[len(prefix):]}]"
        gres_node = ""
        gres = ""
        if self.gpus_per_node:
            gres_node = f"Gres=gpu:{self.gpus_per_node}"
            devs = [self.root / "dev" / f"gpu{g}" for g in range(self.gpus_per_node)]
            try:
                for d in devs:
                    if not d.exists():
                        os.mknod(d, 0o666 | 0o020000, os.makedev(1, 3))  # char device like /dev/null
                gres = (f"NodeName={nodelist} Name=gpu "
                        f"File={self.root / 'dev'}/gpu[0-{self.gpus_per_node - 1}]\n")
            except OSError:  # no mknod (e.g. a container without CAP_MKNOD): count-only GRES
                gres = f"NodeName={nodelist} Name=gpu Count={self.gpus_per_node}\n"
        (self.etc / "gres.conf").write_text(gres)
        (self.etc / "plugstack.conf").write_text("")
        lines = [
            "ClusterName=phxci",
            f"SlurmctldHost={host}(127.0.0.1)",
            "SlurmUser=root", "SlurmdUser=root",
            f"SlurmctldPort={self.ctld_port}",
            "AuthType=auth/munge", "CredType=cred/munge",
            f"AuthInfo=socket={self.munge_socket},cred_expire={self.cred_expire}",
            f"StateSaveLocation={self.root / 'state'}",
            f"SlurmdSpoolDir={self.root / 'spool'}/%n",
            f"SlurmctldPidFile={self.run_dir / 'slurmctld.pid'}",
            f"SlurmdPidFile={self.run_dir}/slurmd-%n.pid",
            f"SlurmctldLogFile={self.log / 'slurmctld.log'}",
            f"SlurmdLogFile={self.log}/slurmd-%n.log",
            "SlurmctldDebug=info", "SlurmdDebug=info",
            f"PlugStackConfig={self.etc / 'plugstack.conf'}",
            "MailProg=/bin/true",
            "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none",
            "SelectType=select/cons_tres", "SelectTypeParameters=CR_Core",
            "SlurmdParameters=config_overrides",
            "GresTypes=gpu",
            "JobAcctGatherType=jobacct_gather/none", "AccountingStorageType=accounting_storage/none",
            "JobCompType=jobcomp/none", "MpiDefault=none", "SwitchType=switch/none",
            "ReturnToService=2",
            "SchedulerType=sched/backfill", "SchedulerParameters=batch_sched_delay=0",
            "MinJobAge=300", "KillWait=5", "InactiveLimit=0",
            "SlurmctldTimeout=30", "SlurmdTimeout=30", "MessageTimeout=10",
        ]
        for n in self.nodes:
            lines.append(
                f"NodeName={n} NodeHostname={host} NodeAddr={self.addrs[n]} Port={self.slurmd_ports[n]} "
                f"CPUs={self.cpus_per_node} Sockets=1 CoresPerSocket={self.cpus_per_node} ThreadsPerCore=1 "
                f"RealMemory={self.mem_per_node} {gres_node} Features={self.features} State=UNKNOWN")
        for i, p in enumerate(self.partitions):
            lines.append(f"PartitionName={p} Nodes=ALL Default={'YES' if i == 0 else 'NO'} MaxTime=INFINITE State=UP")
        self.conf.write_text("\n".join(lines) + "\n")
        (self.root / "env.sh").write_text(f"export SLURM_CONF={self.conf}\n")

    def _daemon(self, name: str, argv: list[str]) -> None:
        out = open(self.log / f"{name}.out", "wb")
        # own session (setsid); cwd = root, which slurmstepd inherits (stop() finds strays by it)
        self.procs[name] = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                            cwd=self.root, env=self.env, start_new_session=True)
        out.close()

    def _start_daemons(self, deadline: float) -> None:
        self._daemon("slurmctld", ["slurmctld", "-D", "-i", "-f", str(self.conf)])
        while True:
            if self.cmd("scontrol", "ping", check=False, timeout=10).stdout.find("UP") >= 0:
                break
            if self.procs["slurmctld"].poll() is not None or time.time() > deadline:
                raise SlurmError(f"slurmctld did not come up; see {self.log}/slurmctld.out and slurmctld.log")
            time.sleep(0.1)
        for n in self.nodes:
            (self.root / "spool" / n).mkdir(parents=True, exist_ok=True)
            self._daemon(f"slurmd-{n}", ["slurmd", "-D", "-N", n, "-f", str(self.conf)])
        while True:
            idle = set(self.cmd("sinfo", "-h", "-N", "-t", "idle", "-o", "%N", check=False).stdout.split())
            if len(idle) >= self.nnodes:
                break
            dead = [k for k, p in self.procs.items() if p.poll() is not None]
            if dead or time.time() > deadline:
                sinfo = self.cmd("sinfo", "-N", check=False).stdout
                raise SlurmError(f"only {len(idle)}/{self.nnodes} nodes idle (dead: {dead}); logs in {self.log}\n"
                                 + sinfo)
            time.sleep(0.2)

    def _warmup(self, deadline: float) -> None:
        """slurmctld's scheduler first runs ~3 s after start: absorb that, and prove a job runs end to end."""
        jid = self.sbatch(["-J", "warmup", "-N1", "-o", "/dev/null", "--wrap", "true"])
        info = self.wait_job(jid, timeout=max(5.0, deadline - time.time()))
        if info.get("JobState") != "COMPLETED":
            raise SlurmError(f"warm-up job {jid} ended {info.get('JobState')}; logs in {self.log}")

    def stop(self) -> None:
        if not self.started:
            return
        ctld = self.procs.get("slurmctld")
        if ctld is not None and ctld.poll() is None:
            jobs = self.job_ids()
            if jobs:
                self.cmd("scancel", *jobs, check=False)
            deadline = time.time() + 20
            while self.job_ids() and time.time() < deadline:
                time.sleep(0.2)
        # slurmd first (all at once), then slurmctld (saves state on TERM), then munged
        self._stop([p for k, p in self.procs.items() if k.startswith("slurmd-")])
        self._stop([p for k, p in self.procs.items() if k == "slurmctld"])
        if _alive(self.munged_pid):
            os.kill(self.munged_pid, signal.SIGTERM)
            for _ in range(100):
                if not _alive(self.munged_pid):
                    break
                time.sleep(0.05)
            if _alive(self.munged_pid):
                os.kill(self.munged_pid, signal.SIGKILL)
        self._kill_leftovers()
        self.procs.clear()
        self.munged_pid = None
        self.started = False

    @staticmethod
    def _stop(procs: list[subprocess.Popen], grace: float = 15.0) -> None:
        for p in procs:
            if p.poll() is None:
                p.terminate()
        deadline = time.time() + grace
        for p in procs:
            try:
                p.wait(timeout=max(0.1, deadline - time.time()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()

    def _kill_leftovers(self) -> None:
        """SIGKILL slurmstepd processes our slurmd spawned (cwd == root) and any process whose environment
        holds this cluster's SLURM_CONF (job processes left behind). Only ours: matched by path, never by name."""
        mark = f"SLURM_CONF={self.conf}".encode()
        me = os.getpid()
        for _ in range(3):
            found = False
            for d in Path("/proc").iterdir():
                if not d.name.isdigit() or int(d.name) == me:
                    continue
                try:
                    ours = (os.readlink(d / "cwd") == str(self.root) and (d / "comm").read_text().strip() == "slurmstepd"
                            ) or mark in (d / "environ").read_bytes().split(b"\0")
                except OSError:
                    continue
                if ours:
                    found = True
                    try:
                        os.kill(int(d.name), signal.SIGKILL)
                    except ProcessLookupError:
                        pass
            if not found:
                return
            time.sleep(0.3)

    def cleanup(self) -> None:
        """stop() and remove the state directory."""
        self.stop()
        shutil.rmtree(self.root, ignore_errors=True)

    # ------------------------------------------------------------------ jobs and nodes
    def sbatch(self, args: list[str], *, cwd: Path | None = None, env: dict[str, str] | None = None) -> str:
        e = self.env
        e.update(env or {})
        p = self.cmd("sbatch", "--parsable", *args, cwd=cwd, env=e)
        return p.stdout.strip().split(";")[0]

    def job_ids(self) -> list[str]:
        return self.cmd("squeue", "-h", "-o", "%i", check=False).stdout.split()

    def job_info(self, jid: str) -> dict[str, str]:
        out = self.cmd("scontrol", "show", "job", "-o", jid, check=False).stdout
        return dict(re.findall(r"(\w+)=(\S*)", out))

    def wait_job(self, jid: str, timeout: float = 120.0, poll: float = 0.2) -> dict[str, str]:
        """Wait until job `jid` has left the queue (or `timeout`); returns its scontrol record."""
        deadline = time.time() + timeout
        while time.time() < deadline:
            info = self.job_info(jid)
            if info.get("JobState") in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY",
                                        "BOOT_FAIL", "DEADLINE", "PREEMPTED"):
                return info
            time.sleep(poll)
        raise TimeoutError(f"job {jid} still {self.job_info(jid).get('JobState')} after {timeout:.0f}s")

    def node_info(self, node: str) -> dict[str, str]:
        out = self.cmd("scontrol", "show", "node", "-o", node).stdout
        return dict(re.findall(r"(\w+)=(\S*)", out))

    def node_of_addr(self, addr: str) -> str:
        for n, a in self.addrs.items():
            if a == addr:
                return n
        raise KeyError(f"no node has address {addr}")

    def set_down(self, node: str, reason: str = "phoenixrun-test") -> None:
        """Mark a node DOWN (what slurmctld does when a node dies). It does not kill the node's processes."""
        self.cmd("scontrol", "update", f"nodename={node}", "state=down", f"reason={reason}")

    def resume(self, node: str) -> None:
        self.cmd("scontrol", "update", f"nodename={node}", "state=resume", check=False)

    def wait_idle(self, timeout: float = 30.0) -> None:
        deadline = time.time() + timeout
        while time.time() < deadline:
            idle = set(self.cmd("sinfo", "-h", "-N", "-t", "idle", "-o", "%N", check=False).stdout.split())
            if len(idle) >= self.nnodes:
                return
            time.sleep(0.2)
        raise TimeoutError(f"nodes not all idle after {timeout:.0f}s:\n" + self.cmd("sinfo", "-N", check=False).stdout)

    def logs_tail(self, lines: int = 30) -> str:
        """The tail of slurmctld's log (for failure messages)."""
        try:
            return "\n".join((self.log / "slurmctld.log").read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


if __name__ == "__main__":  # manual use: python tests/slurm_harness.py [NNODES] -> starts, prints env, waits
    import sys
    why = unavailable_reason()
    if why:
        sys.exit(f"cannot run a local Slurm: {why}")
    c = SlurmCluster(int(sys.argv[1]) if len(sys.argv) > 1 else 4)
    t = time.time()
    c.start()
    print(f"{c.nnodes} nodes idle in {time.time() - t:.1f}s; export SLURM_CONF={c.conf}   (Ctrl-C stops)")
    print(c.cmd("sinfo").stdout)
    try:
        signal.pause()
    except KeyboardInterrupt:
        pass
    finally:
        c.cleanup()
