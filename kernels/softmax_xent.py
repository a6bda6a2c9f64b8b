"""Fused sparse softmax cross-entropy: per-example loss, gradient and correct flag.

Versions: v1, one thread per example row, reading its row straight from global memory;
v2, the same per-row arithmetic on rows a block first stages in shared memory, so that
global memory is read and written in coalesced runs (rows of at most MAX_STAGED_COLS
classes: the launcher's default there). Keras's
``SparseCategoricalCrossentropy(from_logits=True)`` plus the accuracy metric, in one
kernel:

    loss[r]    = logsumexp(logits[r]) - logits[r, label[r]]
    grad[r, j] = (softmax(logits[r])[j] - (j == label[r])) * scale
    correct[r] = 1.0 if argmax(logits[r]) == label[r] else 0.0   (first max wins)

``scale`` folds in the loss reduction: training with a mean over the *global* batch
passes ``scale = 1 / global_batch``, so the gradient leaving this kernel is already
the gradient of the averaged loss (this is what ``compute_average_loss`` is for).

Numerically stable: the kernel keeps a running maximum m and a running sum
s = sum_j exp(logits[r, j] - m), rescaling s whenever m grows ("online softmax",
Milakov & Gimelshein 2018). Every exponent is <= 0, so nothing overflows, and the
statistics take a single sweep over the row; a second sweep writes the gradient.
Why v2: in v1 the 32 threads of a warp read 32 rows, so each load instruction touches
32 addresses C floats apart, and each store of the gradient writes 32 scattered floats.
A block's rows are one contiguous run of memory, so v2 copies the run into shared
memory with consecutive threads on consecutive addresses (coalesced), computes there,
and copies the gradient back out the same way. Measured on an H100 over 64 MB of
10-class logits: v1 523-687 GB/s, v2 1,198-1,369 GB/s (cudaMemcpy: 2,760). For very wide
rows a block per row would be the next version.

The probabilities path (``from_logits=False``), as Keras computes it for the output
of a softmax layer: p = clip(probs[r, label], EPSILON, 1 - EPSILON),
loss = -log(p), grad wrt probs is -scale / probs[r, label] in the label column
(0 elsewhere, and 0 where clipping was active, as TF's gradient of clip_by_value).
Keras also divides ``probs`` by its row sum first; for softmax outputs that sum is
1, so we leave that step (and its gradient) out.

Bad labels: the NumPy references raise ``ValueError`` (``check_labels``), and ``fit`` and
``evaluate`` call ``check_labels`` on the host before any kernel sees a batch, on every
backend. The kernels cannot raise, so, as a last guard (a custom loop's labels already on
a device), a row whose label is outside [0, C) gets loss = NaN, grad row = NaN and
correct = 0: the NaN reaches the reported loss rather than being silently ignored.

NaN logits or probabilities: the kernels give NaN where the references do, and their
correct flag follows ``np.argmax`` (the first NaN of a row is its arg-max).
"""
import math

import numpy as np
from numba import cuda, float32

from kernels.launch import THREADS_1D, check_array, check_no_alias, flat, grid_1d, launch
from kernels.registry import mat, register, sig, vec

#: Keras's ``backend.epsilon()``: probabilities are clipped to [EPSILON, 1 - EPSILON]
#: before the log, so log(0) never happens.
EPSILON = 1e-7

_LABEL_DTYPES = (np.int32, np.int64)
#: The one label type the library hands these kernels. Labels of any integer dtype (uint8
#: from ``keras.datasets``, int16, uint32...) are converted to it once per batch, where the
#: batch is staged (``mirrored/keras/data_adapters.py``'s ``class_indices``, the resident
#: loader, a custom loop's ``keras/tape.py``), so every backend runs the same kernel on the
#: same type. int64: tfds's label dtype, so its data sets need no conversion. (The launchers
#: also take int32, for callers of the kernels themselves.)
LABEL_DTYPE = np.dtype(np.int64)
_LABEL_DTYPE_SET = frozenset(np.dtype(t) for t in _LABEL_DTYPES)   # checked at every launch


# --- NumPy references -----------------------------------------------------------------

