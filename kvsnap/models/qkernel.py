"""kvsnap's own quantized products on x86-64 CPUs with AVX2 (``qmatmul.c``), built once per machine.

Why: torch's CPU kernels for int4 and int8 weights compute in bfloat16, which a CPU without bfloat16
instructions emulates: on the 2-core AVX2 VM, a decode step's quantized products alone took 32 ms a token,
more than llama.cpp's whole step over the same GGUF. llama.cpp quantizes the activations too, in groups of
32, to 8 bits, and multiplies integers; ``qmatmul.c`` does the same for kvsnap's layouts with 16-bit
activations, which keep the default model's greedy answers its float weights' (8 bits changed them).

The source is compiled with the machine's C compiler (``$CC``, else ``cc``) the first time a quantized model
loads, into ``$KVSNAP_HOME/kernels`` (0700; the library 0600, named by the digest of source, compiler and
flags). A library read back is used only if it is a regular file owned by this user that no one else may
write, in a folder of the same kind: it is code this process runs. Where no compiler works, the CPU lacks
AVX2/FMA/F16C, or ``KVSNAP_QKERNEL=0``, torch's kernels run instead (``unavailable_reason`` says why).

Quantizing the activations makes a different model from torch's bfloat16 path: the fingerprint names which
one ran (``kvsnap.models.quantize``), so a snapshot never moves between them.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shlex
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

from kvsnap.models.catalog import kvsnap_home
from kvsnap.paths import private_file, private_folder

SOURCE = Path(__file__).with_name("qmatmul.c")
GROUP = 32
FLAGS = ("-O3", "-mavx2", "-mfma", "-mf16c", "-ffp-contract=off", "-fopenmp", "-fPIC", "-shared", "-std=c11")
ACTIVATIONS = torch.int16  # the activation codes' type (qmatmul.c's act_t)
ABI_VERSION = 12
_lock = threading.Lock()
_reason: list[str] = []  # why the kernels are not available (set once, by ``library``)


def _cpu_reason() -> str | None:
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return f"not an x86-64 CPU ({platform.machine()})"
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        return "the CPU lacks AVX2"
    try:
        flags = Path("/proc/cpuinfo").read_text(errors="replace")
    except OSError:
        return "cannot read /proc/cpuinfo to check for FMA and F16C"
    missing = [f for f in ("fma", "f16c") if f" {f}" not in flags]
    return f"the CPU lacks {', '.join(missing)}" if missing else None


def _compiler() -> tuple[list[str], str] | str:
    """The compiler's command line (``$CC`` may carry arguments: ``gcc -march=native``) and its version
    line; else why there is none, in words."""
    given = os.environ.get("CC") or "cc"
    try:
        words = shlex.split(given)
    except ValueError as exc:
        return f"CC={given!r} is not a command line ({exc})"
    cc = shutil.which(words[0]) if words else None
    if cc is None:
        return f"no C compiler ({words[0] if words else 'CC is empty'} is not on PATH)"
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        return f"no C compiler ({cc} --version failed: {exc})"
    return [cc, *words[1:]], version.splitlines()[0] if version else ""


def _build(folder: Path, cc: list[str], name: str) -> Path:
    target = folder / name
    if private_file(target):
        return target
    work = Path(tempfile.mkdtemp(prefix=".build-", dir=folder))
    try:
        out = work / name
        done = subprocess.run(
            [*cc, *FLAGS, str(SOURCE), "-o", str(out), "-lm"], capture_output=True, text=True, timeout=300
        )
        if done.returncode != 0:
            raise OSError(f"{Path(cc[0]).name} failed: {(done.stderr or done.stdout).strip().splitlines()[-1:]}")
        os.chmod(out, 0o600)
        os.replace(out, target)  # a link or file someone put at the name is replaced, never written through
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return target


SYMBOLS = ("kv_abi_version", "kv_quantize_rows", "kv_matmul_q4", "kv_matmul_q8", "kv_quantize_q4", "kv_layer_qkv",
           "kv_layer_rest", "kv_layers")  # fmt: skip


def _bind(lib: ctypes.CDLL) -> ctypes.CDLL:
    # A library at the name that lacks an entry point (another build, a planted file) is refused here,
    # not found out by the first product that calls it.
    missing = [name for name in SYMBOLS if not hasattr(lib, name)]
    if missing:
        raise OSError(f"the library lacks {', '.join(missing)}")
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.kv_abi_version.restype = ctypes.c_int
    lib.kv_quantize_rows.argtypes = [p, i64, i64, p, p, p]
    lib.kv_quantize_rows.restype = None
    lib.kv_matmul_q4.argtypes = [p, p, p, i64, p, p, p, i64, i64, p]
    lib.kv_matmul_q4.restype = None
    lib.kv_matmul_q8.argtypes = [p, p, i64, p, p, i64, i64, p]
    lib.kv_matmul_q8.restype = None
    lib.kv_quantize_q4.argtypes = [p, i64, i64, p, p, p]
    lib.kv_quantize_q4.restype = None
    lib.kv_layer_qkv.argtypes = lib.kv_layer_rest.argtypes = [p, p]  # kv_layer, kv_call (kvsnap.models.qstep)
    lib.kv_layer_qkv.restype = None
    lib.kv_layer_rest.restype = ctypes.c_int  # -1: no memory for the scores
    lib.kv_layers.argtypes = [i64, p, p, p, p, p]  # every layer: kv_layers in qmatmul.c
    lib.kv_layers.restype = ctypes.c_int
    return lib


def library() -> ctypes.CDLL | None:
    """The built kernels, or None (``unavailable_reason`` says why). Built or found once per process."""
    with _lock:
        return _library()


@functools.cache
def _library() -> ctypes.CDLL | None:
    if os.environ.get("KVSNAP_QKERNEL", "1") == "0":
        _reason.append("KVSNAP_QKERNEL=0")
        return None
    reason = _cpu_reason()
    found = _compiler() if reason is None else None
    if isinstance(found, str):
        reason = found
    if reason is not None or found is None:
        _reason.append(reason or "unavailable")
        return None
    cc, version = found
    digest = hashlib.sha256(SOURCE.read_bytes() + f"|{version}|{' '.join([*cc[1:], *FLAGS])}".encode()).hexdigest()[:24]
    folder = kvsnap_home() / "kernels"
    try:
        if not private_folder(folder):
            raise OSError(f"{folder} is not a private folder of this user's")
        lib = _bind(ctypes.CDLL(str(_build(folder, cc, f"qmatmul-{digest}.so"))))
        if lib.kv_abi_version() != ABI_VERSION:
            raise OSError("the built library is another version")
        _self_test(lib)
    except (OSError, subprocess.SubprocessError, AssertionError) as exc:
        _reason.append(f"could not build the quantized kernels: {exc}")
        return None
    return lib


def unavailable_reason() -> str | None:
    """None where ``library()`` works, else why not."""
    return None if library() is not None else (_reason[0] if _reason else "unavailable")


# -- the products ------------------------------------------------------------------------------------


def rows_of(x: torch.Tensor) -> torch.Tensor:
    """``x`` as the contiguous float32 [M, K] rows the kernels take."""
    return x.reshape(-1, x.shape[-1]).to(torch.float32).contiguous()


def matmul_q4(x: torch.Tensor, codes: torch.Tensor, d: torch.Tensor, mins: torch.Tensor) -> torch.Tensor:
    """``x`` [M, K] float32 by int4 weights (codes [N, K / 2] uint8, d and mins [N, K / 32] float16): [M, N]."""
    return _q4(library(), x, codes, d, mins)


def matmul_q8(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``x`` [M, K] float32 by int8 weights (codes [N, K] int8, scales [N, K / 32] float16): [M, N]."""
    return _q8(library(), x, codes, scales)


