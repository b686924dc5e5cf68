"""Bad input to the ``lit_thresh`` command: one clear message, a non-zero exit, no file written over.

Parse errors (malformed YAML, an unknown key, a wrong type, an unknown class) come from the parser,
:class:`Parser`: a one-line usage, the error naming the key, exit status 2. Errors found once the config
is parsed (a model or data argument the classes refuse, a missing data file, a ``ckpt_path`` that is
absent or of another model) are ValueError / TypeError / OSError raised while the classes are built,
before the run writes anything (those a ``setup`` hook finds come once the run's new ``version_N``
directory exists); :func:`exit_on_input_error` turns them into ``lit_thresh: error: <message>`` and exit
status 1. ``LIT_THRESH_TRACEBACK=1`` shows the traceback instead.
"""

import inspect
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, NoReturn

import yaml
from lightning.pytorch.cli import LightningArgumentParser

from lit_thresh import attention

TRACEBACK_ENV = "LIT_THRESH_TRACEBACK"
# What bad input raises: the argument checks of the package (ValueError / TypeError, naming the
# argument) and the file system (OSError: a missing data file or checkpoint); and NaNGuard's stop at a
# non-finite loss (FloatingPointError, naming the step). Anything else (a RuntimeError, an IndexError,
# ...) is a bug and keeps its traceback.
INPUT_ERRORS = (ValueError, TypeError, OSError, FloatingPointError)


def one_line(message: str) -> str:
    """message with its line breaks and runs of spaces collapsed to single spaces."""
    return " ".join(message.split())


@contextmanager
def exit_on_input_error(prog: str = "lit_thresh") -> Iterator[None]:
    """Ends the program with ``<prog>: error: <message>`` on stderr and exit status 1 when the block raises
    one of INPUT_ERRORS, unless the environment sets LIT_THRESH_TRACEBACK (to anything but 0)."""
    try:
        yield
    except INPUT_ERRORS as err:
        if os.environ.get(TRACEBACK_ENV, "0") not in ("", "0"):
            raise
        while isinstance(err.__cause__, INPUT_ERRORS) and _raised_in(err, "jsonargparse"):
            err = err.__cause__  # a class's own error, that jsonargparse wrapped in the list of Union types tried
        sys.exit(f"{prog}: error: {one_line(str(err))}")


def _raised_in(err: BaseException, package: str) -> bool:
    """Whether err was raised by code of `package`."""
    tb = err.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return tb is not None and tb.tb_frame.f_globals.get("__name__", "").startswith(package)


def attention_variants() -> list[str]:
    """The attention classes lit_thresh ships, by the name `--model.config.attention` accepts."""
    classes = (getattr(attention, name) for name in attention.__all__)
    return [
        cls.__name__
        for cls in classes
        if isinstance(cls, type) and issubclass(cls, attention.Attention) and not inspect.isabstract(cls)
    ]


class Parser(LightningArgumentParser):
    """LightningArgumentParser whose errors stay short: a one-line usage instead of every option, a YAML
    syntax error that names its file, and an error about `model.config.attention` that lists the variants.
    Options must be spelt out: `--trainer.max_epoch` is an error, not `--trainer.max_epochs`."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def print_usage(self, file: Any = None) -> None:
        self._print_message(f"usage: {self.prog.replace(' [options]', '')} [options]\n", file)

    def error(self, message: str, ex: Exception | None = None) -> NoReturn:
        if '"model.config.attention"' in message:
            message += (
                f"\n  attention variants: {', '.join(attention_variants())} (lit_thresh.attention, or any "
                "import path of an Attention subclass); `--model.config.attention.help NAME` lists a variant's "
                "options"
            )
        super().error(message, ex)

    def parse_path(self, path: str | os.PathLike, *args: Any, **kwargs: Any) -> Any:
        """Parses a config file; one that is not valid YAML is reported by its name and line."""
        try:
            with open(path, encoding="utf-8") as stream:
                yaml.safe_load(stream)  # the error marks name the stream's file
        except yaml.YAMLError as err:
            self.error(f"{path} is not valid YAML: {one_line(str(err))}")
        except OSError:
            pass  # the parser reports a missing or unreadable file itself
        return super().parse_path(path, *args, **kwargs)
