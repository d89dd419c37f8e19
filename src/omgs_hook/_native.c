/*
 * omgs_hook._native: the fused accumulate-and-select pass of a sparse group, in C.
 *
 * One pass over the group's bucket runs does what the NumPy/torch chunk loop of
 * omgs_hook.topk.SampledTopkSelector.accumulate_select does, with the same results bit
 * for bit:
 *
 *     out[offset + i] = gradient[i] + residual[offset + i]   (a copy where residual is NULL)
 *     gradient[i] = 0                                         (when clear is set)
 *     every position whose |out| bit pattern >= threshold_bits is a candidate
 *
 * except that the candidate buffers have a fixed size: when they fill up the threshold
 * is raised (exactly: see compact()), so a threshold far too low - a hint from a step
 * whose sums were smaller - costs a few in-buffer selections, not a second pass.
 *
 * The magnitude of a float32 is its bit pattern with the sign bit cleared; for those
 * patterns the integer order is the value order, NaN lies above inf, and inf above every
 * finite value, so NaN and inf are always candidates (the selection rule of topk.py).
 * The additions are plain IEEE float32 additions (no -ffast-math): the same sums as
 * torch.add.
 *
 * Why C: the pass is memory bound (it reads the gradient and the residual and writes
 * the sums and the zeros), but the chunk loop in Python runs four more passes over each
 * cache-resident chunk (abs, compare, nonzero, zero) and a dozen Python calls per chunk.
 * Here every 64-element block is summed, stored and tested in registers; only a block
 * that holds a candidate is looked at again. The interpreter lock is released for the
 * pass, so gloo's and DDP's threads run beside it.
 *
 * Optional: the package builds it when a C compiler is present and falls back to the
 * chunk loop otherwise (OMGS_HOOK_NATIVE=0 also selects the chunk loop).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define BLOCK 64

static inline int32_t magnitude_bits(float v)
{
    int32_t bits;
    memcpy(&bits, &v, sizeof bits);
    return bits & 0x7fffffff;
}

/* The value of rank `rank` (0-based, ascending) of a[0..n): quickselect, O(n) on average;
 * a is reordered. */
static int32_t select_rank(int32_t *a, int64_t n, int64_t rank)
{
    int64_t lo = 0, hi = n - 1;
    while (lo < hi) {
        const int64_t mid = lo + (hi - lo) / 2;
        /* median of three as the pivot */
        int32_t x = a[lo], y = a[mid], z = a[hi], pivot;
        if (x < y) pivot = y < z ? y : (x < z ? z : x);
        else pivot = x < z ? x : (y < z ? z : y);
        int64_t i = lo, j = hi;
        while (i <= j) {
            while (a[i] < pivot) i++;
            while (a[j] > pivot) j--;
            if (i <= j) {
                const int32_t t = a[i];
                a[i] = a[j];
                a[j] = t;
                i++;
                j--;
            }
        }
        if (rank <= j) hi = j;
        else if (rank >= i) lo = i;
        else return a[rank];
    }
    return a[rank];
}

/* The candidate buffers are full: raise the threshold to the keep-th largest magnitude
 * stored and drop the stored entries below it (the rest keep their order). Exact: at
 * least keep >= k stored entries reach the new threshold, so the k-th largest magnitude
 * of the whole group does too, and every entry of the top k - stored or still to come -
 * reaches it. Returns the entries kept; `count` itself when ties at the new threshold
 * leave nothing to drop (the caller then gives up recording). */
static int64_t compact(int64_t *positions, float *values, int64_t count, int64_t keep,
                       int32_t *scratch, int32_t *threshold)
{
    for (int64_t i = 0; i < count; i++)
        scratch[i] = magnitude_bits(values[i]);
    const int32_t raised = select_rank(scratch, count, count - keep);
    if (raised > *threshold)
        *threshold = raised;
    int64_t kept = 0;
    for (int64_t i = 0; i < count; i++) {
        if (magnitude_bits(values[i]) >= *threshold) {
            positions[kept] = positions[i];
            values[kept] = values[i];
            kept++;
        }
    }
    return kept;
}

struct candidates {
    int64_t *positions;
    float *values;
    int64_t cap;    /* capacity of positions and values */
    int64_t keep;   /* entries a compaction keeps at least (>= k) */
    int32_t *scratch;
    int64_t count;
    int32_t threshold;
    int overflow;   /* ties kept a full buffer from shrinking: recording stopped */
};

static inline void record(struct candidates *c, int64_t position, float value)
{
    if (c->overflow)
        return;
    if (c->count == c->cap) {
        const int64_t kept = compact(c->positions, c->values, c->count, c->keep, c->scratch,
                                     &c->threshold);
        if (kept == c->count) {
            c->overflow = 1;
            return;
        }
        c->count = kept;
        if (magnitude_bits(value) < c->threshold)
            return;
    }
    c->positions[c->count] = position;
    c->values[c->count] = value;
    c->count++;
}