def check_labels(labels, classes):
    """Raise ValueError naming the bad values unless every label lies in [0, classes).
    The references call it; so does ``fit`` on the host, before any kernel sees them."""
    if labels.size and (labels.min() < 0 or labels.max() >= classes):
        bad = labels[(labels < 0) | (labels >= classes)]
        raise ValueError(f"labels must lie in [0, {classes}) for {classes} classes; got "
                         f"{bad[:5].tolist()}{' ...' if bad.size > 5 else ''}. Check the "
                         f"data set's label encoding and the last layer's width.")


def _outputs(dtype, b, c, loss_out, grad_out, correct_out):
    loss = np.empty(b, dtype) if loss_out is None else loss_out          # (B,)
    grad = np.empty((b, c), dtype) if grad_out is None else grad_out     # (B, C)
    correct = np.empty(b, dtype) if correct_out is None else correct_out  # (B,)
    return loss, grad, correct


def softmax_xent_ref(logits, labels, loss_out=None, grad_out=None, correct_out=None,
                     scale=1.0):
    """(loss (B,), grad (B, C), correct (B,)) from logits (B, C), integer labels (B,).

    Any float dtype; results in logits' dtype, written into the ``*_out`` arrays when
    given. Raises ValueError for a label outside [0, C).
    """
    b, c = logits.shape
    check_labels(labels, c)
    loss, grad, correct = _outputs(logits.dtype, b, c, loss_out, grad_out, correct_out)
    rows = np.arange(b)
    shifted = logits - logits.max(axis=1, keepdims=True)  # (B, C), every entry <= 0
    np.exp(shifted, out=grad)                               # (B, C) unnormalised
    sums = grad.sum(axis=1, keepdims=True)                  # (B, 1) >= 1
    np.subtract(np.log(sums[:, 0]), shifted[rows, labels], out=loss)
    np.equal(logits.argmax(axis=1), labels, out=correct, casting="unsafe")
    grad /= sums                                            # softmax
    grad[rows, labels] -= 1
    grad *= grad.dtype.type(scale)
    return loss, grad, correct


def prob_xent_ref(probs, labels, loss_out=None, grad_out=None, correct_out=None,
                  scale=1.0):
    """(loss, grad wrt probs, correct) from probabilities (B, C), as Keras with
    ``from_logits=False`` (see the module docstring). Raises ValueError on bad labels."""
    b, c = probs.shape
    check_labels(labels, c)
    loss, grad, correct = _outputs(probs.dtype, b, c, loss_out, grad_out, correct_out)
    rows = np.arange(b)
    lo = probs.dtype.type(EPSILON)
    hi = probs.dtype.type(1) - lo
    p = probs[rows, labels]                    # (B,) probability of the true class
    np.negative(np.log(np.clip(p, lo, hi)), out=loss)
    np.equal(probs.argmax(axis=1), labels, out=correct, casting="unsafe")
    grad.fill(0)
    active = (p >= lo) & (p <= hi)             # (B,) where the clip passes gradient
    grad[rows[active], labels[active]] = -probs.dtype.type(scale) / p[active]
    return loss, grad, correct


# --- kernels -------------------------------------------------------------------------------

@cuda.jit(device=True, inline="always")
def _poison_row(r, loss, grad, correct, with_grad):
    """Row r has a label outside [0, C): a kernel cannot raise, so the row's loss (and,
    ``with_grad``, its gradient) becomes NaN and its correct flag 0, where it shows.

    Inlined into the calling kernel (``inline="always"``, at Numba IR level): a
    non-inline device function is compiled separately and linked, and numba-cuda asks
    the CUDA driver for that step, so ``cuda.compile_ptx`` fails on a machine with no
    driver, i.e. CI (tests/test_kernels_compile.py)."""
    loss[r] = math.nan
    correct[r] = float32(0.0)
    if with_grad:
        for j in range(grad.shape[1]):
            grad[r, j] = math.nan


