"""submit_pm.sh end to end on a real (throw-away, one-node) SLURM cluster, plus dry-run checks.

The cluster comes from ``tests/e2e/slurm/slurm_cluster.sh`` (Debian's Slurm 22.05 + munge, installed
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

REPO = Path(__file__).resolve().parents[2]
SUBMIT = REPO / "submit_pm.sh"
CLUSTER = REPO / "tests" / "e2e" / "slurm" / "slurm_cluster.sh"
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
    from utils.preprocess.synthetic_dataset import make_synthetic_dataset

    out = tmp_path_factory.mktemp("slurm_data") / "tiny"
    make_synthetic_dataset(out, channels=4, img_size=(32, 64), train_years=2, valid_years=1,
                           steps_per_year=64, dt_hours=6.0, seed=0)
    return out


def _job_state(job_id: str, env: dict[str, str]) -> dict[str, str]:
    """JobState/ExitCode/Reason/Restarts from ``scontrol show job`` (empty once slurmctld has purged the job)."""
    res = subprocess.run(["scontrol", "show", "job", job_id], capture_output=True, text=True, env=env, timeout=30)
    return dict(re.findall(r"\b(JobState|ExitCode|Reason|Restarts)=(\S+)", res.stdout))


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
    # both ranks of one 2-process job started: the trainer (training/loop/trainer.py) logs
    # "rank 0/2 on cpu (launcher slurm): ..." on rank 0 and prints "rank 1/2 on cpu ready" on the others
    assert re.search(r"\brank 0/2 on \S+ \(launcher slurm\)", text), f"no start line of rank 0:\n{diag}"
    assert re.search(r"\brank 1/2 on \S+", text), f"no start line of rank 1:\n{diag}"

    logs = list(expdir.rglob("out.log"))
    events = list(expdir.rglob("events.out.tfevents.*"))
    assert logs, f"no out.log under {expdir}: {sorted(map(str, expdir.rglob('*')))}\n{diag}"
    assert events, f"no TensorBoard events file under {expdir}: {sorted(map(str, expdir.rglob('*')))}\n{diag}"


# ---- preemption: signal forwarding, requeue, exact resume ----------------------------------

FINAL_STATES = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "BOOT_FAIL", "DEADLINE",
                "OUT_OF_MEMORY"}


def _diag(tmp_path: Path, cdir: Path) -> str:
    """Every job output file under ``tmp_path`` and the daemons' log tails, for failure messages."""
    return ("\n".join(_tail(p, 200) for p in sorted(tmp_path.rglob("*.out"))) + "\n"
            + _tail(cdir / "log" / "slurmctld.log", 40) + "\n" + _tail(cdir / "log" / "slurmd.log", 40))


def _submit(cmd: list[str], env: dict[str, str]) -> str:
    """``sbatch`` without --wait; returns the job id."""
    res = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    m = re.search(r"Submitted batch job (\d+)", res.stdout)
    assert m, f"sbatch did not submit: {cmd}\nrc={res.returncode}\nstdout: {res.stdout}\nstderr: {res.stderr}"
    return m.group(1)


def _wait_until(cond, what: str, timeout: float, jobs: list[str], env: dict[str, str], diag) -> None:
    """Poll ``cond()`` every 0.1 s; on timeout cancel ``jobs`` and fail with ``diag()``."""
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            subprocess.run(["scancel", *jobs], env=env, timeout=30)
            pytest.fail(f"{what}: not within {timeout:.0f}s\n" + diag())
        time.sleep(0.1)


def _wait_jobs(jobs: list[str], env: dict[str, str], timeout: float, diag) -> dict[str, dict[str, str]]:
    """Poll ``scontrol show job`` until every job is in a final state (a requeued job passes through
    PENDING again); returns each job's last fields (``{}`` if purged before it was seen)."""
    last: dict[str, dict[str, str]] = {}
    done: dict[str, dict[str, str]] = {}

    def finished() -> bool:
        for job in jobs:
            if job not in done:
                res = subprocess.run(["scontrol", "show", "job", job], capture_output=True, text=True, env=env,
                                     timeout=30)
                info = dict(re.findall(r"\b(JobState|ExitCode|Reason|Restarts)=(\S+)", res.stdout))
                if "Invalid job id" in res.stderr:  # purged (MinJobAge) after its end
                    done[job] = last.get(job, {})
                elif info.get("JobState") in FINAL_STATES:
                    done[job] = info
                elif info:  # else a transient scontrol failure: ask again
                    last[job] = info
        return len(done) == len(jobs)

    _wait_until(finished, f"jobs {jobs} did not finish (last seen: {last})", timeout, jobs, env, diag)
    return done


