"""CUDA top-k by magnitude: radix select on float bit patterns, in CuPy raw kernels.

Imported only when the ``cupy`` backend is asked for; CuPy itself is imported lazily, so
this module also imports (and its pure helpers work) on machines without a GPU.

Why bit patterns: for an IEEE float with the sign bit cleared, the bit pattern read as
an unsigned integer is ordered exactly like the magnitude (+0 < denormals < normals <
inf < NaN). So ``key = bits(x) & ~sign`` turns "k largest |x|" into "k largest unsigned
keys", which a radix select finds exactly. NaN keys sort above inf, matching
``torch.topk``. The same code serves float16/bfloat16 (15-bit keys), float32 (31 bits)
and float64 (63 bits); bfloat16 reaches CuPy as int16 (CuPy has no bfloat16 dtype).

Algorithm for one call (D elements, 1 <= k < D; ``TopkSelector`` handles k == D):

1. Radix select, most significant digit first, digits of at most 11 bits (31-bit keys:
   11 + 10 + 10). Each digit costs two kernels and no host synchronisation:

   * ``radix_histogram`` - histogram of the current digit over the keys whose higher
     digits equal the prefix found so far (grid-stride, per-block shared-memory
     histogram; lanes of a warp hitting the same bin add once via ``__match_any_sync``);
   * ``radix_pick_digit`` - one block: suffix sums of the histogram, the bin holding the
     k-th largest key, i.e. ``above < rank <= above + count``; the prefix grows by that
     digit and ``rank -= above``.

   After the last digit the device-side state holds T, the k-th largest key, and
   ``need``, how many keys equal to T belong to the top k (all keys > T do).
2. ``count_tile_matches`` - per tile of ``TILE`` elements, the number of keys > T and
   == T; exclusive prefix sums of those counts (``torch.cumsum``) give every tile its
   output offsets.
3. ``write_selected`` - each block walks its tile in index order, ranks its elements
   with warp ballots, and writes an element when ``key > T``, or ``key == T`` and fewer
   than ``need`` equal keys come before it (the lower-index-first tie rule). Output
   position = (#keys > T before it) + min(#keys == T before it, need), so values and
   indices come out in ascending index order, deterministically (no atomics decide the
   order).

Memory traffic: (digits + 2) reads of x (5 for float32), plus 12 bytes per selected
entry written. Kernels run on PyTorch's current CUDA stream; all buffers are torch
tensors shared with CuPy through DLPack (zero copy).
"""

import math
from dataclasses import dataclass

import numpy as np
import torch

from omgs_hook.topk import BackendUnavailableError, TopkSelector

MAX_DIGIT_BITS = 11  # 2048 bins: 8 KiB of shared memory per histogram block
TILE = 4096  # elements per block in the count and write kernels
BLOCK = 256  # threads per block (a multiple of the 32-lane warp)
PICK_BLOCK = 1024  # threads of the single pick block: 2 bins per thread at 11 bits


@dataclass(frozen=True)
class KeyFormat:
    """How a float dtype maps to unsigned magnitude keys."""

    c_type: str  # unsigned C type of the same width
    int_dtype: torch.dtype  # signed torch view of the same width (DLPack-able)
    key_bits: int  # bits below the sign bit


KEY_FORMATS = {
    torch.float16: KeyFormat("unsigned short", torch.int16, 15),
    torch.bfloat16: KeyFormat("unsigned short", torch.int16, 15),
    torch.float32: KeyFormat("unsigned int", torch.int32, 31),
    torch.float64: KeyFormat("unsigned long long", torch.int64, 63),
}


def radix_digit_plan(key_bits, max_digit_bits=MAX_DIGIT_BITS):
    """Digits of a ``key_bits``-bit key, most significant first, as (shift, bits) pairs.

    The fewest digits of at most ``max_digit_bits`` bits, widths as equal as possible
    (wider ones first): 31 -> (20, 11), (10, 10), (0, 10).
    """
    if key_bits < 1 or max_digit_bits < 1:
        raise ValueError(f"radix_digit_plan: key_bits={key_bits}, max_digit_bits={max_digit_bits}")
    count = math.ceil(key_bits / max_digit_bits)
    base, extra = divmod(key_bits, count)
    widths = [base + 1] * extra + [base] * (count - extra)
    plan, remaining = [], key_bits
    for width in widths:
        remaining -= width
        plan.append((remaining, width))
    return tuple(plan)


