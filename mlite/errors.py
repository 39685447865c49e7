"""The one error type users see.

Every problem a user can fix (bad config key, impossible mesh, missing file, wrong tensor shape, corrupt
checkpoint) raises `MliteError` with one line that names the problem and the fix. The CLI and the Invoke
tasks print that line and exit with status 2, never a traceback.
"""

from __future__ import annotations

EXIT_USAGE = 2


class MliteError(Exception):
    """A user-fixable problem; `str(err)` is the single line printed to the user."""

    def __init__(self, message: str):
        super().__init__(" ".join(message.split()))  # always one line
