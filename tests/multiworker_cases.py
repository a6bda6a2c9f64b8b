"""What each worker runs in tests/test_multi_worker.py (started there by ``mpiexec -n N``).

    mpiexec -n 2 python tests/multiworker_cases.py train OUT [--gpus 2]
    mpiexec -n 3 python tests/multiworker_cases.py ring OUT [--cpus 2]
    mpiexec -n 2 python tests/multiworker_cases.py ring-gpus OUT [--gpus 2]
    mpiexec -n 2 python tests/multiworker_cases.py fail OUT
    mpiexec -n 2 python tests/multiworker_cases.py stall OUT
    mpiexec -n 2 python tests/multiworker_cases.py function OUT

Each case writes what it measured into OUT as ``<case>_rank<r>.npz`` (the test
compares the workers with each other and with one replica on the global batch,
computed in the test's own process); a case that finds something wrong raises,
which ends every worker with an error (the abort hook).
"""
import os
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

import mirrored as tf  # noqa: E402

DIN, HIDDEN, CLASSES = 5, 4, 3           # a tiny dense model (the CUDA simulator is slow)
EXAMPLES, GLOBAL_BATCH = 23, 6           # 4 batches per epoch, the last of 5 rows (uneven)
EPOCHS = 2
LEARNING_RATE = 0.1
PIPELINE_GLOBAL_BATCH = 8                # divisible by 2 and 4 replicas


def data(seed=7):
    """The same examples on every worker (and in the test's oracle)."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((EXAMPLES, DIN)).astype(np.float32)        # (23, 5) float32
    y = rng.integers(0, CLASSES, EXAMPLES)                              # (23,) int64
    return x, y


def build(strategy=None):
    """The model, inside ``strategy``'s scope when given (else no strategy)."""
    def make():
        model = tf.keras.Sequential([tf.keras.layers.Dense(HIDDEN, activation="relu", input_shape=(DIN,)),
                                     tf.keras.layers.Dense(CLASSES)])
        model.compile(loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      optimizer=tf.keras.optimizers.SGD(LEARNING_RATE, momentum=0.9), metrics=["accuracy"])
        return model
    if strategy is None:
        return make()
    with strategy.scope():
        return make()


def configure(cpus=1, gpus=0):
    if cpus > 1:
        cpu = tf.config.list_physical_devices("CPU")[0]
        tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * cpus)
    if gpus:
        gpu = tf.config.list_physical_devices("GPU")[0]
        tf.config.set_logical_device_configuration(gpu, [tf.config.LogicalDeviceConfiguration()] * gpus)


def case_train(out, gpus=0):
    """fit (2 epochs; a CSVLogger and a ModelCheckpoint every 3 batches) + evaluate +
    save_weights, then the custom loop, on every worker."""
    configure(gpus=gpus)
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    rank = strategy.cluster_resolver.task_id
    tf.random.set_seed(100 + rank)        # different seeds: the chief's initial weights must win
    x, y = data()
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(GLOBAL_BATCH)
    model = build(strategy)
    init = model.get_weights()
    history = model.fit(ds, epochs=EPOCHS, callbacks=[
        tf.keras.callbacks.CSVLogger(os.path.join(out, "log.csv")),
        tf.keras.callbacks.ModelCheckpoint(os.path.join(out, "ck-{epoch}-{batch}.weights.h5"),
                                           save_weights_only=True, save_freq=3)])
    evaluated = model.evaluate(ds)
    model.save_weights(os.path.join(out, "fit.weights.h5"))
    fit_weights = model.get_weights()
    copies = [[c.numpy() for c in v.values] for v in model.trainable_variables]

    # the custom loop (MirroredStrategy's tutorial), same start
    model2 = build(strategy)
    model2.set_weights(init)
    optimizer = tf.keras.optimizers.SGD(LEARNING_RATE, momentum=0.9)
    loss_object = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none")

    def train_step(inputs):
        features, labels = inputs
        with tf.GradientTape() as tape:
            logits = model2(features, training=True)
            loss = tf.nn.compute_average_loss(loss_object(labels, logits), global_batch_size=GLOBAL_BATCH)
        grads = tape.gradient(loss, model2.trainable_variables)
        optimizer.apply_gradients(zip(grads, model2.trainable_variables))
        return loss

    # the last batch has 5 rows: its loss is averaged over 6 here, as the tutorial's
    # compute_average_loss(global_batch_size=GLOBAL_BATCH) does; full batches only
    full = tf.data.Dataset.from_tensor_slices((x, y)).batch(GLOBAL_BATCH, drop_remainder=True)
    losses = []
    for _ in range(EPOCHS):
        for batch in strategy.experimental_distribute_dataset(full):
            per_replica = strategy.run(train_step, args=(batch,))
            losses.append(float(strategy.reduce(tf.distribute.ReduceOp.SUM, per_replica, axis=None)))
    # fit on the data set kept on the devices (each worker gathers its replicas' rows there);
    # CPU only: the simulator's gather kernel would make this case slow
    resident = []
    if not gpus:
        model3 = build(strategy)
        model3.set_weights(init)
        options = tf.distribute.InputOptions(experimental_place_dataset_on_device=True)
        model3.fit(strategy.experimental_distribute_dataset(ds, options), epochs=EPOCHS, verbose=0)
        resident = model3.get_weights()

    # distribute_datasets_from_function: one input pipeline per worker, sharded by the user
    seen = []

    def dataset_fn(ctx):
        seen.append((ctx.num_input_pipelines, ctx.input_pipeline_id, ctx.num_replicas_in_sync))
        per_replica = ctx.get_per_replica_batch_size(PIPELINE_GLOBAL_BATCH)
        return tf.data.Dataset.from_tensor_slices((x, y)).shard(
            ctx.num_input_pipelines, ctx.input_pipeline_id).batch(per_replica)

    first = next(iter(strategy.distribute_datasets_from_function(dataset_fn)))
    first_labels = np.concatenate([t.numpy() for t in strategy.experimental_local_results(first[1])])
    ids = strategy.experimental_distribute_values_from_function(
        lambda ctx: np.float32(ctx.replica_id_in_sync_group))
    gathered = strategy.gather(ids, axis=0)
    np.savez(os.path.join(out, f"train_rank{rank}.npz"), *init, *fit_weights, *model2.get_weights(),
             n=len(init), loss=np.array(history.history["loss"]), evaluated=np.array(evaluated),
             custom_losses=np.array(losses), gathered=np.asarray(gathered),
             replicas=strategy.num_replicas_in_sync,
             input_context=np.array(seen), resident=np.concatenate([w.ravel() for w in resident] or [[]]), first_labels=first_labels,
             copies_equal=all(np.array_equal(c[0], d) for c in copies for d in c[1:]))


