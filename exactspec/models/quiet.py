"""Quiet loading: exactspec's own progress bars only on a terminal (`progress_off`), and
transformers' bars, log lines and warnings silenced (`quiet_transformers`); used by loading
and GGUF conversion, re-exported by exactspec.models.loading."""

from __future__ import annotations

import contextlib
import functools
import os
import warnings
from collections.abc import Iterator
from unittest import mock

from tqdm.auto import tqdm
from transformers.utils import logging as hf_logging


def progress_off() -> bool | None:
    """tqdm's `disable` for exactspec's own progress bars: on stderr, only on a terminal.

    $EXACTSPEC_PROGRESS=1 forces them on (`exactspec --progress`), 0 off; unset, None lets
    tqdm show them only when stderr is a terminal.
    """
    flag = os.environ.get("EXACTSPEC_PROGRESS", "")
    return {"1": False, "0": True}.get(flag.strip())


@contextlib.contextmanager
def quiet_transformers(gguf: bool = False) -> Iterator[None]:
    """Silence transformers' progress bars ("Loading weights"), log lines and warnings inside.

    `gguf`: also its GGUF reader's bar, which ignores the switch (importing that reader costs
    0.16 s, so only conversions ask). The previous settings are restored on exit; exactspec's
    own diagnostics still go through `logging` (-v shows them).
    """
    bars, verbosity = hf_logging.is_progress_bar_enabled(), hf_logging.get_verbosity()
    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    try:
        with contextlib.ExitStack() as stack:
            stack.enter_context(warnings.catch_warnings())
            warnings.simplefilter("ignore")
            if gguf:
                import transformers.modeling_gguf_pytorch_utils as reader

                stack.enter_context(mock.patch.object(reader, "tqdm",
                                                      functools.partial(tqdm, disable=True)))
            yield
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()