KERNEL_SOURCE = r"""
typedef {c_type} raw_bits_t;
#define MAGNITUDE_MASK {mask:#x}ULL
#define FULL_WARP 0xffffffffu
#define PICK_BLOCK {pick_block}
#define MAX_BINS {max_bins}

// |x| as an unsigned key: ordered like the magnitude, NaN above inf.
__device__ __forceinline__ unsigned long long magnitude_key(raw_bits_t raw) {{
    return ((unsigned long long)raw) & MAGNITUDE_MASK;
}}

// Histogram of digit (key >> shift) & (2^digit_bits - 1) over the keys whose bits above
// the digit equal state[0]. Grid-stride; the loop trip count is uniform per block so
// every lane reaches __match_any_sync. blockDim must be a multiple of 32.
extern "C" __global__ void radix_histogram(
        const raw_bits_t* __restrict__ x, long long n, const unsigned long long* __restrict__ state,
        int shift, int digit_bits, unsigned long long* __restrict__ hist) {{
    extern __shared__ unsigned int block_hist[];
    const int nbins = 1 << digit_bits;
    for (int b = threadIdx.x; b < nbins; b += blockDim.x) block_hist[b] = 0u;
    __syncthreads();
    const unsigned long long prefix = state[0];
    const int high_shift = shift + digit_bits;
    const unsigned int lane = threadIdx.x & 31u;
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (long long base = (long long)blockIdx.x * blockDim.x; base < n; base += stride) {{
        const long long i = base + threadIdx.x;
        int bin = -1;
        if (i < n) {{
            const unsigned long long key = magnitude_key(x[i]);
            if ((key >> high_shift) == prefix)
                bin = (int)((key >> shift) & (unsigned long long)(nbins - 1));
        }}
        // Lanes with the same bin add once (gradients crowd a few exponent bins).
        const unsigned int peers = __match_any_sync(FULL_WARP, bin);
        if (bin >= 0 && lane == (unsigned int)(__ffs(peers) - 1))
            atomicAdd(&block_hist[bin], (unsigned int)__popc(peers));
    }}
    __syncthreads();
    for (int b = threadIdx.x; b < nbins; b += blockDim.x) {{
        const unsigned int count = block_hist[b];
        if (count != 0u) atomicAdd(&hist[b], (unsigned long long)count);
    }}
}}

// One block of PICK_BLOCK threads. state = {{prefix, rank}}: rank 1 is the largest key
// still matching the prefix. Finds the bin b with above(b) < rank <= above(b) + hist[b],
// appends b to the prefix and subtracts above(b) from the rank. first_rank > 0 starts a
// selection (prefix 0, rank = k) instead of reading state.
extern "C" __global__ void radix_pick_digit(
        const unsigned long long* __restrict__ hist, int digit_bits, long long first_rank,
        unsigned long long* state) {{
    __shared__ unsigned long long suffix[MAX_BINS];
    const int nbins = 1 << digit_bits;
    for (int b = threadIdx.x; b < nbins; b += blockDim.x) suffix[b] = hist[b];
    __syncthreads();
    // Inclusive suffix sums (Hillis-Steele): suffix[b] = sum of hist[c] for c >= b.
    for (int offset = 1; offset < nbins; offset <<= 1) {{
        unsigned long long add[MAX_BINS / PICK_BLOCK];
        int j = 0;
        for (int b = threadIdx.x; b < nbins; b += blockDim.x, ++j)
            add[j] = (b + offset < nbins) ? suffix[b + offset] : 0ull;
        __syncthreads();
        j = 0;
        for (int b = threadIdx.x; b < nbins; b += blockDim.x, ++j) suffix[b] += add[j];
        __syncthreads();
    }}
    const unsigned long long rank = first_rank > 0 ? (unsigned long long)first_rank : state[1];
    const unsigned long long prefix = first_rank > 0 ? 0ull : state[0];
    __syncthreads();  // all threads have read state before the one writer updates it
    for (int b = threadIdx.x; b < nbins; b += blockDim.x) {{
        const unsigned long long above = (b + 1 < nbins) ? suffix[b + 1] : 0ull;
        if (above < rank && rank <= suffix[b]) {{
            state[0] = (prefix << digit_bits) | (unsigned long long)b;
            state[1] = rank - above;
        }}
    }}
}}

// Per tile of `tile` elements: how many keys are > T and == T (T = state[0]).
extern "C" __global__ void count_tile_matches(
        const raw_bits_t* __restrict__ x, long long n, long long tile,
        const unsigned long long* __restrict__ state,
        long long* __restrict__ tile_gt, long long* __restrict__ tile_eq) {{
    __shared__ unsigned int block_gt, block_eq;
    if (threadIdx.x == 0) {{ block_gt = 0u; block_eq = 0u; }}
    __syncthreads();
    const unsigned long long threshold = state[0];
    const long long start = (long long)blockIdx.x * tile;
    const long long end = (start + tile < n) ? start + tile : n;
    unsigned int gt = 0u, eq = 0u;
    for (long long i = start + threadIdx.x; i < end; i += blockDim.x) {{
        const unsigned long long key = magnitude_key(x[i]);
        gt += key > threshold;
        eq += key == threshold;
    }}
    for (int offset = 16; offset > 0; offset >>= 1) {{
        gt += __shfl_down_sync(FULL_WARP, gt, offset);
        eq += __shfl_down_sync(FULL_WARP, eq, offset);
    }}
    if ((threadIdx.x & 31u) == 0u) {{ atomicAdd(&block_gt, gt); atomicAdd(&block_eq, eq); }}
    __syncthreads();
    if (threadIdx.x == 0) {{ tile_gt[blockIdx.x] = block_gt; tile_eq[blockIdx.x] = block_eq; }}
}}

// Writes the selected entries of one tile in index order. gt_before / eq_before: keys
// > T / == T in all earlier tiles. An entry == T is selected while fewer than `need`
// equal keys precede it; its output slot is (#> T before) + min(#== T before, need).
extern "C" __global__ void write_selected(
        const raw_bits_t* __restrict__ x, long long n, long long tile,
        const unsigned long long* __restrict__ state,
        const long long* __restrict__ tile_gt, const long long* __restrict__ tile_eq,
        const long long* __restrict__ gt_before, const long long* __restrict__ eq_before,
        raw_bits_t* __restrict__ out_values, long long* __restrict__ out_indices) {{
    __shared__ unsigned int warp_gt[32];
    __shared__ unsigned int warp_eq[32];
    const unsigned long long threshold = state[0];
    const long long need = (long long)state[1];
    long long gt_run = gt_before[blockIdx.x];
    long long eq_run = eq_before[blockIdx.x];
    // Nothing to write (uniform per block, so returning before __syncthreads is safe).
    if (tile_gt[blockIdx.x] == 0 && (tile_eq[blockIdx.x] == 0 || eq_run >= need)) return;
    const long long start = (long long)blockIdx.x * tile;
    const long long end = (start + tile < n) ? start + tile : n;
    const unsigned int lane = threadIdx.x & 31u;
    const unsigned int warp = threadIdx.x >> 5;
    const unsigned int nwarps = blockDim.x >> 5;
    const unsigned int lanes_below = (1u << lane) - 1u;
    for (long long base = start; base < end; base += blockDim.x) {{
        const long long i = base + threadIdx.x;
        const bool valid = i < end;
        const raw_bits_t raw = valid ? x[i] : (raw_bits_t)0;
        const unsigned long long key = magnitude_key(raw);
        const bool is_gt = valid && key > threshold;
        const bool is_eq = valid && key == threshold;
        const unsigned int ballot_gt = __ballot_sync(FULL_WARP, is_gt);
        const unsigned int ballot_eq = __ballot_sync(FULL_WARP, is_eq);
        if (lane == 0u) {{ warp_gt[warp] = __popc(ballot_gt); warp_eq[warp] = __popc(ballot_eq); }}
        __syncthreads();
        long long gt_rank = gt_run + __popc(ballot_gt & lanes_below);
        long long eq_rank = eq_run + __popc(ballot_eq & lanes_below);
        unsigned int chunk_gt = 0u, chunk_eq = 0u;
        for (unsigned int w = 0; w < nwarps; ++w) {{
            if (w < warp) {{ gt_rank += warp_gt[w]; eq_rank += warp_eq[w]; }}
            chunk_gt += warp_gt[w];
            chunk_eq += warp_eq[w];
        }}
        if (is_gt || (is_eq && eq_rank < need)) {{
            const long long slot = gt_rank + (eq_rank < need ? eq_rank : need);
            out_values[slot] = raw;
            out_indices[slot] = i;
        }}
        gt_run += chunk_gt;
        eq_run += chunk_eq;
        __syncthreads();  // warp_gt / warp_eq are rewritten by the next chunk
    }}
}}
"""


