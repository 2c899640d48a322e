"""Which host-sync path carries the outliers? 1,000 tiny launches with 11 syncs per block, where a
sync is: .item() (pageable D2H), torch.cuda.synchronize(), or an event sync; under the context's
default scheduling flags, then with CU_CTX_SCHED_SPIN / BLOCKING_SYNC set through the driver API."""
import ctypes
import gc
import statistics
import time

import torch


def run(sync, n=150):
    x = torch.zeros(16, device="cuda")
    out = []
    for _ in range(n):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for i in range(1000):
            x.add_(1)
            if i % 91 == 0:
                sync(x)
        torch.cuda.synchronize()
        out.append((time.perf_counter() - t0) * 1e3)
    m = statistics.median(out)
    return f"median {m:6.3f}  CV {100 * statistics.pstdev(out) / statistics.fmean(out):5.1f}%  p90 {sorted(out)[134]:6.3f}  max {max(out):6.2f}  >1.2x: {sum(t > 1.2 * m for t in out)}"


def item(x):
    x.sum().item()


def dsync(x):
    torch.cuda.synchronize()


def evsync(x):
    e = torch.cuda.Event()
    e.record()
    e.synchronize()


gc.disable()
torch.zeros(1, device="cuda")
cu = ctypes.CDLL("libcuda.so.1")
flags = ctypes.c_uint()
print("cuCtxGetFlags rc", cu.cuCtxGetFlags(ctypes.byref(flags)), "flags", flags.value)
for label, f in (("default", None), ("spin", 1), ("yield", 2), ("blocking", 4), ("spin again", 1)):
    if f is not None:
        rc = cu.cuCtxSetFlags(ctypes.c_uint(f))
        cu.cuCtxGetFlags(ctypes.byref(flags))
        label += f" (set rc {rc}, flags {flags.value})"
    print(f"== {label}")
    for name, fn in (("item", item), ("device sync", dsync), ("event sync", evsync)):
        print(f"  {name:12s}", run(fn))
