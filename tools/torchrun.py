"""``python -m tools.torchrun [torchrun options] train.py [options]``: torchrun whose exit status a job script can act on.

    python -m tools.torchrun --standalone --nproc_per_node=4 train.py --config short

Plain torchrun turns a preemption into a failure: SIGTERMed, it forwards SIGTERM, gives the workers 30 s, then
exits 1 with a traceback; when the workers stop with the preemption status 75 after their checkpoint, it also
exits 1 with a traceback. A job script then cannot tell "requeue me" from "I failed". This wrapper runs the same
launcher (``torch.distributed.run``'s options and agent) in-process and:

* handles SIGTERM, SIGUSR1 and Ctrl-C itself, from its first statement: each worker gets the signal the launcher
  got (so its preemption line names it; a second Ctrl-C stops them at once) as soon as it has exec'd and catches
  all three (a signal that came before the workers did waits for them), checkpoints at the next step boundary and
  exits 75, with no deadline from the launcher;
* exits 130 after a second Ctrl-C (or a Ctrl-C after another signal), as one process does (saying
  ``interrupted`` itself when the workers had stopped before it reached them), 75 when the workers
  stopped with 75 (every rank agrees on the step, so any 75 means the job was preempted), else a failed
  worker's own status; workers print their own ``error:``
  line, and one killed by a signal (the kernel's OOM killer, say) is named in one line here, with status 2 (a
  lost rank, as in ``docs/errors.md``; 1 is for bugs).
"""

from __future__ import annotations

import signal

# the preemption signals, each passed on to every worker as it came
FORWARDED = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
PENDING: list[int] = []  # the signals to pass on, in the order they came


def _record(signum: int, frame) -> None:
    PENDING.append(signum)


for _signum in FORWARDED:  # first: a signal during start-up is kept for the workers, never the default's death
    signal.signal(_signum, _record)

import functools  # noqa: E402
import logging  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

from utils.core.errors import EXIT_INTERRUPTED, EXIT_PREEMPTED, note_repeated, option_values, run_cli  # noqa: E402

# torchrun's agent keeps its own handlers for these only
AGENT_SIGNALS = "SIGHUP,SIGQUIT"
FORWARD_POLL_S = 0.1


def worker_pids(parent: int | None = None) -> list[int]:
    """The processes whose parent is ``parent`` (default this one): the workers the agent started."""
    parent = os.getpid() if parent is None else parent
    children = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # the process ended while we looked
        if int(fields[1]) == parent:
            children.append(int(stat.parent.name))
    return children


def runs_own_program(pid: int) -> bool:
    """Whether child ``pid`` has exec'd its program. Until then it is a fork of this launcher, with its command
    line and signal handlers: a signal sent then is lost at exec or, once Python's vfork child restored the
    default handlers, kills it, and the other ranks wait for it at the rendezvous. During exec the command
    line is empty until the handlers have been reset."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
    return cmdline not in (b"", _own_cmdline())


@functools.cache
def _own_cmdline() -> bytes:
    return Path("/proc/self/cmdline").read_bytes()


def catches(pid: int, signums: tuple[int, ...] = FORWARDED) -> bool:
    """Whether process ``pid`` has a handler for each of ``signums`` (``SigCgt`` of ``/proc/<pid>/status``): a
    worker catches them once ``train.py``'s first statement installed them all; before that, SIGTERM or SIGUSR1
    would kill it."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    mask = int(next((line.split()[1] for line in status.splitlines() if line.startswith("SigCgt:")), "0"), 16)
    return all(mask >> (signum - 1) & 1 for signum in signums)


def ready(pid: int) -> bool:
    """Whether worker ``pid`` may be sent a preemption signal. Exec first: a fork's handlers are the launcher's."""
    return runs_own_program(pid) and catches(pid)


