"""Every kernel the library launches, through the real CUDA compiler, with no GPU.

The simulator tests (test_kernels_*.py) check what each kernel computes; these check that
each is a valid, efficient GPU program: for every (kernel, signature) registered in
``kernels/registry.py``, ``python -m kernels.report`` runs NVVM (``cuda.compile_ptx``)
for sm_80 and sm_90 and ``ptxas -v`` on the result. Then, for every row:

    it compiled and assembled               no error, nothing missing from the registry
    0 spill bytes and a 0-byte stack frame  registers, not local memory
    no float64 instruction                  in a kernel whose signature has no float64
    registers x block threads <= 65,536     the launcher's block fits an SM's register file

and every ``@cuda.jit`` kernel defined in ``kernels/`` is registered. None of this needs a
GPU, only the numba-cuda[cu12] wheels of requirements.txt, so nothing here skips. The real
compiler and the simulator cannot share a process (this one may run the simulator:
tests/conftest.py), so the report runs ONCE in a child process with
``NUMBA_ENABLE_CUDASIM=0`` and every test reads its JSON rows (module-scoped fixture).

    python -m pytest tests/test_kernels_compile.py        # ~30 s on 2 cores
    python -m kernels.report                              # the same numbers as a table
"""
import json
import os
import subprocess
import sys
import functools
import textwrap

import pytest

from conftest import summarise
from kernels import registry, report

#: The compute capabilities CI compiles for: where students' GPUs are (P100 6.0 on Kaggle, T4
#: 7.5 on Colab and Kaggle) and the A100 and H100 the course uses.
CCS = ("6.0", "7.5", "8.0", "9.0")

#: Seconds the child process may take compiling everything (measured: ~30 s on 2 busy cores).
REPORT_TIMEOUT_S = 600


#: The ones every toolkit we support must reach (CUDA 12 and 13 alike).
REQUIRED_CCS = ("7.5", "8.0", "9.0")


@functools.lru_cache(maxsize=None)
def compiled_ccs():
    """CCS as far as this toolkit reaches: CUDA 13's compiler starts at sm_75, so on a
    machine with the cu13 wheels (or toolkit) sm_60 is left out and the summary says so.
    Asked in a child process with real CUDA (this one runs the simulator)."""
    import json
    code = "import json; from kernels import report; print(json.dumps(report.toolkit_ccs()))"
    reach = set(json.loads(_child(code)))
    assert set(REQUIRED_CCS) <= reach, f"this CUDA toolkit targets only {sorted(reach)}"
    return tuple(cc for cc in CCS if cc in reach)


@pytest.fixture(scope="module")
def rows():
    """The report's rows for every registered kernel, signature and cc in compiled_ccs()."""
    ccs = compiled_ccs()
    args = [a for cc in ccs for a in ("--cc", cc)]
    rows, done = report.run_report(*args, timeout=REPORT_TIMEOUT_S)
    assert rows is not None, (f"python -m kernels.report {' '.join(args)} printed no JSON "
                              f"(exit {done.returncode}):\n{done.stderr[-3000:]}")
    # The report's last line counts what was compiled: shown at the end of the pytest run.
    last = done.stderr.strip().splitlines()[-1:] or ["(the report printed no summary)"]
    SUMMARY[:] = [f"real CUDA compiler: {last[0]}"]
    if ccs != CCS:
        SUMMARY.append(f"not compiled for {sorted(set(CCS) - set(ccs))}: this CUDA toolkit's "
                       f"compiler does not target them (CUDA 13 starts at sm_75; use the cu12 wheels)")
    return rows


#: What the report said, for the end of the pytest run (the first test passes it on).
SUMMARY = []


def _good(rows):
    return [r for r in rows if not r["error"]]


def _where(r):
    return f"{r['kernel']} {r['signature']} on sm_{r['cc'].replace('.', '')}"


def _registered_at_import():
    """(label, signature) of every kernel a fresh process registers when it imports kernels/,
    as the report's child process sees them. Not this process's registry: the kernels
    compiled per layer shape (conv2d_v3, conv2d_grad, pooling's v2 backward) also register
    the shapes that earlier tests of this run made."""
    import json
    code = ("import json; from kernels import registry; print(json.dumps("
            "[[s.label, sig] for s in registry.registered() for sig in s.signatures]))")
    return {tuple(pair) for pair in json.loads(_child(code))}


