"""What a session holds, as the code that writes it out needs it: a snapshot file (``snapshot_save``)
or the block store (``store_save``). A value made by ``Session.contents``; the writers read it and
add to its ``encoded`` blocks, and change nothing else."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from kvsnap.engine.cache import KVCache
from kvsnap.engine.encoded import EncodedBlocks
from kvsnap.models.load import LoadedModel
from kvsnap.sealing import SealKey
from kvsnap.types import DROPPED_MESSAGES, BlockFormat, EncodedBlock


@dataclass(frozen=True, slots=True)
class Contents:
    lm: LoadedModel
    fmt: BlockFormat
    tokens: list[int]  # every token whose KV is in ``cache``
    cache: KVCache
    encoded: EncodedBlocks  # blocks encoded earlier, reused as they are
    last_logits: torch.Tensor | None  # after tokens[-1]
    messages: list[dict[str, str]] | None
    made_by: dict[str, Any] | None  # what computed the KV (kvsnap.engine.verify.recorded); None: unknown
    dropped_messages: int = 0  # of ``messages``, out of the model's view (kvsnap.types.chat_view)
    key: SealKey | None = None  # its .kv files are sealed with this (sealing.save_key); a plain store refuses it
    marks: dict[str, Any] | None = None  # where the chat's exchanges end, its pending ids (kvsnap.conversation)

    def extra(self) -> dict[str, Any]:
        """What a file or store session records beside the messages: how many are out of view, and
        where the exchanges end in the tokens."""
        dropped = {DROPPED_MESSAGES: self.dropped_messages} if self.dropped_messages else {}
        return {**dropped, **(self.marks or {})}

    def encode(self, tokens: list[int] | None = None, first: int = 0) -> tuple[list[EncodedBlock], int]:
        """Blocks ``first``.. of ``tokens`` (default: all) as stored, and how many had to be encoded now."""
        return self.encoded.encode(self.cache, self.tokens if tokens is None else tokens, self.fmt, first)

    def logits_array(self) -> np.ndarray | None:
        return self.last_logits.float().cpu().numpy() if self.last_logits is not None else None
