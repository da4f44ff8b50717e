"""Errors that end a command: each carries its exit code and the next step to take."""

# Exit codes (documented in the README).
OK = 0
PENDING = 1  # apply --dry-run: changes pending; verify: a check failed
USAGE = 2  # bad input: unknown or mismatched version, unknown transform, bad flag
TARGET = 3  # no vLLM, ambiguous, editable install, read-only tree
DRIFT = 4  # a file is not what we expect (hand edit, other version): nothing written
LOCKED = 5  # another ddtree-patch run holds the lock
TRANSFORM = 6  # a transform failed (anchor not found exactly once): nothing written
IO = 7  # a write failed; the run was rolled back
VERIFY = 8  # verify failed after apply; the patch was reverted


class PatchError(Exception):
    """A failure the user can act on."""

    def __init__(self, message: str, code: int, hint: str = "", details=None):
        super().__init__(message)
        self.message = message
        self.code = code
        self.hint = hint
        self.details = details or []

    def to_dict(self) -> dict:
        return {"message": self.message, "exit_code": self.code, "hint": self.hint,
                "details": self.details}
