"""Errors for expected bad input, exit statuses, and the wrapper every command-line entry point runs in.

Expected problems (bad config, data or environment) are :class:`UserError`: the entry point prints them
as one line, ``error: <message>``, with no traceback, and exits non-zero (:func:`run_cli`).
"""

from __future__ import annotations

import argparse
import difflib
import itertools
import os
import sys
from typing import Callable


class UserError(Exception):
    """Bad input from the user (config, data, environment). The message names the problem and the fix."""


class NothingToDo(Exception):
    """The command has nothing to do (the run it names is complete): its message is printed, exit 0."""


class NonFiniteError(UserError):
    """NaN or Inf found in a batch or in the loss."""


# Exit status of a run stopped by SIGUSR1/SIGTERM after writing its checkpoint: EX_TEMPFAIL of
# sysexits.h ("try again later"); submit_pm.sh requeues the job on it.
EXIT_PREEMPTED = 75


# exit status of a command stopped by Ctrl-C (128 + SIGINT), as shells report it
EXIT_INTERRUPTED = 130


# Exit status of a run stopped because a GPU ran out of memory (every rank: see OutOfMemory), so
# scripts can tell it from other errors (2) and retry with a smaller batch.
EXIT_OUT_OF_MEMORY = 3


class OutOfMemory(UserError):
    """A device ran out of memory: the message names the rank, phase, batch, figures and remedies;
    exit EXIT_OUT_OF_MEMORY."""


def failure_status(exc: BaseException) -> int:
    """The exit status a rank's failure ``exc`` gives every rank of the job: :data:`EXIT_OUT_OF_MEMORY`
    for :class:`OutOfMemory`, :data:`EXIT_INTERRUPTED` for a ``KeyboardInterrupt`` (a second Ctrl-C stops the
    job, not a failure of it), else 2."""
    if isinstance(exc, KeyboardInterrupt):
        return EXIT_INTERRUPTED
    return EXIT_OUT_OF_MEMORY if isinstance(exc, OutOfMemory) else 2


class Preempted(Exception):
    """The run stopped on a signal after checkpointing: the message is printed, exit EXIT_PREEMPTED."""


class Stopped(BaseException):
    """A signal stopped a command that keeps no state to go on from (``evaluate.py``, the tools) at once: raised
    from the signal handler (:class:`utils.core.signals.StopOnSignal`), a ``BaseException`` so that no ``except
    Exception`` on the way swallows it, while every atomic write under way removes its temporary file. The
    message is printed, exit :data:`EXIT_PREEMPTED` (the same command does the work again)."""


def one_line(exc: BaseException | str) -> str:
    """``exc``'s message on one line (library messages may hold newlines)."""
    return " ".join(str(exc).split())


def exit_status(main, *args, **kwargs) -> int:
    """Run ``main(*args, **kwargs)`` for a command-line entry point: exit status ``main``'s when it returns an
    ``int`` (a launcher passing its workers' on), else 0 (also after
    :class:`NothingToDo`, whose message goes to stdout), :data:`EXIT_PREEMPTED` after
    :class:`Preempted` (message to stdout), or :func:`failure_status` (2, or :data:`EXIT_OUT_OF_MEMORY`)
    with ``error: <message>`` on stderr (no traceback) for a :class:`UserError`."""
    try:
        status = main(*args, **kwargs)
        return status if type(status) is int else 0
    except NothingToDo as exc:
        print(exc, flush=True)
        return 0
    except Preempted as exc:
        if str(exc):  # rank 0 speaks for the job
            print(exc, flush=True)
        return EXIT_PREEMPTED
    except UserError as exc:
        print(f"error: {one_line(exc)}", file=sys.stderr, flush=True)  # always one line
        return failure_status(exc)


def run_cli(main: Callable[[list[str]], object], argv: list[str] | None = None) -> int:
    """Run a command-line entry point ``main(argv)`` (default ``sys.argv[1:]``) and return its exit status:
    :func:`exit_status`'s, :data:`EXIT_INTERRUPTED` after Ctrl-C, 0 when the reader of a pipe closed early
    (``--help | head``), 1 with a traceback for a bug.

    A failed rank of a multi-process job exits at once (``os._exit``), without tearing down a process
    group whose peers may be gone.
    """
    try:
        status = exit_status(main, sys.argv[1:] if argv is None else argv)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        status = EXIT_INTERRUPTED
    except Stopped as exc:
        print(exc, flush=True)
        status = EXIT_PREEMPTED
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        status = 0
    except Exception:
        import traceback
        traceback.print_exc()
        status = 1
    dist = sys.modules.get("torch.distributed")  # imported by the entry point if it uses it
    if status and dist is not None and dist.is_available() and dist.is_initialized():
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)
    return status


