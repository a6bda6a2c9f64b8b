"""``python -m mirrored``: the project's main job, from the command line.

    python -m mirrored info                     # versions, devices, peer access
    python -m mirrored info --logical-gpus 4    # ... after splitting GPU:0 (or the CPU) in 4

Until the training workflow lands, ``python -m mirrored`` with no command prints
the same report as ``info``.
"""
import argparse
import sys


def _split_devices(n):
    """Split the first GPU (or, with none, the CPU) into ``n`` logical devices."""
    import mirrored as tf
    gpus = tf.config.list_physical_devices("GPU")
    target = gpus[0] if gpus else tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(
        target, [tf.config.LogicalDeviceConfiguration() for _ in range(n)])


def build_parser():
    parser = argparse.ArgumentParser(prog="python -m mirrored", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", nargs="?", default="info", choices=["info"],
                        help="what to do (default: info)")
    parser.add_argument("--logical-gpus", type=int, default=None, metavar="N",
                        help="split GPU:0 (or the CPU where there is no GPU) into N logical devices")
    return parser


def main(argv=None):
    args = build_parser().parse_args(argv)
    if args.logical_gpus is not None:
        if args.logical_gpus < 1:
            build_parser().error("--logical-gpus must be at least 1")
        _split_devices(args.logical_gpus)
    from mirrored.info import report
    print(report())
    return 0


if __name__ == "__main__":
    sys.exit(main())
