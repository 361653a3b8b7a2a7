"""How checkpoint files are written: DCP's file writer, made to fail when one of its threads fails."""

from __future__ import annotations

import threading

import torch.distributed.checkpoint as dcp

from distributed.checkpoint.files import os_error

WRITE_THREADS = 8  # per rank


class CheckedWriter(dcp.FileSystemWriter):
    """DCP's ``FileSystemWriter`` that fails when one of its writer threads fails.

    Its threads' exceptions (a full disk, say) only reach ``threading.excepthook``, which prints
    a traceback, and the items they were writing are just missing from the results: DCP would
    then write the metadata of an incomplete checkpoint. Here the thread's exception is kept
    (not printed) and raised from ``write_data``, so the save fails like a one-thread save.

    Raises:
        OSError: a writer thread's failure, or the OSError behind it (a full disk).
    """

    def write_data(self, plan, planner):
        failures: list[BaseException] = []
        previous = threading.excepthook

        def keep(args) -> None:
            if _is_writer_thread(args.thread):
                failures.append(args.exc_value)
            else:
                previous(args)
        threading.excepthook = keep
        try:
            written = super().write_data(plan, planner)
        except (OSError, RuntimeError) as exc:
            failures.insert(0, exc)
        finally:
            # a failure in the calling thread returns before DCP joins its threads: join them here,
            # while their failures are still kept, not printed
            for thread in filter(_is_writer_thread, threading.enumerate()):
                thread.join()
            threading.excepthook = previous
        if failures:
            # DCP pickles each rank's exception to gather them, which drops ``__context__``: raise the
            # OSError behind the zip writer's "unexpected pos" RuntimeError so the reason survives
            raise os_error(failures[0]) or failures[0]
        if len(written.wait()) != len(plan.items):  # a thread ended without an exception we saw
            raise OSError(f"DCP wrote {len(written.wait())} of {len(plan.items)} items")
        return written


def _is_writer_thread(thread: threading.Thread | None) -> bool:
    """One of the threads ``FileSystemWriter.write_data`` starts (named after their target)."""
    return thread is not None and "_write_files_from_queue" in thread.name