# Stands in for python under submit_pm.sh (PYTHON=this file; it gets "train.py ..." as arguments).
STUB_TRAINER = r"""#!/bin/bash
# First run (SLURM_RESTART_COUNT unset or 0): exit STUB_FIRST_EXIT at once when set; otherwise mark
# this rank ready and wait for SIGUSR1/SIGTERM, then exit 75 like train.py after a preemption.
# Later runs exit 0.
echo "stub rank ${SLURM_PROCID} restart ${SLURM_RESTART_COUNT:-0}"
if [[ ${SLURM_RESTART_COUNT:-0} != 0 ]]; then exit 0; fi
if [[ -n "${STUB_FIRST_EXIT:-}" ]]; then exit "${STUB_FIRST_EXIT}"; fi
trap 'echo "stub rank ${SLURM_PROCID}: signal"; kill -KILL "$sleeper" 2>/dev/null; exit 75' USR1 TERM
# the step's signals reach every process of the task: the sleeper ignores them, else it could die and
# end the wait before this shell runs its trap
(trap '' USR1 TERM; exec sleep 120) &
sleeper=$!
touch "${STUB_DIR}/ready.${SLURM_PROCID}"
wait "$sleeper"
echo "stub rank ${SLURM_PROCID}: no signal"
exit 1
"""


@pytest.mark.slurm
@pytest.mark.timeout(600)
def test_submit_pm_forwards_signals_and_requeues(slurm_cluster, tmp_path):
    """submit_pm.sh's trap/requeue logic with a stub trainer: SIGUSR1 or SIGTERM to the batch shell reaches
    both tasks, status 75 requeues the job exactly once and the restart (status 0) ends it; a first run
    that exits 0 or 3 without a signal is not requeued and its status is the job's; a job ended by a
    plain ``scancel`` stays cancelled."""
    cdir, env = slurm_cluster
    stub = tmp_path / "stub_trainer.sh"
    stub.write_text(STUB_TRAINER)
    stub.chmod(0o755)
    cases = {"usr1": ("USR1", None), "term": ("TERM", None), "ok": (None, "0"), "fail": (None, "3"),
             "cancel": ("cancel", None)}
    jobs: dict[str, str] = {}
    t0 = time.monotonic()
    for name, (_, first_exit) in cases.items():
        (tmp_path / name).mkdir()
        job_env = dict(env, PYTHON=str(stub), STUB_DIR=str(tmp_path / name), DATA_DIR=str(tmp_path),
                       LOG_DIR=str(tmp_path / "logs"), **({"STUB_FIRST_EXIT": first_exit} if first_exit else {}))
        jobs[name] = _submit(["sbatch", "-N1", "-n", "2", *CPU_OVERRIDES, "-J", name,
                              "-o", str(tmp_path / name / "%x-%j.out"), str(SUBMIT), "--config=tiny"], job_env)
    diag = lambda: f"jobs: {jobs}\n" + _diag(tmp_path, cdir)  # noqa: E731
    for name, (sig, _) in cases.items():
        if sig:
            ready = [tmp_path / name / f"ready.{r}" for r in (0, 1)]
            _wait_until(lambda: all(p.exists() for p in ready), f"stub tasks of job {name} ready", 180,
                        list(jobs.values()), env, diag)
            how = [] if sig == "cancel" else [f"--signal={sig}", "--batch"]
            subprocess.run(["scancel", *how, jobs[name]], env=env, check=True, timeout=30)
    states = _wait_jobs(list(jobs.values()), env, 300, diag)
    print(f"\n[slurm] stub jobs {jobs} done in {time.monotonic() - t0:.1f}s: {states}")

    for name, (sig, first_exit) in cases.items():
        job, state = jobs[name], states[jobs[name]]
        outs = sorted((tmp_path / name).glob("*.out"))
        assert len(outs) == 1, f"{name}: expected one output file (append mode over restarts)\n{diag()}"
        text = outs[0].read_text(errors="replace")
        requeues = re.findall(rf"^preempted \(exit status 75\): requeued job {job}\b.*$", text, re.M)
        starts = re.findall(rf"^job {job}: .*, restart (\d+)$", text, re.M)
        if sig == "cancel":  # the tasks may exit 75 (SIGTERM) or be SIGKILLed by srun; never requeued
            assert not requeues and starts == ["0"], f"{name}: requeued after scancel\n{diag()}"
            expected = ("CANCELLED", state.get("ExitCode"), "0")
        elif sig:
            assert f"batch shell: SIG{sig}; forwarding SIGUSR1" in text, f"{name}: no forwarding line\n{diag()}"
            assert text.count("stub rank 0: signal") == 1 and text.count("stub rank 1: signal") == 1, \
                f"{name}: the signal did not reach both tasks once\n{diag()}"
            assert len(requeues) == 1 and starts == ["0", "1"], f"{name}: {requeues} {starts}\n{diag()}"
            expected = ("COMPLETED", "0:0", "1")
        else:
            assert not requeues and starts == ["0"], f"{name}: requeued after status {first_exit}\n{diag()}"
            expected = ("COMPLETED", "0:0", "0") if first_exit == "0" else ("FAILED", f"{first_exit}:0", "0")
        if state:  # still known to slurmctld
            got = (state.get("JobState"), state.get("ExitCode"), state.get("Restarts"))
            assert got == expected, f"{name}: {state}, expected {expected}\n{diag()}"


