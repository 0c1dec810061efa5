"""The PyTorch front end (the `torch` extra): capture, op table, module rewrite, `fold`/`inspect`.

Importing it without PyTorch raises `MissingExtraError`, one line naming `normpass[torch]`; the
ONNX path never imports this package.
"""

from ..errors import missing_extra

try:
    import torch  # noqa: F401
except ModuleNotFoundError as e:
    if e.name != "torch":  # torch is there but broken: its own error says more
        raise
    raise missing_extra(
        "the PyTorch front end (normpass.fold, normpass.inspect, normpass fold --torch)", "PyTorch", "torch"
    ) from None
