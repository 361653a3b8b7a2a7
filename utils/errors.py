"""Errors for expected bad input: the entry points print them as one line and exit non-zero."""


class UserError(Exception):
    """Bad input from the user (config, data, environment). The message names the problem and the fix."""


class NonFiniteError(UserError):
    """NaN or Inf found in a batch or in the loss."""
