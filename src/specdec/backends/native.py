"""Our compiled kernels, exact by construction: a row's result never depends on what shares its call.

- `attention_rows` (csrc/one_query.c): one-query attention for every row of a pass in one call.
- `append_kv` (csrc/kv_append.c): a batched pass's new keys and values into each sequence's
  cache slab, one call per layer.
- `rms_norm` (csrc/norm.c): Llama's RMSNorm over bf16 rows, one call.
- `silu_mul` (csrc/activation.c): a SwiGLU MLP's silu(gate) * up over its merged GEMM's output.
- `rotary` (csrc/rotary.c): the rotary embedding of a pass's queries and keys, read from their
  stacked q/k/v GEMM's output, rounded as transformers' eager bf16 ops round it.
- `linear_i8` (csrc/linear_i8.c): a drafter's int8 linear layers (`pack_i8`): each call rounds
  its input rows to int8 in groups of `I8_GROUP` and sums with the CPU's int8 dot-product
  instruction (AVX512-VNNI; on AVX2, the same sums by multiply-adds of bytes and of 16-bit pairs),
  streaming half of bf16's bytes at the memory's speed. Not exact (only drafts go through it), but
  a row's result depends on that row alone.
- `linear` (csrc/linear.c): bf16 linear layers on weights packed once in tiles (`pack_tiles`),
  read by the CPU's bf16 dot-product instruction (AVX512-BF16; on AVX512 without it and on AVX2,
  each pair widened to fp32 and summed by fused multiply-adds, the same sums on both:
  `linear_widens`). Every output sums over its inputs in one order whatever the call's rows, so a
  decode step's one row and a verification pass's
  rows meet without padding or cutting (backends/rows.py), and a 1..4-row call streams the
  weights at the memory's speed, where oneDNN's blocked kernel reached about two thirds of it
  (docs/kernels.md#tiled-bf16-linears). On a CPU with AMX, `linear` runs the same packed tiles
  on AMX's tiles instead (csrc/linear_amx.c, `linear_amx_kernel`), every call summed in AMX's order
  (docs/kernels.md#tiled-bf16-linears-on-amx).

Attention: a row-exact pass runs attention a query row at a time, each row over exactly the keys it may see
(backends/rows.py); through sdpa that is a call per row per layer, and at 16 sequences in flight
those calls and the Python around them cost more than the attention itself. The kernel takes all
of a pass's rows, each over its own key spans in its own sequence's cache, and computes every
(row, key/value head) by the same code from its own inputs alone: a decode step's row and the
same row inside a batch come out with the same bits by construction. Decode steps use it too, so
every pass kind agrees.

Both are C, built at first use with the machine's C compiler (`cc`, or $CC) for this CPU, and kept
under specdec's home (kernels/). Where they cannot be built or loaded, or with SPECDEC_NATIVE=0,
attention stays sdpa a row at a time and linears oneDNN's (exact too, slower); on CPUs without
AVX2 and FMA the linears stay oneDNN's. CPU only; attention in bf16 and fp32, linears in bf16.
"""

from __future__ import annotations

import array
import contextlib
import ctypes
import functools
import hashlib
import logging
import mmap
import os
import platform
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from ..errors import SpecdecError

log = logging.getLogger("specdec.backends")

SOURCES = [Path(__file__).parent / "csrc" / name for name in ("one_query.c", "linear.c", "kv_append.c", "activation.c",
                                                                   "norm.c", "candidates.c", "linear_i8.c", "rotary.c",
                                                                   "linear_amx.c")]
HEADERS = [Path(__file__).parent / "csrc" / "vec16.h"]
FLAGS = ["-O3", "-march=native", "-ffp-contract=fast", "-fopenmp", "-shared", "-fPIC", "-std=gnu11"]
# a build that no process loaded for this long (each load touches it) goes at the next build: each
# change of sources, compiler or CPU leaves its build behind, and nothing else would remove it
STALE_SECONDS = 30 * 24 * 3600