def kernel_source(dtype):
    """The CUDA source specialised for ``dtype``'s key width (also used by tests to
    compile-check the kernels with nvcc on machines without a GPU)."""
    key_format = KEY_FORMATS[dtype]
    return KERNEL_SOURCE.format(c_type=key_format.c_type, mask=(1 << key_format.key_bits) - 1,
                                pick_block=PICK_BLOCK, max_bins=1 << MAX_DIGIT_BITS)


KERNEL_NAMES = ("radix_histogram", "radix_pick_digit", "count_tile_matches", "write_selected")


def _import_cupy():
    try:
        import cupy
    except Exception as error:  # ImportError, or a broken CUDA install raising on import
        raise BackendUnavailableError(
            f"cupy top-k backend: cannot import cupy ({error})") from error
    return cupy


def cupy_unavailable_reason(device):
    """None when CuPy can run on ``device``; otherwise a sentence saying why not.

    Does not compile the kernels (``CupyTopkSelector`` does, and reports failures).
    """
    device = torch.device(device)
    if device.type != "cuda":
        return f"the cupy top-k backend needs a CUDA device, got {device}"
    if not torch.cuda.is_available():
        return "the cupy top-k backend needs CUDA, but torch.cuda.is_available() is False"
    try:
        cupy = _import_cupy()
    except BackendUnavailableError as error:
        return str(error)
    try:
        if not cupy.is_available():
            return "cupy is installed but reports no usable GPU (cupy.is_available() is False)"
        index = device.index if device.index is not None else torch.cuda.current_device()
        if index >= cupy.cuda.runtime.getDeviceCount():
            return f"cupy does not see CUDA device {index}"
    except Exception as error:  # driver/runtime errors surface as various CuPy exceptions
        return f"cupy cannot use the GPU ({error})"
    return None


