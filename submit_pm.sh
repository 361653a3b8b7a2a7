#!/bin/bash
#SBATCH -C gpu
#SBATCH --nodes 1
#SBATCH --ntasks-per-node 4
#SBATCH --gpus-per-node 4
#SBATCH --cpus-per-task 32
#SBATCH --time 01:00:00
#SBATCH -J vit-era5
#SBATCH -o %x-%j.out
#SBATCH --open-mode=append
#SBATCH --signal=B:USR1@180
#SBATCH --requeue
#
# Launch train.py with one task per GPU (Perlmutter layout: 4 GPUs per node).
#
#   sbatch submit_pm.sh --config=short
#   sbatch -N 4 submit_pm.sh --config=bs64_opt
#   ENABLE_PROFILING=1 PROFILE_OUTPUT=bs64 sbatch submit_pm.sh --config=bs64_opt
#   sbatch submit_pm.sh --tune --config=short     the batch-size tuner (tools/tune_batch_size.py)
#                                                 instead of train.py, on the same layout
#   bash submit_pm.sh --help                      this text (python train.py --help lists train.py's keys)
#
# Every argument after the script name (and after --tune) goes to train.py, AFTER the defaults
# `--data_path "$DATA_DIR" --expdir "$LOG_DIR"`, so e.g. `--data_path /x` wins.
#
# Site settings are not hard-wired; set them in the environment of `sbatch`:
#   SBATCH_ACCOUNT=m1234 SBATCH_QOS=regular   account and QOS (read by sbatch itself;
#                                             same as `sbatch -A m1234 -q regular`)
#   SETUP_CMD='module load pytorch/2.3.1'     evaluated in the batch script before launch
#   SHIFTER_IMAGE=nersc/pytorch:24.08.01      run every task in that Shifter image
#                                             (modules: SHIFTER_MODULES, default gpu,nccl-plugin)
#   CONTAINER='apptainer exec --nv img.sif'   any other per-task wrapper (word-split)
#   PYTHON=/path/to/python                    interpreter (default: python)
#   DATA_DIR, LOG_DIR                         data / experiment dirs (default: $SCRATCH/vit-era5/data
#                                             and .../logs; without SCRATCH: <repo>/data and <repo>/runs)
#   MASTER_ADDR, MASTER_PORT                  rendezvous (default: first node of the job,
#                                             29500 + SLURM_JOB_ID % 1000)
#   ENABLE_PROFILING=1                        wrap rank 0 in `nsys profile` (all ranks with
#                                             PROFILE_ALL_RANKS=1); report goes to
#                                             $LOG_DIR/profiles/$PROFILE_OUTPUT[_rankN].nsys-rep;
#                                             NSYS_EXTRA_ARGS adds nsys options
#   REPO_DIR                                  checkout holding train.py (default: found from
#                                             the submit dir or the submitted script's path)
#   DRY_RUN=1                                 only print the resolved command
#
# Preemption and requeue: Slurm sends SIGUSR1 to this batch shell 180 s before the time
# limit (--signal=B:USR1@180; Slurm may send it up to 60 s earlier; override on the command
# line, e.g. `sbatch --signal=B:USR1@600 submit_pm.sh ...`). srun runs in the background;
# the shell traps SIGUSR1 and SIGTERM and forwards either to every task as SIGUSR1 with
# `kill -USR1 <srun pid>` (srun relays SIGUSR1 to the job step's tasks; SIGTERM must never
# reach srun from here: srun answers it by SIGKILLing the tasks -- Slurm 22.05). train.py then
# stops at the next step boundary, checkpoints and exits 75 (EX_TEMPFAIL). On status 75 the
# script requeues its own job (`scontrol requeue $SLURM_JOB_ID`, allowed by --requeue) and
# says so in one line; the restarted job (same job id; `restart N` on the `job` line, from
# SLURM_RESTART_COUNT) runs the same command, which resumes from that checkpoint. Any other
# status is passed through unchanged. The output file is opened in append mode, so one
# file holds every restart. Not requeued (the job exits 75; submit the same command again
# to resume): jobs submitted with `--no-requeue`, and jobs no longer RUNNING, i.e. ended by
# `scancel` or the time limit (Slurm 22.05 would requeue those too, undoing the cancel).
# Preempt by hand: `scancel --signal=USR1 --batch <jobid>`.
#
# Generic (GPU-less) SLURM clusters: sbatch command-line options (and SBATCH_*
# environment variables) override the #SBATCH lines above. Tested on Slurm 22.05:
# BOTH `-C ""` (or `--constraint=`) AND `--gpus-per-node=0` are needed --
# `-C ""` clears the gpu feature request (else "Invalid feature specification"),
# `--gpus-per-node=0` clears the GPU request (else "Invalid generic resource (gres)
# specification"); `--gres=none` and `--gpus=0` do NOT clear --gpus-per-node.
#   sbatch -C "" --gpus-per-node=0 --ntasks-per-node=2 --cpus-per-task=1 submit_pm.sh --config=tiny
# Same via environment: SBATCH_CONSTRAINT= SBATCH_GPUS_PER_NODE=0 sbatch ... submit_pm.sh ...
# Add --overcommit when the node has fewer CPUs than tasks (else the job stays PENDING).
set -euo pipefail

