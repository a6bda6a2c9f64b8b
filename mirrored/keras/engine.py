"""The training engine behind ``Sequential``: one flat buffer, one program per replica.

Two ideas make a data-parallel step cheap, and both are here:

1. **Packed parameters** (``ParameterPack``). All of a model's weights live in
   ONE flat float32 buffer per device, in Keras's order (kernel, bias, layer by
   layer); each ``Variable`` is a view into it. The gradients get a twin flat
   buffer. So the gradient all-reduce is one ring over one buffer (tensor
   fusion for free: nothing to pack), and the optimizer is one kernel launch
   per device for the whole model.

2. **A replica program** (``ReplicaProgram``). For one device it runs the dense
   stack forward and backward with the kernels, into buffers that are allocated
   once per batch size and reused every step:

       forward   z_i = a_{i-1} @ W_i            gemm
                 a_i = relu(z_i + b_i)          bias_relu   (or bias_add)
       loss      l, dz_L = xent(z_L, labels)    softmax_xent (fused, scaled by 1/global batch)
       backward  dW_i = a_{i-1}^T @ dz_i        gemm(trans_a)
                 db_i = sum_rows(dz_i)          sum_axis
                 da_{i-1} = dz_i @ W_i^T        gemm(trans_b)
                 dz_{i-1} = da_{i-1} * (a_{i-1} > 0)   relu_backward

   Loss sums and correct counts are accumulated ON the device; the host reads
   them only when it prints progress, so a step needs no host synchronisation.

Why the loss is scaled by 1/GLOBAL batch on every replica: each replica's
gradient is then its share of the gradient of the mean loss over the global
batch, and the all-reduce SUM of the shares is exactly that gradient — what one
device would compute on the whole batch (TensorFlow's rule; the tests check it).

Neighbours: ``models.py`` (Sequential drives this), ``optimizers.py`` (updates
the packed buffers), ``mirrored/cross_device_ops.py`` (the ring).
"""
import contextlib

import numpy as np

from mirrored.tensor import Tensor
from mirrored.values import MirroredVariable

FLOAT = np.dtype(np.float32)

#: The phases of one training step, in the order they happen. ``Sequential``'s step
#: names them for whoever times it (``mirrored.timing``; ``mirrored.viz`` colours them).
INPUT_COPY = "input copy"              # host slice (or row numbers) -> the replica's device
FORWARD_BACKWARD = "forward+backward"  # the dense stack, the loss, the gradients
ALL_REDUCE = "all-reduce"              # SUM of the replicas' packed gradients (the ring)
OPTIMIZER = "optimizer"                # one update launch per device
STEP_PHASES = (INPUT_COPY, FORWARD_BACKWARD, ALL_REDUCE, OPTIMIZER)


class Untimed:
    """The timer a step uses when nobody times it: every phase is a plain block.

    ``mirrored.timing.PhaseTimer`` has the same four methods and records the phases.
    """

    def phase(self, name, replica, device):
        return contextlib.nullcontext()

    def collective(self, name, devices):
        return contextlib.nullcontext()

    def begin_all(self, name, devices):
        return ()

    def end_all(self, tokens):
        pass


UNTIMED = Untimed()


def components(variable):
    """The per-device copies of a variable: its components, or itself."""
    return list(variable.values) if isinstance(variable, MirroredVariable) else [variable]


