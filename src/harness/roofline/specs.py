"""Device ceilings: dense datasheet peaks per dtype, memory bandwidth, name matching, overrides.

Units: ``peak_tflops`` in TFLOP/s (1e12 FLOP/s, 2 FLOP per multiply-accumulate), ``mem_bw_gbs``
in GB/s (1e9 B/s). Every peak below is the **dense** tensor-core figure of the vendor's
datasheet or architecture whitepaper; datasheets print the 2:4 structured-sparsity figure
("with sparsity") next to it at twice the value, and that one is never used here. For the
GeForce cards the figure is the one with **FP32 accumulate** (what PyTorch's bf16/fp16 GEMMs
use), which on those cards is half the FP16-accumulate rate.

``fp32`` is the non-tensor FP32 rate (CUDA cores); ``tf32`` the dense TF32 tensor rate
(used by fp32 matmuls only when ``torch.backends.cuda.matmul.allow_tf32`` is on).

Name matching: ``match_device(torch.cuda.get_device_name())`` recognises the strings the
driver really reports ("NVIDIA H100 80GB HBM3" -> H100 SXM, "NVIDIA H100 PCIe", "NVIDIA H100
NVL", "NVIDIA A100-SXM4-80GB", "NVIDIA GeForce RTX 4090", ...). Patterns are anchored so that
"A10" does not match "A100"/"A10G", "L4" not "L40"/"L40S", "H20" not "H200", "H200" not
"GH200", "B200" not "GB200". A name that matches nothing is reported as **unknown** and gets
no datasheet peak: only calibrated ceilings (``python -m harness calibrate``) or explicit
overrides (``hardware.peak_tflops`` / ``hardware.mem_bw_gbs``) are used for it.
"""
from __future__ import annotations

import platform
import re
from dataclasses import dataclass, field
from typing import Optional

from ..config import HardwareConfig, from_dict
from ..dtypes import TABLE, canonical
from ..floats import finite

DTYPES = tuple(TABLE)
norm_dtype = canonical   # 'bfloat16' / 'torch.bfloat16' / 'bf16' -> 'bf16' (harness.dtypes, the one table)


def hardware_config(hardware) -> HardwareConfig:
    """The ``hardware`` config section as a ``HardwareConfig`` (a mapping, e.g. from a manifest, is
    read with the schema; keys it does not know are dropped)."""
    if isinstance(hardware, HardwareConfig):
        return hardware
    return from_dict(HardwareConfig, dict(hardware or {}), strict=False)


@dataclass(frozen=True)
class DeviceSpec:
    """Datasheet ceilings of one device. ``peak_tflops``: dense TFLOP/s per dtype (missing key =
    the dtype has no tensor path on this device, e.g. fp8 before Hopper/Ada)."""

    key: str
    name: str
    peak_tflops: dict
    mem_bw_gbs: float
    memory_gb: float
    source: str
    pattern: str
    uncertain: str = ""          # non-empty: which figures are not from an official NVIDIA datasheet

    def peak(self, dtype) -> Optional[float]:
        return self.peak_tflops.get(norm_dtype(dtype))


# Dense datasheet figures (sparse figure / 2 where the sheet prints only "with sparsity").
SPECS: dict = {}


def _add(spec: DeviceSpec) -> None:
    SPECS[spec.key] = spec


# H100 SXM5 80GB (NVIDIA H100 Tensor Core GPU datasheet): FP64 34, FP32 67, TF32 494.7 (989 sparse),
# BF16/FP16 989.4 (1,979 sparse), FP8 1,978.9 (3,958 sparse); HBM3 3.35 TB/s.
_add(DeviceSpec("h100-sxm", "NVIDIA H100 SXM5 80GB",
                {"bf16": 989.4, "fp16": 989.4, "tf32": 494.7, "fp32": 67.0, "fp8": 1978.9}, 3350.0, 80,
                "NVIDIA H100 datasheet (SXM column), dense", r"(?<![a-z0-9])h100(?!.*(pcie|nvl))"))
# H100 PCIe 80GB (same datasheet, PCIe column): FP32 51, TF32 378 (756 sparse),
# BF16/FP16 756.5 (1,513 sparse), FP8 1,513 (3,026 sparse); HBM2e 2.0 TB/s.
_add(DeviceSpec("h100-pcie", "NVIDIA H100 PCIe 80GB",
                {"bf16": 756.5, "fp16": 756.5, "tf32": 378.0, "fp32": 51.0, "fp8": 1513.0}, 2000.0, 80,
                "NVIDIA H100 datasheet (PCIe column), dense", r"(?<![a-z0-9])h100.*pcie"))
