"""A quantized model's codes kept in a file: quantized once, mapped by every later load.

Why: quantizing at load reads every float weight and computes every code in each new process (9-12 s and
5.6-5.9 GB of peak memory for a 1B-shaped model on 2 cores, against llama.cpp's 0.1-0.5 s and 1.4 GB for
the same GGUF). The first quantized load of a model writes what it made (the codes and scales of every
linear and of the embedding, the norms, the fused q/k/v and gate/up products laid end to end) into one
safetensors file under ``$KVSNAP_HOME/quantized``; a later load maps that file and builds the model's
modules over views of it: no float weight is read, nothing is quantized or copied, and only the pages a
forward touches become resident.

The file is input when it is read back: it is used only if it is a regular file of this user's that no
one else may write, in a folder of the same kind, no larger than its header says, its header bounded and
its metadata naming this layout, the same source weights (their digest), mode, kernel and model shape,
every tensor of the dtype and shape the model's modules need and within the file. Anything else is not
used: the model is quantized from its weights again and the file made anew (``Cached.reason`` says why).
Tensor bytes carry no checksum (reading them all to check one would cost what mapping saves): the file is
written whole or not at all (temp file, fsync, rename), 0600, in a 0700 folder.

Only models whose every product runs on kvsnap's kernel (``a16``) are kept this way: torch's int4 layout
is its own and opaque.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from kvsnap.models import qkernel
from kvsnap.models.catalog import quantized_root, quantized_stem
from kvsnap.models.fused import FusedQuantized
from kvsnap.models.quantize import QuantizedEmbedding, QuantizedLinear, expected_shapes
from kvsnap.paths import private_file, private_folder

LAYOUT = 1  # the file's layout: a change to it (or to the kernel's code layout) makes every file another's
FORMAT = "kvsnap-quantized"
HEADER_LIMIT = 64 << 20  # the JSON header of a file of a few hundred tensors is a few hundred KB
_DTYPES = {"I8": torch.int8, "U8": torch.uint8, "F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32}
_NAMES = {v: k for k, v in _DTYPES.items()}
_FUSED = ("qkv", "gate_up")


class CacheRejected(Exception):
    """A cached file that is not this model's codes, or not sound: why, in a few words."""


@dataclass(frozen=True)
class Cached:
    """Where a model's quantized form lives, and what it must say it is."""

    path: Path
    identity: dict[str, str]  # the metadata a file must carry to be used: source, mode, kernel, shape


def cached_form(
    source: Path, weights_digest: str, mode: str, kernel_name: str, config: dict[str, Any], dtype: torch.dtype
) -> Cached:
    """The file that holds (or will hold) the model in ``source`` quantized ``mode`` for ``kernel_name``, its
    float parts (norms, biases) in ``dtype``: each dtype a form of its own, so runs in two never replace one
    another's."""
    shape = hashlib.blake2b(json.dumps(config, sort_keys=True, default=str).encode(), digest_size=8).hexdigest()
    identity = {
        "format": FORMAT,
        "layout": str(LAYOUT),
        "kernel_abi": str(qkernel.ABI_VERSION),
        "weights": weights_digest,
        "mode": mode,
        "quantization": kernel_name,
        "config": shape,
        "dtype": str(dtype).removeprefix("torch."),
    }
    key = hashlib.blake2b(json.dumps(identity, sort_keys=True).encode(), digest_size=8).hexdigest()
    return Cached(quantized_root() / f"{quantized_stem(source)}-{kernel_name}-v{LAYOUT}-{key}.safetensors", identity)


def keepable(model: nn.Module) -> bool:
    """Whether ``model``'s quantized form can be kept in a file: every linear, the embedding and a tied head
    on kvsnap's kernel, and nothing else quantized."""
    linears = [m for m in model.modules() if isinstance(m, QuantizedLinear)]
    embeddings = [m for m in model.modules() if isinstance(m, QuantizedEmbedding)]
    return bool(linears) and len(embeddings) == 1 and all(m.kernel == "a16" for m in [*linears, *embeddings])


# -- writing -------------------------------------------------------------------------------------------