class ParameterPack:
    """Every trainable variable of a model in one flat buffer per device, plus gradients.

    After packing, ``variables[k]``'s copy on device r is the view
    ``params[r][offsets[k]:offsets[k] + sizes[k]]`` reshaped; its gradient is the
    same slice of ``grads[r]``.
    """

    def __init__(self, variables, devices):
        self.variables = list(variables)
        self.devices = list(devices)
        self.shapes = [v.shape for v in self.variables]
        self.sizes = [int(np.prod(s, dtype=np.int64)) for s in self.shapes]
        self.offsets = list(np.cumsum([0] + self.sizes[:-1]).astype(int))
        self.total = int(sum(self.sizes))
        for var in self.variables:
            var._pack = self                     # lets apply_gradients find the fast path
        self.params, self.grads = [], []        # flat (total,) float32 per device
        self.param_views, self.grad_views = [], []   # [device][k] shaped views
        for r, dev in enumerate(self.devices):
            with dev.activate():
                flat = dev.empty((self.total,), FLOAT)
                grad = dev.empty((self.total,), FLOAT)
                dev.ops.fill(grad, 0.0)
                pviews, gviews = [], []
                for var, off, size, shape in zip(self.variables, self.offsets, self.sizes, self.shapes):
                    comp = components(var)[r]
                    view = flat[off:off + size]
                    dev.copy_into(view, comp._tensor._buf)
                    comp._tensor = Tensor(view.reshape(shape), dev)   # the variable now lives here
                    pviews.append(comp._tensor._buf)
                    gviews.append(grad[off:off + size].reshape(shape))
            self.params.append(flat)
            self.grads.append(grad)
            self.param_views.append(pviews)
            self.grad_views.append(gviews)

    def grad_tensors(self, r):
        dev = self.devices[r]
        return [Tensor(g, dev) for g in self.grad_views[r]]


class _Buffers:
    """Activations and gradients for one batch size on one device, reused every step."""

    def __init__(self, dev, b, units, in_dim):
        self.act = [dev.empty((b, u), FLOAT) for u in units]     # a_i: (b, units_i)
        self.dact = [dev.empty((b, u), FLOAT) for u in units]    # dz_i: (b, units_i)
        self.probs = dev.empty((b, units[-1]), FLOAT)            # softmax output, for predict
        # row 0: per-example loss; row 1: 1.0 where argmax == label; row 2: 1.0 (counts examples)
        self.stats = dev.empty((3, b), FLOAT)
        self.loss, self.correct = self.stats[0], self.stats[1]
        dev.ops.fill(self.stats[2], 1.0)


