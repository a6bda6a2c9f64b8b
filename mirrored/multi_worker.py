"""``MultiWorkerMirroredStrategy``: MirroredStrategy over several processes (workers), joined by MPI.

What changes from ``MirroredStrategy`` (``strategy.py``), and nothing else does:

* Workers. ``mpiexec -n W python train.py`` starts W copies of the script; each
  is one worker, with its own local replicas (its logical GPUs, else its CPU,
  chosen as ``MirroredStrategy()`` chooses them), and MPI's rank is its
  ``cluster_resolver.task_id``. Worker 0 is the chief. A plain ``python train.py``
  is one worker, as in TensorFlow. If ``TF_CONFIG`` is set, its cluster must
  agree with MPI's world (how many workers, which one this is), else an error.
* ``num_replicas_in_sync`` counts every replica of every worker; replica ids run
  over all of them (worker ``rank``'s local replica l is replica ``rank*L + l``).
* The gradients' sum is ``CollectiveAllReduce`` (``collective_all_reduce.py``):
  the same ring, stretched over all W*L replicas, its hops between workers MPI
  messages. ``CommunicationOptions(implementation=RING)`` (or AUTO) selects it;
  NCCL runs as the ring, with a note.
* Variables start equal everywhere: each initial value is broadcast from the
  chief (TensorFlow does the same), so the workers need not share a seed. The same
  message carries every worker's (name, shape, dtype) of the variable: workers that
  build different models are refused on every worker, naming the first difference
  and the ranks, before any value is used (``_agree_on_variable``). Arrays given to
  ``fit``/``evaluate`` must hold as many examples on every worker
  (``extended.check_example_count``, before the first step).
* Start-up: the chief prints every worker's rank, PID and host (``Workers.table``),
  so that a launcher's "PID 4242 ... EXIT CODE: 9" names the worker that died.
* Input: ``experimental_distribute_dataset(ds)`` gives each worker its rows of
  every global batch (TensorFlow's DATA sharding): every worker reads the same
  global batches, cuts each into ``num_replicas_in_sync`` slices by the
  rebatching rule, and keeps the slices of its own replicas. Shuffle with a seed
  (``mirrored.random.set_seed``) so that every worker sees the same batches.
  ``distribute_datasets_from_function(fn)`` calls ``fn(InputContext(
  num_input_pipelines=W, input_pipeline_id=rank, ...))``: one pipeline per worker,
  to shard as it likes (``ds.shard(ctx.num_input_pipelines, ctx.input_pipeline_id)``).
* Results: ``strategy.reduce``/``gather`` combine every worker's replicas (the
  workers' partial results are exchanged and summed in rank order, so every
  worker gets the same bits); ``fit``/``evaluate`` logs are over all workers.
* Only the chief prints (``fit``/``evaluate``/``predict`` progress) and keeps
  files: ``extended.should_checkpoint`` / ``should_save_summary`` are True on the
  chief only, and a non-chief ``model.save_weights(path)`` writes into a
  temporary directory that is deleted at once — what Keras's callbacks do on
  non-chief workers (``distributed_file_utils.write_filepath``: a
  ``workertemp_<task_id>`` directory, removed after the save).
* Faults: every wait for another worker has a deadline, counted in steps once the
  first steps (which compile) are done: max(60 s, 10 x the slowest step so far)
  (``workers.Workers.deadline_s``); ``CommunicationOptions(timeout_seconds=...)`` or
  ``MIRRORED_WORKER_TIMEOUT_S`` fixes it instead. A peer on this host whose process
  ended is named (rank and PID) within a second. An exception nobody catches ends every
  worker (``workers.install_abort_hook``): the failing worker prints its error, rank
  and PID, then ``MPI.Abort``.

Neighbours: ``strategy.py`` (MirroredStrategy, which this extends),
``collective_all_reduce.py`` (the ring across workers), ``workers.py`` (MPI),
``input_lib.py`` and ``keras/step.py`` (which read ``extended.replica_offset``).
"""
import enum
import json
import os
import socket
import warnings

import numpy as np

from mirrored import nest
from mirrored.collective_all_reduce import CollectiveAllReduce
from mirrored.strategy import (MirroredStrategy, Strategy, StrategyExtended, choose_devices,
                               host_components, reduce_on_host)
