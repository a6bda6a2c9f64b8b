"""python -m mirrored: the project's main job, from the command line.

    python -m mirrored                          # the MNIST lab: no strategy vs MirroredStrategy
    python -m mirrored --model dense            # ... with the fast dense stack
    python -m mirrored --logical-gpus 4         # ... over 1, 2 and 4 logical devices
    python -m mirrored --devices GPU:0,GPU:1    # ... over these devices
    python -m mirrored --quick                  # a few steps on a little data (seconds)
    python -m mirrored info                     # versions, devices, peer access
    python -m mirrored info --logical-gpus 4    # ... after splitting GPU:0 (or the CPU) in 4

The lab trains the course's MNIST model (its ConvNet: Conv2D, MaxPooling2D,
Flatten, Dense, Dense) with no strategy and with MirroredStrategy, every run
from the same initial weights, prints Keras's progress lines, then a table
(epoch time, ms/step, samples/s, scaling efficiency, test accuracy) and writes
a bar chart (--plot). With no GPU the CPU is split into 2 logical CPUs, so
the table has a two-replica row (--logical-gpus N for N). The data is full
MNIST when it is cached or can be downloaded, else the bundled 8k/2k subset
(the report says which). The logic lives in mirrored/lab/workflow.py.
"""
import argparse
import sys

EXIT_USAGE = 2          # argparse's code for a bad command line; also a device that is not there


def _split_devices(n):
    """Split the first GPU (or, with none, the CPU) into ``n`` logical devices."""
    import mirrored as tf
    gpus = tf.config.list_physical_devices("GPU")
    target = gpus[0] if gpus else tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(
        target, [tf.config.LogicalDeviceConfiguration() for _ in range(n)])


def build_parser():
    from mirrored.lab.workflow import (BATCH_PER_REPLICA, CPU_REPLICAS, DEFAULT_EPOCHS, DEFAULT_MODEL,
                                   DEFAULT_PLOT, MODELS, QUICK)
    parser = argparse.ArgumentParser(prog="python -m mirrored", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", nargs="?", default="lab", choices=["lab", "info"],
                        help="lab: train and time the MNIST lab (default); info: the device report")
    parser.add_argument("--model", choices=sorted(MODELS), default=DEFAULT_MODEL,
                        help=f"conv: {MODELS['conv']} (default); dense: {MODELS['dense']} (fast)")
    parser.add_argument("--logical-gpus", type=int, default=None, metavar="N",
                        help=f"split GPU:0 (or the CPU where there is no GPU) into N logical devices "
                             f"(default: none on a GPU; {CPU_REPLICAS} on the CPU)")
    parser.add_argument("--epochs", type=int, default=None, metavar="E",
                        help=f"epochs per run, the first one untimed warm-up (default {DEFAULT_EPOCHS}; "
                             f"{QUICK['epochs']} with --quick)")
    parser.add_argument("--devices", default=None, metavar="LIST",
                        help="comma-separated devices to compare on, e.g. GPU:0,GPU:1 or CPU:0 "
                             "(default: every logical GPU, else the logical CPUs)")
    parser.add_argument("--batch-per-replica", type=int, default=BATCH_PER_REPLICA, metavar="B",
                        help=f"examples per replica per step; global batch = B × replicas "
                             f"(default {BATCH_PER_REPLICA})")
    parser.add_argument("--data-dir", default=None, metavar="DIR",
                        help="where MNIST is kept (default $MIRRORED_DATA_DIR or ~/tensorflow_datasets)")
    parser.add_argument("--plot", default=DEFAULT_PLOT, metavar="PATH",
                        help=f"where to write the PNG bar chart (default ./{DEFAULT_PLOT})")
    parser.add_argument("--no-plot", action="store_true", help="do not write the chart")
    parser.add_argument("--quick", action="store_true",
                        help=f"small settings: first {QUICK['train_examples']} / {QUICK['test_examples']} "
                             f"examples, {QUICK['epochs']} epochs (seconds; timings marked too "
                             f"short to compare)")
    return parser


def main(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.logical_gpus is not None and args.logical_gpus < 1:
        parser.error("--logical-gpus must be at least 1")
    if args.command == "info":
        if args.logical_gpus is not None:
            _split_devices(args.logical_gpus)
        from mirrored.info import report
        print(report())
        return 0
    if args.epochs is not None and args.epochs < 1:
        parser.error("--epochs must be at least 1")
    if args.batch_per_replica < 1:
        parser.error("--batch-per-replica must be at least 1")
    import matplotlib
    matplotlib.use("Agg")                 # a command line only writes the PNG
    from mirrored.lab import workflow
    try:
        workflow.run(epochs=args.epochs, devices=args.devices, logical_gpus=args.logical_gpus,
                     batch_per_replica=args.batch_per_replica, data_dir=args.data_dir,
                     plot=None if args.no_plot else args.plot, quick=args.quick, model=args.model)
    except workflow.DeviceError as err:
        print(f"{parser.prog}: error: {err}", file=sys.stderr)
        return EXIT_USAGE
    return 0


if __name__ == "__main__":
    sys.exit(main())