# ---- --help: this header (forwarded, --help would reach srun, which fails outside a job) ----
for arg in "$@"; do
    if [[ "${arg}" == --help || "${arg}" == -h ]]; then
        # the comment block from "Launch train.py" to the code, without the comment marks
        sed -n '/^# Launch train.py/,/^set -euo pipefail/s/^# \{0,1\}//p' "${BASH_SOURCE[0]}"
        exit 0
    fi
done

# ---- optional site setup (modules etc.) --------------------------------------
# Typical Perlmutter setups (or set SETUP_CMD / SHIFTER_IMAGE instead of editing):
#   module load pytorch/2.3.1
#   SHIFTER_IMAGE=nersc/pytorch:24.08.01
if [[ -n "${SETUP_CMD:-}" ]]; then
    echo "setup: ${SETUP_CMD}"
    set +u # module/conda scripts often read unset variables
    eval "${SETUP_CMD}"
    set -u
fi

# ---- where the code is ---------------------------------------------------------
# Under sbatch this file runs from a spool copy, so $0 does not point at the checkout.
find_repo() {
    local d
    if [[ -n "${REPO_DIR:-}" ]]; then
        echo "${REPO_DIR}"
        return
    fi
    if [[ -n "${SLURM_SUBMIT_DIR:-}" && -f "${SLURM_SUBMIT_DIR}/train.py" ]]; then
        echo "${SLURM_SUBMIT_DIR}"
        return
    fi
    if [[ -n "${SLURM_JOB_ID:-}" ]] && command -v scontrol >/dev/null 2>&1; then
        d=$(scontrol show job "${SLURM_JOB_ID}" 2>/dev/null | awk -F= '$1 ~ /^ *Command$/ {print $2; exit}')
        d=${d%% *}
        if [[ -n "$d" && -f "$(dirname "$d")/train.py" ]]; then
            dirname "$d"
            return
        fi
    fi
    cd "$(dirname "${BASH_SOURCE[0]}")" && pwd
}
REPO_DIR=$(find_repo)
if [[ ! -f "${REPO_DIR}/train.py" ]]; then
    echo "error: no train.py in ${REPO_DIR}; submit from the repository root or set REPO_DIR" >&2
    [[ "${DRY_RUN:-0}" == 1 ]] || exit 1
fi
cd "${REPO_DIR}"

# ---- data and log directories --------------------------------------------------
if [[ -n "${SCRATCH:-}" ]]; then
    DATA_DIR=${DATA_DIR:-${SCRATCH}/vit-era5/data}
    LOG_DIR=${LOG_DIR:-${SCRATCH}/vit-era5/logs}
else
    DATA_DIR=${DATA_DIR:-${REPO_DIR}/data}
    LOG_DIR=${LOG_DIR:-${REPO_DIR}/runs}
fi

# ---- environment for the trainer -------------------------------------------------
export HDF5_USE_FILE_LOCKING=${HDF5_USE_FILE_LOCKING:-FALSE} # Lustre/NFS
export FI_MR_CACHE_MONITOR=${FI_MR_CACHE_MONITOR:-userfaultfd} # Slingshot/libfabric
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-${SLURM_CPUS_PER_TASK:-1}}

first_host=""
if [[ -n "${SLURM_JOB_NODELIST:-}" ]] && command -v scontrol >/dev/null 2>&1; then
    # awk (not head) reads all input: no SIGPIPE under pipefail
    first_host=$(scontrol show hostnames "${SLURM_JOB_NODELIST}" | awk 'NR == 1')