def save(model: nn.Module, cached: Cached) -> int:
    """Write ``model``'s quantized form (``keepable``) to ``cached.path``, whole or not at all; its size."""
    from kvsnap.format.atomic import replace_whole

    tensors, layout = _contents(model)
    header = {name: None for name in tensors}
    offset = 0
    for name, t in tensors.items():
        n = t.numel() * t.element_size()
        header[name] = {"dtype": _NAMES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + n]}
        offset += n
    header["__metadata__"] = {**cached.identity, "modules": json.dumps(layout, sort_keys=True)}
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    parts: list[bytes | memoryview] = [struct.pack("<Q", len(raw)), raw]
    parts += [memoryview(t.contiguous().view(torch.uint8).reshape(-1).numpy()) for t in tensors.values()]
    if not private_folder(cached.path.parent):
        raise OSError(f"{cached.path.parent} is not a folder only this user may write")
    return replace_whole(cached.path, parts, 0o600)  # a link at the name is replaced, never written through


def _contents(model: nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The tensors to write, by name, and what the loader needs to rebuild the modules over them."""
    names = {id(m): name for name, m in model.named_modules()}
    tensors: dict[str, torch.Tensor] = {}
    linears: dict[str, dict[str, Any]] = {}
    fused: dict[str, list[str]] = {}
    in_fused: dict[int, tuple[str, int]] = {}
    for owner, module in model.named_modules():
        for attr in _FUSED:
            product = module.__dict__.get(attr)
            if not isinstance(product, FusedQuantized):
                continue
            product.refresh()
            key = f"{owner}.{attr}"
            whole = product.whole[0]
            for field in ("qweight", "scales", "mins"):
                if getattr(whole, field, None) is not None:
                    tensors[f"{key}.{field}"] = whole.qweight if field == "qweight" else getattr(whole, field)
            fused[key] = [names[id(p)] for p in product.parts]
            start = 0
            for part in product.parts:
                in_fused[id(part)] = (key, start)
                start += part.out_features
    embedding = model.get_input_embeddings()
    for name, module in model.named_modules():
        if isinstance(module, QuantizedLinear):
            spec: dict[str, Any] = {"bits": module.bits, "shape": [module.out_features, module.in_features]}
            if module.qweight is embedding.qweight:
                spec["shares"] = names[id(embedding)]
            elif id(module) in in_fused:
                spec["fused"], spec["offset"] = in_fused[id(module)]
            else:
                for field in ("qweight", "scales", "mins"):
                    if getattr(module, field, None) is not None:
                        tensors[f"{name}.{field}"] = getattr(module, field)
            if module.bias is not None:
                tensors[f"{name}.bias"] = module.bias.detach()
            spec["bias"] = module.bias is not None
            linears[name] = spec
        elif isinstance(module, QuantizedEmbedding):
            tensors[f"{name}.qweight"], tensors[f"{name}.scales"] = module.qweight, module.scales
            if module.embed_scale is not None:
                tensors[f"{name}.embed_scale"] = module.embed_scale.reshape(1)
        else:
            for pname, param in module.named_parameters(recurse=False):
                tensors[f"{name}.{pname}" if name else pname] = param.detach()
    layout = {"linears": linears, "fused": fused, "embedding": names[id(embedding)]}
    return {k: v.detach().cpu() for k, v in tensors.items()}, layout


# -- reading -------------------------------------------------------------------------------------------


def load(cached: Cached, skeleton: nn.Module, dtype: torch.dtype) -> nn.Module:
    """``skeleton`` (a model whose parameters are on the meta device) built over the file's tensors, mapped.
    Raises ``CacheRejected`` where the file is missing, not sound, or not this model's."""
    path = cached.path
    header, data_start, size = _read_header(path)
    metadata = header.pop("__metadata__", None)
    if not isinstance(metadata, dict):
        raise CacheRejected("no metadata")
    for key, value in cached.identity.items():
        if metadata.get(key) != value:
            raise CacheRejected(f"made for another {key}")
    try:
        layout = json.loads(metadata.get("modules", ""))
    except ValueError:
        raise CacheRejected("unreadable module layout") from None
    storage = torch.UntypedStorage.from_file(str(path), False, size)  # private mapping: pages load on use
    tensors = {name: _view(storage, name, entry, data_start, size) for name, entry in header.items()}
    try:
        model = _rebuild(skeleton, tensors, layout, dtype)
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise CacheRejected(f"does not fit the model ({exc})") from None
    model.quantization = cached.identity["quantization"]
    return model


def _read_header(path: Path) -> tuple[dict[str, Any], int, int]:
    if not os.path.lexists(path):
        raise CacheRejected("not made yet")
    if not private_file(path):
        raise CacheRejected("not a regular file of this user's that only this user may write")
    if not private_folder(path.parent, make=False):
        raise CacheRejected(f"{path.parent} is not a folder only this user may write")
    try:
        with open(path, "rb", buffering=0) as f:
            if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                raise CacheRejected("not a regular file")
            size = os.fstat(f.fileno()).st_size
            head = f.read(8)
            if len(head) < 8:
                raise CacheRejected("truncated")
            (n,) = struct.unpack("<Q", head)
            if n > HEADER_LIMIT or 8 + n > size:
                raise CacheRejected("header larger than the file or the limit")
            raw = f.read(n)
    except OSError as exc:
        raise CacheRejected(f"unreadable ({exc.strerror or exc})") from None
    try:
        header = json.loads(raw)
    except (ValueError, RecursionError):
        raise CacheRejected("unreadable header") from None
    if not isinstance(header, dict):
        raise CacheRejected("unreadable header")
    return header, 8 + n, size


def _view(storage: torch.UntypedStorage, name: str, entry: Any, data_start: int, size: int) -> torch.Tensor:
    if not isinstance(entry, dict) or entry.get("dtype") not in _DTYPES:
        raise CacheRejected(f"tensor {name!r} of an unknown dtype")
    shape, span = entry.get("shape"), entry.get("data_offsets")
    if not _counts(shape) or not _counts(span) or len(span) != 2:
        raise CacheRejected(f"tensor {name!r} has no sound shape or offsets")
    dtype = _DTYPES[entry["dtype"]]
    count = 1
    for d in shape:
        count *= d
    start, end = data_start + span[0], data_start + span[1]
    itemsize = torch.empty(0, dtype=dtype).element_size()
    if end - start != count * itemsize or end > size or start % itemsize:
        raise CacheRejected(f"tensor {name!r} does not fit its bytes")
    flat = torch.empty(0, dtype=torch.uint8).set_(storage, start, (end - start,), (1,))
    return flat.view(dtype).reshape(shape)


def _counts(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in value)


def _take(tensors: dict[str, torch.Tensor], name: str, dtype: torch.dtype, shape: tuple) -> torch.Tensor:
    t = tensors.pop(name)
    if t.dtype != dtype or tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name} is {t.dtype} {tuple(t.shape)}, not {dtype} {tuple(shape)}")
    return t


