"""kvsnap's block store as vLLM's KV tier, with the real engine on this CPU (the default model).

Two rounds of engines, each in processes of their own (benchmarks/vllm_engine.py), run side by side
to keep the wall time down:
1. an engine without the connector answers the prompt and a question after it (the reference), while
   two engines with the connector answer other prompts into one store at the same time, one of them
   the prompt alone, two of them sharing its first blocks;
2. a fresh engine (vLLM's default processes: scheduler and worker apart) answers the prompt and the
   question from the store, then is SIGKILLed while it saves a long new prompt; beside it, an engine
   on a read-only copy of the store and one on a copy it can no longer write to, as on a full
   filesystem, answer the same and try to save another prompt.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import vllm_engines as eng

from kvsnap import provenance
from kvsnap.hashing import chain_root
from kvsnap.models.fingerprint import config_file, fingerprint
from kvsnap.store import BlockStore

BLOCK = 128  # vLLM's CPU block size, and so the store's (the least multiple of it and kvsnap's 64)


@pytest.fixture(scope="module")
def model() -> Path:
    return eng.default_model()


@pytest.fixture(scope="module")
def prompts(model):
    ids = eng.tokenize(model, (eng.ROOT / "examples" / "report.txt").read_text())
    assert len(ids) >= 4000
    prompt = ids[: eng.PROMPT_TOKENS]
    return SimpleNamespace(
        prompt=prompt,
        asked=prompt + eng.tokenize(model, eng.SUFFIX),
        other=ids[1000:2000],
        shared=ids[:512] + ids[2000:2500],  # the prompt's first 4 blocks, then its own
        third=ids[2500:3500],
        long=ids[2048:4000],  # 15 new blocks, saved in one put
        unsaved=ids[3000:4000],
    )


def job(model: Path, store: Path | None, *requests: tuple[list[int], int], **more) -> dict:
    reqs = [{"ids": ids, "max_tokens": n} for ids, n in requests]
    return {"model": str(model), "store": str(store) if store else None, "requests": reqs, **more}


@pytest.fixture(scope="module")
def first_round(model, prompts, tmp_path_factory):
    folder = tmp_path_factory.mktemp("vllm-round-1")
    store = folder / "store"
    engines = [
        eng.Engine(job(model, None, (prompts.asked, 16), in_process=True), folder, "reference"),
        eng.Engine(job(model, store, (prompts.prompt, 1), (prompts.other, 1), in_process=True), folder, "a"),
        eng.Engine(job(model, store, (prompts.shared, 1), (prompts.third, 1), in_process=True), folder, "b"),
    ]
    reference, a, b = (e.finish() for e in engines)
    return SimpleNamespace(store=store, reference=reference[1], a=engines[1], b=engines[2])


def read_only(folder: Path) -> tuple[str, ...] | None:
    """A command prefix that runs a command with ``folder`` mounted read-only (a private mount
    namespace: root ignores file modes), or None where this system does not allow it."""
    wrap = ("unshare", "-rm", "sh", "-c", 'mount --bind -o ro "$0" "$0" && exec "$@"', str(folder))
    if shutil.which("unshare") is None:
        return None
    probe = subprocess.run([*wrap, "sh", "-c", f'! touch "{folder}/.probe" 2>/dev/null'], capture_output=True)
    return wrap if probe.returncode == 0 else None


# A full filesystem as a process sees it, as root or not: RLIMIT_FSIZE 0 fails every write that would
# grow a file (EFBIG where a full disk says ENOSPC: the same failed write() under the store's code).
# vLLM cannot start that way (it writes temp files): its engine sets the limit once it is up.
FULL = ("sh", "-c", 'ulimit -f 0 && exec "$@"', "sh")


@pytest.fixture(scope="module")
def second_round(model, prompts, first_round, tmp_path_factory):
    folder = tmp_path_factory.mktemp("vllm-round-2")
    store = first_round.store
    ro_store = folder / "read-only-store"
    shutil.copytree(store, ro_store)
    wrap = read_only(ro_store)
    ro_before = eng.files_under(ro_store)
    ro = None
    if wrap is not None:
        ro_job = job(model, ro_store, (prompts.asked, 16), (prompts.unsaved, 1), in_process=True)
        ro = eng.Engine(ro_job, folder, "read-only", wrap=wrap)
    full_store = folder / "full-store"
    shutil.copytree(store, full_store)
    full_before = eng.files_under(full_store)
    full_job = job(model, full_store, (prompts.asked, 16), (prompts.unsaved, 1), in_process=True, file_size_limit=0)
    full = eng.Engine(full_job, folder, "full")
    fresh = eng.Engine(job(model, store, (prompts.asked, 16), (prompts.long, 1)), folder, "fresh")
    answer = fresh.wait_for(0)
    killed = kill_mid_save(fresh, store / "blocks")
    return SimpleNamespace(
        store=store,
        answer=answer,
        killed=killed,
        fresh=fresh,
        ro=ro,
        ro_records=ro.finish() if ro is not None else None,
        ro_store=ro_store,
        ro_before=ro_before,
        full=full,
        full_records=full.finish(),
        full_store=full_store,
        full_before=full_before,
    )


def kill_mid_save(engine: eng.Engine, blocks: Path) -> dict:
    """SIGKILL ``engine`` as soon as a new file appears under ``blocks`` (a save under way)."""
    before = set(eng.files_under(blocks))
    deadline = time.monotonic() + eng.ENGINE_TIMEOUT
    while time.monotonic() < deadline and not engine.ended:
        new = set(eng.files_under(blocks)) - before
        if new:
            engine.kill()
            return {"new_files": sorted(new)}
        time.sleep(0.002)
    engine.kill()
    raise AssertionError(f"no save seen before the engine ended:\n{engine.log[-6000:]}")


def test_two_engines_saving_at_once_keep_the_store_sound(first_round):
    store = BlockStore(first_round.store, create=False)
    assert store.check() == []
    stats = store.stats()
    # 7 blocks each of the four 1,000-token prompts, the 4 that two of them share stored once.
    assert stats["blocks"] == 7 + 7 + 3 + 7
    (maker,) = stats["made_by"]
    assert maker["made_by"]["forward"] == "vllm" and maker["made_by"]["vllm"].startswith("0.32.")
    assert "vLLM 0.32." in provenance.describe(maker["made_by"])


def test_vllm_keys_chains_of_its_own_apart_from_kvsnaps(first_round, model):
    index = BlockStore(first_round.store, create=False).read_index()
    (chain,) = index.chains.values()
    parts = dict(chain.parts)
    assert parts["engine"].startswith("vllm 0.32.") and parts["kv_dtype"] == "float32"
    assert chain.block_size == BLOCK and chain.layout.num_layers == 30 and chain.layout.num_kv_heads == 3
    kvsnap_root = chain_root(fingerprint(model, config_file(model), "float32"), "", BLOCK)
    assert chain.root != kvsnap_root


def test_a_fresh_engine_loads_the_prompts_blocks_and_answers_as_without_the_store(first_round, second_round):
    reference, answer = first_round.reference, second_round.answer
    assert reference["num_cached_tokens"] == 0
    assert answer["num_cached_tokens"] == 7 * BLOCK  # the prompt's whole blocks: 896 of its 1,000 tokens
    assert answer["token_ids"] == reference["token_ids"], (answer["text"], reference["text"])
    assert "Miriam Okafor" in answer["text"]
    assert BlockStore(second_round.store, create=False).stats()["hit_tokens"] >= 7 * BLOCK


def test_a_sigkill_mid_save_leaves_the_store_sound(second_round):
    store = BlockStore(second_round.store, create=False)
    # Every block the index names reads; check names only the killed writer's half-written file, if any.
    problems = store.check()
    assert all("a temp file a killed writer left" in p for p in problems), problems
    assert store.stats()["blocks"] == 24  # the killed save added nothing the index names
    leftovers = store.gc(verify=False)
    # Proof that the kill landed inside the save: files written that no index names yet.
    assert leftovers.temp_files + leftovers.orphan_files > 0, second_round.killed
    assert store.check() == []


def test_a_read_only_store_serves_its_hits_and_saves_nothing(first_round, second_round):
    if second_round.ro is None:
        pytest.skip("no read-only mount here (unshare -rm and mount --bind are not allowed)")
    answer, _ = second_round.ro_records[1:]
    assert answer["token_ids"] == first_round.reference["token_ids"]
    assert "kvsnap: store save failed" in second_round.ro.log
    assert eng.files_under(second_round.ro_store) == second_round.ro_before


def test_a_store_on_a_full_filesystem_serves_its_hits_and_saves_nothing(first_round, second_round):
    answer, _ = second_round.full_records[1:]
    assert answer["token_ids"] == first_round.reference["token_ids"]
    assert answer["num_cached_tokens"] == 7 * BLOCK
    assert "kvsnap: store save failed" in second_round.full.log
    # Nothing written, no temp file left behind, and `kvsnap store check` finds it sound, on the full filesystem.
    assert eng.files_under(second_round.full_store) == second_round.full_before
    check = [*FULL, sys.executable, "-m", "kvsnap_cli.main", "store", "check", str(second_round.full_store)]
    out = subprocess.run(check, capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
