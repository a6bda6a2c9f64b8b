"""What one replica holds and runs: the packed parameters, and a program of layer nodes.

Two ideas make a data-parallel step cheap, and both are here:

1. **Packed parameters** (``ParameterPack``). All of a model's weights live in ONE flat
   float32 buffer per device, in Keras's order (kernel, bias, layer by layer); each
   ``Variable`` is a view into it, and the gradients get a twin buffer. So the all-reduce is
   one ring over one buffer, and the optimizer one launch per device for the whole model.
   ``all_reduce`` (below) is that ring call: ``fit`` and ``apply_gradients`` both make it.

2. **A replica program** (``ReplicaProgram``). A model is a directed acyclic graph of layer
   calls, ``Node``s in topological order (every node after the nodes it reads): a
   ``Sequential`` is a chain, a functional or subclassed model any DAG (``functional.py``
   sorts it). Tensor 0 is the input, tensor i + 1 node i's output; each node has a
   ``LayerState`` per device (weight and gradient views, buffers made once per batch size)::

       forward    values[i+1] = layer.forward(state, values[inputs])   nodes in order
       loss       l, dlogits = xent(logits, labels)   fused, scaled by 1/GLOBAL batch (or
                                                      MSE/BCE against float targets)
       backward   grads[inputs] += layer.backward(state, grads[i+1])   nodes in reverse
       penalties  grad += 2 l2 w / N                  kernel_regularizer (keras/regularizers.py)

   Fan-out: a tensor read by several nodes gets the SUM of their gradients, added in the
   order the nodes run backward into a buffer of the engine's (``grad_sum``; a layer may
   change the dy it is given in place, so it never gets one another node still needs). A
   layer called twice (shared) has one set of weights and the sum of its calls'
   gradients. Why a fixed order: float addition is not associative, and a fixed order gives
   the same bits every step and on every replica (the replicas must stay bitwise equal).
   What each layer launches is its own business (``layers.py``): the program knows no
   layer type. Loss sums and correct counts stay ON the device until progress is printed.

Why 1/GLOBAL batch on every replica: each replica's gradient is then its share of the
mean loss's gradient, and the all-reduce SUM of the shares is exactly what one device
would compute on the whole batch (TensorFlow's rule; the tests check it).

Neighbours: ``layers.py`` (each layer's forward/backward), ``step.py`` (drives these
programs), ``functional.py`` (the nodes' order), ``optimizers.py``, ``mirrored/ring.py``.
"""
from collections import namedtuple

import numpy as np

from kernels.launch import view   # a reshape made once per buffer (numba-cuda types each new view)
from mirrored.keras import custom_loop, non_trainable, sample_weights
from mirrored.program import recording
from mirrored.tensor import Tensor
from mirrored.values import components

FLOAT = np.dtype(np.float32)

#: One call of a layer in the model's program: ``inputs``, the numbers of the tensors it
#: reads (0: the model's input; i + 1: node i's output); ``multi``: called on a list.
Node = namedtuple("Node", "layer inputs multi")


class ParameterPack:
    """Every trainable variable of a model in one flat buffer per device, plus gradients.

    After packing, ``variables[k]``'s copy on device r is the view
    ``params[r][offsets[k]:offsets[k] + sizes[k]]`` reshaped; its gradient is the
    same slice of ``grads[r]``. Non-trainable weights stay outside (``non_trainable.py``).
    """

    def __init__(self, variables, devices, state=()):
        self.variables = list(variables)
        self.devices = list(devices)
        self.averaged = non_trainable.AveragedState(state, self.devices) or None   # per-replica state
        self.shapes = [v.shape for v in self.variables]
        self.sizes = [int(np.prod(s, dtype=np.int64)) for s in self.shapes]
        self.offsets = list(np.cumsum([0] + self.sizes[:-1]).astype(int))
        self.total = int(sum(self.sizes))
        custom_loop.register(self)               # lets apply_gradients find the packed path
        self.params, self.grads = [], []        # flat (total,) float32 per device
        self.param_views, self.grad_views = [], []   # [device][k] shaped views
        for r, dev in enumerate(self.devices):
            with dev.activate():
                flat = dev.empty((self.total,), FLOAT)
                grad = dev.from_numpy(np.zeros(self.total, FLOAT))   # zeros copied: no kernel to load at build
                pviews, gviews = [], []
                for var, off, size, shape in zip(self.variables, self.offsets, self.sizes, self.shapes):
                    comp = components(var)[r]
                    view = flat[off:off + size]
                    dev.copy_into(view, comp.value().buf)
                    comp.use_storage(Tensor(view.reshape(shape), dev))   # the variable now lives here
                    pviews.append(comp.value().buf)
                    gviews.append(grad[off:off + size].reshape(shape))
            self.params.append(flat)
            self.grads.append(grad)
            self.param_views.append(pviews)
            self.grad_views.append(gviews)


