"""One error type for every user mistake, so the CLI can print one line and exit 2."""


class SpecError(ValueError):
    """A user input is wrong; `field` names where (a dotted spec path, a file, a flag)."""

    def __init__(self, field: str, reason: str):
        super().__init__(f"{field}: {reason}")
        self.field = field
        self.reason = reason


class CapabilityError(SpecError):
    """A well-formed layout that the chosen engine cannot run (its adapter's ENGINE.capabilities): a
    comparison shows it as a dash with this reason rather than refusing the whole spec."""


class StoreError(SpecError):
    """The results store cannot be read or written: a missing, foreign, newer or read-only file,
    or a write that failed (a full disk); printed as `error: store: <reason>`."""

    def __init__(self, reason: str):
        super().__init__("store", reason)