def _cpu_signature() -> str:
    """What -march=native compiles for: a home shared by machines of other CPUs gets other builds."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor()
    return next((line for line in lines if line.startswith(("flags", "Features"))), platform.processor())


def _compiler_version(compiler: str) -> bytes:
    """What `compiler --version` prints (another compiler, another build), or its name."""
    try:
        return subprocess.run([compiler, "--version"], capture_output=True, timeout=30).stdout or compiler.encode()
    except (OSError, subprocess.SubprocessError):
        return compiler.encode()


def _build(target: Path, compiler: str) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as scratch:  # workers building at once each replace it whole
        built = Path(scratch) / target.name
        subprocess.run([compiler, *FLAGS, "-o", str(built), *map(str, SOURCES), "-lm"], check=True,
                       capture_output=True, text=True, timeout=120)
        os.replace(built, target)


def prune_builds(keep: Path, stale: float = STALE_SECONDS) -> list[Path]:
    """Remove the other builds beside `keep` that no process loaded for `stale` seconds -> those
    removed. On a local disk a process still running one keeps it mapped; a checkout that needs
    one again builds it anew (under a second). A home on a network filesystem shared by machines
    that run specdec for over a month at a time should keep its own `SPECDEC_HOME` per machine."""
    removed, now = [], time.time()
    for build in keep.parent.glob("specdec-*.so"):
        with contextlib.suppress(OSError):  # gone already, or another user's
            if build != keep and now - build.stat().st_mtime > stale:
                build.unlink()
                removed.append(build)
    return removed


def _load(target: Path, compiler: str) -> ctypes.CDLL:
    """The build at `target`, made first where it is missing, touched as in use (`prune_builds`)."""
    for attempt in range(2):
        with contextlib.suppress(OSError):  # missing, or a read-only home that keeps its builds as they are
            os.utime(target)
        if not target.exists():
            _build(target, compiler)
            prune_builds(target)
        try:
            # torch's CPU wheels load their libgomp as libgomp.so.1, which this library's OpenMP binds to
            return ctypes.CDLL(str(target))
        except OSError:
            if attempt or target.exists():
                raise
            # another process pruned it between our look and our load (its last use was a month ago)


def build_stamp() -> str:
    """Which build of the kernels runs (a hash of their sources, flags, compiler and CPU: its file
    is specdec-<stamp>.so), or "off": what measured pass costs depend on besides the model
    (`pass_costs`)."""
    lib = library()
    return Path(lib._name).stem.removeprefix("specdec-") if lib is not None else "off"


@functools.cache
def library() -> ctypes.CDLL | None:
    """The compiled kernels, or None where they are off or cannot be built (the reason logged once)."""
    if os.environ.get("SPECDEC_NATIVE", "1") == "0":
        return None
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        log.warning("no C compiler (cc): attention runs through sdpa a row at a time, linears through oneDNN")
        return None
    from ..models.catalogue import home

    parts = [source.read_bytes() for source in SOURCES + HEADERS] + [" ".join(FLAGS).encode(), _compiler_version(compiler),
                                                           platform.machine().encode(), _cpu_signature().encode()]
    stamp = hashlib.sha256(bytes(1).join(parts)).hexdigest()[:16]
    target = home() / "kernels" / f"specdec-{stamp}.so"
    try:
        return _load(target, compiler)
    except (OSError, subprocess.SubprocessError) as error:
        detail = ((error.stderr if isinstance(error, subprocess.CalledProcessError) else None) or str(error)).strip()
        log.warning("specdec's kernels could not be built (%s): attention runs through sdpa a row at a time, "
                    "linears through oneDNN", detail.splitlines()[-1] if detail else type(error).__name__)
        return None


def _function(name: str, restype, argtypes: list):
    """The compiled function `name` with its C types, or None where the library is not built."""
    lib = library()
    if lib is None:
        return None
    function = lib[name]
    function.restype, function.argtypes = restype, argtypes
    return function


@functools.cache
def one_query_kernel():
    """The compiled `specdec_one_query_rows`, or None (`library`)."""
    return _function("specdec_one_query_rows", ctypes.c_int,
                     [ctypes.c_int64] * 5 + [ctypes.c_float, ctypes.c_int, ctypes.c_int]
                     + [ctypes.c_void_p, ctypes.c_int64] + [ctypes.c_void_p] * 9)


def _built_with(flag: str) -> bool:
    """Whether the library is built and its instruction-set `flag` function says its kernel is in."""
    lib = library()
    return lib is not None and bool(lib[flag]())


@functools.cache
def linear_kernel():
    """The compiled `specdec_linear_bf16`, or None where the library is not built or the CPU has
    neither AVX512 nor AVX2 with FMA (the library was built without it): on AVX512-BF16 its
    dot-product instruction, else fused multiply-adds on pairs widened to fp32 (`linear_widens`)."""
    if not _built_with("specdec_linear_available"):
        return None
    return _function("specdec_linear_bf16", ctypes.c_int,
                     [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
                      ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_void_p])


@functools.cache
def linear_widens() -> bool:
    """Whether `linear` sums with fused multiply-adds on bf16 pairs widened to fp32 (AVX512 without
    its BF16 extension, 2; AVX2, 3: the same sums, 8 lanes at a time), not the CPU's bf16
    dot-product instruction."""
    lib = library()
    return lib is not None and lib["specdec_linear_available"]() in (2, 3)


@functools.cache
def linear_on_avx2() -> bool:
    """Whether `linear` runs on AVX2's 8-lane fused multiply-adds (a CPU without AVX512)."""
    lib = library()
    return lib is not None and lib["specdec_linear_available"]() == 3