# H100 NVL 94GB, one GPU (H100 datasheet, NVL column, 2024 single-GPU edition): FP32 60,
# TF32 417.5 (835 sparse), BF16/FP16 835.5 (1,671 sparse), FP8 1,670.5 (3,341 sparse); 3.9 TB/s.
_add(DeviceSpec("h100-nvl", "NVIDIA H100 NVL 94GB",
                {"bf16": 835.5, "fp16": 835.5, "tf32": 417.5, "fp32": 60.0, "fp8": 1670.5}, 3900.0, 94,
                "NVIDIA H100 datasheet (NVL column, per GPU), sparse/2", r"(?<![a-z0-9])h100\W*nvl",
                uncertain="per-GPU NVL figures: the first NVL sheet printed a 2-GPU pair (7.8 TB/s, 3,958 BF16 "
                          "sparse); halved here"))
# H200 SXM 141GB (NVIDIA H200 datasheet): same compute as H100 SXM (BF16 1,979 sparse -> 989.4
# dense, FP8 3,958 sparse -> 1,978.9, TF32 989 sparse -> 494.7, FP32 67); HBM3e 4.8 TB/s.
_add(DeviceSpec("h200", "NVIDIA H200 SXM 141GB",
                {"bf16": 989.4, "fp16": 989.4, "tf32": 494.7, "fp32": 67.0, "fp8": 1978.9}, 4800.0, 141,
                "NVIDIA H200 datasheet (SXM column), dense", r"(?<![a-z0-9])h200(?![0-9])(?!.*nvl)"))
# H200 NVL 141GB (H200 datasheet, NVL column): FP32 60, TF32 417.5 (835 sparse), BF16 835.5
# (1,671 sparse), FP8 1,670.5 (3,341 sparse); 4.8 TB/s.
_add(DeviceSpec("h200-nvl", "NVIDIA H200 NVL 141GB",
                {"bf16": 835.5, "fp16": 835.5, "tf32": 417.5, "fp32": 60.0, "fp8": 1670.5}, 4800.0, 141,
                "NVIDIA H200 datasheet (NVL column), sparse/2", r"(?<![a-z0-9])h200\W*nvl"))
# H20 96GB (China-market Hopper): BF16 148, FP8 296, TF32 74, FP32 44; HBM3 4.0 TB/s.
_add(DeviceSpec("h20", "NVIDIA H20 96GB",
                {"bf16": 148.0, "fp16": 148.0, "tf32": 74.0, "fp32": 44.0, "fp8": 296.0}, 4000.0, 96,
                "partner/press spec sheets (no public NVIDIA datasheet), dense",
                r"(?<![a-z0-9])h20(?![0-9a-z]|-3e)",
                uncertain="all H20 figures: no public NVIDIA datasheet; widely reported partner figures"))
# A100 SXM4 80GB (NVIDIA A100 datasheet): FP32 19.5, TF32 156 (312 sparse), BF16/FP16 312
# (624 sparse), no FP8; HBM2e 2,039 GB/s.
_add(DeviceSpec("a100-sxm-80gb", "NVIDIA A100 SXM4 80GB",
                {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5}, 2039.0, 80,
                "NVIDIA A100 datasheet (80GB SXM column), dense", r"(?<![a-z0-9])a100.*80\s*gb(?!.*pcie)"))
# A100 PCIe 80GB: same compute; HBM2e 1,935 GB/s.
_add(DeviceSpec("a100-pcie-80gb", "NVIDIA A100 PCIe 80GB",
                {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5}, 1935.0, 80,
                "NVIDIA A100 datasheet (80GB PCIe column), dense", r"(?<![a-z0-9])a100(?=.*80\s*gb)(?=.*pcie)"))
# A100 40GB (SXM4 and PCIe): same compute; HBM2 1,555 GB/s.
_add(DeviceSpec("a100-40gb", "NVIDIA A100 40GB (SXM4 or PCIe)",
                {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5}, 1555.0, 40,
                "NVIDIA A100 datasheet (40GB columns), dense", r"(?<![a-z0-9])a100(?!.*80\s*gb)"))