class CupyTopkSelector(TopkSelector):
    """Exact top-k by magnitude on CUDA tensors with our radix-select kernels (see module
    docstring). Constructing it checks CuPy and compiles the float32 kernels, so failures
    show up at ``get_selector`` time, not mid-training.

    Args:
        device: the CUDA device the tensors will live on.
    """

    name = "cupy"

    def __init__(self, device):
        device = torch.device(device)
        reason = cupy_unavailable_reason(device)
        if reason is not None:
            raise BackendUnavailableError(reason)
        self._cupy = _import_cupy()
        self.device_index = (device.index if device.index is not None
                             else torch.cuda.current_device())
        self._modules = {}
        self._sm_counts = {}
        try:
            self._kernels(torch.float32, self.device_index)
        except Exception as error:  # NVRTC missing / compile failure
            raise BackendUnavailableError(
                f"cupy top-k kernels failed to compile: {error}") from error

    def _kernels(self, dtype, device_index):
        """Compiled kernels for ``dtype``'s key width on one device (cached)."""
        key = (KEY_FORMATS[dtype].c_type, device_index)
        kernels = self._modules.get(key)
        if kernels is None:
            cupy = self._cupy
            with cupy.cuda.Device(device_index):
                module = cupy.RawModule(code=kernel_source(dtype), options=("--std=c++14",))
                kernels = {name: module.get_function(name) for name in KERNEL_NAMES}
            self._modules[key] = kernels
        return kernels

    def _select(self, x, k):
        if x.device.type != "cuda":
            raise BackendUnavailableError(
                f"the cupy top-k backend needs a CUDA tensor, got one on {x.device}")
        cupy = self._cupy
        x = x.contiguous()
        numel = x.numel()
        device = x.device
        key_format = KEY_FORMATS[x.dtype]
        kernels = self._kernels(x.dtype, device.index)
        plan = radix_digit_plan(key_format.key_bits)
        tiles = -(-numel // TILE)
        bins = 1 << MAX_DIGIT_BITS

        # state (prefix, rank) followed by one histogram per digit, zeroed by one memset.
        work = torch.zeros(2 + len(plan) * bins, dtype=torch.int64, device=device)
        tile_counts = torch.empty(2, tiles, dtype=torch.int64, device=device)
        values = torch.empty(k, dtype=x.dtype, device=device)
        indices = torch.empty(k, dtype=torch.int64, device=device)

        unsigned = {2: cupy.uint16, 4: cupy.uint32, 8: cupy.uint64}[x.element_size()]
        hist_blocks = max(1, min(-(-numel // BLOCK), 8 * self._sm_count(device.index)))
        n = np.int64(numel)
        tile = np.int64(TILE)
        with cupy.cuda.Device(device.index), self._cupy_stream(device):
            keys = cupy.from_dlpack(x.view(key_format.int_dtype)).view(unsigned)
            work_cp = cupy.from_dlpack(work).view(cupy.uint64)
            state = work_cp[:2]
            for digit, (shift, digit_bits) in enumerate(plan):
                hist = work_cp[2 + digit * bins: 2 + (digit + 1) * bins]
                kernels["radix_histogram"](
                    (hist_blocks,), (BLOCK,),
                    (keys, n, state, np.int32(shift), np.int32(digit_bits), hist),
                    shared_mem=4 * (1 << digit_bits))
                kernels["radix_pick_digit"](
                    (1,), (PICK_BLOCK,),
                    (hist, np.int32(digit_bits), np.int64(k if digit == 0 else 0), state))
            counts = cupy.from_dlpack(tile_counts)
            kernels["count_tile_matches"](
                (tiles,), (BLOCK,), (keys, n, tile, state, counts[0], counts[1]))
            # Exclusive prefix sums per tile; torch runs them on the same stream.
            before = cupy.from_dlpack(torch.cumsum(tile_counts, dim=1) - tile_counts)
            kernels["write_selected"](
                (tiles,), (BLOCK,),
                (keys, n, tile, state, counts[0], counts[1], before[0], before[1],
                 cupy.from_dlpack(values.view(key_format.int_dtype)).view(unsigned),
                 cupy.from_dlpack(indices)))
        return values, indices

    def _sm_count(self, device_index):
        count = self._sm_counts.get(device_index)
        if count is None:
            count = self._sm_counts[device_index] = torch.cuda.get_device_properties(
                device_index).multi_processor_count
        return count

    def _cupy_stream(self, device):
        """PyTorch's current stream on ``device`` as a CuPy stream (kernels and torch
        ops then run in order, and torch's allocator may reuse our buffers safely)."""
        cupy = self._cupy
        torch_stream = torch.cuda.current_stream(device)
        if torch_stream.cuda_stream == 0:
            return cupy.cuda.Stream.null
        from_external = getattr(cupy.cuda.Stream, "from_external", None)
        if from_external is not None and hasattr(torch_stream, "__cuda_stream__"):
            return from_external(torch_stream)  # CuPy >= 14 with the CUDA stream protocol
        return cupy.cuda.ExternalStream(torch_stream.cuda_stream, device.index)