def all_reduce(pack, cross_device_ops):
    """Step 3: every replica's packed gradient buffer becomes the SUM over all replicas.

    One call of the strategy's cross-device ops (the ring, ``RingAllReduce``) over
    one flat buffer per device, in place. One replica has nothing to sum (the cross-device
    ops know: across workers, one local device is still one replica of many).
    """
    cross_device_ops.all_reduce_flat("SUM", pack.grads, pack.devices)
    if pack.averaged is not None:              # BatchNormalization's moving statistics: their mean
        pack.averaged.average(cross_device_ops)


class LayerState:
    """What one layer node holds on one replica's device (``layers.py`` says how it is used).

    ``weights`` / ``grads``: the layer's variables on this device as views into the
    packed parameter and gradient buffers (Keras's order: kernel, bias). A layer called
    twice (shared) has one state per node; all but its last node write their gradients
    into scratch buffers of their own, which the program then adds into the packed ones
    (``accumulate``: those packed views, else None). ``need_dx``: whether a node before
    has weights, so ``backward`` must return the gradient with respect to the input (a
    tuple, one per input, for a layer called on a list). ``buffers(b)``: the node's own
    buffers for batches of ``b`` (``layer.make_buffers``), made on first use. ``fused``: the
    neighbour's state when this node and the next run as one op (``Conv2D.fuse_next``).
    """

    __slots__ = ("layer", "dev", "ops", "replica_id", "global_replica_id", "weights", "grads",
                 "need_dx", "_buffers", "fused", "accumulate", "penalty_factor")

    def __init__(self, layer, dev, replica_id, weights, grads, need_dx, global_replica_id=None,
                 accumulate=None, penalty_factor=1.0):
        self.layer, self.dev, self.ops, self.replica_id = layer, dev, dev.ops, replica_id
        # among every worker's replicas (MultiWorkerMirroredStrategy); the local id on one machine
        self.global_replica_id = replica_id if global_replica_id is None else global_replica_id
        self.weights, self.grads, self.need_dx, self.accumulate = weights, grads, need_dx, accumulate
        self._buffers, self.penalty_factor = {}, penalty_factor   # 1/N: add_loss's share (call_layers.py)
        self.fused = None        # the neighbour's state when two layers run as one op (Conv2D's fuse_next)

    def buffers(self, b):
        if b not in self._buffers:                  # None too: a layer that keeps nothing
            self._buffers[b] = self.layer.make_buffers(self, b)
        return self._buffers[b]


class _LossBuffers:
    """The loss's buffers for one batch size on one device, reused every step."""

    def __init__(self, dev, b, classes):
        self.dlogits = dev.empty((b, classes), FLOAT)    # d loss / d logits: (b, classes)
        self.probs = dev.empty((b, classes), FLOAT)      # softmax output, for predict
        # row 0: per-example loss; row 1: 1.0 where argmax == label; row 2: 1.0 (counts examples)
        self.stats = dev.empty((3, b), FLOAT)
        self.loss, self.correct = self.stats[0], self.stats[1]
        dev.ops.fill(self.stats[2], 1.0)