from mirrored import backends, context, workers as _workers
from mirrored.program import recording
from mirrored.cross_device_ops import ReduceOp
from mirrored.tensor import HostTensor, Tensor
from mirrored.traced_function import reduce_in_trace
from mirrored.values import DistributedValues, PerReplica, Variable


class CommunicationImplementation(enum.Enum):
    """``tf.distribute.experimental.CommunicationImplementation``: AUTO, RING, NCCL."""

    AUTO = "AUTO"
    RING = "RING"
    NCCL = "NCCL"


class CommunicationOptions:
    """``tf.distribute.experimental.CommunicationOptions``: how the workers' all-reduce runs.

    ``implementation``: ``RING`` (or ``AUTO``, which picks it) is ours: the ring
    over every replica of every worker, MPI between workers. ``NCCL`` runs as the ring, with a warning that says so.
    ``timeout_seconds``: a fixed deadline for every wait for another worker (None:
    ``MIRRORED_WORKER_TIMEOUT_S`` if set, else the deadline counted in steps,
    ``workers.Workers.deadline_s``). ``bytes_per_pack`` is accepted for
    compatibility (gradients are always fused into one buffer per dtype).
    """

    def __init__(self, bytes_per_pack=0, timeout_seconds=None,
                 implementation=CommunicationImplementation.AUTO):
        if bytes_per_pack < 0:
            raise ValueError(f"bytes_per_pack must be non-negative, got {bytes_per_pack}.")
        name = getattr(implementation, "value", implementation)
        if isinstance(name, str):
            name = name.upper()
        if name not in ("AUTO", "RING", "NCCL"):
            raise ValueError(f"implementation must be a CommunicationImplementation (AUTO, RING, "
                             f"NCCL), got {implementation!r}.")
        if name == "NCCL":
            warnings.warn(
                "CommunicationImplementation.NCCL: mirrored does not use NCCL; the workers' "
                "all-reduce runs on our own ring (peer-memory reads inside a worker, MPI messages "
                "between workers), as with RING: the same sums.", stacklevel=2)
        if timeout_seconds is not None and not timeout_seconds > 0:
            raise ValueError(f"timeout_seconds must be positive (or None), got {timeout_seconds}.")
        self.bytes_per_pack = bytes_per_pack
        self.timeout_seconds = timeout_seconds
        self.implementation = CommunicationImplementation(name)

    def __repr__(self):
        return (f"CommunicationOptions(bytes_per_pack={self.bytes_per_pack}, timeout_seconds="
                f"{self.timeout_seconds}, implementation={self.implementation})")


class ClusterSpec:
    """The cluster as TensorFlow names it: ``{'worker': ['mpi-rank-0', ...]}``.

    Workers here are MPI ranks, not host:port addresses; the names say so.
    """

    def __init__(self, num_workers):
        self._jobs = {"worker": [f"mpi-rank-{r}" for r in range(num_workers)]}

    def as_dict(self):
        return {job: list(tasks) for job, tasks in self._jobs.items()}

    @property
    def jobs(self):
        return list(self._jobs)

    def num_tasks(self, job_name):
        return len(self._jobs[job_name])

    def task_indices(self, job_name):
        return list(range(len(self._jobs[job_name])))

    def __repr__(self):
        return f"ClusterSpec({self.as_dict()})"


class MPIClusterResolver:
    """``strategy.cluster_resolver``: which worker this process is (MPI's rank)."""

    def __init__(self, rank, size):
        self.task_type = "worker"
        self.task_id = rank
        self.rpc_layer = "mpi"
        self.environment = ""
        self._size = size

    def cluster_spec(self):
        return ClusterSpec(self._size)

    def master(self, task_type=None, task_id=None, rpc_layer=None):
        return ""

    def __repr__(self):
        return f"<MPIClusterResolver: task_type='worker', task_id={self.task_id} of {self._size}>"