fi
first_host=${first_host:-$(hostname)}
if [[ -z "${MASTER_ADDR:-}" ]]; then
    MASTER_ADDR=${first_host}
    # A node name that does not resolve (small test clusters): use Slurm's NodeAddr.
    if ! getent hosts "${MASTER_ADDR}" >/dev/null 2>&1 && command -v scontrol >/dev/null 2>&1; then
        addr=$(scontrol show node "${first_host}" 2>/dev/null |
            awk '{for (i = 1; i <= NF; i++) if ($i ~ /^NodeAddr=/) {sub(/^NodeAddr=/, "", $i); print $i; exit}}')
        MASTER_ADDR=${addr:-${MASTER_ADDR}}
    fi
fi
export MASTER_ADDR
export MASTER_PORT=${MASTER_PORT:-$((29500 + ${SLURM_JOB_ID:-0} % 1000))}

# Perlmutter: GPU i is closest to the CPUs of task (3 - i) with Slurm's default
# affinity, so reverse the order (as the NERSC tutorial does); REVERSE_GPU_ORDER=0 disables.
if [[ "${REVERSE_GPU_ORDER:-$([[ ${NERSC_HOST:-} == perlmutter ]] && echo 1 || echo 0)}" == 1 ]]; then
    export CUDA_VISIBLE_DEVICES=3,2,1,0
fi

# ---- launch command ----------------------------------------------------------------
launch=(srun -u)
# srun >= 22.05 does not inherit --cpus-per-task from the allocation
if [[ -n "${SLURM_CPUS_PER_TASK:-}" ]]; then
    launch+=("--cpus-per-task=${SLURM_CPUS_PER_TASK}")
fi

if [[ -n "${CONTAINER:-}" ]]; then
    read -r -a container_cmd <<<"${CONTAINER}"
    launch+=("${container_cmd[@]}")
elif [[ -n "${SHIFTER_IMAGE:-}" ]]; then
    launch+=(shifter "--image=${SHIFTER_IMAGE}" "--module=${SHIFTER_MODULES:-gpu,nccl-plugin}")
fi

if [[ "${ENABLE_PROFILING:-0}" == 1 ]]; then
    export ENABLE_PROFILING # the trainer calls cudaProfilerStart/Stop
    PROFILE_DIR=${LOG_DIR}/profiles
    PROFILE_OUTPUT=${PROFILE_OUTPUT:-${SLURM_JOB_NAME:-vit-era5}-${SLURM_JOB_ID:-0}}
    mkdir -p "${PROFILE_DIR}"
    read -r -a nsys_extra <<<"${NSYS_EXTRA_ARGS:-}"
    # Per-task wrapper: nsys on rank 0 only (all ranks with PROFILE_ALL_RANKS=1).
    # Arguments: report path, all-ranks flag, nsys options, "--", command.
    # shellcheck disable=SC2016  # expanded by the per-task bash, not here
    nsys_wrapper='out=$1 all=$2; shift 2; o=(); while [[ $1 != -- ]]; do o+=("$1"); shift; done; shift; if [[ ${SLURM_PROCID:-0} == 0 || $all == 1 ]]; then [[ $all == 1 ]] && out+=_rank${SLURM_PROCID:-0}; exec nsys profile -o "$out" "${o[@]}" "$@"; fi; exec "$@"'
    launch+=(bash -c "${nsys_wrapper}" nsys-wrap "${PROFILE_DIR}/${PROFILE_OUTPUT}" "${PROFILE_ALL_RANKS:-0}"
        "--trace=cuda,nvtx,osrt" --capture-range=cudaProfilerApi --capture-range-end=stop -f true
        ${nsys_extra[@]+"${nsys_extra[@]}"} --)
    if [[ "${PROFILE_ALL_RANKS:-0}" == 1 ]]; then
        echo "profiling: all ranks -> ${PROFILE_DIR}/${PROFILE_OUTPUT}_rank<N>.nsys-rep"
    else
        echo "profiling: rank 0 -> ${PROFILE_DIR}/${PROFILE_OUTPUT}.nsys-rep"
    fi
fi

entry=(train.py)
if [[ "${1:-}" == "--tune" ]]; then
    shift
    entry=(-m tools.tune_batch_size)
