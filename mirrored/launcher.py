"""Starting workers: which ``mpiexec`` to use, which MPI it belongs to, and the command line
and environment that start N workers with it.

``MultiWorkerMirroredStrategy`` runs one worker per process, and ``mpiexec -n N python
train.py`` starts them (``multi_worker.py``, ``workers.py``). Most users type that command
themselves; the programs that type it for them (the multi-worker tests, ``python -m
benchmarks.multiworker``, lab 06) all build it here, with ``mpiexec_command``, because
MPIs differ in what they need:

* MPICH (the ``mpich`` wheel that requirements.txt installs, whose ``mpiexec`` is Hydra;
  Intel MPI and MVAPICH use Hydra too) runs as root and starts more processes than cores
  as it is.
* Open MPI (a cluster's, a container's, a GPU box's own) refuses to run as root unless
  told (``--allow-run-as-root``, or both ``OMPI_ALLOW_RUN_AS_ROOT=1`` and
  ``OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1``), and refuses more processes than it counts slots
  (cores) unless told (``--oversubscribe``). Colab and containers run as root: there
  every launch failed at once ("mpiexec has detected an attempt to run as root").

Which MPI an ``mpiexec`` belongs to is what ``mpiexec --version`` says: Open MPI prints
"mpiexec (Open MPI) 5.0.3" (4.x: "mpiexec (OpenRTE) 4.1.2"), Hydra "HYDRA build details".

Neighbours: ``workers.py`` (what each started process does to join the others),
``multi_worker.py`` (the strategy), ``tests/test_multi_worker.py`` (launches its cases here).
"""
import functools
import os
import pathlib
import shutil
import subprocess
import sys

OPEN_MPI, MPICH, UNKNOWN = "Open MPI", "MPICH", "unknown"

#: What Open MPI needs in the environment to run as root (both must be 1).
OPEN_MPI_AS_ROOT = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}

VERSION_TIMEOUT_S = 30          # ``mpiexec --version`` answers at once; a hung one is no mpiexec


def find_mpiexec():
    """The ``mpiexec`` to start workers with, or None: ``$MIRRORED_MPIEXEC`` when set (None if
    there is no such file), else the one beside this Python (the mpich wheel puts it there),
    else the one in this environment's ``bin``, else the first on ``PATH``."""
    named = os.environ.get("MIRRORED_MPIEXEC")
    if named:
        return named if pathlib.Path(named).exists() else None
    for here in (pathlib.Path(sys.executable).parent / "mpiexec", pathlib.Path(sys.prefix, "bin", "mpiexec")):
        if here.exists():
            return str(here)
    return shutil.which("mpiexec")


@functools.lru_cache(maxsize=None)
def mpi_flavour(mpiexec):
    """``OPEN_MPI``, ``MPICH`` (any Hydra ``mpiexec``) or ``UNKNOWN``, from ``mpiexec --version``
    (asked once per path)."""
    try:
        out = subprocess.run([mpiexec, "--version"], capture_output=True, text=True,
                             timeout=VERSION_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired):
        return UNKNOWN
    text = out.stdout + out.stderr
    if "Open MPI" in text or "OpenRTE" in text or "open-mpi.org" in text:
        return OPEN_MPI
    if "HYDRA" in text.upper() or "MPICH" in text:
        return MPICH
    return UNKNOWN


def mpiexec_command(n, argv, mpiexec=None, env=None):
    """``(command, environment)`` that start ``n`` workers, each running ``argv`` (a list:
    ``[sys.executable, "train.py", ...]``), for ``subprocess.run(command, env=environment)``.

    ``mpiexec``: the launcher (default ``find_mpiexec()``); ``env``: the environment to start
    from (default this process's; it is copied, not changed). For Open MPI the command
    allows more workers than cores (``--oversubscribe``) and, as root, running as root
    (``--allow-run-as-root`` and ``OPEN_MPI_AS_ROOT``); other MPIs need nothing added."""
    mpiexec = mpiexec or find_mpiexec()
    if mpiexec is None:
        raise FileNotFoundError("no mpiexec beside this Python nor on PATH: python -m pip install mpi4py "
                                "mpich (requirements.txt), or name one in MIRRORED_MPIEXEC.")
    env = dict(os.environ if env is None else env)
    options = []
    if mpi_flavour(mpiexec) == OPEN_MPI:
        options.append("--oversubscribe")              # Open MPI counts cores as slots
        if hasattr(os, "geteuid") and os.geteuid() == 0:
            options.append("--allow-run-as-root")
            env.update(OPEN_MPI_AS_ROOT)
    return [mpiexec, "-n", str(int(n)), *options, *map(str, argv)], env
