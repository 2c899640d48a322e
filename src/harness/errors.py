"""One exception type for problems a user can fix.

The CLI prints ``error: <message>`` on one line and exits with status 2; the message names the
problem and the fix.
"""


class HarnessError(Exception):
    """A user-facing problem (bad input, missing file, unsupported option) with its fix."""

    def __init__(self, problem: str, fix: str | None = None):
        self.problem = problem
        self.fix = fix
        super().__init__(f"{problem}; fix: {fix}" if fix else problem)
