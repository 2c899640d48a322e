"""Which host-sync path carries the outliers? 1,000 tiny launches with 11 syncs per block, where a
sync is: .item() (pageable D2H), torch.cuda.synchronize(), or an event sync; under the context's
default scheduling flags, then with CU_CTX_SCHED_SPIN / BLOCKING_SYNC set through the driver API."""
import ctypes
import gc
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from host_noise import line  # noqa: E402
from harness.measure.host import time_ms  # noqa: E402


def run(label, sync, n=150):
    x = torch.zeros(16, device="cuda")

    def block():
        for i in range(1000):
            x.add_(1)
            if i % 91 == 0:
                sync(x)

    torch.cuda.synchronize()
    return line(label, time_ms(block, n, cuda=True))


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
        print(run(f"  {name}", fn))
