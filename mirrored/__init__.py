"""mirrored: TensorFlow's MirroredStrategy, re-implemented to be read.

``import mirrored as tf`` and the course's MNIST lab runs: devices
(``mirrored.config``), tensors on a device (``mirrored.constant`` ...), strategies,
data pipelines and Keras-style models. Each name behaves as TensorFlow documents
it; the README lists them.

Reading order: one training step in five files (lines at this writing; 1,500 in all)::

    1. keras/step.py        269  Step.train: the whole step in four visible calls --
                                   split -> forward_backward -> all_reduce -> update;
                                 ``fit`` (keras/trainer.py) calls it once per batch, and a
                                 custom loop's ``apply_gradients`` runs its steps 3-4
    2. keras/engine.py      362  ReplicaProgram: one replica's program of layer nodes (a
                                 DAG in topological order) forward, the loss, backward
                                 (step 2); ParameterPack; all_reduce (step 3)
    3. keras/layers.py      354  Flatten, Dense, Conv2D, MaxPooling2D: each layer's own
                                 forward and backward, through ``dev.ops``
    4. ring.py              290  RingAllReduce: the ring that sums the packed gradients (step 3)
    5. keras/optimizers.py  225  Adam/SGD ``update``: one launch per device (step 4)

   Beside them: keras/trainer.py (fit's loop around the step), keras/models.py (Model,
   Sequential, Functional: made and built), keras/functional.py (keras.Input, layer calls, the nodes' topological order,
   a subclassed model's call traced),
   keras/inference.py (evaluate's and predict's passes), keras/base_layer.py (``Layer``:
   the protocol's defaults), keras/data_adapters.py (the global batch as host arrays),
   input_lib.py (``rebatch_bounds``: TensorFlow's rule for the split, step 1),
   cross_device_ops.py (the ring's base class: checks, MEAN), devices.py
   (``dev.activate``, buffers), backends.py (``dev.ops``: the op on a GPU, our kernels,
   or a CPU, NumPy); then kernels/: gemm.py, activations.py, softmax_xent.py,
   reduction.py, allreduce.py, optimizers.py (each with its NumPy reference).
   ``python -m benchmarks.step_path`` counts the files one step of the lab ConvNet
   calls into.

Around the step, wrapping it from outside: program/ (the device program: a step's device
calls recorded, replayed, captured as CUDA graphs, planned; its docstring tells it in one
story), traced_function.py (``@function`` on it: a custom loop's step traced once, then
replayed); and, apart
from the library, the labs' measuring and drawing in lab/: lab/timing.py (phase timer,
TimedStep), lab/scaling.py (compare strategies), lab/perf_model.py (N GPUs predicted),
lab/viz.py (drawings).

Map of the rest:
    devices.py    devices: physical, logical, CPU and CUDA backends
    config.py     mirrored.config (TF's device functions)
    tensor.py     mirrored.Tensor and tensor functions
    ops.py        TensorFlow's ops as one table: each op's kernel and its gradient rule
                  (tf.square, tf.where, broadcasting +, slicing, matmul, reductions, tf.nn's)
    autodiff.py   the tape's graph: what each op records, and the walk back (any composition,
                  nested tapes); GradientTape itself is keras/tape.py
    image.py      tf.image.resize
    errors.py     TF-named errors
    strategy.py   MirroredStrategy, OneDeviceStrategy, replica contexts (mirrored.distribute)
    multi_worker.py  MultiWorkerMirroredStrategy: workers are MPI ranks (mpiexec -n N)
    cross_device_ops.py  CrossDeviceOps (packing, MEAN), ReductionToOneDevice, ReduceOp
    ring_steps.py the ring's step record (RingStep, RingTransfer; lab 03)
    collective_all_reduce.py  the ring across workers (MPI between processes)
    workers.py    MPI: rank and size, messages with deadlines, abort on failure
    launcher.py   starting workers: which mpiexec, which MPI, the command (Open MPI as root)
    values.py     PerReplica, Mirrored, Variable, MirroredVariable
    data.py       mirrored.data.Dataset (tf.data semantics over NumPy)
    datasets.py   mirrored.datasets.load("mnist") (tfds.load), bundled offline subset in _data/
    keras/        also model_api (compile, evaluate, predict, saving methods), losses, metrics,
                  callbacks, saving, optimizer_state (iterations, learning_rate, clipping,
                  weight decay, what Keras saves), optimizers_more (RMSprop, Adagrad, AdamW),
                  sample_weights (fit's and evaluate's sample_weight, class_weight),
                  schedules (learning-rate schedules), variable_updates (apply_gradients for variables outside a model),
                  custom_loop (which model's packed gradients a tape returned),
                  custom_step (fit running a model's own train_step, Keras 3's),
                  functional_config (Keras 3's "Functional" config),
                  GradientTape (tape.py), progbar
    nn.py         compute_average_loss, scale_regularization_loss, activations, cross entropies
    random.py     set_seed, random tensors (normal, uniform)
    checkpoint.py mirrored.train: Checkpoint, CheckpointManager, latest_checkpoint
    lab/workflow.py  the command-line lab (``python -m mirrored``) and the lab's model
    lab/labs.py   the lab notebooks' first cell (``labs.setup``)
"""
from mirrored import config, data, datasets, distribute, errors, keras, nn, program, random
from mirrored import checkpoint as train  # tf.train: Checkpoint, CheckpointManager, latest_checkpoint
from mirrored.devices import device_scope as device
from mirrored.distribute import (InputContext, MirroredStrategy, MultiWorkerMirroredStrategy,
                                 OneDeviceStrategy, ReduceOp,
                                 ReplicaContext, ValueContext, get_replica_context, get_strategy,
                                 in_cross_replica_context)
from mirrored.keras.tape import GradientTape, UnconnectedGradients
from mirrored.values import Variable, VariableAggregation, VariableSynchronization
from mirrored.module import Module  # tf.Module: a container that finds its variables
from mirrored.tensor import (Tensor, TensorShape, TensorSpec, add_n, as_dtype, bool_, constant,
                             convert_to_tensor, float16, float32, float64, identity, int8, int16, int32,
                             int64, uint8)
# TensorFlow's ops (tf.square, tf.where, tf.matmul, ...): mirrored/ops.py, each with its gradient
from mirrored import image, ops
from mirrored import ops as math   # tf.math: the same functions
from mirrored.ops import (abs, add, argmax, argmin, broadcast_to, cast, ceil, clip_by_value, concat, gather,  # noqa: A004
                          gather_nd, cos, divide, equal, exp, expand_dims, eye, fill, floor, greater, greater_equal,
                          less, less_equal, linspace, log, logical_and, logical_not, logical_or, logical_xor, matmul,
                          maximum, minimum, multiply, negative, newaxis, not_equal, one_hot, ones, ones_like,
                          pow, rank, reduce_all, reduce_any, reduce_max, reduce_mean, reduce_min, reduce_prod,
                          reduce_sum, reshape, round, shape, sigmoid, sign, sin, size, sqrt, square, squeeze,
                          stack, stop_gradient, subtract, tanh, transpose, unstack, where, zeros, zeros_like)
bool = bool_  # noqa: A001 (tf.bool)
from mirrored.traced_function import function  # @tf.function: trace once per signature, then replay
from mirrored.tensor import print_ as print  # noqa: A001 (tf.print: to stderr, as TensorFlow's)
from mirrored.tensor import range_ as range  # noqa: A001 (tf.range)



__version__ = "0.1.0"
