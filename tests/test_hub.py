"""Models by name from the Hugging Face hub, as a user meets them: ``kvsnap pull NAME``, ``--model NAME`` and
``kvsnap models``, against a fake hub on 127.0.0.1 (tests/fake_hub.py); nothing leaves the machine.

``HF_ENDPOINT`` points at the fake hub and ``HF_HOME`` at a fresh folder, read when a download starts.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from fake_hub import FakeHub
from typer.testing import CliRunner

from kvsnap_cli.main import app

runner = CliRunner()
REPO = "kvsnap-test/tiny-llama"
# Files a repo often carries besides its safetensors: never downloaded.
UNWANTED = {"pytorch_model.bin": b"\0" * 4096, "tiny.Q4_0.gguf": b"GGUF" + b"\0" * 4096, "notes.md": b"# notes"}


def invoke(*args: str):
    return runner.invoke(app, list(args))


def one_error_line(result) -> str:
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: ")
    return lines[0]


@pytest.fixture
def hub(tiny_model_dir, tmp_path, monkeypatch):
    import huggingface_hub.constants

    with FakeHub() as server:
        server.add_folder(REPO, tiny_model_dir("llama"), extra=UNWANTED)
        monkeypatch.setenv("HF_ENDPOINT", server.url)
        monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
        monkeypatch.setenv("KVSNAP_HOME", str(tmp_path / "home"))
        for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_TOKEN"):
            monkeypatch.delenv(name, raising=False)
        # huggingface_hub reads HF_HUB_OFFLINE once, at import: a machine that exports it must not turn the
        # fake hub off (kvsnap reads the environment itself when a download starts).
        monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
        yield server


def run_args(model: str) -> list[str]:
    return ["run", "--model", model, "--device", "cpu", "--prompt", "The capital of France", "--max-new-tokens", "4"]


def test_a_model_by_name_is_downloaded_once_then_runs(hub, tmp_path, tiny_model_dir):
    pulled = invoke("pull", REPO)
    assert pulled.exit_code == 0, pulled.output
    assert f"{REPO} ready in" in pulled.stdout
    fetched = {path.rsplit("/", 1)[-1] for _, path, _ in hub.gets() if "/resolve/" in path}
    assert "model.safetensors" in fetched and "config.json" in fetched and "tokenizer.json" in fetched
    assert not fetched & set(UNWANTED), "other weights formats are never downloaded"
    folder = tmp_path / "hf" / "hub" / "models--kvsnap-test--tiny-llama"
    snapshot = next((folder / "snapshots").iterdir())
    source = tiny_model_dir("llama") / "model.safetensors"
    assert (snapshot / "model.safetensors").read_bytes() == source.read_bytes()

    before = len(hub.log)
    ran = invoke(*run_args(REPO), "--json")
    assert ran.exit_code == 0, ran.output
    row = json.loads(ran.stdout)
    assert row["prompt_tokens"] > 0 and row["new_tokens"] == 4
    assert len(hub.log) == before, "a model complete in the cache starts without the network"

    listed = invoke("models", "--json")
    assert listed.exit_code == 0, listed.output
    (entry,) = [m for m in json.loads(listed.stdout)["models"] if m["name"] == REPO]
    assert entry["kind"] == "hub" and entry["bytes"] >= source.stat().st_size
    shown = invoke("models")
    assert REPO in shown.stdout


def test_run_downloads_a_model_named_for_the_first_time(hub):
    ran = invoke(*run_args(REPO))
    assert ran.exit_code == 0, ran.output
    assert hub.gets("model.safetensors")


def test_an_unknown_repo_is_one_line(hub):
    result = invoke(*run_args("kvsnap-test/no-such-model"))
    assert result.exit_code == 1
    line = one_error_line(result)
    assert "kvsnap-test/no-such-model: no such model on" in line and hub.url in line
    from kvsnap.models.catalog import hub_record

    assert "kvsnap-test/no-such-model" not in hub_record(), "a name that fetched nothing leaves no trace"


def test_a_repo_without_safetensors_names_its_gguf(hub):
    hub.repos["kvsnap-test/only-gguf"] = dict(UNWANTED)
    result = invoke("pull", "kvsnap-test/only-gguf")
    assert result.exit_code == 1
    assert "kvsnap-test/only-gguf:tiny.Q4_0.gguf" in one_error_line(result)


def test_a_gguf_not_in_the_repo_is_one_line(hub):
    result = invoke("pull", f"{REPO}:missing.Q4_0.gguf")
    assert result.exit_code == 1
    assert f"{REPO} has no file missing.Q4_0.gguf" in one_error_line(result)


def test_an_interrupted_download_resumes_where_it_stopped(hub, tiny_model_dir, monkeypatch, tmp_path):
    import huggingface_hub.constants

    # huggingface_hub writes what it received in 10 MB chunks: smaller ones let the first half of the tiny
    # model's file reach the disk before the connection drops, as a real model's first chunks do.
    monkeypatch.setattr(huggingface_hub.constants, "DOWNLOAD_CHUNK_SIZE", 1 << 16)
    size = (tiny_model_dir("llama") / "model.safetensors").stat().st_size
    hub.drop_once.add("model.safetensors")
    pulled = invoke("pull", REPO)
    assert pulled.exit_code == 0, pulled.output
    first, again = [r for _, _, r in hub.gets("model.safetensors")]
    assert first is None and again.startswith("bytes=") and again.endswith("-")
    assert 0 < int(again[len("bytes=") : -1]) <= size // 2, "the second request asks only for what is missing"
    snapshot = next((tmp_path / "hf" / "hub" / "models--kvsnap-test--tiny-llama" / "snapshots").iterdir())
    assert (snapshot / "model.safetensors").read_bytes() == (tiny_model_dir("llama") / "model.safetensors").read_bytes()
    ran = invoke(*run_args(REPO))
    assert ran.exit_code == 0, ran.output


def test_offline_with_nothing_cached_is_one_line_and_asks_nothing(hub, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    result = invoke(*run_args(REPO))
    assert result.exit_code == 1
    line = one_error_line(result)
    assert "HF_HUB_OFFLINE" in line and f"kvsnap pull {REPO}" in line
    assert hub.log == []


def test_offline_uses_what_was_downloaded(hub, monkeypatch):
    assert invoke("pull", REPO).exit_code == 0
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    hub.log.clear()
    ran = invoke(*run_args(REPO))
    assert ran.exit_code == 0, ran.output
    assert hub.log == []


def test_no_network_is_one_line(hub, monkeypatch):
    import socket

    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{port}")
    result = invoke("pull", REPO)
    assert result.exit_code == 1
    line = one_error_line(result)
    assert "cannot reach" in line and "not in the local cache" in line


def test_models_rm_removes_a_download_kvsnap_made_and_nothing_else(hub, tmp_path):
    assert invoke("pull", REPO).exit_code == 0
    cache = tmp_path / "hf" / "hub" / "models--kvsnap-test--tiny-llama"
    other = tmp_path / "hf" / "hub" / "models--someone--else"
    other.mkdir(parents=True)
    assert invoke("models", "rm", "someone/else").exit_code == 1
    removed = invoke("models", "rm", REPO)
    assert removed.exit_code == 0, removed.output
    assert not cache.exists() and other.exists()
    assert not (tmp_path / "hf" / "hub" / ".locks" / cache.name).exists(), "the download's lock files go too"
    assert REPO not in invoke("models").stdout


def test_a_model_already_in_the_cache_is_not_removed_by_kvsnap(hub, tmp_path):
    from huggingface_hub import snapshot_download

    snapshot_download(REPO, cache_dir=tmp_path / "hf" / "hub", endpoint=hub.url, allow_patterns=["*.json"])
    assert invoke("pull", REPO).exit_code == 0
    kept = invoke("models", "rm", REPO)
    assert kept.exit_code == 0, kept.output
    assert "left there" in kept.stderr
    assert (tmp_path / "hf" / "hub" / "models--kvsnap-test--tiny-llama").is_dir()


def test_hub_names_are_told_apart_from_paths():
    from kvsnap.models.hub import parse_name

    assert parse_name("org/name") == ("org/name", None)
    assert parse_name("org/name:model.Q4_0.gguf") == ("org/name", "model.Q4_0.gguf")
    for not_a_name in ("./x/y", "~/x", "/x/y", "a/b/c", "org/name:config.json", "org/..", "org/name:../x.gguf"):
        assert parse_name(not_a_name) is None, not_a_name


def test_progress_is_reported_in_megabytes():
    from kvsnap.models.hub import progress_bar_class

    said: list[str] = []
    bar = progress_bar_class("org/x", said.append)(total=2_000_000, unit="B", desc="Reconstructing")
    bar.update(1_000_000)
    bar.update(1_000_000)
    assert said[-1] == "downloading org/x: 2.0 MB of 2.0 MB"


def test_a_path_that_exists_is_never_taken_for_a_hub_name(hub, tmp_path, monkeypatch, tiny_model_dir):
    import shutil

    monkeypatch.chdir(tmp_path)
    shutil.copytree(tiny_model_dir("llama"), Path("kvsnap-test") / "tiny-llama")
    ran = invoke(*run_args(REPO))
    assert ran.exit_code == 0, ran.output
    assert hub.log == []


@pytest.mark.slow
def test_the_default_models_gguf_named_on_the_hub_is_the_default_model(hub, tmp_path):
    """One file is converted once, however it is named: fetched from the hub, the default model's GGUF is the
    default model (found by its content), not a second 517 MB conversion."""
    from conftest import real_model_home

    from kvsnap import models
    from kvsnap.config import DEFAULT_MODEL

    gguf, converted = models.default_gguf_path(), real_model_home() / "models" / DEFAULT_MODEL
    if gguf is None or not models.is_ready(converted):
        pytest.skip(f"the default model is not installed and converted; run: {models.INSTALL_COMMAND}")
    hub.repos["someone/smollm2-gguf"] = {gguf.name: gguf.read_bytes(), "README.md": b"# SmolLM2"}
    root = tmp_path / "home" / "models"
    root.mkdir(parents=True)
    (root / DEFAULT_MODEL).symlink_to(converted)  # this home's default model is the one converted already
    pulled = invoke("pull", f"someone/smollm2-gguf:{gguf.name}")
    assert pulled.exit_code == 0, pulled.output
    assert f"ready in {root / DEFAULT_MODEL}" in pulled.stdout
    assert [p.name for p in root.iterdir() if not p.name.startswith(".")] == [DEFAULT_MODEL]
    assert [path for _, path, _ in hub.gets() if "/resolve/" in path] == [
        f"/someone/smollm2-gguf/resolve/main/{gguf.name}"
    ]


# -- a hostile hub: it cannot write outside the cache, nor send more than it listed ----------------------


def outside_the_cache(tmp_path: Path) -> set[Path]:
    """Every path under the test's folder but the hub cache (and $HF_HOME, its folder) and kvsnap's home."""
    cache, home = tmp_path / "hf" / "hub", tmp_path / "home"
    inside = (tmp_path / "hf", *(p for p in tmp_path.rglob("*") if p.is_relative_to(cache) or p.is_relative_to(home)))
    return set(tmp_path.rglob("*")) - set(inside)


def assert_refused(result, *words: str) -> None:
    """One error line (progress lines may come before it), saying what was refused, not to reconnect."""
    assert result.exit_code == 1
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and result.stderr.strip().splitlines()[-1] == errors[0], result.stderr
    assert "Traceback" not in result.stderr
    line = errors[0]
    assert "cannot reach" not in line and "connect and run it again" not in line, line
    for word in words:
        assert word in line, line


def links_out_of(cache: Path) -> list[Path]:
    return [p for p in cache.rglob("*") if p.is_symlink() and not Path(os.path.realpath(p)).is_relative_to(cache)]


@pytest.mark.parametrize("target", ["planted", "victim.txt"])
def test_an_etag_that_names_a_path_is_refused_and_nothing_lands_outside_the_cache(hub, tmp_path, target):
    (tmp_path / "victim.txt").write_text("someone's file")
    before = outside_the_cache(tmp_path)
    hub.etags["config.json"] = f'"../../../../{target}"'  # blobs/../../../../ is the test's own folder
    result = invoke("pull", REPO)
    assert_refused(result, "not a plain token", "config.json")
    assert outside_the_cache(tmp_path) == before, "a file was made outside the cache"
    assert (tmp_path / "victim.txt").read_text() == "someone's file"
    assert links_out_of(tmp_path / "hf" / "hub") == []


def test_a_commit_id_that_is_not_one_is_refused_before_any_file(hub):
    hub.commit = "../../../../planted"
    assert_refused(invoke("pull", REPO), "commit id")
    assert [p for _, p, _ in hub.log if "/resolve/" in p] == []


def test_a_body_longer_than_listed_is_stopped_and_not_kept(hub, tmp_path):
    hub.bodies["tokenizer.json"] = b"x" * (5 << 20)  # the listing says the real file's size, a few KB
    assert_refused(invoke("pull", REPO), "tokenizer.json", "more bytes than its listing says")
    cache = tmp_path / "hf" / "hub"
    assert [p for p in cache.rglob("*") if p.is_file() and p.stat().st_size >= 1 << 20] == []
    assert not [p for p in cache.rglob("*.incomplete")]


def test_a_length_longer_than_listed_is_refused_before_the_body(hub):
    hub.bodies["tokenizer.json"] = b"x" * (5 << 20)
    hub.lengths["tokenizer.json"] = 5 << 20
    assert_refused(invoke("pull", REPO), "tokenizer.json", "where its listing says")
    assert hub.gets("tokenizer.json") == []


def test_a_config_listed_larger_than_kvsnap_reads_is_not_downloaded(hub):
    hub.sizes["config.json"] = 1 << 30
    assert_refused(invoke("pull", REPO), "config.json", "16 MiB")
    assert [p for _, p, _ in hub.log if "/resolve/" in p] == []


def test_a_cached_file_that_links_out_of_the_cache_is_not_used(hub, tmp_path, tiny_model_dir):
    assert invoke("pull", REPO).exit_code == 0
    snapshot = next((tmp_path / "hf" / "hub" / "models--kvsnap-test--tiny-llama" / "snapshots").iterdir())
    outside = tmp_path / "outside.json"
    outside.write_bytes((tiny_model_dir("llama") / "config.json").read_bytes())
    (snapshot / "config.json").unlink()
    (snapshot / "config.json").symlink_to(outside)  # as an ETag naming an existing file once made it
    assert_refused(invoke(*run_args(REPO)), "config.json", "did not download as listed")