def forward_forever() -> None:
    """Pass every recorded signal on to every worker once it catches them, in order, one per worker and poll: the
    kernel merges a signal sent while the same one is still pending, so two Ctrl-C sent at once would be one."""
    sent: dict[int, int] = {}  # worker pid -> how many of PENDING it was sent
    while True:
        time.sleep(FORWARD_POLL_S)
        if not PENDING:
            continue
        for pid in worker_pids():
            if sent.get(pid, 0) < len(PENDING) and ready(pid):
                try:
                    os.kill(pid, PENDING[sent.get(pid, 0)])
                except ProcessLookupError:
                    continue
                sent[pid] = sent.get(pid, 0) + 1


def stopped_at_once() -> bool:
    """Whether this launcher got a Ctrl-C after another signal: the workers were told to stop at once."""
    return signal.SIGINT in PENDING[1:]


def interrupted(failures: dict) -> int:
    """130 for a job stopped by a second Ctrl-C (or one after another signal). Each worker that Ctrl-C reached
    printed ``interrupted``; when it reached none (a quick checkpoint let them all stop first, and the forwarder
    sends nothing to a worker whose handlers are gone), this line says so, else the user sees only their 75."""
    if all(f.exitcode != EXIT_INTERRUPTED for f in failures.values()):
        print("interrupted: the workers had stopped before the last Ctrl-C reached them", file=sys.stderr,
              flush=True)
    return EXIT_INTERRUPTED


def _stopped_by_agent(rank: int, failures: dict) -> bool:
    """Whether ``rank``'s failure looks like the agent's SIGTERM to a survivor, not a cause: killed by SIGTERM no
    earlier than a second before another failure (the timestamps are whole seconds). A SIGTERM well before
    every other failure is the cause (the others then waited for that rank, e.g. at the rendezvous)."""
    mine = failures[rank]
    others = [f.timestamp for r, f in failures.items() if r != rank]
    return mine.exitcode == -signal.SIGTERM and not (others and mine.timestamp + 2 <= min(others))


def exit_status(failures: dict) -> int:
    """The wrapper's status from the agent's ``{rank: ProcessFailure}``: 75 when the workers were preempted,
    130 when interrupted, else the status of the rank that failed first (2 for a worker killed by a signal, as
    for any lost rank: 1 is for bugs; the agent then SIGTERMed the others, which fail after it)."""
    codes = {f.exitcode for f in failures.values()}
    if EXIT_PREEMPTED in codes:
        return EXIT_PREEMPTED
    if EXIT_INTERRUPTED in codes:
        return EXIT_INTERRUPTED
    rank = min(failures, key=lambda r: (_stopped_by_agent(r, failures), failures[r].timestamp, r))
    code = failures[rank].exitcode
    if code < 0:
        why = " (out of host memory? see dmesg)" if code == -signal.SIGKILL else ""
        print(f"error: rank {rank} was killed by {signal.Signals(-code).name}{why}; the other ranks were stopped",
              file=sys.stderr, flush=True)
        return 2
    return code


def launch(argv: list[str]) -> int:
    """Parse torchrun's options, launch the workers, and map their end to this process's exit status."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import elastic_launch
    from torch.distributed.run import config_from_args, get_args_parser

    parser = get_args_parser()
    parser.allow_abbrev = False  # as every command line of the project: --nproc is not --nproc_per_node
    note_repeated(option_values(parser, argv))  # as every command line of the project: the last value is used
    args = parser.parse_args([f"--signals_to_handle={AGENT_SIGNALS}", *argv])
    if args.standalone:  # as torchrun does it: a one-node job on a local rendezvous
        args.rdzv_backend, args.rdzv_endpoint, args.rdzv_id = "c10d", "localhost:0", f"standalone-{os.getpid()}"
    config, entrypoint, entry_args = config_from_args(args)
    # the agent logs each worker's end as a failure ("failed (exitcode: 75)"): the workers and exit_status speak
    logging.getLogger("torch.distributed.elastic.multiprocessing.api").setLevel(logging.CRITICAL)
    threading.Thread(target=forward_forever, name="signal-forwarder", daemon=True).start()
    try:
        elastic_launch(config=config, entrypoint=entrypoint)(*entry_args)
    except ChildFailedError as exc:
        status = exit_status(exc.failures)
        return interrupted(exc.failures) if stopped_at_once() else status
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(launch))
