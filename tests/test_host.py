"""Host-steadiness probe (measure.host)."""
from harness.measure import host


def test_probe_cpu_shape():
    p = host.probe(cuda=False, n=20)
    py = p["python"]
    assert py["n"] == 20 and 0 < py["min_ms"] <= py["median_ms"] <= py["max_ms"] and py["cv_pct"] >= 0
    assert p["launch"] is None and p["launch_reason"] == "no CUDA device"


def test_describe():
    stats = {"median_ms": 0.61, "cv_pct": 1.25, "min_ms": 0.6, "max_ms": 0.7, "n": 100}
    assert host.describe({"python": stats, "launch": None, "launch_reason": "no CUDA device"}) == \
        "Python loop CV 1.2% (median 0.61 ms); launch loop not run (no CUDA device)"
    assert host.describe({"python": stats, "launch": {**stats, "cv_pct": 3.44, "median_ms": 1.42}}) == \
        "Python loop CV 1.2% (median 0.61 ms); 200 launches + sync CV 3.4% (median 1.42 ms)"