def free_space(directory) -> str:
    """``"N GiB free there"`` for the message of a failed write (full disk, quota)."""
    import shutil
    try:
        return f"{shutil.disk_usage(directory).free / 2**30:.2f} GiB free there"
    except OSError:
        return "free space unknown"


def closest(name: str, valid) -> str:
    """``"; did you mean a, b?"`` for the nearest of ``valid`` to ``name``, or ``""``."""
    near = difflib.get_close_matches(name, list(valid), n=3, cutoff=0.5)
    return f"; did you mean {', '.join(near)}?" if near else ""


def note_repeated(given: dict[str, list[str]]) -> None:
    """One ``note:`` line on stderr for each option given more than once with different values (``given``: option ->
    its values in order), since only the last is used: ``note: --lr given twice (1e-3, then 2e-3); using 2e-3``. Rank
    0 of a launched job speaks for every rank (they parse the same command line); before any process group exists
    the launcher's variables say which rank this is."""
    if os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")) != "0":
        return
    for flag, values in given.items():
        if len(set(values)) > 1:
            times = "twice" if len(values) == 2 else f"{len(values)} times"
            print(f"note: {flag} given {times} ({', then '.join(values)}); using {values[-1]}", file=sys.stderr,
                  flush=True)


def option_values(parser: argparse.ArgumentParser, argv: list[str]) -> dict[str, list[str]]:
    """The values each option of ``parser`` that keeps one value (``store``, torchrun's ``env``) takes in ``argv``, in
    order, by its longest name: what :func:`note_repeated` reads. Flags, ``append`` and ``count`` options are left
    out (a repeat adds, or sets the same value); so is everything after the first positional argument of a parser
    whose positional takes the rest (torchrun's script and its arguments)."""
    rest = any(a.nargs == argparse.REMAINDER for a in parser._actions if not a.option_strings)
    given: dict[str, list[str]] = {}
    i = 0
    while i < len(argv) and argv[i] != "--" and not (rest and not argv[i].startswith("-")):
        flag, eq, value = argv[i].partition("=")
        action = parser._option_string_actions.get(flag)
        i += 1
        if action is None or action.nargs == 0 or isinstance(action, argparse._AppendAction):
            continue  # a positional, a flag, help, or an option whose repeats add up
        if not eq:  # the value is the next arguments: one, or as many as nargs takes, up to the next option
            count = action.nargs if isinstance(action.nargs, int) else 1 if action.nargs in (None, "?") else len(argv)
            taken = list(itertools.takewhile(lambda a: not a.startswith("--"), argv[i:i + count]))
            value, i = " ".join(taken), i + len(taken)
        given.setdefault(max(action.option_strings, key=len), []).append(value)
    return given


class ArgumentParser(argparse.ArgumentParser):
    """The parser of every command line but the config's: an ``argparse.ArgumentParser`` that takes no
    abbreviated option (``--lead_step`` is not ``--lead_steps``: an abbreviation would silently change when an
    option is added) and whose errors are one line like every other bad input: ``error: <message>; see --help``
    on stderr and exit status 2, naming the closest options of an unknown one, as ``train.py`` does (argparse's
    own prints a usage line first, and its ``prog: error:`` prefix differs from the entry points'); an option given
    twice with different values takes the last with a note saying so (:func:`note_repeated`), as ``train.py``'s."""

    def __init__(self, *args, **kwargs):
        self.argv: list[str] = []
        super().__init__(*args, **{**kwargs, "allow_abbrev": False})

    def parse_known_args(self, args=None, namespace=None):
        self.argv = list(sys.argv[1:] if args is None else args)
        note_repeated(option_values(self, self.argv))
        return super().parse_known_args(args, namespace)

    def error(self, message: str):
        # an unknown option first: it explains the rest (a misspelt required option is "required" too)
        flags = [f for f in self._option_string_actions if f not in ("-h", "--help")]  # groups' options too
        unknown = [a for a in self.argv if a.startswith("--") and a.split("=")[0] not in (*flags, "--help")]
        if unknown:
            message = f"unrecognized arguments: {' '.join(unknown)}" + "".join(
                closest(a.split("=")[0], flags) for a in unknown)
        self.exit(2, f"error: {message}; see --help\n")


class UnsafeCheckpoint(UserError):
    """A checkpoint file holds something that loading would have to run: it is refused, nothing is loaded."""