def _child(code):
    """What ``python -c code`` prints in a fresh process with real CUDA (no simulator)."""
    import os
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="0",
               PYTHONPATH=os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p))
    done = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def test_every_registered_kernel_compiles_and_assembles(rows, request):
    for line in SUMMARY:
        summarise(request, line)
    errors = [r["error"] for r in rows if r["error"]]
    assert not errors, "\n\n".join(errors)
    want = {(label, sig, cc) for label, sig in _registered_at_import() for cc in compiled_ccs()}
    got = {(r["kernel"], r["signature"], r["cc"]) for r in rows}
    assert got == want, (f"the report skipped {sorted(want - got)[:5]} and/or made up "
                         f"{sorted(got - want)[:5]}")


#: Kernels whose libdevice functions need a small stack frame, with the most bytes allowed:
#: sinf/cos reduce a huge argument (Payne-Hanek) through a local array (kernels/unary_math.py
#: keeps them in their own kernel so that nothing else hides behind this exception).
LIBDEVICE_STACK_BYTES = {"sin_cos_kernel": 64}
#: ... and whose float32 build has a few float64 instructions from libdevice (sinf's and
#: cosf's reduction of huge arguments; the normal draws' Box-Muller calls cosf).
LIBDEVICE_F64 = {"sin_cos_kernel": 16, "random_normal_kernel": 16}


def test_no_spills_and_no_stack_frame(rows):
    bad = [f"{_where(r)}: {r['spill_stores_bytes']} B spill stores, {r['spill_loads_bytes']} B "
           f"spill loads, {r['stack_bytes']} B stack" for r in _good(rows)
           if r["spill_bytes"] or r["stack_bytes"] > LIBDEVICE_STACK_BYTES.get(r["kernel"], 0)]
    assert not bad, ("kernels that use local memory (a local array indexed at run time, or "
                     "more registers than ptxas allows):\n" + "\n".join(bad))


def test_float32_kernels_have_no_float64_instructions(rows):
    bad = [f"{_where(r)}: {r['f64_instructions']} float64 instruction(s)" for r in _good(rows)
           if not r["float64_allowed"] and r["f64_instructions"] > LIBDEVICE_F64.get(r["kernel"], 0)]
    assert not bad, ("float64 arithmetic in kernels with no float64 argument: look for a "
                     "Python float (0.0, 1e-7, math.nan) mixed into float32 math, or ``/`` "
                     "on integers; write float32(...) instead:\n" + "\n".join(bad))


def test_launch_block_fits_the_register_file(rows):
    bad = [f"{_where(r)}: {r['registers']} registers x {r['block_threads']} threads = "
           f"{r['registers'] * r['block_threads']}" for r in _good(rows)
           if r["registers"] * r["block_threads"] > report.REGISTERS_PER_SM
           or r["blocks_per_sm"] < 1]
    assert not bad, (f"blocks that cannot launch (more than {report.REGISTERS_PER_SM} "
                     f"registers per block): use a smaller block or fewer registers:\n"
                     + "\n".join(bad))


#: Static SASS instructions per output that conv2d v3 forward may need for the lab's layer
#: (28x28x1, 3x3 -> 32, 'valid'; issue 24). v1 needs 880 on sm_90 (one output per pass).
V3_MAX_SASS_PER_OUTPUT = 80


def test_conv2d_v3_needs_few_instructions_per_output(rows):
    """The report's SASS column, read from the real compile: v3 forward for the lab's layer
    within V3_MAX_SASS_PER_OUTPUT on every cc, and far below v1 (so the count is real)."""
    lab = [r for r in _good(rows) if r["kernel"].startswith("conv2d_v3[28x28x1 k3x3->32 s1x1 p0,0 out26x26")]
    v1 = [r for r in _good(rows) if r["kernel"].startswith("conv2d_v1[relu=True]")]
    ccs = compiled_ccs()
    assert len(lab) == len(ccs) and len(v1) == len(ccs), [r["kernel"] for r in lab + v1]
    for r in lab:
        assert r["sass_per_output"] <= V3_MAX_SASS_PER_OUTPUT, (
            f"{_where(r)}: {r['sass_per_output']} SASS instructions per output "
            f"({r['sass_instructions']} / {r['outputs_per_pass']}) > {V3_MAX_SASS_PER_OUTPUT}")
    for r in v1:
        assert r["sass_per_output"] > 5 * V3_MAX_SASS_PER_OUTPUT, r
    assert all(r["sass_instructions"] > 0 for r in _good(rows))


