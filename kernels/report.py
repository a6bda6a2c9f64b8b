"""What the real CUDA compiler makes of every kernel: ``python -m kernels.report``.

No GPU needed. For each kernel registered in ``kernels/registry.py`` and each signature
it is launched with, this compiles the kernel exactly as a launch would: Numba → NVVM →
PTX (``cuda.compile_ptx`` for the chosen compute capability), then ``ptxas -v`` (from the
``nvidia-cuda-nvcc-cu12`` wheel that ``numba-cuda[cu12]`` installs) assembles the PTX
into GPU machine code and says what that code needs::

    python -m kernels.report                  # table for sm_90 (H100)
    python -m kernels.report --cc 8.0         # for sm_80 (A100); --cc may repeat
    python -m kernels.report --only gemm      # the rows whose kernel name contains "gemm"
    python -m kernels.report --json           # the same rows as a JSON list of objects
    python -m kernels.report --jobs 1         # in this process only (default: a worker per core)
    python -m kernels.report --hardware       # on a GPU: beside what the driver loaded

One row per kernel and signature (JSON keys in brackets):

    registers  [registers]       32-bit registers per thread. 65,536 per SM are shared by
                                 every resident thread: registers x block threads must fit.
    smem B     [shared_bytes]    static shared memory per block (cuda.shared.array).
    spill B    [spill_bytes]     bytes spilled to local memory (stores + loads; also
                                 [spill_stores_bytes], [spill_loads_bytes]): registers
                                 ran out and values went to slow memory. Goal: 0.
    stack B    [stack_bytes]     the thread's stack frame in local memory: a local array
                                 indexed at run time, or a call. Goal: 0.
    SASS/out   [sass_per_output] static SASS instructions of the kernel (the GPU's machine
                                 code, [sass_instructions]) divided by the outputs one pass
                                 through its code computes ([outputs_per_pass], declared
                                 at registration): what each output costs in instructions
                                 issued, prologue included. A static count, not a trace:
                                 a loop inside the pass counts once.
    f64        [f64_instructions] PTX instructions on float64. In a float32 kernel each
                                 one is a bug (a Python float constant, ``/`` on ints),
                                 and costs 2x to 64x a float32 one on most GPUs. Goal: 0.
    block      [block_threads]   threads per block the kernel's launcher uses.
    blocks/SM  [blocks_per_sm]   how many such blocks fit on one SM at once, limited by
                                 registers, shared memory, warps and blocks
                                 ([limited_by] says which).
    occupancy  [occupancy]       resident warps / the SM's maximum: the theoretical
                                 occupancy. High is not the goal in itself (GEMM v3
                                 trades occupancy for registers on purpose, see
                                 kernels/gemm.py), but 0 means the launch fails.

``[kernel]`` is the registered name with its compile-time variant, ``[signature]``
Numba's type string, ``[cc]`` the compute capability. A kernel that fails to compile is
reported with its name, signature and the compiler's message ([error]); so is a kernel
defined in ``kernels/`` that is not registered. Either makes the exit status 1.

``--hardware`` (a real GPU only) compiles for the GPU's own compute capability and also
loads every kernel through Numba's dispatcher, as a launch does, and reads back what the
driver reports for the loaded code: [hw_registers], [hw_local_bytes] (stack + spills),
[hw_shared_bytes]. Equal numbers say that this table, made with no GPU, is the code that
runs.

``tests/test_kernels_compile.py`` runs this for sm_80 and sm_90 in every test run and
fails on any error, spill, stack frame, float64 instruction in a float32 kernel, or a
block that does not fit an SM. The CUDA simulator cannot compile: this must run with
``NUMBA_ENABLE_CUDASIM=0`` (unset is fine), which is why tests and lab 04 start it as a
child process (``run_report``).
"""
import argparse
import json
import math
import os
import re
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from kernels import registry

#: The compute capability the report compiles for unless told otherwise: the H100 that
#: the benchmarks target.
DEFAULT_CC = (9, 0)