def _make_softmax_xent_kernel(with_grad):
    @cuda.jit
    def softmax_xent_kernel(logits, labels, loss, grad, correct, scale):
        """One thread per row r (grid-stride over rows); logits (B, C) with C >= 1,
        labels (B,), loss/correct (B,), grad (B, C) (ignored unless ``with_grad``,
        a compile-time constant). Loop nest:
            for r in range(B):
                m, s, best = -inf, 0, 0
                for j in range(C):                 # sweep 1: online max, sum, argmax
                    if logits[r, j] > m: s = s * exp(m - logits[r, j]) + 1; m = ...; best = j
                    else: s += exp(logits[r, j] - m)
                loss[r] = m + log(s) - logits[r, label]
                for j in range(C):                 # sweep 2: the gradient
                    grad[r, j] = (exp(logits[r, j] - m) / s - (j == label)) * scale
        """
        rows, cols = logits.shape
        for r in range(cuda.grid(1), rows, cuda.gridsize(1)):
            label = labels[r]
            if label < 0 or label >= cols:
                _poison_row(r, loss, grad, correct, with_grad)
                continue
            m = logits[r, 0]
            s = float32(1.0)  # exp(logits[r, 0] - m)
            best = 0
            for j in range(1, cols):
                v = logits[r, j]
                if v > m or (math.isnan(v) and not math.isnan(m)):  # the first maximum (or NaN) wins, as np.argmax
                    s = s * math.exp(m - v) + float32(1.0)
                    m = v
                    best = j
                else:
                    s += math.exp(v - m)
            loss[r] = m + math.log(s) - logits[r, label]
            correct[r] = float32(1.0) if best == label else float32(0.0)
            if with_grad:
                inv = scale / s  # softmax * scale = exp(v - m) * (scale / s)
                for j in range(cols):
                    g = math.exp(logits[r, j] - m) * inv
                    if j == label:
                        g -= scale
                    grad[r, j] = g

    return softmax_xent_kernel


#: v2 stages the rows of a block in shared memory when a row has at most this many
#: classes (a 256-row block then needs 16 KiB); wider rows run v1.
MAX_STAGED_COLS = 16
#: Rows per v2 block: one thread per row, the library's 1-D block size.
STAGE_ROWS = THREADS_1D
#: v2's shared tile, in floats (a constant: Numba needs the size at compile time).
STAGE_FLOATS = STAGE_ROWS * MAX_STAGED_COLS


def _make_softmax_xent_v2_kernel(with_grad):
    @cuda.jit
    def softmax_xent_v2_kernel(logits, labels, loss, grad, correct, scale):
        """v2, on logits and grad seen flat, (B * C,): row r is elements [r*C, (r+1)*C).
        A block of STAGE_ROWS threads takes the rows [r0, r0 + STAGE_ROWS), one
        thread per row (grid-stride over such groups); C <= MAX_STAGED_COLS. Those rows'
        n = rows * C logits are one contiguous run: thread t copies run elements t,
        t + STAGE_ROWS, ... into the shared tile (consecutive threads, consecutive
        addresses); sync; thread t computes row r0 + t exactly as v1 does, reading the
        tile, and overwrites its tile row with the gradient; sync; the block copies the
        tile out to grad the same coalesced way; sync (the next group reuses the tile).
        Same loop nest and the same float32 operations as v1: the results are equal."""
        tile = cuda.shared.array(STAGE_FLOATS, float32)   # the group's rows, (rows, C) flat
        rows = labels.shape[0]
        cols = logits.shape[0] // rows                     # the launcher skips rows == 0
        t = cuda.threadIdx.x
        for r0 in range(cuda.blockIdx.x * STAGE_ROWS, rows, cuda.gridDim.x * STAGE_ROWS):
            base = r0 * cols                               # the group's run starts here
            n = min(STAGE_ROWS, rows - r0) * cols
            for e in range(t, n, STAGE_ROWS):
                tile[e] = logits[base + e]
            cuda.syncthreads()
            r = r0 + t
            if r < rows:
                o = t * cols                                # this row's start in the tile
                label = labels[r]
                if label < 0 or label >= cols:              # as _poison_row, in the tile
                    loss[r] = math.nan
                    correct[r] = float32(0.0)
                    if with_grad:
                        for j in range(cols):
                            tile[o + j] = math.nan
                else:
                    m = tile[o]
                    s = float32(1.0)
                    best = 0
                    for j in range(1, cols):
                        v = tile[o + j]
                        if v > m or (math.isnan(v) and not math.isnan(m)):   # as v1
                            s = s * math.exp(m - v) + float32(1.0)
                            m = v
                            best = j
                        else:
                            s += math.exp(v - m)
                    loss[r] = m + math.log(s) - tile[o + label]
                    correct[r] = float32(1.0) if best == label else float32(0.0)
                    if with_grad:
                        inv = scale / s
                        for j in range(cols):
                            g = math.exp(tile[o + j] - m) * inv
                            if j == label:
                                g -= scale
                            tile[o + j] = g
            cuda.syncthreads()
            if with_grad:
                for e in range(t, n, STAGE_ROWS):
                    grad[base + e] = tile[e]
                cuda.syncthreads()

    return softmax_xent_v2_kernel


