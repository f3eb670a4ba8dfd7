"""The one exception type for bad user input.

Anything a user can fix (a missing file, a malformed corpus, an unknown config key) raises
`UserError` with a one-line message naming the file and the fix; the CLI prints it as
`error: ...` and exits with EXIT_USER_ERROR, never with a traceback.
"""

EXIT_USER_ERROR = 2
EXIT_COLLECTIVE_TIMEOUT = 3  # a distributed collective waited longer than parallel.timeout_s


class UserError(Exception):
    pass
