"""``python -m mirrored info``: what this machine offers, in one report.

Versions of numba and numba-cuda, whether CUDA is real or Numba's simulator,
whether compiled kernels are kept on disk (kernels/registry.py) and a first run compiles
them ahead (kernels/compile_ahead.py), the CPU backend's BLAS and its thread policy
(mirrored/backends.py, ``blas_policy``),
every physical and logical device with its memory, and which physical GPUs can
read each other's memory directly (the peer-access matrix the ring all-reduce
uses). Call ``report()`` for the text, e.g. from a notebook.
"""
import platform
import sys
from importlib import metadata

from kernels import cpu_loops, registry
from mirrored import backends, devices as _dev


def _version(dist):
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "not installed"


def _fmt_bytes(n):
    if n is None:
        return "unknown"
    if n == float("inf"):
        return "unlimited (simulated)"
    return f"{n / 2**20:,.0f} MiB"


def peer_access_matrix():
    """{(i, j): bool} for every ordered pair of distinct physical CUDA GPUs."""
    if _dev.cuda_mode() != "real":
        return {}
    from numba import cuda
    ids = [g.id for g in cuda.gpus]
    matrix = {}
    for i in ids:
        with cuda.gpus[i]:
            ctx = cuda.current_context()
            for j in ids:
                if i != j:
                    matrix[(i, j)] = bool(ctx.can_access_peer(j))
    return matrix


def _cpu_lines():
    """The CPU backend's BLAS, the thread policy in force, and its compiled loops."""
    blas = backends.blas_info()
    try:
        _, why = backends.blas_policy()
    except ValueError as err:
        why = f"invalid: {err}"
    kernel = f", {blas['kernel']} kernels" if blas.get("kernel") else ""
    version = f" {blas['version']}" if blas.get("version") else ""
    found = (f"{blas['note']}{version}{kernel}, {blas['threads']} thread(s) now ({blas['library']})"
             if blas["library"] else blas["note"])
    return ["", "CPU backend:",
            f"  BLAS         {found}",
            f"  BLAS policy  {why}",
            f"  conv loops   {cpu_loops.threads_note()}"]


def report():
    """The whole report as a string."""
    lines = ["mirrored: MirroredStrategy re-implemented with Numba CUDA kernels", ""]
    lines.append(f"python       {platform.python_version()} ({sys.platform})")
    for dist in ("numba", "numba-cuda", "numpy"):
        lines.append(f"{dist:<12} {_version(dist)}")
    mode = _dev.cuda_mode()
    lines.append("CUDA         " + {
        "real": "real GPU(s) (numba-cuda)",
        "simulator": "Numba CUDA simulator (NUMBA_ENABLE_CUDASIM=1): kernels run as Python threads",
        "none": "no CUDA GPU found: everything runs on the CPU backend (NumPy; conv and "
                "pooling as compiled Numba loops)"}[mode])
    lines.append(f"kernel cache {registry.disk_cache_note()}")
    from kernels import compile_ahead
    lines.append(f"compile      {compile_ahead.note()}")
    lines += _cpu_lines()
    lines += ["", "physical devices:"]
    for phys in _dev.list_physical():
        extra = ""
        if phys.device_type == "GPU" and mode == "real":
            from numba import cuda
            gpu = cuda.gpus[_dev.physical_gpu_id(phys.name)]
            with gpu:
                free, total = cuda.current_context().get_memory_info()
            extra = f"  {gpu.name.decode() if isinstance(gpu.name, bytes) else gpu.name}, " \
                    f"compute capability {gpu.compute_capability}, {_fmt_bytes(total)}"
        elif phys.device_type == "GPU":
            extra = "  simulated"
        lines.append(f"  {phys.name:<26} {extra}")
    lines += ["", "logical devices:"]
    for d in _dev.logical_devices():
        free, total = d.memory_info()
        limit = "no limit" if d.memory_limit is None else f"memory_limit {_fmt_bytes(d.memory_limit)}"
        mem = f"{limit}; device memory {_fmt_bytes(total)}" if d.memory_limit is None and total else limit
        lines.append(f"  {d.name:<46} on {d.physical.name}  ({mem})")
    matrix = peer_access_matrix()
    lines += ["", "peer access between physical GPUs (row reads column's memory):"]
    if not matrix:
        lines.append("  n/a: fewer than two real GPUs (logical GPUs on one card share its memory)")
    else:
        ids = sorted({i for i, _ in matrix})
        lines.append("        " + " ".join(f"GPU{j:<3}" for j in ids))
        for i in ids:
            cells = ["  -   " if i == j else ("  yes " if matrix[(i, j)] else "  no  ") for j in ids]
            lines.append(f"  GPU{i:<3}" + " ".join(cells))
    return "\n".join(lines)
