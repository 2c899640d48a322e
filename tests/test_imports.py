"""The package's import graph has no cycle: every module sits below the modules that use it."""
from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"


def _modules() -> dict:
    mods = {}
    for p in (SRC / "harness").rglob("*.py"):
        rel = p.relative_to(SRC).with_suffix("")
        parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
        mods[".".join(parts)] = p
    return mods


def _imports(name: str, path: Path, mods: dict) -> set:
    """Package modules ``name`` imports anywhere in its file (function-level imports included)."""
    pkg = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = pkg.split(".")[: len(pkg.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            targets = [base] + [f"{base}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        else:
            continue
        for t in targets:
            # a package's own submodules and its parents are not edges (importing `harness.x` runs harness/__init__)
            if t in mods and t != name and not name.startswith(t + ".") and not t.startswith(name + "."):
                out.add(t)
    return out


def cycles(graph: dict) -> list:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_cycle_finder_finds_a_planted_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle_inside_harness():
    mods = _modules()
    graph = {m: _imports(m, p, mods) for m, p in mods.items()}
    assert len(graph) > 40 and graph["harness.run"]
    assert cycles(graph) == []


def test_the_reference_model_imports_no_kernel_and_the_kernels_no_model():
    """``models/llm.py``, ``deepseek_ocr.py`` and ``vision.py`` keep the vendor's single path: no module
    of ``harness.kernels`` (or ``harness.variants``, which binds them) is imported there; the kernels
    import nothing from ``harness.models``."""
    mods = _modules()
    for name in ("harness.models.llm", "harness.models.deepseek_ocr", "harness.models.vision"):
        bad = {m for m in _imports(name, mods[name], mods) if m.startswith(("harness.kernels", "harness.variants"))}
        assert not bad, (name, bad)
    kernels = [m for m in mods if m.startswith("harness.kernels.")]
    assert len(kernels) >= 7
    for name in kernels:
        bad = {m for m in _imports(name, mods[name], mods) if m.startswith("harness.models")}
        assert not bad, (name, bad)


def test_the_import_finder_sees_function_level_kernel_imports(tmp_path):
    """The check above would catch a lazy import inside a function (as the model files once had)."""
    pkg = tmp_path / "harness"
    (pkg / "models").mkdir(parents=True)
    (pkg / "kernels").mkdir()
    for p in (pkg / "__init__.py", pkg / "models" / "__init__.py", pkg / "kernels" / "__init__.py",
              pkg / "kernels" / "gemv_triton.py"):
        p.write_text("")
    (pkg / "models" / "llm.py").write_text("def f():\n    from ..kernels.gemv_triton import gemv\n")
    mods = {"harness": pkg / "__init__.py", "harness.models": pkg / "models" / "__init__.py",
            "harness.kernels": pkg / "kernels" / "__init__.py",
            "harness.kernels.gemv_triton": pkg / "kernels" / "gemv_triton.py", "harness.models.llm": pkg / "models" / "llm.py"}
    assert "harness.kernels.gemv_triton" in _imports("harness.models.llm", mods["harness.models.llm"], mods)


def _fresh_interpreter(code: str) -> str:
    """stdout of ``code`` run by a new interpreter that imports this checkout's ``src``."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_the_measure_facade_is_lazy():
    """Importing the report side's ``harness.measure.summary`` runs ``harness/measure/__init__`` but
    loads neither the measurement machinery (``runner``, ``recorder``) nor torch; the facade's names
    are still there on first access, each the object its submodule defines."""
    out = _fresh_interpreter(
        "import sys\n"
        "import harness.measure.summary\n"
        "print(sorted(m for m in ('harness.measure.runner', 'harness.measure.recorder', 'torch') if m in sys.modules))\n"
        "import harness.measure as m\n"
        "from harness.measure import recorder, runner, summary\n"
        "print(m.measure_case is runner.measure_case, m.CaseMeasurement is runner.CaseMeasurement,\n"
        "      m.StageRecorder is recorder.StageRecorder, m.Summary is summary.Summary, m.summarize is summary.summarize)\n"
        "print(sorted(m.__all__) == sorted(n for n in dir(m) if n in m.__all__), hasattr(m, 'not_a_name'))\n")
    assert out.split("\n")[:3] == ["[]", "True True True True True", "True False"]