def check_tf_config(rank, size, environ=None):
    """Refuse a ``TF_CONFIG`` whose cluster disagrees with MPI's world (none: nothing to check).

    TensorFlow's layout: ``{"cluster": {"worker": [...], "chief": [...]?}, "task":
    {"type": "worker", "index": i}}``; with a ``chief`` job the chief is worker 0 and
    ``worker`` i is worker i+1, else ``worker`` i is worker i.
    """
    raw = (os.environ if environ is None else environ).get("TF_CONFIG")
    if not raw:
        return
    hint = ("MPI decides here: unset TF_CONFIG, or make it describe the same world "
            "(mpiexec -n N starts N workers, numbered by rank).")
    try:
        config = json.loads(raw)
        cluster = config.get("cluster", {})
        task = config.get("task", {})
    except (ValueError, AttributeError) as err:
        raise ValueError(f"TF_CONFIG is not the JSON TensorFlow expects ({err}): {raw[:200]!r}") from err
    chiefs = list(cluster.get("chief", []))
    workers = chiefs + list(cluster.get("worker", []))
    if len(workers) != size:
        raise ValueError(f"TF_CONFIG describes {len(workers)} worker(s) (cluster {cluster}), but MPI "
                         f"started {size}. {hint}")
    task_type, index = task.get("type", "worker"), int(task.get("index", 0))
    if task_type not in ("worker", "chief"):
        raise ValueError(f"TF_CONFIG's task type {task_type!r} has no place here (only 'worker' "
                         f"and 'chief' workers train in MultiWorkerMirroredStrategy). {hint}")
    position = index if task_type == "chief" else index + len(chiefs)
    if position != rank:
        raise ValueError(f"TF_CONFIG says this process is task {task_type!r} {index} (worker "
                         f"{position}), but MPI made it rank {rank}. {hint}")


class MultiWorkerExtended(StrategyExtended):
    """``strategy.extended`` of a multi-worker strategy: this worker's place among all."""

    def __init__(self, strategy, devices, cross_device_ops):
        super().__init__(strategy, devices, cross_device_ops)
        workers = cross_device_ops.workers
        self._workers = workers
        self._num_workers = workers.size
        self._replica_offset = workers.rank * len(self.devices)

    @property
    def workers(self):
        """The ``workers.World`` joining this worker to the others (rank, size, MPI messages)."""
        return self._workers

    @property
    def _is_chief(self):
        return self._workers.rank == 0

    should_checkpoint = property(lambda self: self._is_chief)
    should_save_summary = property(lambda self: self._is_chief)

    def broadcast_from_chief(self, value, what="a broadcast"):
        """The chief's ``value`` (picklable), on every worker."""
        return self._workers.bcast(value, 0, what)

    def check_example_count(self, count, what):
        """Refuse arrays of different lengths on the workers, naming each worker's count:
        every worker cuts the same global batches (with the chief's shuffle), so a worker
        with other data would read past its arrays or run another number of steps."""
        counts = self._workers.allgather(int(count), "agreeing on the number of examples")
        if len(set(counts)) > 1:
            named = "; ".join(f"{self._workers.name(r)}: {n}" for r, n in enumerate(counts))
            raise ValueError(
                f"{what}: the workers hold different numbers of examples ({named}). With "
                f"MultiWorkerMirroredStrategy every worker passes the same arrays (each keeps "
                f"its replicas' rows of every global batch); to give each worker its own data, "
                f"use strategy.distribute_datasets_from_function with datasets that yield the "
                f"same number of batches on every worker.")

    def sum_across_workers(self, values, what="a sum"):
        """Host float64 ``values``, summed over the workers in rank order (same bits on each)."""
        parts = self._workers.allgather(np.asarray(values, np.float64), what)
        total = parts[0].copy()
        for part in parts[1:]:
            total = total + part
        return total


#: Variables by which a user sets the BLAS's thread count themselves (then we leave it).
BLAS_THREAD_VARS = backends.BLAS_THREAD_VARS