#: Registers in one SM's register file (every architecture in ``SM_LIMITS``); the file
#: is split into 4 sub-partitions, and each warp's registers sit in one of them.
REGISTERS_PER_SM = 65536
SUB_PARTITIONS = 4
#: Registers are allocated per warp in units of 256 (8 per thread).
REGISTER_UNIT_PER_WARP = 256
#: Shared memory is allocated per block in units of 128 bytes; from cc 8.0 on the
#: system also reserves 1 KiB per block.
SHARED_UNIT = 128
SHARED_RESERVED_PER_BLOCK = 1024
WARP = 32
#: Seconds one ptxas run may take (the largest kernel, gemm v3, takes well under 1 s).
PTXAS_TIMEOUT_S = 120
#: Characters of a compiler message kept in a row's ``error``.
MAX_MESSAGE = 2000


@dataclass(frozen=True)
class SMLimits:
    """Per-SM limits of one compute capability (CUDA C++ Programming Guide, "Technical
    Specifications per Compute Capability"): what the occupancy column divides by."""
    gpu: str              # an example GPU, for the reader
    max_warps: int        # resident warps per SM
    max_blocks: int       # resident blocks per SM
    shared_bytes: int     # shared memory per SM at the largest carve-out


#: The compute capabilities the report knows (CUDA 12.9's NVVM and ptxas compile every one).
SM_LIMITS = {
    (6, 0): SMLimits("P100 (Kaggle)", 64, 32, 64 * 1024),
    (7, 5): SMLimits("T4 (Colab, Kaggle)", 32, 16, 64 * 1024),
    (8, 0): SMLimits("A100", 64, 32, 164 * 1024),
    (8, 6): SMLimits("RTX 3090, A10", 48, 16, 100 * 1024),
    (8, 9): SMLimits("RTX 4090, L4", 48, 24, 100 * 1024),
    (9, 0): SMLimits("H100, H200", 64, 32, 228 * 1024),
    (10, 0): SMLimits("B200", 64, 32, 228 * 1024),
    (12, 0): SMLimits("RTX 5090", 48, 32, 100 * 1024),
}


def cc_name(cc):
    return f"{cc[0]}.{cc[1]}"


def toolkit_ccs():
    """The compute capabilities this CUDA toolkit's compiler can target, as "M.m" strings
    (NVRTC's list, which numba-cuda compiles with). CUDA 12 reaches back to sm_50; CUDA 13
    starts at sm_75, so a P100 (6.0) needs numba-cuda[cu12]."""
    from numba.cuda.cudadrv import nvrtc
    return [cc_name(cc) for cc in nvrtc.get_supported_ccs()]


def parse_cc(text):
    """``"9.0"`` (or ``"90"``, ``"sm_90"``) -> (9, 0); an unknown one raises ValueError
    naming the known ones."""
    t = str(text).strip().lower().removeprefix("sm_")
    try:
        cc = tuple(int(p) for p in t.split(".")) if "." in t else (int(t[:-1]), int(t[-1]))
    except (ValueError, IndexError):
        cc = None
    if cc not in SM_LIMITS:
        known = ", ".join(f"{cc_name(c)} ({lim.gpu})" for c, lim in SM_LIMITS.items())
        raise ValueError(f"unknown compute capability {text!r}; known: {known}. "
                         f"Write it as MAJOR.MINOR, e.g. --cc 9.0.")
    return cc


# --- reading what the compilers say --------------------------------------------------------

#: A PTX instruction line: optional predicate (``@%p1``), then the opcode with its
#: suffixes (``fma.rn.f64``). Directives (``.reg .f64 %fd<4>;``) start with a dot.
_PTX_INSTRUCTION = re.compile(r"^\s*(?:@!?%\w+\s+)?([a-z][\w.]*)")


def count_f64_instructions(ptx):
    """PTX instructions that compute on, load, store or convert float64 values: every
    instruction whose opcode has an ``.f64`` part (``add.f64``, ``cvt.f64.f32``)."""
    n = 0
    for line in ptx.splitlines():
        m = _PTX_INSTRUCTION.match(line)
        if m and ".f64" in m.group(1):
            n += 1
    return n


_PTXAS_FIELDS = {
    "registers": re.compile(r"Used (\d+) registers"),
    "stack_bytes": re.compile(r"(\d+) bytes stack frame"),
    "spill_stores_bytes": re.compile(r"(\d+) bytes spill stores"),
    "spill_loads_bytes": re.compile(r"(\d+) bytes spill loads"),
}
_PTXAS_SMEM = re.compile(r"(\d+) bytes smem")
#: "Function properties for NAME" starts each function's block in ptxas -v's output.
_PTXAS_FUNCTION = re.compile(r"Function properties for (\S+)")
#: The prefix of libdevice's internal functions, which ptxas may keep as calls.
_LIBDEVICE_INTERNAL = "__internal_"