@pytest.mark.slurm
@pytest.mark.timeout(1200)
def test_submit_pm_preempted_job_requeues_and_resumes_exactly(slurm_cluster, tiny_data, tmp_path):
    """A 2-task tiny run gets SIGUSR1 (``scancel --signal=USR1 --batch``) while training after its first
    checkpoint: it checkpoints and exits 75, submit_pm.sh requeues the job, the restart resumes the same run
    and completes, and the final parameters equal (torch.equal) those of an uninterrupted 2-task job run
    alongside."""
    import torch

    cdir, env = slurm_cluster
    num_iters = 64  # 4 epochs of 16 steps; the signal, sent at the first checkpoint (10), stopped runs at 13-17
    args = ["--config=tiny", "--data_path", str(tiny_data), "--yaml_config", "config/ViT.yaml",
            "--num_iters", str(num_iters), "--log_every", "50", "--checkpoint_every_steps", "10"]
    jobs: dict[str, str] = {}
    t0 = time.monotonic()
    for name in ("preempted", "reference"):
        expdir = tmp_path / name
        job_env = dict(env, PYTHON=sys.executable, DATA_DIR=str(tiny_data), LOG_DIR=str(expdir))
        jobs[name] = _submit(["sbatch", "-N1", "-n", "2", *CPU_OVERRIDES, "-J", name, "-o", str(tmp_path / "%x-%j.out"),
                              str(SUBMIT), *args, "--expdir", str(expdir)], job_env)
    diag = lambda: f"jobs: {jobs}\n" + _diag(tmp_path, cdir)  # noqa: E731
    run = tmp_path / "preempted" / "tiny" / "2CPU" / "00"
    _wait_until(lambda: (run / "checkpoints" / "latest").exists(), "first checkpoint of the preempted job", 300,
                list(jobs.values()), env, diag)
    t_signal = time.monotonic() - t0
    subprocess.run(["scancel", "--signal=USR1", "--batch", jobs["preempted"]], env=env, check=True, timeout=30)
    states = _wait_jobs(list(jobs.values()), env, 900, diag)
    print(f"\n[slurm] signalled after {t_signal:.1f}s; jobs {jobs} done in {time.monotonic() - t0:.1f}s: {states}")

    for name, job in jobs.items():
        state = states[job]
        if state:
            assert (state.get("JobState"), state.get("ExitCode")) == ("COMPLETED", "0:0"), f"{name}: {state}\n{diag()}"
    assert states[jobs["preempted"]].get("Restarts", "1") == "1", diag()

    text = next(tmp_path.glob(f"preempted-{jobs['preempted']}.out")).read_text(errors="replace")
    job = jobs["preempted"]
    starts = [m.start() for m in re.finditer(rf"^job {job}: .*, restart \d+$", text, re.M)]
    assert re.findall(rf"^job {job}: .*, restart (\d+)$", text, re.M) == ["0", "1"], f"not one restart:\n{diag()}"
    first, second = text[:starts[1]], text[starts[1]:]
    stopped = re.findall(r"^preempted by SIGUSR1 at iteration (\d+): checkpoint", first, re.M)
    assert len(stopped) == 1, f"no (or more than one) preemption line in the first run:\n{diag()}"
    assert len(re.findall(rf"^preempted \(exit status 75\): requeued job {job}\b", first, re.M)) == 1, diag()
    resumed = re.findall(r"resumed at iteration (\d+)", second)
    assert resumed == stopped, f"second run: resumed at {resumed}, preempted at {stopped}:\n{diag()}"
    assert 0 < int(stopped[0]) < num_iters, diag()
    assert "requeued job" not in second and "resumed at" not in first, diag()
    runs = sorted(p.name for p in run.parent.iterdir())
    assert runs == ["00"], f"the restart did not continue run 00: {runs}\n{diag()}"
    reference_text = next(tmp_path.glob(f"reference-{jobs['reference']}.out")).read_text(errors="replace")
    assert not re.search(r"^preempted|resumed at iteration", reference_text, re.M), diag()

    got = torch.load(run / "checkpoints" / "model.pt", map_location="cpu")
    want = torch.load(tmp_path / "reference" / "tiny" / "2CPU" / "00" / "checkpoints" / "model.pt", map_location="cpu")
    assert got["step"] == want["step"] == num_iters, (got["step"], want["step"])
    assert got["model"].keys() == want["model"].keys()
    differ = [k for k in want["model"] if not torch.equal(got["model"][k], want["model"][k])]
    assert not differ, f"parameters differ from the uninterrupted run: {differ}\n{diag()}"


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


@pytest.mark.parametrize("args", [["--help"], ["-h"], ["--config=tiny", "--help"]])
def test_submit_help_prints_the_usage_and_exits_0(tmp_path, args):
    """Not forwarded to srun, which fails outside a job."""
    res = subprocess.run(["bash", str(SUBMIT), *args], cwd=tmp_path, capture_output=True, text=True, timeout=60,
                         env=_clean_env(REPO_DIR=str(REPO)))
    assert res.returncode == 0 and res.stderr == "", res.stdout + res.stderr
    assert res.stdout.startswith("Launch train.py with one task per GPU"), res.stdout
    assert "  sbatch submit_pm.sh --config=short\n" in res.stdout and "command:" not in res.stdout


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
