"""Who computed a store's blocks: ``kvsnap store stats`` counts blocks per maker, so blocks that vLLM
made (kvsnap/integrations/vllm.py) and blocks that kvsnap made are told apart in one store."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from kvsnap import provenance
from kvsnap.hashing import chain_hashes, chain_root, checksum
from kvsnap.store import BlockStore, ChainInfo
from kvsnap.types import EncodedBlock, KVLayout
from kvsnap_cli.main import app

LAYOUT = KVLayout(2, 1, 4, "float32")
BS = 4
KVSNAP = {"kvsnap": "0.1.0", "torch": "2.13.0", "transformers": "5.24.0", "forward": "native", "device": "cpu"}
VLLM = {"kvsnap": "0.1.0", "torch": "2.13.0", "vllm": "0.32.0", "forward": "vllm", "attention": "CPU_ATTN/vec"}
VLLM = {**VLLM, "device": "cpu"}


def put(store: BlockStore, fingerprint: str, tokens: list[int], made_by: dict[str, str]) -> None:
    root = chain_root(fingerprint, "", BS)
    blocks = []
    for i, h in enumerate(chain_hashes(tokens, BS, root)):
        raw = bytes([i + 1]) * (BS * LAYOUT.bytes_per_token)
        blocks.append(EncodedBlock(BS, h, len(raw), raw, checksum(raw)))
    chain = ChainInfo(root, fingerprint, fingerprint, LAYOUT, BS)
    store.put(chain, tokens, blocks, codec="raw", made_by=provenance.encode(made_by))


def test_stats_count_blocks_per_maker(tmp_path):
    store = BlockStore(tmp_path / "store")
    put(store, "model", list(range(8)), KVSNAP)  # 2 blocks
    put(store, "model+vllm", list(range(12)), VLLM)  # 3 blocks, a chain of their own
    makers = store.stats()["made_by"]
    assert [(m["blocks"], m["made_by"]) for m in makers] == [(3, VLLM), (2, KVSNAP)]
    assert makers[0]["bytes"] == 3 * BS * LAYOUT.bytes_per_token

    out = " ".join(CliRunner().invoke(app, ["store", "stats", str(tmp_path / "store")]).stdout.split())
    assert "vLLM 0.32.0 (CPU_ATTN/vec attention), kvsnap 0.1.0, torch 2.13.0 on cpu" in out
    assert "2 blocks (512 B): kvsnap 0.1.0, torch 2.13.0, transformers 5.24.0 (native forward) on cpu" in out
    data = json.loads(CliRunner().invoke(app, ["store", "stats", str(tmp_path / "store"), "--json"]).stdout)
    assert data["made_by"][0]["made_by"]["vllm"] == "0.32.0"


def test_vllm_made_kv_differs_from_kvsnaps_own_forward():
    """kvsnap's resume spot-checks KV another engine made, as it does for another library version."""
    running = {**KVSNAP}
    assert provenance.differences(provenance.encode(VLLM), running) == ["forward vllm -> native"]
    assert provenance.parse(provenance.encode(VLLM)) == VLLM
    assert provenance.differences(provenance.encode(VLLM), VLLM) == []