def case_ring(out, cpus=1):
    """CollectiveAllReduce against MPI's Allreduce on awkward sizes; the step record names workers."""
    from mpi4py import MPI
    from mirrored import devices as registry
    from mirrored.collective_all_reduce import CollectiveAllReduce
    from mirrored.workers import install_abort_hook, world
    configure(cpus=cpus)
    comm, workers = MPI.COMM_WORLD, world()
    install_abort_hook(workers)
    rank, size = comm.Get_rank(), comm.Get_size()
    devices = [d for d in registry.logical_devices() if d.device_type == "CPU"]
    ring = CollectiveAllReduce(workers, keep_steps=True)
    rng = np.random.default_rng([int.from_bytes(os.urandom(4), "little"), rank])
    results = {}
    for n_elems in (1, 2, 3, 5, 31, 33, 65, 1000, 4097, 10007):
        inputs = [rng.standard_normal(n_elems).astype(np.float32) for _ in devices]
        buffers = [dev.from_numpy(a) for dev, a in zip(devices, inputs)]     # NumPy on CPUs
        ring.all_reduce_flat("SUM", buffers, devices)
        local_sum = inputs[0].copy()
        for a in inputs[1:]:
            local_sum += a
        mpi = np.empty_like(local_sum)
        comm.Allreduce(local_sum, mpi, op=MPI.SUM)             # MPI's own all-reduce
        every = np.concatenate(comm.allgather(np.stack(inputs)))   # (N, n) all replicas' inputs
        steps = ring.steps
        crossings = [(t.src_worker, t.dst_worker) for s in steps for t in s.transfers
                     if t.src_worker != t.dst_worker]
        results[f"ring_{n_elems}"] = np.stack([np.asarray(b) for b in buffers])
        results[f"mpi_{n_elems}"] = mpi
        results[f"inputs_{n_elems}"] = every
        results[f"crossings_{n_elems}"] = np.array(crossings).reshape(-1, 2)
        results[f"steps_{n_elems}"] = len(steps)
    # MEAN over every replica, and a second dtype in one batch_reduce
    ints = tf.distribute.PerReplica([tf.constant(np.arange(4, dtype=np.int32) + rank, device=d)
                                     for d in devices]) if len(devices) > 1 else \
        tf.constant(np.arange(4, dtype=np.int32) + rank, device=devices[0])
    from mirrored.values import DistributedValues
    comps = list(ints.values) if isinstance(ints, DistributedValues) else [ints]
    reduced = ring.all_reduce_components("SUM", [comps])[0]
    results["int_sum"] = reduced[0].numpy()
    results["int_mean"] = ring.all_reduce_components("MEAN", [comps])[0][0].numpy()   # float64, as TF's '/'
    np.savez(os.path.join(out, f"ring_rank{rank}.npz"), local=len(devices), **results)


def case_fail(out):
    """Worker 1 raises inside strategy.run; worker 0 goes on to an all-reduce."""
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    rank = strategy.cluster_resolver.task_id

    def step():
        if rank == 1:
            raise ValueError("worker 1 breaks on purpose")
        ctx = tf.distribute.get_replica_context()
        return ctx.all_reduce("SUM", tf.constant(1.0))

    strategy.run(step)
    pathlib.Path(out, f"fail_rank{rank}_finished").write_text("the other worker never failed?")