#: SASS instructions are 16 bytes each on every architecture the report knows (Volta,
#: sm_70, on): the instruction count of a kernel is its ``.text.<kernel>`` section's size
#: / 16. The code ends with EXIT, a branch to itself, then NOPs up to an alignment: the
#: trailing NOPs are not counted. (The CUDA wheels that numba-cuda installs bring ptxas
#: but neither nvdisasm nor cuobjdump, so the cubin's ELF sections are read directly.)
SASS_INSTRUCTION_BYTES = 16
#: The opcode field (low 12 bits) of NOP on sm_70 and later.
SASS_NOP_OPCODE = 0x918


def count_sass_instructions(cubin):
    """Static SASS instructions in a cubin (an ELF file's bytes) with one kernel: the
    16-byte words of its ``.text.*`` section, less the trailing NOP padding."""
    import struct
    if cubin[:4] != b"\x7fELF" or cubin[4] != 2:
        raise ValueError("not a 64-bit ELF cubin")
    shoff, = struct.unpack_from("<Q", cubin, 0x28)
    entsize, count, names = struct.unpack_from("<HHH", cubin, 0x3A)
    sections = [struct.unpack_from("<IIQQQQ", cubin, shoff + i * entsize) for i in range(count)]
    strtab = sections[names][4]
    texts = []
    for name, _, _, _, offset, size in sections:
        end = cubin.index(b"\0", strtab + name)
        if cubin[strtab + name:end].startswith(b".text."):
            words = [int.from_bytes(cubin[i:i + 8], "little")
                     for i in range(offset, offset + size, SASS_INSTRUCTION_BYTES)]
            while words and words[-1] & 0xFFF == SASS_NOP_OPCODE:
                words.pop()
            texts.append(len(words))
    if len(texts) != 1:
        raise ValueError(f"the cubin has {len(texts)} .text sections, expected 1 (one kernel)")
    return texts[0]


def parse_ptxas(text):
    """The numbers of ``ptxas -v`` for a module with ONE entry function: registers,
    stack_bytes, spill_stores_bytes, spill_loads_bytes, shared_bytes (0 when ptxas
    prints no smem). Raises ValueError when a number is missing or appears twice.

    One exception: libdevice's own slow paths, which ptxas keeps as called functions
    (``__internal_accurate_pow`` for float64 ``**``, ``__internal_trig_reduction_slowpathd``
    for float64 sin/cos of huge arguments), print a second "Function properties" block.
    Those blocks are NVIDIA's, not ours: their stack and spill bytes are added to the
    kernel's (a call's frame is the thread's stack too), and only our own functions must
    be one."""
    blocks = _PTXAS_FUNCTION.split(text)        # [before, name, body, name, body, ...]
    internal = [body for name, body in zip(blocks[1::2], blocks[2::2])
                if name.startswith(_LIBDEVICE_INTERNAL)]
    ours = text
    for body in internal:
        ours = ours.replace(body, "", 1)
    out = {}
    for key, pattern in _PTXAS_FIELDS.items():
        found = pattern.findall(ours)
        if len(found) != 1:
            raise ValueError(f"ptxas -v printed {len(found)} '{pattern.pattern}' values, "
                             f"expected 1 (one kernel per module, no separate device "
                             f"functions: keep device functions inline). Output:\n{text}")
        out[key] = int(found[0]) + (0 if key == "registers" else
                                    sum(int(v) for body in internal for v in pattern.findall(body)))
    smem = _PTXAS_SMEM.findall(text)
    out["shared_bytes"] = int(smem[0]) if smem else 0
    return out


