"""The vLLM connector's scheduler-side bookkeeping (kvsnap/integrations/vllm.py): which tokens of a
request to load from the block store into which of vLLM's blocks, and which new full blocks to save
after each step. Plain values and arithmetic: no vLLM, no torch, no files, so it is tested without an
engine.

Two block sizes meet here. vLLM's paged KV cache comes in blocks of ``vllm_block_size`` tokens
(``block_ids``: a request's vLLM blocks in order, from its first token); the store keeps blocks of
``block_size`` tokens, a multiple of it, keyed by kvsnap's chain. A load covers whole vLLM blocks
(vLLM's scheduler counts computed tokens in them), from where vLLM's own prefix cache stops to the end
of the store's match, and never the prompt's last token: vLLM computes that one to get the first
logits. A save covers whole store blocks of the prompt once vLLM has computed them, so a prompt
prefilled in chunks is saved chunk by chunk and a request that ends early keeps what it computed.
Tokens generated after the prompt are not saved: the next turn's prompt holds them and saves them then.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class LoadSpec:
    """Copy tokens ``[start, end)`` of a request from the store into its vLLM blocks."""

    req_id: str
    namespace: str
    token_ids: tuple[int, ...]  # the prompt up to the end of the last store block the load reads
    start: int  # both multiples of the vLLM block size
    end: int
    block_ids: tuple[int, ...]  # the request's vLLM blocks from its first token, covering [0, end)


@dataclass(frozen=True, slots=True)
class SaveSpec:
    """Store the whole blocks of ``token_ids`` that the store lacks, from the request's vLLM blocks.

    The saver asks the store what it lacks when it saves (another engine may have saved some blocks
    since, or the budget evicted some): every block of ``token_ids`` is in vLLM's cache to copy from.
    """

    req_id: str
    namespace: str
    token_ids: tuple[int, ...]  # the prompt up to the end of the block this step completed (whole store blocks)
    block_ids: tuple[int, ...]  # the request's vLLM blocks covering [0, len(token_ids))


@dataclass(frozen=True, slots=True)
class ScheduledRequest:
    """One request of a vLLM step, as the scheduler's output describes it."""

    req_id: str
    num_computed: int  # tokens computed before this step (loaded ones included)
    num_scheduled: int  # tokens this step computes
    block_ids: Sequence[int] | None  # new requests and resumed ones: all their blocks; others: the new ones
    all_blocks: bool


@dataclass(slots=True)
class _Request:
    token_ids: tuple[int, ...]
    namespace: str
    saved: int  # prompt tokens from the first that the store holds (whole store blocks)
    block_ids: list[int]
    load: tuple[int, int] | None = None  # (start, end), from allocation to the step that loads it


@dataclass(frozen=True, slots=True)
class _Lookup:
    token_ids: tuple[int, ...]
    namespace: str
    stored: int  # prompt tokens stored, whoever made them
    start: int  # what vLLM holds already: a load starts there


class Planner:
    """Per-request state from the first lookup to ``finish``, and each step's loads and saves."""

    def __init__(self, block_size: int, vllm_block_size: int):
        if block_size <= 0 or vllm_block_size <= 0 or block_size % vllm_block_size:
            raise ValueError(f"store block size {block_size} is not a multiple of vLLM's {vllm_block_size}")
        self.block_size = block_size
        self.vllm_block_size = vllm_block_size
        self._requests: dict[str, _Request] = {}
        self._lookups: dict[str, _Lookup] = {}

    def matched(
        self,
        req_id: str,
        token_ids: Sequence[int],
        namespace: str,
        stored_blocks: int,
        num_computed: int,
    ) -> int:
        """Tokens to load beyond ``num_computed`` (what vLLM holds, whole vLLM blocks): the
        ``stored_blocks`` store blocks found, up to the last whole vLLM block before the prompt's last
        token. vLLM may ask again before it allocates: the last answer counts."""
        vbs = self.vllm_block_size
        end = min(stored_blocks * self.block_size, (len(token_ids) - 1) // vbs * vbs)
        stored = min(stored_blocks, len(token_ids) // self.block_size) * self.block_size
        self._lookups[req_id] = _Lookup(tuple(token_ids), namespace, stored, num_computed)
        return max(0, end - num_computed)

    def allocated(self, req_id: str, block_ids: Sequence[int], num_external: int) -> None:
        """vLLM gave the request ``block_ids`` (all of them, from its first token) and counts
        ``num_external`` tokens as loaded by the next step."""
        lookup = self._lookups.pop(req_id, None)
        if lookup is None:
            return  # not looked up (a prompt shorter than a block, or the store failed): nothing to do
        req = self._requests.get(req_id)
        if req is None:
            req = self._requests[req_id] = _Request(lookup.token_ids, lookup.namespace, lookup.stored, [])
        req.saved = max(req.saved, lookup.stored)
        req.block_ids = list(block_ids)
        req.load = (lookup.start, lookup.start + num_external) if num_external > 0 else None

    def step(self, scheduled: Sequence[ScheduledRequest]) -> tuple[list[LoadSpec], list[SaveSpec]]:
        """This step's loads (before the forward) and saves (after it)."""
        bs, vbs = self.block_size, self.vllm_block_size
        loads: list[LoadSpec] = []
        saves: list[SaveSpec] = []
        for s in scheduled:
            req = self._requests.get(s.req_id)
            if req is None:
                continue
            if s.block_ids is not None:
                req.block_ids = list(s.block_ids) if s.all_blocks else req.block_ids + list(s.block_ids)
            if req.load is not None:
                start, end = req.load
                req.load = None
                read_to = -(-end // bs) * bs
                loads.append(
                    LoadSpec(
                        s.req_id, req.namespace, req.token_ids[:read_to], start, end, tuple(req.block_ids[: end // vbs])
                    )
                )
            done = min(s.num_computed + s.num_scheduled, len(req.token_ids)) // bs * bs
            if done > req.saved and len(req.block_ids) * vbs >= done:
                saves.append(
                    SaveSpec(s.req_id, req.namespace, req.token_ids[:done], tuple(req.block_ids[: done // vbs]))
                )
                req.saved = done
        return loads, saves

    def finish(self, req_id: str) -> None:
        self._requests.pop(req_id, None)
        self._lookups.pop(req_id, None)

    @property
    def num_requests(self) -> int:
        return len(self._requests) + len(self._lookups)
