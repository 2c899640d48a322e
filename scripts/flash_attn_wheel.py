#!/usr/bin/env python3
"""flash-attn for the vendor model's ``flash_attention_2``: a wheel of only the kernels it calls.

    python scripts/flash_attn_wheel.py download   # where PyPI is reachable (needs torch importable)
    python scripts/flash_attn_wheel.py build      # on the GPU machine (nvcc, ninja, the CUDA torch)
    python scripts/flash_attn_wheel.py install [--target DIR]   # builds first when no cached wheel fits
    python scripts/flash_attn_wheel.py            # all three, each skipped when its result is cached

flash-attn 2.8.3.post2 is published as an sdist only, and a full build compiles 72 CUDA files
(forward, split-KV forward and backward for fp16/bf16 x head dims 32..256 x causal or not) for four
GPU generations: hours on one machine. The vendor's LLM (transformers 4.46.3's LlamaFlashAttention2
through ``_flash_attention_forward``: ``flash_attn_func`` / ``flash_attn_varlen_func``) calls it with
bf16 tensors of head dim 128, causal in prefill and decode, without dropout, ALiBi, softcap or a
local window. So the build keeps:

* ``flash_api.cpp`` and four kernel files: ``flash_fwd_hdim128_bf16{,_causal}_sm80.cu`` (the
  forward) and ``flash_fwd_split_hdim128_bf16{,_causal}_sm80.cu`` (the split-KV forward that the
  library picks for short queries such as a decode step);
* one GPU architecture, the local GPU's (``sm_90`` on an H100 or H200: FA2's Ampere-style kernels
  compiled for Hopper);
* ``FLASHATTENTION_DISABLE_{BACKWARD,DROPOUT,ALIBI,SOFTCAP,LOCAL}`` for the C++ and the CUDA
  compiler (flash-attn then refuses those features with its own error instead of running them).

Three small edits to the extracted sdist make that link and stay safe (none is committed; the sdist
is downloaded, never vendored): ``setup.py``'s source list and flags; ``static_switch.h``'s dtype and
head-dim switches reduced to bf16 / head dim <= 128 (anything else raises a ``TORCH_CHECK`` error
instead of calling a kernel that was not built); ``flash_api.cpp``'s backward entry point calls no
backward kernel under ``FLASHATTENTION_DISABLE_BACKWARD`` (the library's own check already refuses
the call; without the edit the module would not load: the symbol is undefined).

Cache (git-ignored, ``.flash-attn/`` in the repository root, ``FLASH_ATTN_CACHE`` moves it): the sdist,
and one folder per build key (flash-attn version, torch version, CUDA version, GPU architecture,
Python tag) with the wheel and ``build.json`` (seconds, wheel bytes, kept files, flags). A later
``build`` or ``install`` with the same key reuses the wheel.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

VERSION = "2.8.3.post2"
SDIST = f"flash_attn-{VERSION}.tar.gz"
ROOT = Path(__file__).resolve().parent.parent
CACHE = Path(os.environ.get("FLASH_ATTN_CACHE", ROOT / ".flash-attn"))

KEPT_KERNELS = ("flash_fwd_hdim128_bf16_sm80.cu", "flash_fwd_hdim128_bf16_causal_sm80.cu",
                "flash_fwd_split_hdim128_bf16_sm80.cu", "flash_fwd_split_hdim128_bf16_causal_sm80.cu")
DISABLED = ("BACKWARD", "DROPOUT", "ALIBI", "SOFTCAP", "LOCAL")
NARROW = "DSOCR_HARNESS_BF16_HDIM128"
DEFINES = [f"-DFLASHATTENTION_DISABLE_{x}" for x in DISABLED] + [f"-D{NARROW}"]

# appended to static_switch.h: the switches flash_api.cpp dispatches through, reduced to what was built
SWITCHES = f"""
#ifdef {NARROW}   // dsocr-harness build: bf16 kernels of head dim 128 only
#undef FP16_SWITCH
#define FP16_SWITCH(COND, ...) [&] {{ \\
    TORCH_CHECK(!(COND), "this flash-attn build holds bf16 kernels only (dsocr-harness)"); \\
    using elem_type = cutlass::bfloat16_t; return __VA_ARGS__(); }}()