def _activations(lib: ctypes.CDLL, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    m, k = x.shape
    xq = torch.empty(m, k, dtype=ACTIVATIONS)
    xd = torch.empty(m, k // GROUP, dtype=torch.float32)
    xs = torch.empty_like(xd)
    lib.kv_quantize_rows(x.data_ptr(), m, k, xq.data_ptr(), xd.data_ptr(), xs.data_ptr())
    return xq, xd, xs


def _q4(lib: ctypes.CDLL, x: torch.Tensor, codes: torch.Tensor, d: torch.Tensor, mins: torch.Tensor) -> torch.Tensor:
    xq, xd, xs = _activations(lib, x)
    n, k = codes.shape[0], x.shape[1]
    out = torch.empty(x.shape[0], n, dtype=torch.float32)
    lib.kv_matmul_q4(
        xq.data_ptr(), xd.data_ptr(), xs.data_ptr(), x.shape[0],
        codes.data_ptr(), d.data_ptr(), mins.data_ptr(), n, k, out.data_ptr(),
    )  # fmt: skip
    return out


def _q8(lib: ctypes.CDLL, x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    xq, xd, _ = _activations(lib, x)
    n, k = codes.shape
    out = torch.empty(x.shape[0], n, dtype=torch.float32)
    lib.kv_matmul_q8(xq.data_ptr(), xd.data_ptr(), x.shape[0], codes.data_ptr(), scales.data_ptr(), n, k,
                     out.data_ptr())  # fmt: skip
    return out


def quantize_q4(weight: torch.Tensor, rows_at_once: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``weight`` [N, K] as int4 codes packed for the kernel [N, K / 2], d and mins float16 [N, K / 32]:
    ``weight_codes.int4_pairs`` then ``pack_q4``, bit for bit, in one pass (``rows_at_once`` rows of float32
    temporaries at a time)."""
    n, k = weight.shape
    codes = torch.empty(n, k // 2, dtype=torch.uint8)
    d = torch.empty(n, k // GROUP, dtype=torch.float16)
    mins = torch.empty_like(d)
    lib = library()
    for start in range(0, n, rows_at_once):
        rows = weight[start : start + rows_at_once].detach().to(torch.float32).contiguous()
        lib.kv_quantize_q4(
            rows.data_ptr(), rows.shape[0], k, codes[start].data_ptr(), d[start].data_ptr(), mins[start].data_ptr()
        )
    return codes, d, mins


def pack_q4(q: torch.Tensor) -> torch.Tensor:
    """Codes 0..15 as int [N, K] into the kernel's nibbles [N, K / 2]: in each group of 32, byte j holds
    element j (low nibble) and element j + 16 (high nibble)."""
    n, k = q.shape
    grouped = q.to(torch.uint8).reshape(n, k // GROUP, 2, GROUP // 2)
    return (grouped[:, :, 0] | (grouped[:, :, 1] << 4)).reshape(n, k // 2).contiguous()


def unpack_q4(codes: torch.Tensor) -> torch.Tensor:
    n, half = codes.shape
    grouped = codes.reshape(n, half // (GROUP // 2), 1, GROUP // 2)
    return torch.cat([grouped & 0x0F, grouped >> 4], dim=2).reshape(n, half * 2)


def _self_test(lib: ctypes.CDLL) -> None:
    """The built library computes what its layouts say, on a small product (a miscompiled or foreign
    library is refused here, not trusted with a model)."""
    g = torch.Generator().manual_seed(0)
    n, k, m = 40, 96, 5
    x = torch.randn(m, k, generator=g)
    q = torch.randint(0, 16, (n, k), generator=g)
    d = (torch.rand(n, k // GROUP, generator=g) / 8).half()
    mins = (torch.rand(n, k // GROUP, generator=g) - 0.5).half()
    weight = q.float() * d.float().repeat_interleave(GROUP, 1) + mins.float().repeat_interleave(GROUP, 1)
    _close(_q4(lib, x, pack_q4(q), d, mins), x @ weight.t(), "int4")
    q8 = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)  # weight codes
    s = (torch.rand(n, k // GROUP, generator=g) / 64).half()  # a scale per group of 32
    _close(_q8(lib, x, q8, s), x @ (q8.float() * s.float().repeat_interleave(GROUP, 1)).t(), "int8")


def _close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    # 16-bit activations in groups of 32: a product is within ~1e-4 of the float one, never 1e-2 away.
    if not torch.allclose(got, want, rtol=1e-2, atol=1e-2 * float(want.abs().mean())):
        raise AssertionError(f"the {what} self-test computed wrong products")