# A10 24GB (NVIDIA A10 datasheet): FP32 31.2, TF32 62.5 (125 sparse), BF16/FP16 125 (250 sparse);
# GDDR6 600 GB/s.
_add(DeviceSpec("a10", "NVIDIA A10 24GB",
                {"bf16": 125.0, "fp16": 125.0, "tf32": 62.5, "fp32": 31.2}, 600.0, 24,
                "NVIDIA A10 datasheet, dense", r"(?<![a-z0-9])a10(?![0-9a-z])"))
# L4 24GB (NVIDIA L4 datasheet): FP32 30.3, TF32 60 (120 sparse), BF16/FP16 121 (242 sparse),
# FP8 242.5 (485 sparse); GDDR6 300 GB/s.
_add(DeviceSpec("l4", "NVIDIA L4 24GB",
                {"bf16": 121.0, "fp16": 121.0, "tf32": 60.0, "fp32": 30.3, "fp8": 242.5}, 300.0, 24,
                "NVIDIA L4 datasheet, sparse/2", r"(?<![a-z0-9])l4(?![0-9a-z])"))
# L40S 48GB (NVIDIA L40S datasheet): FP32 91.6, TF32 183 (366 sparse), BF16/FP16 362.05
# (733 sparse), FP8 733 (1,466 sparse); GDDR6 864 GB/s.
_add(DeviceSpec("l40s", "NVIDIA L40S 48GB",
                {"bf16": 362.05, "fp16": 362.05, "tf32": 183.0, "fp32": 91.6, "fp8": 733.0}, 864.0, 48,
                "NVIDIA L40S datasheet, dense", r"(?<![a-z0-9])l40s(?![0-9a-z])"))
# GeForce RTX 4090 24GB (Ada Lovelace whitepaper, appendix): FP32 82.6; tensor with FP32
# accumulate: BF16/FP16 165.2 (330.4 sparse), TF32 82.6 (165.2 sparse), FP8 330.3 (660.6
# sparse); GDDR6X 1,008 GB/s.
_add(DeviceSpec("rtx4090", "NVIDIA GeForce RTX 4090 24GB",
                {"bf16": 165.2, "fp16": 165.2, "tf32": 82.6, "fp32": 82.6, "fp8": 330.3}, 1008.0, 24,
                "NVIDIA Ada Lovelace architecture whitepaper (FP32 accumulate), dense",
                r"rtx\W*4090(?!\W*d\b)(?!.*(laptop|mobile))"))
# GeForce RTX 5090 32GB (RTX Blackwell whitepaper): FP32 104.8; tensor BF16/FP16 with FP32
# accumulate 209.5 (419 sparse; FP16 accumulate: 419 / 838); FP8 419 (838 sparse, FP32 acc);
# GDDR7 1,792 GB/s (28 Gbps x 512 bit).
_add(DeviceSpec("rtx5090", "NVIDIA GeForce RTX 5090 32GB",
                {"bf16": 209.5, "fp16": 209.5, "tf32": 104.8, "fp32": 104.8, "fp8": 419.0}, 1792.0, 32,
                "NVIDIA RTX Blackwell architecture whitepaper (FP32 accumulate), dense",
                r"rtx\W*5090(?!\W*d\b)(?!.*(laptop|mobile))",
                uncertain="tensor figures: FP32-accumulate rate taken as half the FP16-accumulate 419 TFLOP/s "
                          "as on Ada; press tables print only 838 (FP16 acc, sparse)"))
# B200 (HGX B200 datasheet, 8 GPUs, divided by 8): TF32 18 PF sparse -> 1,125 dense per GPU,
# BF16/FP16 36 PF sparse -> 2,250 dense, FP8 72 PF sparse -> 4,500 dense; FP32 ~75 (UNSURE);
# HBM3e 8 TB/s per GPU.
_add(DeviceSpec("b200", "NVIDIA B200 180GB",
                {"bf16": 2250.0, "fp16": 2250.0, "tf32": 1125.0, "fp32": 75.0, "fp8": 4500.0}, 8000.0, 180,
                "NVIDIA HGX B200 datasheet (per GPU), sparse/2", r"(?<![a-z0-9])b200(?![0-9])",
                uncertain="B200 figures changed between announcement and HGX datasheets (power-limit dependent); "
                          "fp32 is the HGX figure / 8"))

