"""Static checks of launch_templates/*.sbatch: `bash -n`, shellcheck, the Slurm directives each site
needs, one shared body, and the address lookup (`node_addr`) against a stub scontrol. No Slurm needed.
shellcheck comes from Debian's package (tests/slurm_setup.sh installs it)."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

TEMPLATES_DIR = Path(__file__).resolve().parents[1] / "launch_templates"
TEMPLATES = sorted(TEMPLATES_DIR.glob("*.sbatch"))
BODY_MARK = "# " + "=" * 87 + " end of knobs\n"
IDS = [t.name for t in TEMPLATES]


def test_the_three_templates_exist():
    assert {"perlmutter.sbatch", "vista.sbatch", "generic.sbatch"} <= {t.name for t in TEMPLATES}


@pytest.mark.parametrize("template", TEMPLATES, ids=IDS)
def test_bash_syntax(template):
    p = subprocess.run(["bash", "-n", str(template)], capture_output=True, text=True)
    assert p.returncode == 0, p.stderr


@pytest.mark.parametrize("template", TEMPLATES, ids=IDS)
def test_shellcheck_clean(template):
    if shutil.which("shellcheck") is None:
        pytest.skip("shellcheck is not installed (apt-get install shellcheck, or tests/slurm_setup.sh)")
    p = subprocess.run(["shellcheck", "--shell=bash", "--severity=style", str(template)], capture_output=True, text=True)
    assert p.returncode == 0, p.stdout + p.stderr


def directives(template: Path) -> list[str]:
    """The #SBATCH options sbatch reads: from the top, up to the first command (comments stripped)."""
    out = []
    for line in template.read_text().splitlines()[1:]:
        if line.startswith("#SBATCH"):
            out.append(line[len("#SBATCH"):].split("#")[0].strip())
        elif line.strip() and not line.startswith("#"):
            break
    return out


@pytest.mark.parametrize("template", TEMPLATES, ids=IDS)
def test_common_directives(template):
    d = directives(template)
    for needed in ("--ntasks-per-node=1", "--no-kill", "--requeue", "--exclusive"):
        assert needed in d, f"{template.name}: no #SBATCH {needed}"
    assert any(re.fullmatch(r"-N \d+", x) for x in d), d


def test_site_directives():
    perl = directives(TEMPLATES_DIR / "perlmutter.sbatch")
    for needed in ("-C gpu", "--gpus-per-node=4"):
        assert needed in perl
    assert any(x.startswith("-q ") for x in perl) and any(x.startswith("-A ") for x in perl), perl
    vista = directives(TEMPLATES_DIR / "vista.sbatch")
    assert "-p gh" in vista and any(x.startswith("-A ") for x in vista), vista


def test_templates_share_one_body():
    """Everything below the knobs is the same script in every template: sites differ only in the header."""
    bodies = {t.name: t.read_text().split(BODY_MARK) for t in TEMPLATES}
    for name, parts in bodies.items():
        assert len(parts) == 2, f"{name}: no '{BODY_MARK.strip()}' line"
    assert len({parts[1] for parts in bodies.values()}) == 1, "template bodies differ"


def node_addr_function(template: Path) -> str:
    text = template.read_text()
    m = re.search(r"^node_addr\(\) \{\n.*?^\}\n", text, re.S | re.M)
    assert m, f"{template.name}: no node_addr function"
    return m.group(0)


@pytest.mark.parametrize("template", TEMPLATES, ids=IDS)
def test_node_addr(template, tmp_path):
    """DNS first (a resolvable name), else Slurm's NodeAddr, else the name itself."""
    stub = tmp_path / "scontrol"
    stub.write_text('#!/bin/sh\n[ "$3" = nid042 ] && echo "NodeName=nid042 Arch=x86_64 CoresPerSocket=64\n'
                    '   NodeAddr=10.9.8.7 NodeHostName=nid042 Version=22.05"\nexit 0\n')
    stub.chmod(0o755)
    script = node_addr_function(template) + (
        'echo "$(node_addr localhost) $(node_addr nid042) $(node_addr no-such-node-phx)"\n')
    env = {**os.environ, "PATH": f"{tmp_path}:{os.environ.get('PATH', '/usr/bin:/bin')}"}
    env.pop("ADDR_SUFFIX", None)
    p = subprocess.run(["bash", "-c", script], capture_output=True, text=True, env=env, timeout=60)
    assert p.returncode == 0, p.stderr
    assert p.stdout.split() == ["127.0.0.1", "10.9.8.7", "no-such-node-phx"], p.stdout