class ReplicaProgram:
    """Forward and backward of a dense stack on one device (see the module docstring)."""

    def __init__(self, dense_layers, pack, replica_id):
        self.layers = dense_layers                 # [Dense], in order
        self.pack = pack
        self.r = replica_id
        self.dev = pack.devices[replica_id]
        self.ops = self.dev.ops
        views = pack.param_views[replica_id]
        gviews = pack.grad_views[replica_id]
        self.W = views[0::2]                       # kernels (in, out)
        self.b = views[1::2]                       # biases (out,)
        self.gW = gviews[0::2]
        self.gb = gviews[1::2]
        self.units = [layer.units for layer in dense_layers]
        self.in_dim = dense_layers[0].input_dim
        self._buffers = {}
        self._inputs = {}                          # (b, label dtype) -> (x (b, in), y (b,)) upload buffers
        self.x = None                              # the last forward's input (b, in)
        self.last_b = 0
        with self.dev.activate():
            self.acc = self.dev.empty((3,), FLOAT)     # [loss sum, correct count, examples]
            self.tmp = self.dev.empty((3, 1), FLOAT)
            self.zero_metrics()

    def zero_metrics(self):
        self.ops.fill(self.acc, 0.0)

    def buffers(self, b):
        buf = self._buffers.get(b)
        if buf is None:
            buf = self._buffers[b] = _Buffers(self.dev, b, self.units, self.in_dim)
        return buf

    def upload(self, x, y):
        """Copy a host batch into this device's input buffers: ``(x_dev, y_dev)``.

        x: (b, in_dim) float32, y: (b,) integer labels, both C-contiguous NumPy.
        The buffers are made once per (batch size, label dtype) and reused every
        step, as the activations are: an epoch of equal batches allocates nothing.
        The next ``upload`` of the same size overwrites them (on a GPU, in stream
        order, after the kernels of this step have read them).
        """
        x_dev, y_dev = self.input_buffers(x.shape[0], y.dtype)
        if x.shape[0]:
            self.dev.upload_into(x_dev, x)
            self.dev.upload_into(y_dev, y)
        return x_dev, y_dev

    def input_buffers(self, b, label_dtype):
        """This device's reusable input buffers for batches of ``b``: x (b, in_dim)
        float32 and y (b,) of ``label_dtype`` (filled by ``upload`` or a gather)."""
        key = (b, np.dtype(label_dtype))
        bufs = self._inputs.get(key)
        if bufs is None:
            bufs = self._inputs[key] = (self.dev.empty((b, self.in_dim), FLOAT),   # x: (b, in) float32
                                        self.dev.empty((b,), label_dtype))         # y: (b,) labels
        return bufs

    # -- forward
    def forward(self, x, probabilities=False):
        """x: (b, in_dim) float32 on this device. Returns the last layer's output buffer:
        its activation applied, except a final softmax (logits kept, see ``output``)."""
        b = x.shape[0]
        buf = self.buffers(b)
        self.x, self.last_b = x, b
        a = x
        for i, layer in enumerate(self.layers):
            z = buf.act[i]                                     # (b, units_i)
            self.ops.gemm(a, self.W[i], z)                     # z = a @ W_i
            if layer.activation == "relu":
                self.ops.bias_relu(z, self.b[i], z)            # a_i = relu(z + b_i)
            else:
                self.ops.bias_add(z, self.b[i], z)             # logits (softmax comes later)
            a = z
        if probabilities and self.layers[-1].activation == "softmax" and b:
            self.ops.softmax(a, buf.probs)
            return buf.probs
        return a

    # -- loss, metrics and backward
    def loss_and_backward(self, labels, mode, scale, with_grad=True):
        """Per-example loss of the last forward, accumulated metrics, and gradients.

        ``mode``: "logits" (softmax cross-entropy on the last layer's pre-softmax
        output), or "probs" (cross-entropy on probabilities, Keras's
        ``from_logits=False`` with no softmax layer). ``scale``: 1/global batch.
        """
        b = self.last_b
        buf = self.buffers(b)
        out = buf.act[-1]
        grad = buf.dact[-1] if with_grad else None
        if b:
            if mode == "probs":
                self.ops.prob_xent(out, labels, buf.loss, grad, buf.correct, scale)
            else:
                self.ops.softmax_xent(out, labels, buf.loss, grad, buf.correct, scale)
            self._accumulate(buf)
        if not with_grad:
            return
        if not b:                                   # an empty slice: zero gradient
            self.ops.fill(self.pack.grads[self.r], 0.0)
            return
        last = self.layers[-1]
        if last.activation == "relu":               # d/dz of relu(z) on top of the loss's d/da
            self.ops.relu_backward(buf.dact[-1], out, buf.dact[-1])
        for i in range(len(self.layers) - 1, -1, -1):
            dz = buf.dact[i]                                     # (b, units_i)
            a_prev = buf.act[i - 1] if i else self.x             # (b, units_{i-1})
            self.ops.gemm(a_prev, dz, self.gW[i], trans_a=True)  # dW_i = a^T dz
            self.ops.sum_axis(dz.reshape(1, b, self.units[i]), self.gb[i].reshape(1, self.units[i]))
            if i:
                da = buf.dact[i - 1]
                self.ops.gemm(dz, self.W[i], da, trans_b=True)   # da = dz W_i^T
                if self.layers[i - 1].activation == "relu":
                    self.ops.relu_backward(da, buf.act[i - 1], da)

    def _accumulate(self, buf):
        """acc += [sum of losses, number correct, examples]: one column-sum launch, one add.

        Even the example count is summed on the device (a row of ones), so a step
        changes no host state here and can be replayed as a CUDA graph
        (``mirrored/graphs.py``). float32 counts exactly up to 2**24 examples per epoch.
        """
        b = buf.stats.shape[1]
        self.ops.sum_axis(buf.stats.reshape(3, b, 1), self.tmp)     # (3, 1)
        self.ops.binary("add", self.acc, self.tmp.reshape(3), self.acc)

    def read_metrics(self):
        """(loss sum, correct count, examples) so far — the one host read."""
        loss, correct, seen = self.dev.to_numpy(self.acc)
        return float(loss), float(correct), int(seen)
