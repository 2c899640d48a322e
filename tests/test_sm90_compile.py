"""``scripts/sm90_compile.py``: the kernels changed without a GPU compile for sm90 (H100/H200) through the
Triton wheel's own ptxas, in a subprocess without TRITON_INTERPRET (the test process interprets them)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _has_ptxas() -> bool:
    try:
        import triton
    except ImportError:
        return False
    return (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas").exists()


pytestmark = pytest.mark.skipif(not _has_ptxas(), reason="no Triton NVIDIA backend with ptxas here")


def _run(args, tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "cache")
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def test_the_changed_kernels_compile_for_sm90(tmp_path):
    """Every case of the script (the router's top-k kernel in three flag sets, the route + align kernel at
    batches 32 and 128) compiles: six "ok" lines, exit status 0."""
    res = _run(["scripts/sm90_compile.py"], tmp_path)
    lines = res.stdout.splitlines()
    assert res.returncode == 0, res.stdout + res.stderr
    assert len(lines) == 6 and all(ln.startswith("ok    ") for ln in lines), lines


def test_a_kernel_the_compiler_rejects_is_reported(tmp_path):
    """The script with its cases replaced by the same store over 4 lanes and over 3 (not a power of two,
    which the compiler refuses): one "ok" line, one "FAIL" line naming the compiler's error, exit status 1."""
    code = (
        f"import sys; sys.path.insert(0, {str(ROOT / 'scripts')!r}); sys.path.insert(0, {str(ROOT / 'src')!r})\n"
        "import triton, triton.language as tl\n"
        "import sm90_compile\n"
        "@triton.jit\n"
        "def store(x_ptr, N: tl.constexpr):\n"
        "    tl.store(x_ptr + tl.arange(0, N), 1.0)\n"
        "sm90_compile.cases = lambda: [(f'store N={n}', store, {'x_ptr': '*fp32'}, {'N': n}, 1) for n in (4, 3)]\n"
        "sys.exit(sm90_compile.main())\n")
    script = tmp_path / "store_kernel.py"               # Triton reads a kernel's source from its file
    script.write_text(code)
    res = _run([str(script)], tmp_path)
    lines = res.stdout.splitlines()
    assert res.returncode == 1, res.stdout + res.stderr
    assert len(lines) == 2 and lines[0].startswith("ok    store N=4"), lines
    assert lines[1].startswith("FAIL  store N=3: CompilationError"), lines