#undef HEADDIM_SWITCH
#define HEADDIM_SWITCH(HEADDIM, ...) [&] {{ \\
    TORCH_CHECK((HEADDIM) <= 128, "this flash-attn build holds head dim <= 128 only (dsocr-harness)"); \\
    constexpr static int kHeadDim = 128; return __VA_ARGS__(); }}()
#endif
"""
BWD_CALL = "run_mha_bwd_<elem_type, kHeadDim, Is_causal>(params, stream);"


def say(msg: str) -> None:
    print(f"[flash-attn] {msg}", flush=True)


def die(msg: str, fix: str) -> None:
    print(f"error: {msg}; fix: {fix}", file=sys.stderr)
    sys.exit(2)


def _torch():
    try:
        import torch
    except ImportError:
        die("torch is not importable in this Python", "run with the interpreter that holds the CUDA build of torch")
    return torch


def build_key() -> str:
    """flash-attn, torch and CUDA versions, the local GPU's architecture and the Python tag."""
    torch = _torch()
    if not torch.cuda.is_available() or not torch.version.cuda:
        die(f"no CUDA GPU is visible to torch {torch.__version__}: the wheel is built for the local GPU",
            "run this on the GPU machine, with the CUDA build of torch")
    major, minor = torch.cuda.get_device_capability()
    return (f"fa{VERSION}-torch{torch.__version__.replace('+', '_')}-cuda{torch.version.cuda}-sm{major}{minor}"
            f"-cp{sys.version_info.major}{sys.version_info.minor}")


def download() -> Path:
    """The sdist in the cache (pip's metadata step imports torch, hence no build isolation)."""
    sdist = CACHE / SDIST
    if sdist.is_file():
        say(f"sdist cached: {sdist}")
        return sdist
    CACHE.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "FLASH_ATTENTION_SKIP_CUDA_BUILD": "TRUE"}
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-build-isolation", "--no-binary", ":all:",
           "-d", str(CACHE), f"flash-attn=={VERSION}"]
    say("downloading the sdist: " + " ".join(cmd[2:]))
    if subprocess.run(cmd, env=env).returncode != 0 or not sdist.is_file():
        die(f"pip could not download flash-attn=={VERSION}", "check that PyPI is reachable and torch is importable")
    return sdist


def _replace_once(text: str, old: str, new: str, where: str) -> str:
    if text.count(old) != 1:
        die(f"{where}: expected one '{old.strip()[:60]}' in flash-attn {VERSION}'s sources, found {text.count(old)}",
            f"the sdist is not the one this script patches; download flash-attn=={VERSION}")
    return text.replace(old, new)


def patch(src: Path) -> None:
    """The three edits of the module docstring, each checked to apply exactly once."""
    setup_py = src / "setup.py"
    text = setup_py.read_text()
    pattern = re.compile(r'(name="flash_attn_2_cuda",\s*sources=\[)(.*?)(\])', re.S)
    found = pattern.findall(text)
    if not found or "flash_api.cpp" not in found[0][1]:
        die("setup.py: the CUDA extension's source list was not found", f"use flash-attn=={VERSION}'s sdist")
    kept = ['"csrc/flash_attn/flash_api.cpp"'] + [f'"csrc/flash_attn/src/{k}"' for k in KEPT_KERNELS]
    text = pattern.sub(lambda m: m.group(1) + ", ".join(kept) + m.group(3), text, count=1)
    block = re.search(r"nvcc_flags = \[.*?\n    \]", text, re.S)    # the CUDA build's flags (ROCm has its own)
    if block is None:
        die("setup.py: the CUDA build's nvcc_flags list was not found", f"use flash-attn=={VERSION}'s sdist")
    flags = block.group(0)
    for x in DISABLED:
        flags = _replace_once(flags, f'# "-DFLASHATTENTION_DISABLE_{x}",', f'"-DFLASHATTENTION_DISABLE_{x}",', "setup.py")
    flags = _replace_once(flags, '"--use_fast_math",', f'"--use_fast_math", "-D{NARROW}",', "setup.py")
    text = text.replace(block.group(0), flags)
    text = _replace_once(text, 'compiler_c17_flag=["-O3", "-std=c++17"]',
                         f'compiler_c17_flag=["-O3", "-std=c++17", {", ".join(repr(d) for d in DEFINES)}]', "setup.py")
    setup_py.write_text(text)
    switch = src / "csrc/flash_attn/src/static_switch.h"
    switch.write_text(switch.read_text() + SWITCHES)
    api = src / "csrc/flash_attn/flash_api.cpp"
    api.write_text(_replace_once(api.read_text(), BWD_CALL,
                                 f"\n#ifndef FLASHATTENTION_DISABLE_BACKWARD\n{BWD_CALL}\n#endif\n", "flash_api.cpp"))