def _make_prob_xent_kernel(with_grad):
    @cuda.jit
    def prob_xent_kernel(probs, labels, loss, grad, correct, scale):
        """One thread per row r (grid-stride over rows); probs (B, C), C >= 1. Loop nest:
            for r in range(B):
                p = probs[r, label]; loss[r] = -log(clip(p, eps, 1 - eps))
                correct[r] = argmax_j probs[r, j] == label
                for j in range(C): grad[r, j] = -scale / p if j == label and eps <= p <= 1 - eps else 0
        """
        rows, cols = probs.shape
        lo = float32(EPSILON)
        hi = float32(1.0) - lo
        for r in range(cuda.grid(1), rows, cuda.gridsize(1)):
            label = labels[r]
            if label < 0 or label >= cols:
                _poison_row(r, loss, grad, correct, with_grad)
                continue
            best = 0
            for j in range(1, cols):
                v = probs[r, j]
                w = probs[r, best]
                if v > w or (math.isnan(v) and not math.isnan(w)):   # as np.argmax: first NaN wins
                    best = j
            correct[r] = float32(1.0) if best == label else float32(0.0)
            p = probs[r, label]
            q = p                  # clip(p, lo, hi) keeping NaN, as np.clip (min/max may drop it)
            if q < lo:
                q = lo
            if q > hi:
                q = hi
            loss[r] = -math.log(q)
            if with_grad:
                for j in range(cols):
                    grad[r, j] = float32(0.0)
                if p >= lo and p <= hi:
                    grad[r, label] = -scale / p

    return prob_xent_kernel


#: Compiled kernels, keyed by with_grad (False: evaluation, no gradient written).
SOFTMAX_XENT_KERNELS = {g: _make_softmax_xent_kernel(g) for g in (False, True)}
SOFTMAX_XENT_V2_KERNELS = {g: _make_softmax_xent_v2_kernel(g) for g in (False, True)}
PROB_XENT_KERNELS = {g: _make_prob_xent_kernel(g) for g in (False, True)}
#: softmax_xent's versions by name.
SOFTMAX_XENT_VERSIONS = {"v1": SOFTMAX_XENT_KERNELS, "v2": SOFTMAX_XENT_V2_KERNELS}


# What the real compiler checks (kernels/registry.py): each kernel with int32 and int64
# labels (both accepted by ``_check_args``). Without a gradient the launcher passes x in
# the grad slot, so both variants have the same signature.
def _xent_signature(label_dtype, logits=mat):
    return sig(logits("float32"), vec(label_dtype), vec("float32"), logits("float32"),
               vec("float32"), "float32")


for _name, _kernels, _logits in (("softmax_xent_kernel", SOFTMAX_XENT_KERNELS, mat),
                                 ("softmax_xent_v2_kernel", SOFTMAX_XENT_V2_KERNELS, vec),
                                 ("prob_xent_kernel", PROB_XENT_KERNELS, mat)):
    for _with_grad, _kernel in _kernels.items():
        register(_kernel, _name,
                 [_xent_signature(np.dtype(t).name, _logits) for t in _LABEL_DTYPES],
                 block=grid_1d(1)[1], variant=f"with_grad={_with_grad}")


