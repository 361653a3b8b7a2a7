"""submit_pm.sh end to end on a real (throw-away, one-node) SLURM cluster, plus dry-run checks.

The cluster comes from ``tests/slurm/slurm_cluster.sh`` (Debian's Slurm 22.05 + munge, installed
with apt-get when missing). The slurm tests need root; they are skipped without root or apt-get,
except under CI (``CI`` set), where that is an error.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SUBMIT = REPO / "submit_pm.sh"
CLUSTER = REPO / "tests" / "slurm" / "slurm_cluster.sh"
SLURM_CMDS = ("slurmctld", "slurmd", "sbatch", "munged")

# CPU overrides that make the GPU-node script run on a GPU-less cluster (see submit_pm.sh's header):
# both -C "" and --gpus-per-node=0 are needed; --overcommit in case the node has fewer CPUs than tasks.
CPU_OVERRIDES = ["-C", "", "--gpus-per-node=0", "--ntasks-per-node=2", "--cpus-per-task=1", "--overcommit"]
JOB_TIMEOUT_S = 1200


def _skip_reason() -> str | None:
    if os.geteuid() != 0:
        return "the SLURM test cluster needs root"
    have_slurm = all(shutil.which(c) or os.path.exists(f"/usr/sbin/{c}") for c in SLURM_CMDS)
    if not have_slurm and shutil.which("apt-get") is None:
        return "SLURM is not installed and apt-get is unavailable"
    return None


def _clean_env(**extra: str) -> dict[str, str]:
    """The environment minus any SLURM/sbatch settings of an enclosing job, plus ``extra``."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "SBATCH_", "SRUN_", "SALLOC_"))}
    env.update(extra)
    return env


def _tail(path: Path, n: int = 60) -> str:
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError as exc:
        return f"<{path}: {exc}>"
    return f"----- {path} (last {n} lines) -----\n" + "\n".join(lines[-n:])


@pytest.fixture(scope="module")
def slurm_cluster():
    """Start the one-node cluster in a temporary dir; always stop it. Yields (dir, env for clients)."""
    reason = _skip_reason()
    if reason:
        if os.environ.get("CI"):
            pytest.fail(f"CI is set but the SLURM test cannot run: {reason}")
        pytest.skip(reason)
    # short path: the munge socket lives in it (AF_UNIX paths are limited to 107 bytes)
    cdir = Path(tempfile.mkdtemp(prefix="vit-slurm-", dir="/tmp"))
    t0 = time.monotonic()
    try:
        start = subprocess.run([str(CLUSTER), "start", str(cdir)], capture_output=True, text=True, timeout=900,
                               env=_clean_env())
        if start.returncode != 0:
            pytest.fail(f"slurm_cluster.sh start failed (rc={start.returncode}):\n{start.stdout}\n{start.stderr}")
        print(f"\n[slurm] cluster started in {time.monotonic() - t0:.1f}s: {start.stderr.strip()}")
        yield cdir, _clean_env(SLURM_CONF=str(cdir / "slurm.conf"))
    finally:
        subprocess.run([str(CLUSTER), "stop", str(cdir)], capture_output=True, text=True, timeout=120)
        shutil.rmtree(cdir, ignore_errors=True)


@pytest.fixture(scope="module")
def tiny_data(tmp_path_factory):
    from tools.make_synthetic_data import make_synthetic_dataset

    out = tmp_path_factory.mktemp("slurm_data") / "tiny"
    make_synthetic_dataset(out, channels=4, img_size=(32, 64), train_years=2, valid_years=1,
                           steps_per_year=64, dt_hours=6.0, seed=0)
    return out


def _job_state(job_id: str, env: dict[str, str]) -> dict[str, str]:
    """JobState/ExitCode from ``scontrol show job`` (empty once slurmctld has purged the job)."""
    res = subprocess.run(["scontrol", "show", "job", job_id], capture_output=True, text=True, env=env, timeout=30)
    return dict(re.findall(r"\b(JobState|ExitCode|Reason)=(\S+)", res.stdout))


