"""Errors that end a command: each carries its exit code and the next step to take."""

# Exit codes.  CODES is the documented table (docs/cli.md, `--help`).
OK = 0
PENDING = 1  # apply --dry-run: changes pending; verify: a check failed
USAGE = 2  # bad input: version, transform, flags, --python / --site-packages
TARGET = 3  # no vLLM, ambiguous, editable, read-only, linked file, RECORD, incomplete, state
DRIFT = 4  # a file or the saved state is not what we expect: nothing written
LOCKED = 5  # another ddtree-patch run holds the lock on the target
TRANSFORM = 6  # a transform failed (anchor not found exactly once): nothing written
IO = 7  # a write failed; the run was rolled back
VERIFY = 8  # verify failed after apply; what that apply wrote was reverted
INTERNAL = 9  # a bug: unexpected error (DDTREE_PATCH_DEBUG=1 shows the traceback)
INTERRUPTED = 130  # SIGINT (Ctrl-C), after a write in progress was rolled back
TERMINATED = 143  # SIGTERM, likewise

CODES = {
    OK: "ok",
    PENDING: "`apply --dry-run`: changes pending; `verify`: a check failed",
    USAGE: "bad input: unknown, unsupported or mismatched version, unknown transform, "
           "contradictory flags, an unusable `--python` / `--site-packages`, a usage error",
    TARGET: "target problem: no vLLM, two of them, editable install, read-only tree, "
            "symlinked file, missing/unreadable RECORD, a file to edit missing from the "
            "install, unusable state folder",
    DRIFT: "drift: a file differs from what was expected, or the saved state belongs to "
           "another install, cannot be read or names a path outside vLLM or the state "
           "folder (nothing written); `status`: needs action; `revert`: RECORD check "
           "failed; `forget`: vLLM files still hold the patch",
    LOCKED: "another ddtree-patch run holds the lock on this vLLM",
    TRANSFORM: "a transform's anchor was not found exactly once (nothing written)",
    IO: "a write failed; everything was rolled back",
    VERIFY: "verify failed after apply; what that apply wrote was reverted",
    INTERNAL: "internal error (a bug; nothing is written after it, `recover` undoes a "
              "half-done run)",
    INTERRUPTED: "interrupted by SIGINT (Ctrl-C); a write in progress was rolled back first",
    TERMINATED: "terminated by SIGTERM; a write in progress was rolled back first",
}


class Terminated(BaseException):
    """SIGTERM, raised like KeyboardInterrupt so that a write in progress rolls back."""


def interruption(exc: BaseException) -> tuple[int, str] | None:
    """An interruption's exit code (128 + the signal) and what happened, or None."""
    if isinstance(exc, KeyboardInterrupt):
        return INTERRUPTED, "interrupted by SIGINT (Ctrl-C)"
    if isinstance(exc, Terminated):
        return TERMINATED, "terminated by SIGTERM"
    return None


class PatchError(Exception):
    """A failure the user can act on: message, exit code, the next step (``hint``)."""

    def __init__(self, message: str, code: int, hint: str = "", details=None):
        super().__init__(message)
        assert code in CODES and code != OK, code
        self.message = message
        self.code = code
        self.hint = hint
        self.details = details or []

    def to_dict(self) -> dict:
        return {"message": self.message, "exit_code": self.code, "hint": self.hint,
                "details": self.details}