class ReplicaProgram:
    """The model's layer nodes on one device: forward, loss, backward (the module docstring).

    ``nodes``: ``Node``s in topological order (``functional.py``); tensor 0 the model's input, tensor
    i + 1 node i's output. ``input_grad``: backward leaves d loss / d input in ``grads[0]`` (tape.py)
    """

    def __init__(self, nodes, pack, replica_id, in_dim, replica_offset=0, num_replicas=1, input_grad=False):
        self.nodes, self.pack = list(nodes), pack
        self.penalty_factor = 1.0 / num_replicas    # each replica's share of model.losses' gradient
        self.r, self.dev, self.ops = replica_id, pack.devices[replica_id], pack.devices[replica_id].ops
        self.in_dim = in_dim                      # features per example: inputs are (b, in_dim)
        #: edges[t]: how many inputs of nodes tensor t feeds (fan-out when > 1)
        self.edges = [sum(node.inputs.count(t) for node in self.nodes) for t in range(len(self.nodes) + 1)]
        last = {id(node.layer): i for i, node in enumerate(self.nodes)}   # a shared layer's last node
        self.upstream = upstream = [input_grad]   # upstream[t]: a node before tensor t has weights (t=0: dx asked)
        self.states = []
        for i, node in enumerate(self.nodes):
            layer, n = node.layer, len(node.layer.trainable_weights)
            need_dx = tuple(upstream[t] for t in node.inputs)
            own = last[id(layer)] == i            # the last node writes the packed gradients
            weights, grads, packed = non_trainable.layer_views(layer, pack, replica_id, own)  # + frozen ones'
            self.states.append(LayerState(layer, self.dev, replica_id, weights,
                                          grads, need_dx if node.multi else need_dx[0],
                                          replica_offset + replica_id, None if own else packed, self.penalty_factor))
            upstream.append(n > 0 or any(need_dx))
        for i, (node, state) in enumerate(zip(self.nodes, self.states)):   # layers that run as one op
            fuse = getattr(node.layer, "fuse_next", None)     # if its output feeds one node, not the loss
            if fuse is not None and self.edges[i + 1] == 1 and i + 1 < len(self.nodes):
                following = next(s for s, n in zip(self.states, self.nodes) if i + 1 in n.inputs)
                if following.fused is None and state.fused is None and fuse(following.layer, self.ops):
                    state.fused, following.fused = following, state
        #: [(state, regularizer, index of the weight)]: every penalty, once per layer (keras/regularizers.py)
        self.penalties = [(state, reg, i) for state in self.states if state.accumulate is None
                          for reg, i in state.layer.regularized + state.layer.reported_losses]
        self.classes = self.nodes[-1].layer.output_shape[-1]
        self.softmax_output = getattr(self.nodes[-1].layer, "activation", None) == "softmax"
        self._loss_buffers, self._grad_sums = {}, {}   # b -> _LossBuffers; (tensor, b) -> its gradient's
        self.input_cache = {}                      # (b, label dtype, shape) -> (x, y) input buffers
        self.x, self.logits, self.last_b = None, None, 0   # the last forward's input (b, in), output, b
        with self.dev.activate():
            self.metric_sums = self.dev.from_numpy(np.zeros(4, FLOAT))   # [loss, correct, examples, weights]
            self.acc = self.metric_sums[:3]
            self.tmp = self.dev.empty((3, 1), FLOAT)

    def zero_metrics(self):
        self.ops.fill(self.metric_sums, 0.0)

    def caches(self):
        """The dicts of buffers made on first use (inputs, loss, gradient sums, every node's): a
        step that fails drops what it added (``keras/step.py``'s ``rolled_back_on_error``)."""
        return [self.input_cache, self._loss_buffers, self._grad_sums] + [s._buffers for s in self.states]

    def loss_buffers(self, b):
        buf = self._loss_buffers.get(b)
        if buf is None:
            buf = self._loss_buffers[b] = _LossBuffers(self.dev, b, self.classes)
        return buf

    def grad_sum(self, t, b, use="sum"):
        """The engine's own buffer for d loss / d tensor ``t``, batches of ``b``: (b,) + its shape."""
        buf = self._grad_sums.get((t, b, use))
        if buf is None:
            shape = (b,) + (tuple(self.nodes[t - 1].layer.output_shape) if t else (self.in_dim,))
            buf = self._grad_sums[(t, b, use)] = self.dev.empty(shape, FLOAT)
        return buf

    def reserve(self, b):
        """Make (once) every node's, the loss's and the gradient sums' buffers for batches of
        ``b``, so that a step that runs out of memory does so before anything is computed."""
        for state in self.states:
            state.buffers(b)
        if b:
            self.loss_buffers(b)
            for t in range(1, len(self.edges)):
                if self.edges[t] > 1 and self.upstream[t]:
                    self.grad_sum(t, b)

    def input_buffers(self, b, label_dtype, label_shape=(), scalars=None):
        """Step 1's landing place, once per batch size: x (b, in_dim) float32, y (b,) + ``label_shape``
        (labels, or MSE/BCE targets), room for a training step's optimizer ``scalars``: one copy."""
        k = len(scalars) if scalars is not None and b else 0      # (a replica with no rows: none)
        key = (b, np.dtype(label_dtype), tuple(label_shape), k)
        if key not in self.input_cache:
            specs = [((b, self.in_dim), FLOAT), ((b,) + tuple(label_shape), label_dtype)]
            self.input_cache[key] = self.dev.empty_parts(specs + [((k,), FLOAT)] * bool(k))
        return self.input_cache[key]

    # -- the program
    def forward(self, x, training=False, probabilities=False):
        """x: (b, in_dim) float32 on this device, through every node in topological order.

        Returns the last node's output buffer (logits before a final softmax);
        ``probabilities=True`` applies that softmax (for ``predict``)."""
        self.x, self.last_b = x, x.shape[0]
        values = [x]                                             # values[t]: tensor t, (b,) + its shape
        for state, node in zip(self.states, self.nodes):
            xs = [values[t] for t in node.inputs] if node.multi else values[node.inputs[0]]
            values.append(state.layer.forward(state, xs, training))
        self.logits = x = values[-1]                             # (b, classes)
        self.ran_forward(values[0], x)        # set by a replay too: a host entry (host_method, below)
        if probabilities and self.softmax_output and self.last_b:
            probs = self.loss_buffers(self.last_b).probs
            self.ops.softmax(x, probs)
            return probs
        return x

    def ran_forward(self, x, logits):
        self.x, self.last_b, self.logits = x, x.shape[0], logits

    def loss(self, labels, mode, scale, with_grad=True):
        """Per-example loss of the last forward (added to the metrics on the device)
        and, ``with_grad``, its gradient with respect to the logits.

        ``mode``: "logits" (softmax cross-entropy of the pre-softmax output), "probs" (no softmax
        layer, ``from_logits=False``), float targets (``ops.target_loss``: one-hot, MSE, BCE), or a
        loss written in ops (``custom_losses.Loss.run_in``). ``scale``: 1/global batch. ``labels`` may be
        (labels, weights): Keras's sample_weight, applied after the kernel (keras/sample_weights.py)."""
        labels, weights = labels if isinstance(labels, tuple) else (labels, None)
        b = self.last_b
        if not b:
            return
        buf = self.loss_buffers(b)
        grad = buf.dlogits if with_grad else None                # (b, classes)
        if mode == "probs":
            self.ops.prob_xent(self.logits, labels, buf.loss, grad, buf.correct, scale)
        elif mode == "logits":
            self.ops.softmax_xent(self.logits, labels, buf.loss, grad, buf.correct, scale)
        elif hasattr(mode, "run_in"):                           # written in ops (keras/custom_losses.py)
            mode.run_in(self, labels, buf, grad, scale)
        else:                                                    # float targets (b, classes)
            self.ops.target_loss(mode, self.logits, labels, buf.loss, grad, buf.correct, scale)
        if weights is not None:                                  # sum(w l) / B: rows of dlogits times w
            sample_weights.apply(self, weights, buf, grad)
        self._accumulate(buf)
        self._accumulate_penalties(b)

    def _accumulate_penalties(self, b):
        """The loss metric += b x model.losses (Keras reports the data loss plus the penalties)."""
        for state, reg, i in self.penalties:
            value = self.dev.scratch("penalty value", (1,), FLOAT)
            reg.value_into(self.dev, state.weights[i], value)
            self.ops.binary_scalar("mul", value, float(b), value)
            self.ops.binary("add", self.acc[0:1], value, self.acc[0:1])

    def add_penalty_gradients(self):
        """fit's regularization: each regularized weight's penalty gradient x 1/N into this
        replica's packed gradient, so the all-reduce SUM adds it once (keras/regularizers.py)."""
        for state, reg, i in self.penalties:
            reg.add_gradient(self.dev, state.weights[i], state.grads[i], self.penalty_factor)

    def backward(self):
        """The nodes in reverse, from the loss's gradient; every weight's gradient lands
        in this replica's packed gradient buffer (an empty slice: all zeros).

        A tensor that feeds several nodes gets the sum of their gradients, added in the
        order the nodes run backward, into a buffer of the engine's (``grad_sum``): a fixed
        order, so the sum has the same bits every step and on every replica."""
        b = self.last_b
        if not b:
            self.ops.fill(self.pack.grads[self.r], 0.0)
            return
        self.grads = grads = [None] * len(self.edges)            # grads[t]: d loss / d tensor t
        arrived = [0] * len(self.edges)
        grads[-1] = self.loss_buffers(b).dlogits                 # (b, classes)
        for i in reversed(range(len(self.nodes))):
            state, node = self.states[i], self.nodes[i]
            if not self.upstream[i + 1]:                         # no weights here nor before
                continue
            dxs = state.layer.backward(state, grads[i + 1])
            for packed, own in zip(state.accumulate or (), state.grads):   # a shared layer's node
                self.ops.binary("add", packed, own, packed)
            for j, (t, dx) in enumerate(zip(node.inputs, dxs if node.multi else [dxs])):
                if dx is None:
                    continue
                if node.multi and any(dx is other for other in dxs[:j]):   # one buffer, two inputs:
                    copy = self.grad_sum(t, b, "copy")                     # each its own (in place!)
                    self.dev.copy_into(copy, dx)
                    dx = copy
                arrived[t] += 1
                if self.edges[t] == 1:
                    grads[t] = dx                                # its only consumer's: pass it on
                elif arrived[t] == 1:
                    grads[t] = dx                                # the first of several: kept
                else:                                            # sum = first + second + ...
                    total = self.grad_sum(t, b)
                    self.ops.binary("add", view(grads[t], total.shape), view(dx, total.shape), total)
                    grads[t] = total

    def forward_backward(self, x, y, mode, scale):
        """Step 2 on this replica: forward (training), loss scaled by ``scale``, backward."""
        self.forward(x, training=True)
        self.loss(y, mode, scale)
        self.backward()
        self.add_penalty_gradients()

    def _accumulate(self, buf):
        """acc += [sum of losses, number correct, examples]: one column-sum launch, one add.

        Even the example count is summed on the device (a row of ones), so a step
        changes no host state here and can be replayed as a CUDA graph
        (``mirrored/program/capture.py``). float32 counts exactly up to 2**24 examples per epoch.
        """
        b = buf.stats.shape[1]
        self.ops.sum_axis(view(buf.stats, (3, b, 1)), self.tmp)     # (3, 1)
        self.ops.binary("add", self.acc, view(self.tmp, (3,)), self.acc)

    def read_metrics(self):
        """(loss sum, correct count, examples, sum of sample weights) so far — the one host read."""
        loss, correct, seen, weights = self.dev.to_numpy(self.metric_sums)
        return float(loss), float(correct), int(seen), float(weights)


recording.host_method(ReplicaProgram, "ran_forward")     # a replay sets the last forward's buffers
