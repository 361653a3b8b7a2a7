"""Errors for expected bad input: the entry points print them as one line and exit non-zero."""


class UserError(Exception):
    """Bad input from the user (config, data, environment). The message names the problem and the fix."""


class NonFiniteError(UserError):
    """NaN or Inf found in a batch or in the loss."""


def exit_status(main, *args, **kwargs) -> int:
    """Run ``main(*args, **kwargs)`` for a command-line entry point: exit status 0, or 2 with
    ``error: <message>`` on stderr (no traceback) for a :class:`UserError`."""
    import sys
    try:
        main(*args, **kwargs)
        return 0
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return 2
