"""One error type for every user mistake, so the CLI can print one line and exit 2."""

import reprlib

FIELD_MAX, REASON_MAX = 200, 1000  # characters: a message quotes what the user gave, which can be megabytes

_SHORT = reprlib.Repr()  # (keyword arguments only from Python 3.12)
_SHORT.maxlevel, _SHORT.maxstring, _SHORT.maxlong, _SHORT.maxother = 3, 80, 40, 80
_SHORT.maxtuple = _SHORT.maxlist = _SHORT.maxdict = _SHORT.maxset = _SHORT.maxfrozenset = _SHORT.maxdeque = 6


def shown(value) -> str:
    """A value as an error message quotes it: its repr, cut short (a list of a million items is not
    repeated whole)."""
    return _SHORT.repr(value)


def cut(text: str, limit: int) -> str:
    """`text` within `limit` characters: its start and end, and how much was left out between."""
    if len(text) <= limit:
        return text
    keep = (limit - 40) // 2
    return f"{text[:keep]} ...[{len(text) - 2 * keep:,} characters cut]... {text[-keep:]}"


class SpecError(ValueError):
    """A user input is wrong; `field` names where (a dotted spec path, a file, a flag). Both are cut
    to a length a terminal shows (whatever value a check quoted), so the error stays one short line."""

    def __init__(self, field: str, reason: str):
        field, reason = cut(str(field), FIELD_MAX), cut(str(reason), REASON_MAX)
        super().__init__(f"{field}: {reason}")
        self.field = field
        self.reason = reason


class SpecErrors(SpecError):
    """Every mistake a check found in one input (a ds_config's every contradiction), so that a user
    fixes them in one go: the CLI prints one `error: <field>: <reason>` line for each, exit code 2."""

    def __init__(self, errors: list[SpecError]):
        super().__init__(errors[0].field, errors[0].reason)
        self.errors = list(errors)

    def __str__(self) -> str:
        return "\n".join(f"{e.field}: {e.reason}" for e in self.errors)


def raise_all(errors: list[SpecError]) -> None:
    """Raise the one error, or all of them at once (SpecErrors); nothing when the list is empty."""
    if len(errors) == 1:
        raise errors[0]
    if errors:
        raise SpecErrors(errors)


class CapabilityError(SpecError):
    """A well-formed layout that the chosen engine cannot run (its facts: harness.registry.EngineFacts): a
    comparison shows it as a dash with this reason rather than refusing the whole spec."""


class StoreError(SpecError):
    """The results store cannot be read or written: a missing, foreign, newer or read-only file,
    or a write that failed (a full disk); printed as `error: store: <reason>`."""

    def __init__(self, reason: str):
        super().__init__("store", reason)


class StoreWriteError(StoreError):
    """A record the store could not take after the work was done (a full disk): a fault, not a mistake in
    the input, so the CLI exits 74 (sysexits' EX_IOERR) rather than 2; the record waits in a fallback file
    that the next command opening the store merges back."""


class NonFiniteStep(ArithmeticError):
    """An engine found a step's gradients non-finite and its framework skipped or refused the update
    (DeepSpeed's skipped step, Megatron's unsuccessful one). The reference never skips, so the
    runner records the run as diverged at that step, as it does for a non-finite loss (harness.run)."""