def build(jobs: int | None = None) -> Path:
    """The wheel for this machine's key: cached, or built from the cached sdist (patched in a temp dir)."""
    key = build_key()
    out = CACHE / "wheels" / key
    wheels = sorted(out.glob("flash_attn-*.whl"))
    if wheels:
        say(f"wheel cached for {key}: {wheels[0].name}")
        return wheels[0]
    sdist = CACHE / SDIST
    if not sdist.is_file():
        die(f"no flash-attn sdist in {CACHE}", "run `python scripts/flash_attn_wheel.py download` where PyPI is "
            "reachable and carry .flash-attn/ to this machine")
    if shutil.which("nvcc") is None and not Path("/usr/local/cuda/bin/nvcc").is_file():
        die("nvcc (the CUDA compiler) is not on PATH", "install the CUDA toolkit matching torch's CUDA version")
    torch = _torch()
    major, minor = torch.cuda.get_device_capability()
    jobs = jobs or os.cpu_count() or 4
    env = {**os.environ, "FLASH_ATTENTION_FORCE_BUILD": "TRUE", "FLASH_ATTN_CUDA_ARCHS": f"{major}{minor}",
           "TORCH_CUDA_ARCH_LIST": f"{major}.{minor}", "MAX_JOBS": str(jobs), "NVCC_THREADS": "2"}
    env["PATH"] = env.get("PATH", "") + ":/usr/local/cuda/bin"
    with tempfile.TemporaryDirectory(prefix="flash-attn-build-") as tmp:
        with tarfile.open(sdist) as tar:
            tar.extractall(tmp, filter="data")
        src = Path(tmp) / f"flash_attn-{VERSION}"
        patch(src)
        say(f"building {len(KEPT_KERNELS)} kernel files for sm_{major}{minor} with {jobs} jobs (a few minutes)")
        t0 = time.perf_counter()
        cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", str(Path(tmp) / "dist"),
               str(src)]
        if subprocess.run(cmd, env=env).returncode != 0:
            die("the flash-attn build failed (see the compiler's messages above)",
                "check nvcc matches torch's CUDA version and ninja is installed")
        seconds = time.perf_counter() - t0
        wheel = next((Path(tmp) / "dist").glob("flash_attn-*.whl"))
        out.mkdir(parents=True, exist_ok=True)
        shutil.copy2(wheel, out / wheel.name)
    record = {"key": key, "build_s": round(seconds, 1), "wheel": wheel.name, "wheel_bytes": (out / wheel.name).stat().st_size,
              "kernels": list(KEPT_KERNELS), "defines": DEFINES, "arch": f"sm_{major}{minor}", "jobs": jobs,
              "gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "cuda": torch.version.cuda}
    (out / "build.json").write_text(json.dumps(record, indent=1) + "\n")
    say(f"built {wheel.name} in {seconds:.0f} s: {record['wheel_bytes'] / 1e6:.1f} MB, cached in {out}")
    return out / wheel.name


def install(target: str | None = None, jobs: int | None = None) -> None:
    wheel = build(jobs)
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--force-reinstall", str(wheel)]
    if target:
        cmd += ["--target", target, "--upgrade"]
    if subprocess.run(cmd).returncode != 0:
        die(f"pip could not install {wheel}", "see pip's message above")
    say(f"installed {wheel.name}" + (f" into {target}" if target else ""))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("step", nargs="?", default="all", choices=("download", "build", "install", "all"))
    ap.add_argument("--target", help="install into this folder (pip --target) instead of the environment")
    ap.add_argument("--jobs", type=int, help="parallel compile jobs (default: all cores)")
    args = ap.parse_args(argv)
    if args.step in ("download", "all") and not (CACHE / SDIST).is_file():
        download()
    if args.step == "download":
        return
    if args.step == "build":
        build(args.jobs)
        return
    install(args.target, args.jobs)


if __name__ == "__main__":
    main()