# --- the registry cannot fall behind the code ---------------------------------------------

def test_every_kernel_in_kernels_is_registered():
    missing = registry.unregistered()
    assert not missing, (f"CUDA kernels in kernels/ that are not registered: {missing}. Call "
                         f"kernels.registry.register(kernel, name, signatures, block) below "
                         f"each, with every signature its launcher passes.")


def test_an_unregistered_kernel_is_found():
    """The walk that the test above relies on does find a kernel nobody registered."""
    from numba import cuda

    @cuda.jit
    def stray_kernel(x):
        x[0] = 1

    found = registry.unregistered(module_prefix=__name__)
    assert any(name.endswith("stray_kernel") for name in found), found
    del stray_kernel


def test_every_registered_signature_parses():
    """Each registered signature is one Numba accepts (a typo is caught without compiling)."""
    from numba.core import sigutils
    for spec in registry.registered():
        assert spec.signatures and spec.block_threads >= 1, spec.label
        for sig in spec.signatures:
            args, ret = sigutils.normalize_signature(sig)
            assert str(ret) == "none" and args, f"{spec.label}: {sig!r} must be void(...)"


# --- bad input: what a broken kernel looks like in the report --------------------------------

_BROKEN_KERNELS = r'''
import json, math
from numba import cuda, float32
from kernels import report
from kernels.registry import KernelSpec

@cuda.jit
def sums_in_float64(x, out):
    acc = 0.0                      # a Python float: float64, carried through the loop
    for i in range(x.size):
        acc += x[i]
    out[0] = acc

@cuda.jit
def local_array_at_run_time_index(x, n):
    buf = cuda.local.array(64, float32)
    for i in range(64):
        buf[i] = x[i]
    buf[n] += float32(1.0)         # n unknown at compile time: buf lives on the stack
    x[0] = buf[n + 1]

@cuda.jit
def stores_a_string(x):
    x[0] = "not a number"

specs = [KernelSpec("sums_in_float64", "", sums_in_float64, ("void(float32[::1], float32[::1])",), (256,), "t"),
         KernelSpec("local_array_at_run_time_index", "", local_array_at_run_time_index, ("void(float32[::1], int64)",), (256,), "t"),
         KernelSpec("stores_a_string", "", stores_a_string, ("void(float32[::1])",), (256,), "t")]
print(json.dumps(report.compile_rows(specs, [(9, 0)])))
'''


def test_broken_kernels_are_reported_with_name_signature_and_message():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="0",
               PYTHONPATH=os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p))
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(_BROKEN_KERNELS)], cwd=root,
                          env=env, capture_output=True, text=True, timeout=REPORT_TIMEOUT_S)
    assert done.returncode == 0, done.stderr[-3000:]
    f64, stack, string = json.loads(done.stdout)
    assert f64["error"] is None and f64["f64_instructions"] > 0, f64
    assert stack["error"] is None and stack["stack_bytes"] > 0, stack
    message = string["error"] or ""
    assert ("stores_a_string" in message and "void(float32[::1])" in message
            and "does not compile" in message and "TypingError" in message), string


def test_unknown_compute_capability_names_the_known_ones():
    assert report.parse_cc("9.0") == (9, 0) == report.parse_cc("sm_90")
    with pytest.raises(ValueError, match=r"unknown compute capability '4\.2'; known: 6\.0 .*7\.5 .*9\.0"):
        report.parse_cc("4.2")


# --- reading ptxas and PTX ------------------------------------------------------------------

#: What ptxas 12.9 prints for gemm v2 on sm_90 (entry name shortened).
_PTXAS_V2 = """\
ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function '_ZN7kernels4gemm7gemm_v2' for 'sm_90'
ptxas info    : Function properties for _ZN7kernels4gemm7gemm_v2
    0 bytes stack frame, 8 bytes spill stores, 4 bytes spill loads
ptxas info    : Used 32 registers, used 1 barriers, 2176 bytes smem, 400 bytes cmem[0]
"""