def case_stall(out):
    """Worker 1 is stuck (sleeps) instead of joining an all-reduce: worker 0's wait times out."""
    import time
    options = tf.distribute.experimental.CommunicationOptions(timeout_seconds=STALL_TIMEOUT_S)
    strategy = tf.distribute.MultiWorkerMirroredStrategy(communication_options=options)
    rank = strategy.cluster_resolver.task_id

    def step():
        if rank == 1:
            time.sleep(10 * STALL_TIMEOUT_S)
        return tf.distribute.get_replica_context().all_reduce("SUM", tf.constant(1.0))

    strategy.run(step)
    pathlib.Path(out, f"stall_rank{rank}_finished").write_text("nobody timed out?")


STALL_TIMEOUT_S = 3


def case_ring_gpus(out, gpus=2):
    """The ring over simulated logical GPUs: staged through host memory and handed to MPI
    directly (the CUDA-aware path; in the simulator device memory is host memory, so the
    wheel's MPI can carry it) on the same inputs, and what this MPI says it is."""
    from mirrored import devices as registry
    from mirrored.collective_all_reduce import CollectiveAllReduce
    from mirrored.workers import install_abort_hook, world
    configure(gpus=gpus)
    workers = world()
    install_abort_hook(workers)
    devices = [d for d in registry.logical_devices() if d.device_type == "GPU"]
    rng = np.random.default_rng([int.from_bytes(os.urandom(4), "little"), workers.rank])
    from kernels.launch import SIMULATOR
    rings = {"staged": CollectiveAllReduce(workers, cuda_aware=False)}
    if SIMULATOR or workers.cuda_aware:     # MPI can read this "device memory" (host memory
        rings["direct"] = CollectiveAllReduce(workers, cuda_aware=True)   # in the simulator)
    results = {"asked": workers.cuda_aware}
    for n_elems in RING_GPU_SIZES:
        inputs = [rng.standard_normal(n_elems).astype(np.float32) for _ in devices]
        results[f"inputs_{n_elems}"] = np.concatenate(workers.allgather(np.stack(inputs)))
        for name, ring in rings.items():
            for _ in range(2):                   # twice: the second call reuses plan and scratch
                buffers = [dev.from_numpy(a) for dev, a in zip(devices, inputs)]
                ring.all_reduce_flat("SUM", buffers, devices)
            results[f"{name}_{n_elems}"] = np.stack([dev.to_numpy(b) for dev, b in zip(devices, buffers)])
    np.savez(os.path.join(out, f"ring_gpus_rank{workers.rank}.npz"), **results)


RING_GPU_SIZES = (1, 5, 33, 1001)        # awkward: empty chunks, uneven chunks


def case_function(out):
    """The tutorial's custom loop eagerly and under ``@tf.function`` (traced once, then
    replayed: the cross-worker ring a host callback, strategy.reduce across workers too),
    from the same start; no eager fallback allowed."""
    import warnings

    from mirrored import traced_function
    warnings.simplefilter("error", traced_function.EagerFallbackWarning)
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    rank = strategy.cluster_resolver.task_id
    x, y = data()
    x = x + np.float32(rank)                    # each worker its own rows: the ring must carry them
    full = tf.data.Dataset.from_tensor_slices((x, y)).batch(GLOBAL_BATCH, drop_remainder=True)
    models = [build(strategy) for _ in range(2)]
    models[1].set_weights(models[0].get_weights())
    start = models[0].get_weights()
    loss_object = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none")

    def distributed(model):
        def train_step(inputs):
            features, labels = inputs
            with tf.GradientTape() as tape:
                loss = tf.nn.compute_average_loss(loss_object(labels, model(features, training=True)),
                                                  global_batch_size=GLOBAL_BATCH)
            model.optimizer.apply_gradients(zip(tape.gradient(loss, model.trainable_variables),
                                                model.trainable_variables))
            return loss
        return lambda b: strategy.reduce(tf.distribute.ReduceOp.SUM, strategy.run(train_step, args=(b,)), axis=None)
    eager, replayed = distributed(models[0]), tf.function(distributed(models[1]))
    losses = [[], []]
    for batch in strategy.experimental_distribute_dataset(full):
        losses[0].append(float(eager(batch)))
        losses[1].append(float(replayed(batch)))
    np.savez(os.path.join(out, f"function_rank{rank}.npz"), losses=np.array(losses),
             traces=replayed.experimental_get_tracing_count(),
             start=np.concatenate([w.ravel() for w in start]),
             eager=np.concatenate([w.ravel() for w in models[0].get_weights()]),
             replayed=np.concatenate([w.ravel() for w in models[1].get_weights()]))


if __name__ == "__main__":
    case, out = sys.argv[1], sys.argv[2]
    opts = dict(zip(sys.argv[3::2], sys.argv[4::2]))
    if case == "train":
        case_train(out, gpus=int(opts.get("--gpus", 0)))
    elif case == "ring":
        case_ring(out, cpus=int(opts.get("--cpus", 1)))
    elif case == "ring-gpus":
        case_ring_gpus(out, gpus=int(opts.get("--gpus", 2)))
    elif case == "fail":
        case_fail(out)
    elif case == "stall":
        case_stall(out)
    elif case == "function":
        case_function(out)
    else:
        raise SystemExit(f"unknown case {case!r}")