# Lookup order: most specific first (NVL and PCIe before the bare H100; 80GB PCIe before 80GB SXM).
_ORDER = ("h100-nvl", "h100-pcie", "h100-sxm", "h200-nvl", "h200", "h20", "a100-pcie-80gb", "a100-sxm-80gb",
          "a100-40gb", "a10", "l40s", "l4", "rtx4090", "rtx5090", "b200")
_COMPILED = [(k, re.compile(SPECS[k].pattern, re.IGNORECASE)) for k in _ORDER]
assert set(_ORDER) == set(SPECS)


def match_device(name: Optional[str]) -> Optional[DeviceSpec]:
    """The datasheet spec for a device name as ``torch.cuda.get_device_name()`` returns it, or a
    spec key ('h100-sxm'); None when unknown (the caller must then not invent a peak)."""
    if not name:
        return None
    text = str(name).strip()
    if text.lower() in SPECS:
        return SPECS[text.lower()]
    low = re.sub(r"\s+", " ", text.lower())
    if low.startswith("cpu") or is_mig(low):
        return None
    for key, pat in _COMPILED:
        if pat.search(low):
            return SPECS[key]
    return None


def is_mig(name: Optional[str]) -> bool:
    """A MIG slice ('NVIDIA A100-SXM4-40GB MIG 3g.20gb'): a fraction of the GPU, so the full
    GPU's datasheet peak does not apply; it is treated as unknown."""
    return bool(name) and re.search(r"\bmig\b", str(name).lower()) is not None


def cpu_name() -> str:
    """'CPU <model name>' from /proc/cpuinfo (or platform) for the CPU 'device'."""
    model = ""
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.lower().startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return "CPU " + (model or platform.processor() or platform.machine() or "unknown")


def device_name_of(device_info: Optional[dict]) -> str:
    """Device name from a manifest ``device`` entry (``rundir.device_info``): the CUDA name, or
    'CPU <model>' for the CPU."""
    info = device_info or {}
    if info.get("name"):
        return str(info["name"])
    if info.get("type") == "cuda":
        return "CUDA device (name not recorded)"
    return str(info.get("cpu_name") or cpu_name())


def slug(name: str) -> str:
    """File-name-safe device key: 'NVIDIA H100 80GB HBM3' -> 'nvidia-h100-80gb-hbm3'."""
    return re.sub(r"[^a-z0-9]+", "-", str(name).lower()).strip("-") or "device"


@dataclass
class Peaks:
    """The ceilings a run is judged against: datasheet (dense, may be None for unknown devices)
    and calibrated (measured, may be None when not calibrated). TFLOP/s and GB/s.

    Which roof each figure is (``harness.roofline.calibrate``): ``peak_tflops`` / ``cal_tflops``
    the compute roof of FLOPs (MFU); ``mem_bw_gbs`` the datasheet memory roof; ``cal_gbs`` the
    measured copy (read + write bytes), the memory roof of the roofline and of traffic that reads
    and writes alike; ``cal_read_gbs`` the measured read stream (a sum over a buffer many times
    the L2 cache), the roof of read-dominated traffic such as decode (weights and KV read, little
    written): decode MBU against it where a record has it (None for records without it, then
    not shown)."""

    device_name: str
    dtype: str
    spec_key: Optional[str] = None         # None = unknown device
    spec_name: Optional[str] = None
    peak_tflops: Optional[float] = None
    mem_bw_gbs: Optional[float] = None
    cal_tflops: Optional[float] = None
    cal_gbs: Optional[float] = None
    cal_read_gbs: Optional[float] = None
    cal_dtype: Optional[str] = None
    cal_source: Optional[str] = None       # path of the calibration JSON, or None
    source: str = ""                       # where the datasheet numbers came from
    notes: list = field(default_factory=list)

    @property
    def known(self) -> bool:
        return self.spec_key is not None

    @staticmethod
    def _ridge(tf, bw) -> Optional[float]:
        if not tf or not bw:
            return None
        return tf * 1e12 / (bw * 1e9)

    @property
    def ridge(self) -> Optional[float]:
        """Datasheet ridge point [FLOP/B]."""
        return self._ridge(self.peak_tflops, self.mem_bw_gbs)

    @property
    def cal_ridge(self) -> Optional[float]:
        """Calibrated ridge point [FLOP/B]."""
        return self._ridge(self.cal_tflops, self.cal_gbs)

    def as_dict(self) -> dict:
        return {"device_name": self.device_name, "dtype": self.dtype, "spec_key": self.spec_key,
                "spec_name": self.spec_name, "peak_tflops": self.peak_tflops, "mem_bw_gbs": self.mem_bw_gbs,
                "ridge_flop_per_byte": self.ridge, "calibrated_tflops": self.cal_tflops,
                "calibrated_gbs": self.cal_gbs, "calibrated_read_gbs": self.cal_read_gbs,
                "calibrated_ridge_flop_per_byte": self.cal_ridge,
                "calibration_dtype": self.cal_dtype, "calibration": self.cal_source or "not calibrated",
                "source": self.source, "notes": list(self.notes)}