def _rebuild(model: nn.Module, tensors: dict[str, torch.Tensor], layout: dict[str, Any], dtype: torch.dtype):
    """The skeleton's linears, embedding, fused products and parameters replaced by the file's, every one
    checked against what the skeleton's module needs; every file tensor used, every parameter filled."""
    linears, fused, embedding_name = layout["linears"], layout["fused"], layout["embedding"]
    skeleton = dict(model.named_modules())
    wanted = {n for n, m in skeleton.items() if _is_plain_linear(m)}
    if set(linears) != wanted:
        raise ValueError(f"linears {sorted(set(linears) ^ wanted)[:3]} differ")
    embedding_skeleton = skeleton[embedding_name]
    vocab, hidden = embedding_skeleton.weight.shape
    scale = tensors.pop(f"{embedding_name}.embed_scale", None)
    embedding = QuantizedEmbedding.from_codes(
        _take(tensors, f"{embedding_name}.qweight", torch.int8, (vocab, hidden)),
        _take(tensors, f"{embedding_name}.scales", torch.float16, (vocab, hidden // qkernel.GROUP)),
        dtype,
        "a16",
        None if scale is None else scale.reshape(()).to(dtype),
    )
    _place(model, embedding_name, embedding)
    wholes: dict[str, dict[str, torch.Tensor]] = {}
    for key, part_names in fused.items():
        first = linears[part_names[0]]
        k = first["shape"][1]
        n = sum(linears[p]["shape"][0] for p in part_names)
        shapes = expected_shapes(first["bits"], "a16", n, k)
        wholes[key] = {f: _take(tensors, f"{key}.{f}", d, s) for f, (d, s) in shapes.items()}
    built: dict[str, QuantizedLinear] = {}
    for name, spec in linears.items():
        out_features, in_features = spec["shape"]
        if (out_features, in_features) != tuple(skeleton[name].weight.shape):
            raise ValueError(f"{name} has shape {spec['shape']}")
        bias = _take(tensors, f"{name}.bias", dtype, (out_features,)) if spec["bias"] else None
        if "shares" in spec:
            if spec["shares"] != embedding_name or (out_features, in_features) != (vocab, hidden):
                raise ValueError(f"{name} shares what it cannot")
            layer = QuantizedLinear.sharing(embedding)
        else:
            bits = spec["bits"]
            if bits not in (4, 8) or (bits == 4 and in_features % qkernel.GROUP):
                raise ValueError(f"{name} has {bits} bits")
            shapes = expected_shapes(bits, "a16", out_features, in_features)
            if "fused" in spec:
                whole, start = wholes[spec["fused"]], spec["offset"]
                codes = {f: whole[f][start : start + out_features] for f in shapes}
            else:
                codes = {f: _take(tensors, f"{name}.{f}", d, s) for f, (d, s) in shapes.items()}
            layer = QuantizedLinear.from_codes(
                {**codes, "bias": bias}, bits=bits, group=qkernel.GROUP, kernel="a16", shape=(out_features, in_features)
            )
        built[name] = layer
        _place(model, name, layer)
    for key, part_names in fused.items():
        parts = [built[p] for p in part_names]
        if len({(p.bits, p.in_features) for p in parts}) != 1:
            raise ValueError(f"{key}: parts of different layouts")
        offsets = [linears[p]["offset"] for p in part_names]
        if offsets != [sum(p.out_features for p in parts[:i]) for i in range(len(parts))]:
            raise ValueError(f"{key}: parts out of order")
        whole = QuantizedLinear.from_codes(
            {**wholes[key], "bias": _joined_bias(parts)},
            bits=parts[0].bits,
            group=qkernel.GROUP,
            kernel="a16",
            shape=(sum(p.out_features for p in parts), parts[0].in_features),
        )
        owner, attr = key.rpartition(".")[0], key.rpartition(".")[2]
        if attr not in _FUSED:
            raise ValueError(f"{key}: not a fused product")
        model.get_submodule(owner).__dict__[attr] = FusedQuantized.over(parts, whole)
    for name, param in list(model.named_parameters()):
        if param.device.type == "meta":
            owner_name, _, pname = name.rpartition(".")
            owner = model.get_submodule(owner_name) if owner_name else model
            owner._parameters[pname] = nn.Parameter(_take(tensors, name, dtype, tuple(param.shape)), False)
    if tensors:
        raise ValueError(f"tensors {sorted(tensors)[:3]} unused")
    if any(t.device.type == "meta" for t in [*model.parameters(), *model.buffers()]):
        raise ValueError("a tensor left unfilled")
    return model.eval().requires_grad_(False)


def _joined_bias(parts: list[QuantizedLinear]) -> torch.Tensor | None:
    if all(p.bias is None for p in parts):
        return None
    return torch.cat([p.bias if p.bias is not None else torch.zeros(p.out_features) for p in parts])


def _is_plain_linear(module: nn.Module) -> bool:
    return getattr(type(module), "plain_product", False) or isinstance(module, nn.Linear)


def _place(model: nn.Module, name: str, module: nn.Module) -> None:
    owner_name, _, attr = name.rpartition(".")
    owner = model.get_submodule(owner_name) if owner_name else model
    setattr(owner, attr, module)