def occupancy(registers, shared_bytes, block_threads, cc):
    """(blocks per SM, theoretical occupancy, the limiting resources) for a kernel with
    ``registers`` per thread and ``shared_bytes`` of static shared memory per block,
    launched with ``block_threads`` per block on compute capability ``cc``."""
    lim = SM_LIMITS[cc]
    warps = math.ceil(block_threads / WARP)                    # warps per block
    per_warp = math.ceil(registers * WARP / REGISTER_UNIT_PER_WARP) * REGISTER_UNIT_PER_WARP
    warps_by_regs = (SUB_PARTITIONS * ((REGISTERS_PER_SM // SUB_PARTITIONS) // per_warp)
                     if per_warp else lim.max_warps)
    reserved = SHARED_RESERVED_PER_BLOCK if cc >= (8, 0) else 0
    shared = math.ceil((shared_bytes + reserved) / SHARED_UNIT) * SHARED_UNIT
    limits = {
        "registers": warps_by_regs // warps,
        "shared memory": lim.shared_bytes // shared if shared else lim.max_blocks,
        "warps": lim.max_warps // warps,
        "blocks": lim.max_blocks,
    }
    blocks = min(limits.values())
    limited_by = ", ".join(k for k, v in limits.items() if v == blocks)   # ties: all of them
    return blocks, blocks * warps / lim.max_warps, limited_by


def find_ptxas():
    """Path of ptxas: the NVIDIA wheel's (numba-cuda[cu12] installs nvidia-cuda-nvcc-cu12),
    else a CUDA toolkit's. Raises RuntimeError saying what to install."""
    try:
        from cuda.pathfinder import find_nvidia_binary_utility
        path = find_nvidia_binary_utility("ptxas")
    except ImportError:
        path = None
    if not path:
        import shutil
        path = shutil.which("ptxas")
    if not path:
        raise RuntimeError("ptxas not found: install the requirements "
                           "(pip install -r requirements.txt brings numba-cuda[cu12] and its "
                           "nvidia-cuda-nvcc-cu12 wheel) or put a CUDA toolkit's bin/ on PATH.")
    return path


# --- compiling ----------------------------------------------------------------------------

def _short(message):
    message = str(message).strip()
    return message if len(message) <= MAX_MESSAGE else message[:MAX_MESSAGE] + " ..."


#: Added to a compile error that asks for the CUDA driver: compile_ptx itself needs none.
_DRIVER_HINT = (" [compile_ptx needs no driver; numba-cuda asks for one when a kernel calls a "
                "device function that is not inline: declare it "
                "@cuda.jit(device=True, inline=\"always\")]")


def compile_ptx(spec, signature, cc):
    """PTX of ``spec.kernel`` for one signature, with the options its ``@cuda.jit`` set."""
    from numba import cuda
    opts = getattr(spec.kernel, "targetoptions", {})
    ptx, _ = cuda.compile_ptx(spec.kernel.py_func, signature, cc=cc,
                              fastmath=opts.get("fastmath", False),
                              lineinfo=opts.get("lineinfo", False), opt=opts.get("opt"),
                              launch_bounds=opts.get("launch_bounds"))
    return ptx


def _base_row(spec, signature, cc):
    return {"kernel": spec.label, "signature": signature, "cc": cc_name(cc),
            "module": spec.module, "block_threads": spec.block_threads,
            "outputs_per_pass": getattr(spec, "outputs_per_pass", 1),
            "float64_allowed": "float64" in signature, "error": None}


def _assemble(row, ptx, cc, ptxas):
    """Run ``ptxas -v`` on ``ptx`` and fill ``row`` with its numbers (or its error)."""
    arch = f"sm_{cc[0]}{cc[1]}"
    try:
        with tempfile.TemporaryDirectory(prefix="kernels-report-") as tmp:
            path = os.path.join(tmp, "kernel.ptx")
            with open(path, "w") as f:
                f.write(ptx)
            cubin = os.path.join(tmp, "kernel.cubin")
            done = subprocess.run([ptxas, "-v", f"-arch={arch}", path, "-o", cubin],
                                  capture_output=True, text=True, timeout=PTXAS_TIMEOUT_S)
            if done.returncode != 0:
                raise RuntimeError(f"ptxas failed (exit {done.returncode}): {done.stderr}")
            with open(cubin, "rb") as f:
                sass = count_sass_instructions(f.read())
        numbers = parse_ptxas(done.stderr)
    except (RuntimeError, ValueError, OSError, subprocess.TimeoutExpired) as err:
        row["error"] = f"{row['kernel']} {row['signature']} ({arch}): {_short(err)}"
        return row
    row.update(numbers)
    row["sass_instructions"] = sass
    row["sass_per_output"] = round(sass / row["outputs_per_pass"], 1)
    row["spill_bytes"] = numbers["spill_stores_bytes"] + numbers["spill_loads_bytes"]
    row["f64_instructions"] = count_f64_instructions(ptx)
    blocks, occ, limited_by = occupancy(numbers["registers"], numbers["shared_bytes"],
                                        row["block_threads"], cc)
    row.update(blocks_per_sm=blocks, occupancy=round(occ, 4), limited_by=limited_by)
    return row


def compile_rows(specs, ccs, ptxas=None, workers=None):
    """One row (a dict, see the module docstring) per (spec, signature, cc).

    Numba's compile runs here, one at a time (it holds the GIL); each ptxas runs in its
    own process, started from a thread pool, so it overlaps the next compile.
    """
    ptxas = ptxas or find_ptxas()
    jobs = []
    with ThreadPoolExecutor(max_workers=workers or os.cpu_count() or 2) as pool:
        for spec in specs:
            for signature in spec.signatures:
                for cc in ccs:
                    row = _base_row(spec, signature, cc)
                    try:
                        ptx = compile_ptx(spec, signature, cc)
                    except Exception as err:  # any compiler error becomes a row, named
                        row["error"] = (f"{spec.label} {signature} (sm_{cc[0]}{cc[1]}) does "
                                        f"not compile: {type(err).__name__}: {_short(err)}"
                                        f"{_DRIVER_HINT if 'driver' in str(err) else ''}")
                        jobs.append(row)
                        continue
                    jobs.append(pool.submit(_assemble, row, ptx, cc, ptxas))
        return [j if isinstance(j, dict) else j.result() for j in jobs]


def _rows_of(labels, ccs):
    """In a worker process: compile_rows for the registered kernels named ``labels`` (a
    fresh process registers what ``import kernels`` registers; None for any label it lacks)."""
    by_label = {s.label: s for s in registry.registered()}
    if not all(label in by_label for label in labels):
        return None
    return compile_rows([by_label[label] for label in labels], ccs)


def compile_rows_in_processes(specs, ccs, processes):
    """compile_rows, the kernels shared among ``processes`` worker processes.

    Why processes: NVVM releases the GIL, but numba-cuda compiles under one global
    compiler lock (benchmarks/compile_gil.py measured it), so threads compile one kernel at
    a time. Processes compile one each. A worker is a fresh Python (``spawn``) that imports
    ``kernels`` and finds each kernel by its registered label; a kernel registered later in
    this process (a per-shape kernel a run made) is compiled here. Rows keep ``specs``'
    order, so the table is the same as one process's.
    """
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor
    if processes <= 1 or len(specs) <= 1:
        return compile_rows(specs, ccs)
    shards = [[s.label] for s in specs]               # one kernel per task: the pool balances
    with ProcessPoolExecutor(processes, mp_context=multiprocessing.get_context("spawn")) as pool:
        futures = [pool.submit(_rows_of, labels, ccs) for labels in shards]
        rows = []
        for spec, future in zip(specs, futures):
            got = future.result()
            rows += got if got is not None else compile_rows([spec], ccs)
    return rows


def unregistered_rows():
    """An error row for each kernel in kernels/ that is not in the registry."""
    return [{"kernel": name, "signature": "", "cc": "", "module": name.rsplit(".", 1)[0],
             "error": f"{name} is a CUDA kernel that is not registered: call "
                      f"kernels.registry.register(kernel, name, signatures, block) below it, "
                      f"with every signature its launcher uses."}
            for name in registry.unregistered()]


def add_hardware_numbers(rows, specs):
    """On a real GPU: load each row's kernel through its dispatcher (as a launch would)
    and add what the driver reports for the loaded code (see the module docstring)."""
    by_label = {s.label: s for s in specs}
    for row in rows:
        if row["error"] or not row["signature"]:
            continue
        try:
            loaded = by_label[row["kernel"]].kernel.compile(row["signature"])
            row["hw_registers"] = int(loaded.regs_per_thread)
            row["hw_local_bytes"] = int(loaded.local_mem_per_thread)
            row["hw_shared_bytes"] = int(loaded.shared_mem_per_block)
        except Exception as err:          # report it in the row; the table still prints
            row["hw_error"] = f"{type(err).__name__}: {_short(err)}"
    return rows


def format_hardware(rows):
    """ptxas's numbers (no GPU) beside the driver's for the same kernels."""
    lines = [f"{'kernel':<44} {'ptxas regs':>10} {'GPU regs':>8} {'GPU local B':>11} "
             f"{'GPU smem B':>10}  same?"]
    for r in rows:
        if r["error"] or not r["signature"]:
            continue
        if "hw_error" in r:
            lines.append(f"{r['kernel']:<44} {r['registers']:>10} -- {r['hw_error']}")
            continue
        same = (r["hw_registers"] == r["registers"] and r["hw_shared_bytes"] == r["shared_bytes"]
                and r["hw_local_bytes"] == r["stack_bytes"])
        lines.append(f"{r['kernel']:<44} {r['registers']:>10} {r['hw_registers']:>8} "
                     f"{r['hw_local_bytes']:>11} {r['hw_shared_bytes']:>10}  {'yes' if same else 'NO'}")
    return "\n".join(lines)


# --- printing -----------------------------------------------------------------------------

def _compact(signature):
    """``void(float32[:, ::1], int64)`` -> ``(f32[:,::1], i64)`` for the table."""
    s = signature.removeprefix("void").replace(" ", "").replace(",", ", ")
    return re.sub(r"\b(u?)(int|float)(\d+)", lambda m: f"{m[1]}{m[2][0]}{m[3]}", s)


def format_table(rows):
    """The rows as a text table, the problem rows listed after it."""
    good = [r for r in rows if not r["error"]]
    width = max([len(r["kernel"]) for r in good] + [6])
    swidth = max([len(_compact(r["signature"])) for r in good] + [9])
    head = (f"{'kernel':<{width}}  {'signature':<{swidth}}  {'cc':>4}  {'registers':>9}  "
            f"{'smem B':>6}  {'spill B':>7}  {'stack B':>7}  {'SASS/out':>8}  {'f64':>4}  "
            f"{'block':>5}  "
            f"{'blocks/SM':>9}  {'occupancy':>9}")
    lines = [head, "-" * len(head)]
    for r in good:
        lines.append(
            f"{r['kernel']:<{width}}  {_compact(r['signature']):<{swidth}}  {r['cc']:>4}  "
            f"{r['registers']:>9}  {r['shared_bytes']:>6}  {r['spill_bytes']:>7}  "
            f"{r['stack_bytes']:>7}  {r['sass_per_output']:>8}  {r['f64_instructions']:>4}  "
            f"{r['block_threads']:>5}  "
            f"{r['blocks_per_sm']:>9}  {r['occupancy']:>9.1%}")
    bad = [r for r in rows if r["error"]]
    if bad:
        lines += ["", f"{len(bad)} problem(s):"] + [f"  {r['error']}" for r in bad]
    return "\n".join(lines)


def _span(values, fmt="{:,}"):
    """``38–48`` for a range, ``32`` for one value (the summary's cells)."""
    lo, hi = min(values), max(values)
    return fmt.format(lo) if lo == hi else f"{fmt.format(lo)}–{fmt.format(hi)}"


def toolchain():
    """``"numba-cuda 0.30.4, ptxas 12.9.86"``: what the summary's figures depend on."""
    from importlib.metadata import version
    done = subprocess.run([find_ptxas(), "--version"], capture_output=True, text=True)
    found = re.search(r"V(\d+\.\d+\.\d+)", done.stdout)
    return f"numba-cuda {version('numba-cuda')}, ptxas {found[1] if found else 'unknown'}"


def format_markdown(rows):
    """One Markdown row per kernel and compute capability, each column the range over the
    kernel's registered signatures: the summary ``kernels/README.md`` carries (a test
    checks it against the compiler's output, so its figures cannot go stale)."""
    groups = {}
    for r in rows:
        if not r["error"]:
            groups.setdefault((r["kernel"].split("[")[0], r["cc"]), []).append(r)
    lines = ["| kernel | cc | signatures | registers | smem B | spill B | stack B | SASS per output "
             "| block | occupancy |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for (name, cc), rs in sorted(groups.items()):
        lines.append(
            f"| {name} | {cc} | {len(rs)} | {_span([r['registers'] for r in rs])} "
            f"| {_span([r['shared_bytes'] for r in rs])} | {_span([r['spill_bytes'] for r in rs])} "
            f"| {_span([r['stack_bytes'] for r in rs])} "
            f"| {_span([r['sass_per_output'] for r in rs], '{:,.1f}')} "
            f"| {_span([r['block_threads'] for r in rs])} "
            f"| {_span([r['occupancy'] for r in rs], '{:.1%}')} |")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(
        prog="python -m kernels.report",
        description="Compile every registered kernel with the real CUDA compiler (no GPU "
                    "needed) and report registers, shared memory, spills, stack, float64 "
                    "instructions and occupancy.")
    parser.add_argument("--cc", action="append", metavar="MAJOR.MINOR",
                        help=f"compute capability (default {cc_name(DEFAULT_CC)}); may repeat; "
                             f"known: {', '.join(cc_name(c) for c in SM_LIMITS)}")
    parser.add_argument("--only", metavar="TEXT", default="",
                        help="only kernels whose registered name contains TEXT (e.g. gemm)")
    parser.add_argument("--json", action="store_true", help="print the rows as a JSON list")
    parser.add_argument("--markdown", action="store_true",
                        help="one Markdown row per kernel (ranges over its signatures): the "
                             "summary kernels/README.md carries")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1, metavar="N",
                        help="compile in N worker processes (default: one per CPU core)")
    parser.add_argument("--hardware", action="store_true",
                        help="on a real GPU: compile for its compute capability and add what "
                             "the driver reports for each loaded kernel")
    args = parser.parse_args(argv)
    try:
        ccs = [parse_cc(c) for c in (args.cc or [cc_name(DEFAULT_CC)])]
    except ValueError as err:
        parser.error(str(err))

    from kernels.launch import SIMULATOR
    if SIMULATOR:
        parser.error("NUMBA_ENABLE_CUDASIM=1 is set: the CUDA simulator cannot compile. Run "
                     "with NUMBA_ENABLE_CUDASIM=0 (no GPU is needed).")
    if args.hardware:
        from numba import cuda
        if not cuda.is_available():
            parser.error("--hardware needs a real CUDA GPU; none was found.")
        ccs = [tuple(cuda.get_current_device().compute_capability)]
    start = time.perf_counter()
    specs = [s for s in registry.registered() if args.only in s.label]
    if not specs:
        known = sorted({s.name for s in registry.registered()})
        parser.error(f"no registered kernel name contains {args.only!r}; names: {', '.join(known)}")
    try:
        find_ptxas()                     # before any worker starts: one clear error
        rows = (compile_rows(specs, ccs) if args.hardware else
                compile_rows_in_processes(specs, ccs, args.jobs))
    except RuntimeError as err:          # no ptxas: say what to install
        parser.exit(2, f"kernels.report: {err}\n")
    if args.hardware:
        add_hardware_numbers(rows, specs)
    if not args.only:
        rows += unregistered_rows()
    seconds = time.perf_counter() - start
    if args.markdown:
        print(f"Compiled with {toolchain()}.\n")
    print(json.dumps(rows, indent=1) if args.json else
          format_markdown(rows) if args.markdown else format_table(rows))
    if args.hardware and not args.json:
        print("\n" + format_hardware(rows))
    n_ok = sum(not r["error"] for r in rows)
    print(f"kernels.report: {n_ok} kernel signature(s) compiled and assembled for "
          f"{', '.join('sm_%d%d' % c for c in ccs)} ({len(specs)} kernels), "
          f"{len(rows) - n_ok} problem(s), {seconds:.1f} s", file=sys.stderr)
    return 1 if n_ok < len(rows) else 0


# --- for tests and notebooks: run the report in a child process ----------------------------

def run_report(*args, timeout=600):
    """Run ``python -m kernels.report --json *args`` with the real compiler in a child
    process (this process may be using the CUDA simulator); returns (rows, completed).

    ``rows`` is None when the child printed no JSON (``completed.stderr`` says why).
    """
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="0",
               PYTHONPATH=os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p))
    done = subprocess.run([sys.executable, "-m", "kernels.report", "--json", *args], cwd=root,
                          env=env, capture_output=True, text=True, timeout=timeout)
    try:
        rows = json.loads(done.stdout)
    except json.JSONDecodeError:
        rows = None
    return rows, done


if __name__ == "__main__":
    sys.exit(main())
