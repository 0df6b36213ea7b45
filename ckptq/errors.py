"""Typed errors. Every message names the bad value and says how to fix it; the CLI maps each class to
one line and an exit code (see ``ckptq.cli``)."""


class CkptqError(Exception):
    """Base class of every error ckptq raises on purpose."""

    exit_code = 1


class UsageError(CkptqError):
    """A bad option value or a combination that cannot work."""

    exit_code = 2


class ArgumentError(UsageError, ValueError):
    """A bad optimizer argument or param group value. Also a ``ValueError``, so code written for
    ``torch.optim`` optimizers (``except ValueError``) catches it; the CLI still maps it to exit 2."""


class InputError(CkptqError):
    """The input is missing, unreadable, not a checkpoint, or needs unsafe unpickling."""

    exit_code = 3


class NothingToConvertError(InputError):
    """The input holds nothing ``convert`` would store: its state is converted already, or it holds no
    optimizer state (``convert --all`` passes over such checkpoints, naming ``reason`` for each)."""

    def __init__(self, message: str, reason: str = "nothing to convert"):
        super().__init__(message)
        self.reason = reason


class OutputExistsError(CkptqError):
    """The output path exists and ``force`` was not given."""

    exit_code = 4


class FormatError(CkptqError):
    """A converted file is truncated, corrupt, or of a version/codec this ckptq cannot decode."""

    exit_code = 5


class ReadbackError(FormatError):
    """A written output does not read back as what was meant (``--replace``); the output was removed and
    the original kept."""


class ChecksumError(FormatError):
    """A tensor's bytes do not match the checksum recorded when it was written."""


class StateMismatchError(CkptqError, ValueError):
    """An optimizer state dict does not fit the optimizer's parameters, or holds values it cannot use.
    Also a ``ValueError``, as torch's ``load_state_dict`` raises for a mismatched state dict."""

    exit_code = 6