/* The pass over one run. */
static void run_pass(float *restrict grad, const float *restrict residual,
                     float *restrict out, int64_t offset, int64_t length, int clear,
                     struct candidates *c)
{
    for (int64_t i = 0; i < length; i += BLOCK) {
        const int64_t m = length - i < BLOCK ? length - i : BLOCK;
        const int32_t threshold = c->threshold;
        float *restrict g = grad + i;
        float *restrict o = out + i;
        int32_t any = 0;
        if (residual) {
            const float *restrict q = residual + i;
            for (int64_t j = 0; j < m; j++) {
                const float v = g[j] + q[j];
                o[j] = v;
                any |= magnitude_bits(v) >= threshold;
            }
        } else {
            for (int64_t j = 0; j < m; j++) {
                const float v = g[j];
                o[j] = v;
                any |= magnitude_bits(v) >= threshold;
            }
        }
        if (any) { /* the block is still in L1 */
            for (int64_t j = 0; j < m; j++) {
                if (magnitude_bits(o[j]) >= c->threshold)
                    record(c, offset + i + j, o[j]);
            }
        }
        if (clear)
            memset(g, 0, (size_t)m * sizeof(float));
    }
}

PyDoc_STRVAR(accumulate_select_f32_doc,
"accumulate_select_f32(runs, num_runs, residual, out, threshold_bits, clear, positions,\n"
"                      values, cap, keep) -> (count, threshold_bits)\n\n"
"The fused pass over a float32 group (see the module source). Every pointer argument\n"
"is an address (tensor.data_ptr()): runs: int64[3 * num_runs] of (gradient address,\n"
"offset in out, length), in ascending offset order; residual: 0 for none; positions:\n"
"int64[cap] and values: float32[cap] receive the candidates in ascending position.\n"
"threshold_bits: the bit pattern of a positive float32 threshold. When the buffers are\n"
"full the threshold is raised so that at least keep (>= k) stored candidates stay (the\n"
"top k is kept whole). Returns the candidates stored and the final threshold's bits;\n"
"count is cap + 1 when ties stopped the buffers from shrinking (the sums and the zeros\n"
"are complete either way).");

static PyObject *accumulate_select_f32(PyObject *self, PyObject *args)
{
    unsigned long long runs_addr, residual_addr, out_addr, positions_addr, values_addr;
    Py_ssize_t num_runs, cap, keep;
    long long threshold_bits;
    int clear;
    (void)self;
    if (!PyArg_ParseTuple(args, "KnKKLpKKnn", &runs_addr, &num_runs, &residual_addr,
                          &out_addr, &threshold_bits, &clear, &positions_addr, &values_addr,
                          &cap, &keep))
        return NULL;
    if (num_runs < 0 || cap < 1 || keep < 1 || keep >= cap || threshold_bits <= 0
            || threshold_bits > 0x7fffffffLL) {
        PyErr_SetString(PyExc_ValueError,
                        "accumulate_select_f32: num_runs must be >= 0, 1 <= keep < cap, and "
                        "threshold_bits the pattern of a positive float32");
        return NULL;
    }
    if (!runs_addr || !out_addr || !positions_addr || !values_addr) {
        PyErr_SetString(PyExc_ValueError, "accumulate_select_f32: null address");
        return NULL;
    }
    int32_t *scratch = (int32_t *)PyMem_RawMalloc((size_t)cap * sizeof(int32_t));
    if (!scratch)
        return PyErr_NoMemory();
    struct candidates c = {
        (int64_t *)(uintptr_t)positions_addr, (float *)(uintptr_t)values_addr, (int64_t)cap,
        (int64_t)keep, scratch, 0, (int32_t)threshold_bits, 0,
    };
    const int64_t *runs = (const int64_t *)(uintptr_t)runs_addr;
    const float *residual = (const float *)(uintptr_t)residual_addr;
    float *out = (float *)(uintptr_t)out_addr;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t r = 0; r < num_runs; r++) {
        float *grad = (float *)(uintptr_t)runs[3 * r];
        const int64_t offset = runs[3 * r + 1];
        const int64_t length = runs[3 * r + 2];
        run_pass(grad, residual ? residual + offset : NULL, out + offset, offset, length,
                 clear, &c);
    }
    Py_END_ALLOW_THREADS
    PyMem_RawFree(scratch);
    return Py_BuildValue("(LL)", (long long)(c.overflow ? c.cap + 1 : c.count),
                         (long long)c.threshold);
}

static PyMethodDef native_methods[] = {
    {"accumulate_select_f32", accumulate_select_f32, METH_VARARGS, accumulate_select_f32_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef native_module = {
    PyModuleDef_HEAD_INIT, "omgs_hook._native",
    "The fused accumulate-and-select pass in C (optional; see omgs_hook.topk).", -1,
    native_methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__native(void)
{
    return PyModule_Create(&native_module);
}