@pytest.mark.parametrize("template", TEMPLATES, ids=IDS)
def test_refuses_to_run_outside_slurm(template, tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    p = subprocess.run(["bash", str(template), "train.py"], capture_output=True, text=True, env=env, cwd=tmp_path,
                       timeout=60)
    assert p.returncode == 1 and "submit this with sbatch" in p.stderr, p.stderr
    assert not any(tmp_path.iterdir())   # nothing created


@pytest.mark.parametrize("template", TEMPLATES, ids=IDS)
def test_requeue_directives(template):
    """Slurm requeues nothing by itself on a non-zero exit or a time limit: the template asks for the time limit's
    warning, keeps the output of every run, and binds each agent to its node's cores."""
    d = directives(template)
    for needed in ("--signal=B:USR1@120", "--open-mode=append", "--requeue"):
        assert needed in d, f"{template.name}: no #SBATCH {needed}"
    assert '--cpu-bind="$CPU_BIND"' in template.read_text() and "CPU_BIND=${CPU_BIND:-cores}" in template.read_text()


def shell_function(template: Path, name: str) -> str:
    m = re.search(rf"^{name}\(\) \{{\n.*?^\}}\n", template.read_text(), re.S | re.M)
    assert m, f"{template.name}: no {name} function"
    return m.group(0)


@pytest.mark.parametrize("rc, time_up, why", [
    (0, 0, ""), (0, 1, ""),                                # finished: never again
    (143, 1, "the time limit is near"),                    # the masters stopped by the USR1 trap
    (75, 0, "the spares ran out (exit code 75)"),
    (75, 1, "the time limit is near"),
    (1, 0, ""), (2, 0, ""), (137, 0, ""),                  # the script failed, or the job was cancelled
])
def test_requeue_reason(rc, time_up, why):
    script = shell_function(TEMPLATES[0], "requeue_reason") + f'requeue_reason {rc} {time_up}\n'
    p = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0 and p.stdout.strip() == why, p.stdout + p.stderr


@pytest.mark.parametrize("env, count, calls, said", [
    ({"REQUEUE": "1", "MAX_REQUEUES": "5"}, "0", "requeue 77", "requeue 1 of at most 5"),
    ({"REQUEUE": "1", "MAX_REQUEUES": "5"}, "5", "", "not requeueing (why): requeued 5 times already (MAX_REQUEUES=5)"),
    ({"REQUEUE": "0", "MAX_REQUEUES": "5"}, "0", "", "not requeueing (why): REQUEUE=0"),
])
def test_requeue_job_policy(tmp_path, env, count, calls, said):
    """`scontrol requeue` is called (a stub records it) unless REQUEUE=0 or MAX_REQUEUES is reached."""
    stub = tmp_path / "scontrol"
    stub.write_text(f'#!/bin/sh\necho "$@" >> {tmp_path}/calls\n')
    stub.chmod(0o755)
    script = ('log() { echo "$*" >&2; }\n' + shell_function(TEMPLATES[0], "requeue_job") + 'requeue_job why\n')
    e = {**os.environ, **env, "PATH": f"{tmp_path}:{os.environ.get('PATH', '/usr/bin:/bin')}",
         "SLURM_JOB_ID": "77", "SLURM_RESTART_COUNT": count, "PERSIST_DIR": "/ckpt"}
    p = subprocess.run(["bash", "-c", script], capture_output=True, text=True, env=e, timeout=60)
    assert said in p.stderr, p.stderr
    recorded = (tmp_path / "calls").read_text().splitlines() if (tmp_path / "calls").exists() else []
    assert recorded[-1:] == ([calls] if calls else []), recorded