@functools.cache
def linear_amx_kernel():
    """The compiled `specdec_linear_amx_bf16` (csrc/linear_amx.c: the tiled layout's sums rounded as
    AMX rounds them, on AMX tiles for many rows and on FMAs for a few), or None where the CPU has
    no AMX or Linux did not lend this process its tiles."""
    if not _built_with("specdec_linear_amx_available"):
        return None
    return _function("specdec_linear_amx_bf16", ctypes.c_int,
                     [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
                      ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_void_p])


TILE = 16  # outputs per tile of a packed weight (csrc/linear.c)


def pack_tiles(weight: torch.Tensor) -> torch.Tensor:
    """weight [N, K] (K even) -> bf16 [ceil(N / 16), K / 2, 16, 2]: tile t, input pair p holds
    W[16t + i, 2p + j] at [t, p, i, j] (rows past N zero), the layout `linear` reads."""
    n, k = weight.shape
    padded = -(-n // TILE) * TILE
    weight = weight.detach().to(torch.bfloat16)
    if padded != n:
        weight = torch.cat([weight, weight.new_zeros(padded - n, k)])
    return weight.reshape(padded // TILE, TILE, k // 2, 2).permute(0, 2, 1, 3).contiguous()


def unpack_tiles(packed: torch.Tensor, n: int) -> torch.Tensor:
    """`pack_tiles`'s inverse: [N, K] bf16."""
    tiles, pairs = packed.shape[:2]
    return packed.permute(0, 2, 1, 3).reshape(tiles * TILE, pairs * 2)[:n].contiguous()


HUGE_PAGE = 2 << 20  # Linux's transparent huge page on x86-64 and most arm64 kernels


def huge_pages(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` copied into memory that Linux backs with 2 MB pages where it grants them (transparent
    huge pages asked for with madvise, which most distributions' default setting requires), or
    `tensor` itself: elsewhere, on another device, or under 2 MB.

    A pass streams every packed weight once; on 4 KB pages each 4 KB of it costs a TLB miss. The
    1.5B target's 28 layers and head in our tiled GEMMs took 0.98x the time at 1 row, 0.95x at 4
    and 0.94x at 16 on 2 MB pages (docs/kernels.md#tiled-bf16-linears). The mapping's 2 MB of slack
    costs address space, and at most the rest of the last huge page in memory."""
    size = tensor.numel() * tensor.element_size()
    if tensor.device.type != "cpu" or size < HUGE_PAGE or platform.system() != "Linux":
        return tensor
    try:
        advice = mmap.MADV_HUGEPAGE
        # private: a shared anonymous mapping is shmem, whose huge pages another setting governs
        memory = mmap.mmap(-1, size + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    except (AttributeError, OSError, ValueError):  # no madvise in this Python, or no memory to map
        return tensor
    offset = -ctypes.addressof(ctypes.c_char.from_buffer(memory)) % HUGE_PAGE
    with contextlib.suppress(OSError):  # a kernel without transparent huge pages: 4 KB pages, as before
        memory.madvise(advice, offset, size)
    copy = torch.frombuffer(memory, dtype=torch.uint8, count=size, offset=offset)  # keeps `memory` alive
    return copy.view(tensor.dtype).view(tensor.shape).copy_(tensor)


def _scratch(rows: int, k: int, n: int, threads: int) -> int:
    """Floats of scratch space `specdec_linear_bf16` needs for `rows` rows of `k` inputs and `n` outputs."""
    return _scratch_function()(rows, k, n, threads)


@functools.cache
def _scratch_function():
    return _function("specdec_linear_scratch", ctypes.c_int64, [ctypes.c_int64] * 3 + [ctypes.c_int])


def linear(x: torch.Tensor, packed: torch.Tensor, n: int, bias: torch.Tensor | None) -> torch.Tensor:
    """x [M, K] bf16 @ W^T (+ bias [n] bf16) -> [M, n] bf16, W packed by `pack_tiles`; sums in fp32,
    each output's over k in one order whatever M is, rounded once."""
    rows, k = x.shape
    if x.dtype != torch.bfloat16 or x.device.type != "cpu":
        raise SpecdecError(f"the tiled bf16 linear takes bf16 inputs on the CPU, not {x.dtype} on {x.device}")
    if (packed.dtype != torch.bfloat16 or not packed.is_contiguous() or packed.shape[1:] != (k // 2, TILE, 2)
            or k % 2 or not k or packed.shape[0] * TILE < n):
        raise SpecdecError(f"a tiled weight [{n}, {k}] must be packed by pack_tiles, not {tuple(packed.shape)} "
                           f"{packed.dtype}")
    if bias is not None and (bias.dtype != torch.bfloat16 or not bias.is_contiguous() or bias.shape != (n,)):
        raise SpecdecError(f"a tiled layer's bias must be bf16 [{n}], contiguous")
    if x.stride(-1) != 1:
        x = x.contiguous()
    threads = torch.get_num_threads()
    y = torch.empty(rows, n, dtype=torch.bfloat16)
    amx = linear_amx_kernel()  # on an AMX CPU every call rounds as AMX does, whatever its rows
    if amx is not None:
        scratch = torch.empty(_amx_scratch(rows, k, threads), dtype=torch.float32)
    else:
        scratch = torch.empty(_scratch(rows, k, n, threads), dtype=torch.float32)
    if rows:
        with _traced("specdec::linear_bf16"):
            done = (amx or linear_kernel())(x.data_ptr(), rows, x.stride(0), packed.data_ptr(), n, k,
                                            None if bias is None else bias.data_ptr(), y.data_ptr(), n, threads,
                                            scratch.data_ptr())
        if done != 0:
            raise SpecdecError("the AMX linear kernel could not use AMX's tiles in this process")
    return y


def _amx_scratch(rows: int, k: int, threads: int) -> int:
    """Floats of scratch space `specdec_linear_amx_bf16` needs."""
    return _amx_scratch_function()(rows, k, threads)


@functools.cache
def _amx_scratch_function():
    return _function("specdec_linear_amx_scratch", ctypes.c_int64, [ctypes.c_int64, ctypes.c_int64, ctypes.c_int])


@functools.cache
def linear_i8_kernel():
    """The compiled `specdec_linear_i8`, or None where the library is not built or the CPU has
    neither AVX512-VNNI nor AVX2 (the library was built without it)."""
    if not _built_with("specdec_linear_i8_available"):
        return None
    _function("specdec_linear_i8_scratch", ctypes.c_int64, [ctypes.c_int64] * 3)  # typed for `linear_i8`
    return _function("specdec_linear_i8", ctypes.c_int,
                     [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                      ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int,
                      ctypes.c_void_p])


@functools.cache
def linear_i8_on_avx2() -> bool:
    """Whether `linear_i8` sums on AVX2 (the same sums as AVX512-VNNI's dot products, by more
    instructions a weight byte: it beats bf16 tiles there for 1-2 rows only)."""
    lib = library()
    return lib is not None and lib["specdec_linear_i8_available"]() == 2


# inputs a call of `linear_i8` rounds with one scale (per row): an outlier channel flattens only its
# own group, as in llama.cpp's Q8_0 blocks; 32 and 64 stream alike (docs/kernels.md)
I8_GROUP = 32


def pack_i8(int8: torch.Tensor) -> torch.Tensor:
    """int8 weight [N, K] (K a multiple of 4) -> uint8 [ceil(N / 16), K / 4, 16, 4]: tile t, input
    quad p holds W[16t + i, 4p + j] + 128 at [t, p, i, j] (rows past N: 128, a zero weight), the
    layout `linear_i8` reads."""
    n, k = int8.shape
    padded = -(-n // TILE) * TILE
    offset = (int8.to(torch.int16) + 128).to(torch.uint8)
    if padded != n:
        offset = torch.cat([offset, offset.new_full((padded - n, k), 128)])
    return offset.reshape(padded // TILE, TILE, k // 4, 4).permute(0, 2, 1, 3).contiguous()


def linear_i8(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, n: int,
              bias: torch.Tensor | None) -> torch.Tensor:
    """x [M, K] bf16 @ (W * scales[:, None])^T (+ bias [n] bf16) -> [M, n] bf16, W int8 packed by
    `pack_i8`, scales [n] fp32; each row of x rounded to int8 in groups of I8_GROUP inputs, one
    scale a group (K a multiple of I8_GROUP)."""
    rows, k = x.shape
    if x.dtype != torch.bfloat16 or x.device.type != "cpu" or k % I8_GROUP:
        raise SpecdecError(f"the int8 linear takes bf16 inputs of a width divisible by {I8_GROUP} on the CPU, "
                           f"not {x.dtype} [{rows}, {k}] on {x.device}")
    if (packed.dtype != torch.uint8 or not packed.is_contiguous() or packed.shape[1:] != (k // 4, TILE, 4)
            or packed.shape[0] * TILE < n or scales.dtype != torch.float32 or scales.shape != (n,)
            or not scales.is_contiguous()):
        raise SpecdecError(f"an int8 weight [{n}, {k}] must be packed by pack_i8 with fp32 scales [{n}], not "
                           f"{tuple(packed.shape)} {packed.dtype} and {tuple(scales.shape)} {scales.dtype}")
    if bias is not None and (bias.dtype != torch.bfloat16 or not bias.is_contiguous() or bias.shape != (n,)):
        raise SpecdecError(f"an int8 layer's bias must be bf16 [{n}], contiguous")
    kernel = linear_i8_kernel()
    if kernel is None:
        raise SpecdecError("the int8 kernel is not built here (no C compiler, SPECDEC_NATIVE=0, or neither "
                           "AVX512-VNNI nor AVX2)")
    if x.stride(-1) != 1:
        x = x.contiguous()
    y = torch.empty(rows, n, dtype=torch.bfloat16)
    if rows:
        scratch = torch.empty(library().specdec_linear_i8_scratch(rows, k, I8_GROUP), dtype=torch.uint8)
        with _traced("specdec::linear_i8"):
            kernel(x.data_ptr(), rows, x.stride(0), packed.data_ptr(), scales.data_ptr(), n, k, I8_GROUP,
                   None if bias is None else bias.data_ptr(), y.data_ptr(), n, torch.get_num_threads(),
                   scratch.data_ptr())
    return y


@functools.cache
def silu_mul_kernel():
    """The compiled `specdec_silu_mul_bf16`, or None (`library`)."""
    return _function("specdec_silu_mul_bf16", None, [ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64,
                                                     ctypes.c_void_p, ctypes.c_int64, ctypes.c_int])


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [M, 2I] bf16 (gate's I columns, then up's) -> silu(gate) * up [M, I] bf16, rounded as
    torch rounds `silu(gate)` and then the product; each element on its own."""
    rows, width = gate_up.shape
    if gate_up.dtype != torch.bfloat16 or gate_up.device.type != "cpu" or width % 2:
        raise SpecdecError(f"silu_mul takes bf16 [rows, 2 * width] on the CPU, not {gate_up.dtype} "
                           f"{tuple(gate_up.shape)} on {gate_up.device}")
    if gate_up.stride(-1) != 1:
        gate_up = gate_up.contiguous()
    out = torch.empty(rows, width // 2, dtype=torch.bfloat16)
    with _traced("specdec::silu_mul"):
        silu_mul_kernel()(rows, width // 2, gate_up.data_ptr(), gate_up.stride(0), out.data_ptr(), out.stride(0),
                          torch.get_num_threads())
    return out


@functools.cache
def rotary_kernel():
    """The compiled `specdec_rotary_bf16`, or None (`library`)."""
    return _function("specdec_rotary_bf16", None, [ctypes.c_int64] * 3 + [ctypes.c_void_p, ctypes.c_int64]
                     + [ctypes.c_void_p] * 2 + [ctypes.c_int64, ctypes.c_void_p, ctypes.c_int])


def rotary(stacked: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int, kv_heads: int,
           dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The queries and keys of a stacked q/k/v projection's output, rotated.

    stacked [1, T, >= (heads + kv_heads) * dim] bf16: q's heads, then k's; cos, sin [1, T, dim] bf16.
    Returns (q [1, heads, T, dim], k [1, kv_heads, T, dim]) contiguous: each element
    bf16(bf16(x * cos) + bf16(rotate_half(x) * sin)), transformers' `apply_rotary_pos_emb` as
    eager torch rounds it.
    """
    rows = stacked.shape[1] if stacked.dim() == 3 else -1
    if (stacked.dim() != 3 or stacked.shape[0] != 1 or stacked.shape[-1] < (heads + kv_heads) * dim or dim % 2
            or cos.shape != (1, rows, dim) or sin.shape != cos.shape
            or any(t.dtype != torch.bfloat16 or t.device.type != "cpu" for t in (stacked, cos, sin))):
        raise SpecdecError(f"rotary takes bf16 [1, T, (heads + kv_heads) * dim] and cos, sin [1, T, dim] on the CPU, "
                           f"not {tuple(stacked.shape)} {stacked.dtype} and {tuple(cos.shape)} {cos.dtype}")
    if stacked.stride(-1) != 1:
        stacked = stacked.contiguous()
    cos, sin = cos.contiguous(), sin.contiguous()
    q = torch.empty(1, heads, rows, dim, dtype=torch.bfloat16)
    k = torch.empty(1, kv_heads, rows, dim, dtype=torch.bfloat16)
    threads = torch.get_num_threads()
    with _traced("specdec::rotary"):
        for out, first, count in ((q, 0, heads), (k, heads * dim, kv_heads)):
            rotary_kernel()(rows, count, dim, stacked.data_ptr() + first * 2, stacked.stride(1), cos.data_ptr(),
                            sin.data_ptr(), dim, out.data_ptr(), threads)
    return q, k


@functools.cache
def rms_norm_kernel():
    """The compiled `specdec_rms_norm_bf16`, or None (`library`)."""
    return _function("specdec_rms_norm_bf16", None, [ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64,
                                                     ctypes.c_void_p, ctypes.c_float, ctypes.c_void_p, ctypes.c_int64,
                                                     ctypes.c_int])


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., H] bf16, weight [H] bf16 -> weight * x / sqrt(mean(x²) + eps) [..., H] bf16, each row
    on its own, rounded as transformers' RMSNorm rounds (after the division, after the weight)."""
    width = x.shape[-1]
    if x.dtype != torch.bfloat16 or weight.dtype != torch.bfloat16 or x.device.type != "cpu" \
            or weight.shape != (width,):
        raise SpecdecError(f"rms_norm takes bf16 rows and a bf16 weight of their width on the CPU, not "
                           f"{x.dtype} {tuple(x.shape)} and {weight.dtype} {tuple(weight.shape)}")
    flat = x.reshape(-1, width)
    if flat.stride(-1) != 1:
        flat = flat.contiguous()
    weight = weight.contiguous()
    out = torch.empty(flat.shape, dtype=torch.bfloat16)
    with _traced("specdec::rms_norm"):
        rms_norm_kernel()(flat.shape[0], width, flat.data_ptr(), flat.stride(0), weight.data_ptr(), eps,
                          out.data_ptr(), width, torch.get_num_threads())
    return out.view(x.shape)


@functools.cache
def candidates_kernel():
    """The compiled `specdec_head_candidates`, or None (`library`)."""
    return _function("specdec_head_candidates", ctypes.c_int,
                     [ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p,
                      ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int])


def head_candidates(logits: torch.Tensor, sum_error: torch.Tensor,
                    room: int = 64) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """A bf16 head's output widened to fp32, and each row's near-top candidates, in one call.

    logits [T, V] bf16 on the CPU; sum_error [T] fp32: each row's bound on its fp32 summation error.
    Returns (logits [T, V] fp32, rows [n], ids [n]): the tokens whose logit is at least
    top - (2^(e - 6) + sum_error) for its row's maximum top of binary exponent e, rows ascending,
    ids ascending within a row; the arithmetic of `rows.refine_top_logits`, which takes over
    (None) where the kernel is not built, a row's maximum is not finite, or a row has more than
    `room` candidates.
    """
    kernel = candidates_kernel()
    if kernel is None or logits.dtype != torch.bfloat16 or logits.device.type != "cpu" or logits.dim() != 2 \
            or logits.stride(-1) != 1 or sum_error.shape != logits.shape[:1] or sum_error.device.type != "cpu":
        return None
    rows, vocab = logits.shape
    sum_error = sum_error.to(torch.float32).contiguous()
    wide = torch.empty(rows, vocab, dtype=torch.float32)
    counts = torch.empty(rows, dtype=torch.int64)
    ids = torch.empty(rows, room, dtype=torch.int64)
    with _traced("specdec::head_candidates"):
        failed = kernel(rows, vocab, logits.data_ptr(), logits.stride(0), wide.data_ptr(), sum_error.data_ptr(), room,
                        counts.data_ptr(), ids.data_ptr(), torch.get_num_threads())
    if failed:
        return None
    kept = torch.arange(room) < counts[:, None]  # [T, room]: each row's first counts[t] slots
    return wide, torch.arange(rows).repeat_interleave(counts), ids[kept]


def _traced(name: str):
    """A named range for torch's profiler around a kernel call, where it is recording (`specdec
    profile --ops` sorts its ops by name); nothing otherwise."""
    if torch.autograd.profiler._is_profiler_enabled:
        return torch.profiler.record_function(name)
    return contextlib.nullcontext()


def _int64s(values) -> array.array:
    """int64 values for a kernel (an `array.array`: built several times faster than a ctypes array;
    pass its address, `_at`)."""
    return array.array("q", values)


def _at(values: array.array) -> int:
    return values.buffer_info()[0]


class RowLayout:
    """Which query rows a call computes and the keys each sees, the same for every layer of a
    pass: row i is query row `query_rows[i]` (of the query's [B, heads, T, D] rows, b * T + t) of
    sequence `sequences[i]`, over its key spans `spans[i]` (each a slice, or a tuple of slices
    read in order)."""

    def __init__(self, query_rows: list[int], sequences: list[int], spans: list):
        runs, bounds = [], [0]
        self.ends: dict[int, int] = {}  # sequence -> the furthest key position its rows read
        for sequence, span in zip(sequences, spans):
            for run in (span if isinstance(span, tuple) else (span,)):
                if not 0 <= run.start < run.stop:
                    raise SpecdecError(f"a row's keys must be non-empty runs from position 0 on, not {run}")
                runs += [run.start, run.stop]
                self.ends[sequence] = max(self.ends.get(sequence, 0), run.stop)
            bounds.append(len(runs) // 2)
        self.rows = len(query_rows)
        self.query_rows, self.sequences = query_rows, _int64s(sequences)
        self.bounds, self.runs = _int64s(bounds), _int64s(runs)


def takes(query: torch.Tensor, key: torch.Tensor) -> bool:
    """Whether the attention kernel computes a model's rows: it is built, the model runs on the CPU
    in bf16 or fp32, and has at most 16 query heads per key/value head. A model's shape and dtype
    decide it, never a tensor's layout (`attention_rows` copies what it cannot read in place), so
    every row of a model takes the same path."""
    heads, kv_heads = query.shape[1], key.shape[1]
    return (one_query_kernel() is not None and query.device.type == "cpu" and key.dtype == query.dtype
            and query.dtype in (torch.bfloat16, torch.float32) and heads % kv_heads == 0 and heads // kv_heads <= 16)


def _readable(x: torch.Tensor) -> torch.Tensor:
    """x as the kernel reads it: positions (and each head's values) contiguous."""
    return x if x.stride(-1) == 1 and (x.shape[-2] <= 1 or x.stride(-2) == x.shape[-1]) else x.contiguous()


class KeyValues:
    """One layer's keys and values of several sequences, as the kernels read them: sequence s's
    keys [kv_heads, positions, D] from address k_ptrs[s], heads k_heads[s] elements apart,
    positions contiguous, `capacities[s]` positions of room, the first `lengths[s]` valid (values
    likewise).

    slabs[s]: sequence s's (keys, values) [1, kv_heads, capacity, D] (kept here, so that their
    memory outlives the calls); addresses[s]: `address(*slabs[s])`, where the caller keeps it."""

    def __init__(self, slabs: list[tuple[torch.Tensor, torch.Tensor]], lengths: list[int],
                 addresses: list[tuple[int, int, int, int, int]] | None = None):
        self.slabs, self.lengths = slabs, lengths
        self.kv_heads, self.dtype, self.vdim = slabs[0][0].shape[1], slabs[0][0].dtype, slabs[0][1].shape[-1]
        k_ptrs, v_ptrs, k_heads, v_heads, capacities = zip(*(addresses or [address(k, v) for k, v in slabs]))
        self.k_ptrs, self.v_ptrs, self.k_heads, self.v_heads = map(_int64s, (k_ptrs, v_ptrs, k_heads, v_heads))
        self.capacities = _int64s(capacities)

    @classmethod
    def of(cls, keys: list[torch.Tensor], values: list[torch.Tensor]) -> KeyValues:
        """Caches [1, kv_heads, L_s, D], all valid (copied where the kernel cannot read them in place)."""
        return cls([(_readable(k), _readable(v)) for k, v in zip(keys, values)], [k.shape[2] for k in keys])

    def views(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Each sequence's valid keys and values, [1, kv_heads, lengths[s], D]."""
        return ([k[:, :, :n] for (k, _), n in zip(self.slabs, self.lengths)],
                [v[:, :, :n] for (_, v), n in zip(self.slabs, self.lengths)])


def address(keys: torch.Tensor, values: torch.Tensor) -> tuple[int, int, int, int, int]:
    """Where the kernels read (write) a sequence's keys and values [1, kv_heads, capacity, D]:
    (keys' address, values' address, their head strides, the positions they hold)."""
    if keys.stride(-1) != 1 or values.stride(-1) != 1 or keys.shape[-2] != values.shape[-2] or \
            keys.shape[-2] > 1 and (keys.stride(-2) != keys.shape[-1] or values.stride(-2) != values.shape[-1]):
        raise SpecdecError("the kernels read a cache's positions contiguous, as many keys as values")
    return keys.data_ptr(), values.data_ptr(), keys.stride(1), values.stride(1), keys.shape[-2]


@functools.cache
def append_kernel():
    """The compiled `specdec_append_kv`, or None (`library`)."""
    return _function("specdec_append_kv", ctypes.c_int,
                     [ctypes.c_int64] * 5 + [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64] * 2
                     + [ctypes.c_void_p] * 7)


def append_kv(key: torch.Tensor, value: torch.Tensor, counts: list[int], starts: list[int],
              slabs: list[tuple[torch.Tensor, torch.Tensor]],
              addresses: list[tuple[int, int, int, int, int]] | None = None) -> KeyValues:
    """Write a batched pass's new keys and values into each sequence's slab, in one call.

    key, value: [1, kv_heads, sum(counts), D] (and Dv), sequence s's rows the next counts[s];
    slabs[s]: its (keys, values) [1, kv_heads, capacity, D], of key's dtype, with room for positions
    starts[s] .. starts[s] + counts[s] - 1, which receive them; addresses: as `KeyValues` takes them.
    Returns the slabs as `attention_rows` reads them, valid up to starts[s] + counts[s].
    """
    kv = KeyValues(slabs, [a + n for a, n in zip(starts, counts)], addresses)
    if kv.dtype != key.dtype or value.dtype != key.dtype or key.shape[0] != 1 or value.shape[:3] != key.shape[:3] \
            or sum(counts) > key.shape[2] or any(k.shape[0] != 1 or k.shape[1:2] + k.shape[3:] != key.shape[1:2] + key.shape[3:]
                                                 or v.shape[3:] != value.shape[3:] for k, v in slabs):
        raise SpecdecError(f"a pass's keys {tuple(key.shape)} and values {tuple(value.shape)} ({key.dtype}) do not "
                           f"fit its caches' slabs or counts")
    if key.stride(-1) != 1:
        key = key.contiguous()
    if value.stride(-1) != 1:
        value = value.contiguous()
    size = key.element_size()
    counts, starts = _int64s(counts), _int64s(starts)  # alive through the call
    failed = append_kernel()(len(slabs), key.shape[1], size, key.shape[-1] * size, value.shape[-1] * size,
                             key.data_ptr(), key.stride(1) * size, key.stride(2) * size,
                             value.data_ptr(), value.stride(1) * size, value.stride(2) * size,
                             _at(counts), _at(starts), _at(kv.capacities), _at(kv.k_ptrs), _at(kv.v_ptrs),
                             _at(kv.k_heads), _at(kv.v_heads))
    if failed:
        raise SpecdecError("a sequence's slab has no room for its pass's keys")
    return kv


def attention_rows(query: torch.Tensor, kv: KeyValues, layout: RowLayout, scale: float) -> torch.Tensor:
    """Every row of `layout` in one kernel call.

    query [B, heads, T, D]; kv: each sequence's cache (`KeyValues`), grouped-query head h reading
    key/value head h // (heads // kv_heads).
    Returns [rows, heads, Dv] in query's dtype.
    """
    kernel = one_query_kernel()
    if query.stride(-1) != 1:
        query = query.contiguous()
    for s, end in layout.ends.items():  # a span past its cache would read out of bounds
        if end > kv.lengths[s]:
            raise SpecdecError(f"a row's keys reach position {end} of a cache holding {kv.lengths[s]}")
    heads, dim = query.shape[1], query.shape[-1]
    vdim = kv.vdim
    out = torch.empty(layout.rows, heads, vdim, dtype=query.dtype)
    length = query.shape[2]
    offsets = _int64s([r // length * query.stride(0) + r % length * query.stride(2) for r in layout.query_rows])
    with _traced("specdec::one_query_rows"):
        status = kernel(layout.rows, heads, kv.kv_heads, dim, vdim, scale, int(query.dtype == torch.bfloat16),
                        torch.get_num_threads(), query.data_ptr(), query.stride(1), _at(offsets),
                        _at(layout.sequences), _at(layout.bounds), _at(layout.runs), _at(kv.k_ptrs), _at(kv.v_ptrs),
                        _at(kv.k_heads), _at(kv.v_heads), out.data_ptr())
    if status:
        raise MemoryError("the one-query attention kernel ran out of memory")
    return out
