"""A quantized model is kept as a file (``kvsnap.models.quantized_file``): quantized once, mapped by later loads.

A later load must compute the same bits as the load that quantized (the file is the model), read no float
weight, and never use a file that is not sound and this model's own: a damaged, foreign, linked or
writable-by-others file is not used, the model is quantized again and the file made anew.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import struct

import pytest
import tiny_models
import torch
from cli_helpers import kvsnap

from kvsnap.config import SamplingParams
from kvsnap.engine.session import Session
from kvsnap.models import catalog, load_model, native, qkernel, quantize

pytestmark = pytest.mark.skipif(
    qkernel.library() is None, reason=f"kvsnap's kernel is not available here: {qkernel.unavailable_reason()}"
)
IDS = list(range(5, 61))
GREEDY = SamplingParams(temperature=0, max_new_tokens=5)


@pytest.fixture
def home(tmp_path, monkeypatch):
    """A KVSNAP_HOME of the test's own, so each test starts with no kept forms."""
    monkeypatch.setenv("KVSNAP_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def _run(lm):
    s = Session(lm, block_size=8, chunk_size=7)
    s.prefill(IDS)
    kv = [(layer.keys.clone(), layer.values.clone()) for layer in s.cache.layers]
    return s.last_logits.clone(), kv, s.generate(GREEDY).token_ids


def _same(a, b) -> bool:
    return (
        torch.equal(a[0], b[0])
        and all(torch.equal(x[0], y[0]) and torch.equal(x[1], y[1]) for x, y in zip(a[1], b[1]))
        and a[2] == b[2]
    )


def _forms() -> list:
    return catalog.quantized_forms()


def _no_float_load(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the float weights were read")

    monkeypatch.setattr(native, "load", refuse)
    monkeypatch.setattr(quantize, "apply", refuse)


@pytest.mark.parametrize(("arch", "mode"), [("llama", "int4"), ("llama", "int8"), ("qwen2", "int4")])
def test_a_later_load_maps_the_kept_form_and_computes_the_same_bits(home, tiny_model_dir, arch, mode, monkeypatch):
    folder = str(tiny_model_dir(arch))
    said: list[str] = []
    first = load_model(folder, device="cpu", quantize=mode, progress=said.append)
    assert any(line.startswith(f"kept the {mode} weights for later loads") for line in said)
    (form,) = _forms()
    assert stat.S_IMODE(os.lstat(form).st_mode) == 0o600 and stat.S_IMODE(os.lstat(form.parent).st_mode) == 0o700
    fresh = _run(first)

    _no_float_load(monkeypatch)
    again = load_model(folder, device="cpu", quantize=mode)
    assert "mapped" in again.load_timings and again.fingerprint == first.fingerprint
    assert again.model.quantization == first.model.quantization == f"{mode}-a16"
    mapped = [m.qweight for m in again.model.modules() if isinstance(m, quantize.QuantizedLinear)]
    assert mapped and all(t.untyped_storage().nbytes() == os.path.getsize(form) for t in mapped)  # views of it
    assert _same(_run(again), fresh)


def _valid_form(home, tiny_model_dir):
    folder = str(tiny_model_dir("llama"))
    lm = load_model(folder, device="cpu", quantize="int4")
    (form,) = _forms()
    return folder, form, _run(lm)


def _rewrite_header(form, change) -> None:
    raw = form.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    change(header)
    text = json.dumps(header, separators=(",", ":")).encode()  # as compact as the writer's
    text += b" " * (n - len(text))
    assert len(text) == n
    form.write_bytes(raw[:8] + text + raw[8 + n :])


def _swap_a_shape(header) -> None:
    name = next(k for k, v in header.items() if k != "__metadata__" and len(v["shape"]) == 2 and "qkv" in k)
    header[name]["shape"] = header[name]["shape"][::-1]  # the same bytes, another shape


def _foreign_weights(header) -> None:
    header["__metadata__"]["weights"] = "0" * 32


def _older_layout(header) -> None:
    header["__metadata__"]["layout"] = "0"


DAMAGE = {
    "truncated": lambda form: form.write_bytes(form.read_bytes()[: os.path.getsize(form) // 2]),
    "header of garbage": lambda form: form.write_bytes(struct.pack("<Q", 12) + b"not json at all"),
    "a huge header size": lambda form: form.write_bytes(struct.pack("<Q", 1 << 62) + b"{}"),
    "a tensor of another shape": lambda form: _rewrite_header(form, _swap_a_shape),
    "other weights": lambda form: _rewrite_header(form, _foreign_weights),
    "another layout version": lambda form: _rewrite_header(form, _older_layout),
    "writable by others": lambda form: os.chmod(form, 0o666),
    "another owner": lambda form: os.chown(form, 65534, 65534),
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_a_damaged_or_foreign_kept_form_is_never_used_and_is_made_anew(home, tiny_model_dir, damage, monkeypatch):
    if damage == "another owner" and os.getuid() != 0:
        pytest.skip("changing a file's owner needs root")
    folder, form, fresh = _valid_form(home, tiny_model_dir)
    DAMAGE[damage](form)
    said: list[str] = []
    lm = load_model(folder, device="cpu", quantize="int4", progress=said.append)
    assert "mapped" not in lm.load_timings
    assert any("is not used" in line for line in said), said
    assert _same(_run(lm), fresh)
    info = os.lstat(form)  # made anew: this user's, 0600, and mapped by the next load
    assert stat.S_ISREG(info.st_mode) and info.st_uid == os.getuid() and stat.S_IMODE(info.st_mode) == 0o600
    _no_float_load(monkeypatch)
    assert _same(_run(load_model(folder, device="cpu", quantize="int4")), fresh)


def test_a_link_or_fifo_at_the_forms_name_is_not_followed_and_what_it_names_is_left(home, tiny_model_dir, tmp_path):
    folder, form, fresh = _valid_form(home, tiny_model_dir)
    elsewhere = tmp_path / "someone-elses.safetensors"
    shutil.copyfile(form, elsewhere)
    before = elsewhere.read_bytes()
    form.unlink()
    form.symlink_to(elsewhere)
    lm = load_model(folder, device="cpu", quantize="int4")
    assert "mapped" not in lm.load_timings and _same(_run(lm), fresh)
    assert not form.is_symlink() and elsewhere.read_bytes() == before  # replaced, never written through
    form.unlink()
    os.mkfifo(form)
    lm = load_model(folder, device="cpu", quantize="int4")  # a FIFO is not opened: it would hang the read
    assert "mapped" not in lm.load_timings and stat.S_ISREG(os.lstat(form).st_mode)


def test_changed_weights_never_map_the_old_form(home, tiny_model_dir, tmp_path):
    folder = tmp_path / "model"
    shutil.copytree(tiny_model_dir("llama"), folder)
    load_model(str(folder), device="cpu", quantize="int4")
    tiny_models.perturbed_copy(tiny_model_dir("llama"), tmp_path / "perturbed", delta=0.05)
    shutil.copyfile(tmp_path / "perturbed" / "model.safetensors", folder / "model.safetensors")
    lm = load_model(str(folder), device="cpu", quantize="int4")
    assert "mapped" not in lm.load_timings and len(_forms()) == 2  # another file: the weights' digest names it


def test_kvsnap_models_lists_a_kept_form_and_models_rm_removes_only_it(home, tiny_model_dir):
    folder = tiny_model_dir("llama")
    load_model(str(folder), device="cpu", quantize="int8")
    (form,) = _forms()
    listed = kvsnap("models", "--json")
    assert listed.returncode == 0, listed.stderr
    (entry,) = json.loads(listed.stdout)["models"]
    assert entry["kind"] == "quantized" and entry["quantized"] == [{"path": str(form), "bytes": form.stat().st_size}]
    gone = kvsnap("models", "rm", form.name)
    assert gone.returncode == 0, gone.stderr
    assert not form.exists() and (folder / "model.safetensors").is_file()


def test_each_dtype_keeps_a_form_of_its_own(home, tiny_model_dir):
    """The float parts (norms, biases) are kept in the run's dtype: a bfloat16 run must not replace the float32
    run's form, nor map it."""
    folder = str(tiny_model_dir("llama"))
    float32 = _run(load_model(folder, device="cpu", quantize="int4"))
    load_model(folder, device="cpu", quantize="int4", dtype="bfloat16")
    assert len(_forms()) == 2
    again = load_model(folder, device="cpu", quantize="int4")
    assert "mapped" in again.load_timings and _same(_run(again), float32)
    assert "mapped" in load_model(folder, device="cpu", quantize="int4", dtype="bfloat16").load_timings