fi
cmd=("${PYTHON:-python}" "${entry[@]}" --data_path "${DATA_DIR}" --expdir "${LOG_DIR}" "$@")

echo "job ${SLURM_JOB_ID:-none}: ${SLURM_JOB_NUM_NODES:-1} node(s) [${SLURM_JOB_NODELIST:-$(hostname)}], ${SLURM_NTASKS:-?} task(s), restart ${SLURM_RESTART_COUNT:-0}"
echo "repo=${REPO_DIR} data=${DATA_DIR} logs=${LOG_DIR} MASTER_ADDR=${MASTER_ADDR} MASTER_PORT=${MASTER_PORT}"
# Echo the resolved command (the nsys wrapper's body abbreviated), shell-quoted where needed.
shown=""
for a in "${launch[@]}" "${cmd[@]}"; do
    if [[ -n "${nsys_wrapper:-}" && "$a" == "${nsys_wrapper}" ]]; then
        a="'<nsys on rank 0 or all ranks>'"
    elif [[ -z "$a" || "$a" == *[^A-Za-z0-9_./=:,@%+-]* ]]; then
        a=$(printf '%q' "$a")
    fi
    shown+=" $a"
done
echo "command:${shown}"

if [[ "${DRY_RUN:-0}" == 1 ]]; then
    exit 0
fi
if [[ -z "${SLURM_JOB_ID:-}" ]]; then
    echo "error: not inside a SLURM job; submit with: sbatch $0 $*" >&2
    exit 1
fi

# ---- run: forward preemption signals to the tasks, requeue after a preemption exit -----
EXIT_PREEMPTED=75 # train.py after a SIGUSR1/SIGTERM checkpoint (utils.errors.EXIT_PREEMPTED)
srun_pid=""
signals=0
# shellcheck disable=SC2317  # only called from the traps below
forward_signal() {
    signals=$((signals + 1))
    if [[ -z "${srun_pid}" ]]; then
        echo "batch shell: SIG$1 before the tasks started; not forwarded"
        return
    fi
    echo "batch shell: SIG$1; forwarding SIGUSR1 to the tasks (they checkpoint and exit ${EXIT_PREEMPTED})"
    # srun relays SIGUSR1 to the step's tasks and keeps running; never send it SIGTERM (see header)
    kill -USR1 "${srun_pid}" 2>/dev/null || true
}
trap 'forward_signal USR1' USR1
trap 'forward_signal TERM' TERM

"${launch[@]}" "${cmd[@]}" &
srun_pid=$!
status=0
while true; do
    seen=${signals}
    status=0
    wait "${srun_pid}" || status=$?
    # A trapped signal makes `wait` return at once (status > 128) while srun goes on: wait again.
    ((signals != seen && status > 128)) || break
    kill -0 "${srun_pid}" 2>/dev/null && continue
    # srun ended around the signal: collect its status unless `wait` already returned it (then 127)
    again=0
    wait "${srun_pid}" 2>/dev/null || again=$?
    ((again == 127)) || status=${again}
    break
done

if ((status == EXIT_PREEMPTED)); then
    # The requeue ends this job (slurmd signals this shell): ignore that until the line is out.
    trap '' USR1 TERM
    # Only a job that still runs is requeued: Slurm 22.05 also requeues a job that `scancel`
    # or the time limit is ending (state CANCELLED/TIMEOUT), which would undo the cancel.
    job_state=$(scontrol show job "${SLURM_JOB_ID}" 2>/dev/null |
        awk '{for (i = 1; i <= NF; i++) if ($i ~ /^JobState=/) {sub(/^JobState=/, "", $i); print $i; exit}}') || true
    if [[ "${job_state}" != RUNNING ]]; then
        echo "preempted (exit status ${EXIT_PREEMPTED}); job ${SLURM_JOB_ID} is ${job_state:-unknown}, not requeued; resume by submitting the same command again"
    elif requeue_out=$(scontrol requeue "${SLURM_JOB_ID}" 2>&1); then
        echo "preempted (exit status ${EXIT_PREEMPTED}): requeued job ${SLURM_JOB_ID}; restart $((${SLURM_RESTART_COUNT:-0} + 1)) resumes from the checkpoint"
    else
        echo "preempted (exit status ${EXIT_PREEMPTED}); requeue of job ${SLURM_JOB_ID} failed: ${requeue_out}; resume by submitting the same command again" >&2
    fi
fi
exit "${status}"
