"""One typed hierarchy of normpass errors.

Every message names the model file or node concerned and says what to do; the CLI prints
`str(error)` as a single line and exits with `error.exit_code`.
"""

from __future__ import annotations


class NormpassError(Exception):
    """Base class of every error normpass raises on purpose."""

    exit_code = 1


class InputError(NormpassError):
    """The user's input (a path, a model file, an option) cannot be used as given."""

    exit_code = 2


class UnsupportedModelError(NormpassError):
    """The model is valid but uses something normpass cannot analyse."""

    exit_code = 2


class InputsRejectedError(UnsupportedModelError):
    """The model as given does not run on the inputs verification made for it (a shape it does not take):
    the user must give the input shapes."""


class WeightOverflowError(UnsupportedModelError):
    """A rewrite's new weights overflow their dtype (finite before, ±inf after): no model of that dtype
    computes the rewrite exactly, whether or not verification runs."""


class VerificationError(NormpassError):
    """A rewritten model does not match the original within the dtype's tolerance."""

    exit_code = 1


class InternalError(NormpassError):
    """normpass's own rewrite is at fault, whatever the input (a bug): one line naming what failed, exit 3
    as for any unexpected error (`cli/guard.py`), with nothing for the user to change but the report."""

    exit_code = 3


class MissingExtraError(InputError, ImportError):
    """A feature needs an optional dependency that is not installed; the message names the extra.

    An `ImportError`, so code that probes for optional features (`except ImportError`) works as
    with any missing module; an `InputError`, so the CLI prints its one line and exits 2.
    """


def missing_extra(feature: str, module: str, extra: str) -> MissingExtraError:
    """E.g. "normpass.fold needs PyTorch, which is not installed: pip install 'normpass[torch]'"."""
    return MissingExtraError(f"{feature} needs {module}, which is not installed: pip install 'normpass[{extra}]'")