# --- launchers -------------------------------------------------------------------------------

def _check_args(what, x, labels, loss_out, grad_out, correct_out):
    check_array(f"{what}: {'logits' if what == 'softmax_xent' else 'probs'}", x,
                np.float32, ndim=2)
    b, c = x.shape
    if labels.dtype not in _LABEL_DTYPE_SET:
        raise TypeError(f"{what}: labels must be int32 or int64 class indices, got "
                        f"{labels.dtype}; for one-hot labels take argmax first.")
    check_array(f"{what}: labels", labels, labels.dtype, shape=(b,))
    check_array(f"{what}: loss_out", loss_out, np.float32, shape=(b,))
    check_array(f"{what}: correct_out", correct_out, np.float32, shape=(b,))
    if grad_out is not None:
        check_array(f"{what}: grad_out", grad_out, np.float32, shape=(b, c))
    if b and not c:
        raise ValueError(f"{what}: need at least one class, got shape {tuple(x.shape)}.")
    outs = [o for o in (loss_out, grad_out, correct_out) if o is not None]
    for i, o in enumerate(outs):  # each output clear of the inputs and the later outputs
        check_no_alias(what, o, x, labels, *outs[i + 1:])


def _launch(kernels, x, labels, loss_out, grad_out, correct_out, scale, stream,
            flat_rows=False):
    if x.shape[0] == 0:
        return
    with_grad = grad_out is not None
    # Without a gradient the kernel never touches ``grad`` (with_grad is a compile-time
    # False): pass the input x, also (B, C) float32, to fill the argument slot.
    grad_arg = grad_out if with_grad else x
    threads = None                    # grid_1d's THREADS_1D
    if flat_rows:                     # v2 walks logits and grad as one flat run each, and
        x, grad_arg = flat(x), flat(grad_arg)
        threads = STAGE_ROWS          # its shared tile holds exactly one row per thread
    launch(kernels[with_grad], *grid_1d(labels.shape[0], threads), stream, x, labels,
           loss_out, grad_arg, correct_out, np.float32(scale))


def softmax_xent(logits, labels, loss_out, grad_out, correct_out, scale=1.0, stream=None,
                 version=None):
    """Fused softmax cross-entropy on the GPU (see the module docstring).

    logits (B, C) float32; labels (B,) int32/int64; loss_out, correct_out (B,) float32;
    grad_out (B, C) float32 or None to skip the gradient (evaluation). All C-contiguous,
    outputs disjoint from inputs and each other. ``version``: "v1", "v2" (C <=
    MAX_STAGED_COLS) or None for v2 where it applies, else v1.
    Returns (loss_out, grad_out, correct_out).
    """
    cols = logits.shape[1] if len(logits.shape) == 2 else 0
    if version is None:
        version = "v2" if cols <= MAX_STAGED_COLS else "v1"
    if version not in SOFTMAX_XENT_VERSIONS:
        raise ValueError(f"softmax_xent: unknown version {version!r}; expected one of "
                         f"{sorted(SOFTMAX_XENT_VERSIONS)} or None.")
    if version == "v2" and cols > MAX_STAGED_COLS:
        raise ValueError(f"softmax_xent: v2 stages at most {MAX_STAGED_COLS} classes per row "
                         f"in shared memory, got {cols}; use v1 (or version=None).")
    _check_args("softmax_xent", logits, labels, loss_out, grad_out, correct_out)
    _launch(SOFTMAX_XENT_VERSIONS[version], logits, labels, loss_out, grad_out, correct_out,
            scale, stream, flat_rows=version == "v2")
    return loss_out, grad_out, correct_out


def prob_xent(probs, labels, loss_out, grad_out, correct_out, scale=1.0, stream=None):
    """Cross-entropy from probabilities on the GPU; arguments as ``softmax_xent``."""
    _check_args("prob_xent", probs, labels, loss_out, grad_out, correct_out)
    _launch(PROB_XENT_KERNELS, probs, labels, loss_out, grad_out, correct_out, scale,
            stream)
    return loss_out, grad_out, correct_out