def test_ptxas_output_is_read():
    assert report.parse_ptxas(_PTXAS_V2) == {
        "registers": 32, "stack_bytes": 0, "spill_stores_bytes": 8, "spill_loads_bytes": 4,
        "shared_bytes": 2176}
    with pytest.raises(ValueError, match="printed 0"):
        report.parse_ptxas("ptxas info    : 0 bytes gmem\n")
    # libdevice's slow path kept as a called function (float64 pow): its frame is added
    internal = ("ptxas info    : Function properties for __internal_accurate_pow\n"
                "    8 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads\n")
    assert report.parse_ptxas(_PTXAS_V2 + internal)["stack_bytes"] == 8
    with pytest.raises(ValueError, match="printed 2"):      # but a second function of ours is not
        report.parse_ptxas(_PTXAS_V2 + internal.replace("__internal_accurate_pow", "_ZN7kernels3f"))


def test_float64_instructions_are_counted():
    ptx = """
    .reg .f64 %fd<4>;
    ld.global.f32 %f1, [%rd1];
    cvt.f64.f32 %fd1, %f1;
    @%p1 add.f64 %fd2, %fd1, %fd1;
    add.f32 %f2, %f1, %f1;
    """
    assert report.count_f64_instructions(ptx) == 2


def test_occupancy_of_gemm_v3_shapes():
    """179 registers x 256 threads (an 8 x 8 register tile): one block of 8 warps per SM
    (12.5% of 64 warps on sm_90); 122 (v3's 8 x 4 tile): two blocks; 32 registers: 8
    blocks, every warp slot filled."""
    assert report.occupancy(179, 8192, 256, (9, 0))[:2] == (1, 0.125)
    assert report.occupancy(122, 6272, 256, (9, 0))[:2] == (2, 0.25)
    assert report.occupancy(32, 0, 256, (9, 0))[:2] == (8, 1.0)
    assert report.occupancy(255, 0, 1024, (9, 0))[0] == 0


def test_hardware_numbers_sit_beside_ptxas_and_say_whether_they_agree():
    """``--hardware`` (GPU only) adds what the driver reports for each loaded kernel; here
    a stand-in dispatcher plays the driver: one kernel agrees with ptxas, one does not,
    one fails to load."""
    class Loaded:
        def __init__(self, regs, local):
            self.regs_per_thread, self.local_mem_per_thread, self.shared_mem_per_block = regs, local, 0

    class Kernel:
        def __init__(self, loaded):
            self.loaded = loaded

        def compile(self, signature):
            if self.loaded is None:
                raise RuntimeError("no such function")
            return self.loaded

    class Spec:
        def __init__(self, label, loaded):
            self.label, self.kernel = label, Kernel(loaded)

    specs = [Spec("same", Loaded(40, 0)), Spec("differs", Loaded(48, 16)), Spec("fails", None)]
    rows = [dict(kernel=s.label, signature="void(float32[::1])", error=None, registers=40,
                 shared_bytes=0, stack_bytes=0) for s in specs]
    report.add_hardware_numbers(rows, specs)
    assert rows[0]["hw_registers"] == 40 and rows[1]["hw_local_bytes"] == 16
    assert "no such function" in rows[2]["hw_error"]
    table = report.format_hardware(rows).splitlines()
    assert table[1].endswith("yes") and table[2].endswith("NO") and "no such function" in table[3]


# --- the summary kernels/README.md carries is the compiler's output --------------------------

def test_the_kernels_readme_summary_is_the_compilers_output(rows):
    """kernels/README.md's sm_90 table is ``python -m kernels.report --cc 9.0 --markdown``:
    compared here with what the compiler gives now, so a kernel change that moves a figure
    fails until the table is regenerated (the figures were hand-typed, and went stale)."""
    import pathlib
    text = (pathlib.Path(__file__).resolve().parents[1] / "kernels" / "README.md").read_text()
    begin = "<!-- begin: python -m kernels.report --cc 9.0 --markdown -->"
    assert begin in text and "<!-- end -->" in text, "kernels/README.md lost its summary's markers"
    block = text.split(begin, 1)[1].split("<!-- end -->", 1)[0].strip()
    written = block.split("\n", 1)[0]                      # "Compiled with numba-cuda ..., ptxas ..."
    here = f"Compiled with {report.toolchain()}."
    if written != here:
        pytest.skip(f"kernels/README.md's summary was made with another toolchain ({written!r}; "
                    f"here: {here!r}): its figures are that toolchain's")
    want = report.format_markdown([r for r in rows if r["cc"] == "9.0"])
    got = block.split("\n", 1)[1].strip()
    assert got == want, ("kernels/README.md's summary differs from the compiler's output: "
                         "regenerate it with python -m kernels.report --cc 9.0 --markdown")