def _share_cores(devices, workers_here):
    """CPU workers sharing one machine split its cores: each worker's OpenBLAS gets
    cores // workers_here threads (at least 1), unless the user set a thread count.

    Without this, every worker's OpenBLAS starts one thread per core and they spin
    against each other: 2 workers on 2 cores took 52.7 ms per lab ConvNet step against
    6.8 for one worker; with one thread each, 9.0 (benchmarks.multiworker, README
    "Beyond one machine"). Returns the note the strategy prints ('' when untouched)."""
    if devices[0].device_type != "CPU" or workers_here <= 1:
        return ""
    if any(os.environ.get(var) for var in BLAS_THREAD_VARS):
        return ""
    from kernels.cpu_loops import usable_cores
    cores = usable_cores()
    threads = max(1, cores // workers_here)
    if backends.set_blas_threads(threads) is None:
        return ""
    return (f"; BLAS threads: {threads} ({workers_here} workers share this machine's {cores} "
            f"cores; set OPENBLAS_NUM_THREADS to choose)")


class MultiWorkerMirroredStrategy(MirroredStrategy):
    """Synchronous data parallelism over every replica of every worker (MPI ranks).

    ``communication_options``: a ``CommunicationOptions`` (RING/AUTO, and the
    deadline of cross-worker waits). See the module docstring for what differs
    from ``MirroredStrategy``; launch with ``mpiexec -n N python train.py``.
    """

    _extended_type = MultiWorkerExtended

    def __init__(self, communication_options=None, cluster_resolver=None):
        if cluster_resolver is not None:
            raise NotImplementedError("cluster_resolver: the workers are MPI's ranks here; start "
                                      "them with mpiexec -n N (leave cluster_resolver=None).")
        options = communication_options or CommunicationOptions()
        if not isinstance(options, CommunicationOptions):
            raise TypeError(f"communication_options must be a CommunicationOptions, got {options!r}.")
        self._options = options
        workers = _workers.world(options.timeout_seconds)
        check_tf_config(workers.rank, workers.size)
        devices = choose_devices(None)
        _workers.install_abort_hook(workers)
        Strategy.__init__(self, devices, CollectiveAllReduce(workers))
        self._workers = workers
        self._resolver = MPIClusterResolver(workers.rank, workers.size)
        # one message: every worker's PID and host (for the table and for naming a lost
        # peer in an error), its local devices, and whether this host is shared
        kinds = [tuple(kind) for kind in workers.introduce((len(devices), devices[0].device_type),
                                                           "agreeing on the devices")]
        if workers.rank == 0 and workers.size > 1:
            print(workers.table(), flush=True)
        if len(set(kinds)) > 1:
            named = "; ".join(f"worker {r}: {n} {kind}(s)" for r, (n, kind) in enumerate(kinds))
            raise ValueError(f"MultiWorkerMirroredStrategy: the workers have different local "
                             f"devices ({named}). Every worker needs the same number and kind of "
                             f"replicas (TensorFlow requires it too): configure the same logical "
                             f"devices on each.")
        blas = _share_cores(devices, workers.hosts.count(socket.gethostname()))
        print(f"Using MultiWorkerMirroredStrategy: worker {workers.rank} of {workers.size} "
              f"(chief: worker 0), local devices {tuple(d.name for d in devices)}, "
              f"{self.num_replicas_in_sync} replicas in sync, communication "
              f"{options.implementation}{blas}", flush=True)

    @property
    def cluster_resolver(self):
        return self._resolver

    # -- variables: the chief's initial value everywhere, once every worker has the same one
    def _create_variable(self, initial_value=None, **kwargs):
        if callable(initial_value):
            initial_value = initial_value()
        if self._workers.size > 1:
            host = initial_value.numpy() if isinstance(initial_value, (Tensor, Variable)) \
                else np.asarray(initial_value)
            dtype = kwargs.get("dtype") or host.dtype
            dtype = getattr(dtype, "name", str(dtype))
            initial_value = self._agree_on_variable(
                (kwargs.get("name") or "Variable", tuple(host.shape), dtype), host)
        return super()._create_variable(initial_value, **kwargs)

    def _agree_on_variable(self, spec, host):
        """The chief's initial value, once every worker has created the same variable.

        One message per variable (what a broadcast costs anyway): every worker sends its
        (name, shape, dtype), the chief its value too. A worker that built another model
        (Dense(8) where the chief has Dense(6)) is refused on every worker, naming the
        first difference and the ranks, before any value is used; a worker with an extra
        variable reaches this call while the others are elsewhere, which ``allgather``
        names (the workers' collective calls differ).
        """
        workers = self._workers
        seen = workers.allgather((spec, host if workers.rank == 0 else None), "creating a variable",
                                 detail=f"{spec[0]!r} of shape {spec[1]}, {spec[2]}")
        specs = [s for s, _ in seen]
        differ = [r for r, other in enumerate(specs) if other != specs[0]]
        if differ:
            def show(r):
                name, shape, dtype = specs[r]
                return f"{workers.name(r)} creates {name!r} of shape {shape}, {dtype}"
            raise ValueError(
                f"MultiWorkerMirroredStrategy: the workers build different models: "
                f"{show(0)}; {show(differ[0])}"
                f"{f' (and {len(differ) - 1} more worker(s) differ)' if len(differ) > 1 else ''}. "
                f"Every worker must create the same variables (names, shapes, dtypes) in the same "
                f"order, inside strategy.scope(): run the same script with the same model on every "
                f"worker (the chief's initial values are then copied to all).")
        return seen[0][1]

    # -- results over every worker
    def reduce(self, reduce_op, value, axis=None):
        """``Strategy.reduce`` over every replica of every worker (same result on each)."""
        reduce_op = ReduceOp.validate(reduce_op)
        value = self._as_local_replicas(value)
        if self._workers.size == 1 or not isinstance(value, DistributedValues):
            if nest.is_nested(value) and any(isinstance(leaf, DistributedValues) for leaf in nest.flatten(value)):
                return nest.map_structure(lambda leaf: self.reduce(reduce_op, leaf, axis), value)
            return super().reduce(reduce_op, value, axis)
        if context.top()[1] is not None:
            raise RuntimeError("strategy.reduce is for cross-replica context; inside the replica "
                               "function use get_replica_context().all_reduce(...).")
        if recording.active() is not None and not recording.in_host_code():
            # inside a @function's trace: the exchange between workers is host work, run again
            # at every replay; the result stays on the first local device (reduce_in_trace)
            return reduce_in_trace(self.extended.devices[0], reduce_op, value, axis,
                                   lambda: self._reduce_across_workers(reduce_op, value, axis), local=False)
        return HostTensor.wrap(self._reduce_across_workers(reduce_op, value, axis))

    def _reduce_across_workers(self, reduce_op, value, axis):
        """``reduce`` of the local replicas' values, then of every worker's, as a NumPy array."""
        comps = host_components(value, "reduce")
        local = reduce_on_host(ReduceOp.SUM, comps, axis)
        count = len(comps) if axis is None else sum(c.shape[axis] for c in comps)
        parts = self._workers.allgather((np.asarray(local), count), "strategy.reduce")
        shapes = [p[0].shape for p in parts]
        if len(set(shapes)) > 1:
            raise ValueError(f"reduce: the workers' values have different shapes {shapes} "
                             f"(after reducing axis={axis}); they must match.")
        total = parts[0][0]
        for part, _ in parts[1:]:
            total = total + part
        if reduce_op == ReduceOp.SUM:
            return total.astype(comps[0].dtype, copy=False)
        count = sum(c for _, c in parts)
        mean = total / count if count else total * np.nan
        return mean.astype(comps[0].dtype) if comps[0].dtype.kind == "f" else mean

    def gather(self, value, axis):
        """Every replica's value (every worker's) concatenated along ``axis``, in replica order."""
        comps = [np.atleast_1d(c) for c in host_components(self._as_local_replicas(value), "gather")]
        every = self._workers.allgather(comps, "strategy.gather")
        return HostTensor.wrap(np.concatenate([c for part in every for c in part], axis=axis))

    def _as_local_replicas(self, value):
        """With one local replica ``run`` returns plain values (as on one machine); across
        workers such a value is still that replica's own, so reduce/gather treat it as a
        PerReplica of one component."""
        if (self._workers.size > 1 and len(self._extended.devices) == 1
                and isinstance(value, (Tensor, np.ndarray, np.generic, int, float))):
            return PerReplica([value])
        return value

    def __repr__(self):
        return (f"<MultiWorkerMirroredStrategy worker {self._workers.rank} of {self._workers.size} "
                f"on {[d.short_name for d in self._extended.devices]}>")
