"""Per-range cost of the measurement path on the GPU node: StageRecorder enter/exit (NVTX push/pop
+ two CUDA event records + host clocks) timed over many iterations with nothing inside, and the
count of ranges in one base-mode request, giving the derived overhead per request."""
import time

import torch

from harness.measure.recorder import StageRecorder

N = 20000
rec = StageRecorder(cuda=True)
for _ in range(100):
    with rec("decode_step", step=0):
        pass
torch.cuda.synchronize()
t0 = time.perf_counter()
for i in range(N):
    with rec("decode_step", step=i % 128):
        pass
t1 = time.perf_counter()
rec.finish()
bare0 = time.perf_counter()
for i in range(N):
    pass
bare1 = time.perf_counter()
per = ((t1 - t0) - (bare1 - bare0)) / N * 1e6
ranges = 1 + 3 + 1 + 1 + 1 + 127   # request, sam/clip/projector, projector glue, prefill, decode, 127 decode steps
print(f"StageRecorder cost per range: {per:.2f} us; base request with 128 tokens has {ranges} ranges "
      f"-> {per * ranges / 1e3:.3f} ms added per request")

import sys  # noqa: E402
sys.path.insert(0, "scripts")
from bench_overhead import Alternating  # noqa: E402

clock = Alternating(None)
t0 = time.perf_counter()
for i in range(N):
    with clock("decode_step", step=i):
        pass
t1 = time.perf_counter()
per_clock = ((t1 - t0) - (bare1 - bare0)) / N * 1e6
print(f"Alternating(None) (the bare run's step timer) cost per range: {per_clock:.2f} us -> "
      f"{per_clock * ranges / 1e3:.3f} ms per request")