def _num(v) -> Optional[float]:
    """A ceiling: a finite positive number, else None."""
    f = finite(v)
    return f if f is not None and f > 0 else None


def resolve_peaks(device_name: Optional[str], dtype="bf16", hardware=None,
                  calibration: Optional[dict] = None) -> Peaks:
    """Ceilings for ``device_name`` running ``dtype``.

    ``hardware`` is the ``hardware`` config group: ``name`` ('auto' = use ``device_name``; any
    other string is matched like a device name or spec key), ``peak_tflops`` and ``mem_bw_gbs``
    (override the datasheet values for this dtype). ``calibration`` is a calibration record
    (``calibrate.load_calibration``): ``gemm_tflops``, ``copy_gbs``, ``read_gbs`` (absent in older
    records), ``gemm_dtype``, ``path``.
    """
    hw = hardware_config(hardware)
    dt = norm_dtype(dtype)
    name = str(device_name or "unknown")
    want = hw.name
    lookup = name if (want in (None, "", "auto")) else str(want)
    spec = match_device(lookup)
    p = Peaks(device_name=name, dtype=dt)
    if spec is not None:
        p.spec_key, p.spec_name, p.source = spec.key, spec.name, spec.source
        p.peak_tflops, p.mem_bw_gbs = spec.peak(dt), spec.mem_bw_gbs
        if lookup != name:
            p.notes.append(f"datasheet spec forced by hardware.name={want!r}")
        if spec.uncertain:
            p.notes.append(f"{spec.key}: {spec.uncertain}")
        if p.peak_tflops is None:
            p.notes.append(f"{spec.name} has no datasheet {dt} rate")
        if dt == "fp32" and not name.lower().startswith("cpu"):
            p.notes.append("fp32 peak is the non-tensor FP32 rate; with TF32 matmuls allowed the tf32 rate "
                           f"({spec.peak('tf32')} TFLOP/s) applies to GEMMs")
    else:
        p.source = "unknown device: no datasheet peak (calibrated ceilings only)"
        if is_mig(lookup):
            p.notes.append("MIG slice: the full GPU's datasheet peak does not apply")
        p.notes.append(f"device {lookup!r} is not in the datasheet table: reported as unknown, "
                       "efficiencies use calibrated ceilings only")
    ov_tf, ov_bw = _num(hw.peak_tflops), _num(hw.mem_bw_gbs)
    if ov_tf is not None:
        p.peak_tflops = ov_tf
        p.notes.append(f"peak {dt} TFLOP/s overridden by config: {ov_tf:g}")
        p.source += " + config override"
    if ov_bw is not None:
        p.mem_bw_gbs = ov_bw
        p.notes.append(f"memory bandwidth overridden by config: {ov_bw:g} GB/s")
        if "override" not in p.source:
            p.source += " + config override"
    if calibration:
        p.cal_tflops = _num(calibration.get("gemm_tflops"))
        p.cal_gbs = _num(calibration.get("copy_gbs"))
        p.cal_read_gbs = _num(calibration.get("read_gbs"))
        p.cal_dtype = calibration.get("gemm_dtype")
        p.cal_source = calibration.get("path") or "calibration record"
        if p.cal_dtype and p.cal_dtype != dt:
            p.notes.append(f"calibrated GEMM ceiling was measured in {p.cal_dtype}, the run uses {dt}")
    return p


__all__ = ["DeviceSpec", "SPECS", "DTYPES", "Peaks", "match_device", "is_mig", "resolve_peaks", "norm_dtype",
           "hardware_config", "cpu_name",
           "device_name_of", "slug"]
