"""Exceptions the CLI turns into one line: problems a user can fix, and runs that ended early.

The CLI prints ``error: <message>`` on one line and exits with status 2; the message names the
problem and the fix.
"""


class HarnessError(Exception):
    """A user-facing problem (bad input, missing file, unsupported option) with its fix."""

    def __init__(self, problem: str, fix: str | None = None):
        self.problem = problem
        self.fix = fix
        super().__init__(f"{problem}; fix: {fix}" if fix else problem)


class RunStopped(Exception):
    """A run that ended early, its directory already closed (status, error, marker file): the one
    line the CLI prints on stderr and the process exit code (2 user error, 1 internal or write
    error, 128 + signal number when interrupted)."""

    def __init__(self, line: str, exit_code: int, run_dir=None):
        self.line = line
        self.exit_code = exit_code
        self.run_dir = run_dir
        super().__init__(line)
