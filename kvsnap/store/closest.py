"""The stored prefix a prompt comes closest to, by token ids, in every chain of a block index. No files, no torch.

A run looks its prompt up in one chain (its model, namespace and block size) and by hash; to explain
a miss (``kvsnap.engine.explain_sources.against_store``) every chain is searched by token ids instead, so a prefix
stored under another namespace, block size or model is found too, and can be named as the reason.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvsnap import prefix

if TYPE_CHECKING:
    from kvsnap.store.index import BlockIndex
    from kvsnap.store.records import ChainInfo


@dataclass(frozen=True, slots=True)
class Closest:
    """The stored prefix a prompt comes closest to: its chain, the path's tokens and what follows them."""

    root: bytes
    tokens: list[int]  # the matching blocks, then the nearest stored block after them and one below it
    matched_blocks: int  # blocks equal to the prompt's, from the first
    last_hash: bytes | None = None  # of the last matching block
    made_by: list[str] = field(default_factory=list)  # provenance texts along the matching path


def closest_in_store(
    index: BlockIndex, prompt_ids: Sequence[int], prefer: Callable[[ChainInfo], bool] | None = None
) -> Closest | None:
    """The stored chain and path sharing the most leading tokens with the prompt (by token ids, in every
    chain: another namespace or block size is still found, to say so); on a tie, a chain ``prefer``
    accepts (the one a run would use: it must not be blamed on a namespace that another chain has).
    None for an empty store."""
    best: tuple[tuple[int, bool], Closest] | None = None
    for root, chain in sorted(index.chains.items()):
        found = _walk(index, root, chain.block_size, list(prompt_ids))
        score = (prefix.common_prefix_len(prompt_ids, found.tokens), bool(prefer and prefer(chain)))
        if best is None or score > best[0]:
            best = (score, found)
    return best[1] if best is not None else None


def _walk(index: BlockIndex, root: bytes, bs: int, prompt_ids: list[int]) -> Closest:
    path: list[int] = []
    made_by: list[str] = []
    parent, last = root, None
    while True:
        kids = sorted((index.blocks[h] for h in index.children.get(parent, ()) if index.blocks[h].full),
                      key=lambda r: r.token_ids)  # fmt: skip
        want = tuple(prompt_ids[len(path) : len(path) + bs])
        exact = next((r for r in kids if r.token_ids == want), None)
        if exact is None:
            break
        path += exact.token_ids
        made_by.append(exact.made_by)
        parent = last = exact.hash
    tokens = list(path)
    if kids:
        near = max(kids, key=lambda r: prefix.common_prefix_len(r.token_ids, want))
        tokens += near.token_ids
        below = sorted((index.blocks[h] for h in index.children.get(near.hash, ())), key=lambda r: r.token_ids)
        if below:
            tokens += below[0].token_ids  # context after a divergence at the end of the near block
    return Closest(root, tokens, len(path) // bs, last, made_by)