@pytest.mark.slurm
@pytest.mark.timeout(1800)
def test_submit_pm_tiny_on_slurm(slurm_cluster, tiny_data, tmp_path):
    cdir, env = slurm_cluster
    expdir = tmp_path / "logs"
    env = dict(env, PYTHON=sys.executable, DATA_DIR=str(tiny_data), LOG_DIR=str(expdir))
    cmd = ["sbatch", "--wait", "-N1", "-n", "2", *CPU_OVERRIDES, "-o", str(tmp_path / "%x-%j.out"),
           str(SUBMIT), "--config=tiny", "--data_path", str(tiny_data), "--expdir", str(expdir),
           "--yaml_config", "config/ViT.yaml", "--num_iters", "40", "--log_every", "10"]
    t0 = time.monotonic()
    try:
        res = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=JOB_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        subprocess.run(["scancel", "--user", "root"], env=env, timeout=30)
        pytest.fail(f"job did not finish within {JOB_TIMEOUT_S}s\n" + "\n".join(
            _tail(p) for p in sorted(tmp_path.glob("*.out"))))
    elapsed = time.monotonic() - t0

    m = re.search(r"Submitted batch job (\d+)", res.stdout)
    outs = sorted(tmp_path.glob("vit-era5-*.out"))
    diag = (f"command: {cmd}\nrc={res.returncode}\nstdout: {res.stdout}\nstderr: {res.stderr}\n"
            + "\n".join(_tail(p, 200) for p in outs) + "\n"
            + _tail(cdir / "log" / "slurmctld.log", 30) + "\n" + _tail(cdir / "log" / "slurmd.log", 30))
    assert m, "sbatch did not submit:\n" + diag
    job_id = m.group(1)
    print(f"\n[slurm] job {job_id} ran in {elapsed:.1f}s (submit to exit)")
    assert res.returncode == 0, f"job {job_id} failed:\n" + diag
    state = _job_state(job_id, env)
    print(f"[slurm] scontrol: {state or 'job already purged'}")
    if state:  # still known to slurmctld (MinJobAge)
        assert state.get("JobState") == "COMPLETED" and state.get("ExitCode") == "0:0", f"{state}\n{diag}"

    assert len(outs) == 1, f"expected one job output file in {tmp_path}:\n{diag}"
    text = outs[0].read_text(errors="replace")
    # submit_pm.sh echoes the resolved command; user args come after the defaults
    assert "command: srun -u" in text, diag
    assert re.search(r"--expdir \S+ --config=tiny", text), diag
    # both ranks of one 2-process job started: the trainer (utils/trainer.py) logs
    # "rank 0/2 on cpu (launcher slurm): ..." on rank 0 and prints "rank 1/2 on cpu ready" on the others
    assert re.search(r"\brank 0/2 on \S+ \(launcher slurm\)", text), f"no start line of rank 0:\n{diag}"
    assert re.search(r"\brank 1/2 on \S+", text), f"no start line of rank 1:\n{diag}"

    logs = list(expdir.rglob("out.log"))
    events = list(expdir.rglob("events.out.tfevents.*"))
    assert logs, f"no out.log under {expdir}: {sorted(map(str, expdir.rglob('*')))}\n{diag}"
    assert events, f"no TensorBoard events file under {expdir}: {sorted(map(str, expdir.rglob('*')))}\n{diag}"


# ---- cheap checks of submit_pm.sh without SLURM -------------------------------------------

def _dry_run(tmp_path: Path, *args: str, **env: str) -> str:
    res = subprocess.run(["bash", str(SUBMIT), *args], cwd=tmp_path, capture_output=True, text=True, timeout=60,
                         env=_clean_env(DRY_RUN="1", REPO_DIR=str(REPO), DATA_DIR="/d", LOG_DIR=str(tmp_path / "l"),
                                        **env))
    assert res.returncode == 0, res.stdout + res.stderr
    line = [ln for ln in res.stdout.splitlines() if ln.startswith("command:")]
    assert len(line) == 1, res.stdout
    return line[0]


def test_submit_dry_run_argument_order(tmp_path):
    line = _dry_run(tmp_path, "--config=tiny", "--data_path", "/mine", "a b", PYTHON="/opt/py")
    assert line == (f"command: srun -u /opt/py train.py --data_path /d --expdir {tmp_path / 'l'} "
                    "--config=tiny --data_path /mine a\\ b")


def test_submit_dry_run_profiling_and_container(tmp_path):
    line = _dry_run(tmp_path, "--config=short", ENABLE_PROFILING="1", PROFILE_OUTPUT="p1",
                    SHIFTER_IMAGE="img:1", SLURM_CPUS_PER_TASK="32")
    assert line.startswith("command: srun -u --cpus-per-task=32 shifter --image=img:1 --module=gpu,nccl-plugin bash -c ")
    assert (f"nsys-wrap {tmp_path / 'l'}/profiles/p1 0 --trace=cuda,nvtx,osrt --capture-range=cudaProfilerApi "
            "--capture-range-end=stop -f true -- python train.py") in line


def test_scripts_shellcheck_clean():
    if shutil.which("shellcheck") is None:
        pytest.skip("shellcheck not installed")
    res = subprocess.run(["shellcheck", str(SUBMIT), str(CLUSTER)], capture_output=True, text=True)
    assert res.returncode == 0, res.stdout + res.stderr
