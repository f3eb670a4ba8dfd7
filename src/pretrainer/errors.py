"""The one exception type for bad user input.

Anything a user can fix (a missing file, a malformed corpus, an unknown config key) raises
`UserError` with a one-line message naming the file and the fix; the CLI prints it as
`error: ...` and exits with EXIT_USER_ERROR, never with a traceback.
"""

# Exit codes (documented in the README):
#   0 success, 2 bad input, 3 a distributed collective timed out,
#   4 budget: projected total over the cap (a checkpoint was written), 5 budget: spent over the cap (no checkpoint),
#   128 + signal (143 SIGTERM, 130 SIGINT): stopped by a signal after writing a checkpoint; run the same command to resume
EXIT_USER_ERROR = 2
EXIT_COLLECTIVE_TIMEOUT = 3


class UserError(Exception):
    pass


class RunStopped(Exception):
    """Training stopped on purpose before max_steps (budget guard, signal); carries the exit code."""

    def __init__(self, message: str, exit_code: int):
        super().__init__(message)
        self.exit_code = exit_code
