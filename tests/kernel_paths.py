"""The two kernel paths a quantized model runs on: kvsnap's own (``kvsnap.models.qkernel``) and torch's
(what runs with ``KVSNAP_QKERNEL=0``, without a compiler or AVX2). ``on_path`` switches in-process: a
model quantized inside it keeps the kernels it was given for good, so one test run covers both."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from unittest import mock

import pytest

from kvsnap.models import qkernel

PATHS = ["kvsnap", "torch"]


@contextlib.contextmanager
def on_path(path: str) -> Iterator[None]:
    """Quantize on ``path``'s kernels: ``torch`` hides kvsnap's library as ``KVSNAP_QKERNEL=0`` does;
    ``kvsnap`` skips where the library cannot be built (its products do not exist there)."""
    if path == "torch":
        with mock.patch.object(qkernel, "library", return_value=None):
            yield
        return
    if qkernel.library() is None:
        pytest.skip(f"no kvsnap kernel here: {qkernel.unavailable_reason()}")
    yield
