"""Stage summaries, kernel categories and attribution (CPU; a GPU variant runs on CUDA only)."""
import contextlib
import types

import pandas as pd
import pytest
import torch

from harness.measure.kernels import categorize

ROOT = __import__("pathlib").Path(__file__).resolve().parents[1]


@pytest.fixture
def tiny_model_cfg():
    import yaml
    from harness.config import ModelConfig, from_dict

    return from_dict(ModelConfig, yaml.safe_load((ROOT / "conf/model/tiny.yaml").read_text()))


@pytest.fixture
def tiny_mode():
    return {"name": "t", "base_size": 128, "image_size": 64, "crop": True}
from harness.measure.observations import busy_ms, stage_rows
from harness.schema.stages import CALL_ALL, DTYPES, OBSERVATION_COLUMNS, frame
from harness.measure.summary import summarize


@pytest.mark.parametrize("name,cat", [
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", "gemm"),
    ("nvjet_tst_128x64_64x8_1x2_h_bz_coopA_TNT", "gemm"),
    ("pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128, 64, 4>>", "attention"),
    ("fmha_cutlassF_bf16_aligned_64x64_rf_sm80", "attention"),
    ("void at::native::vectorized_layer_norm_kernel<c10::BFloat16, float>", "norm"),
    ("void at::native::(anonymous namespace)::cunn_SoftMaxForward<4, float>", "softmax/reduce"),
    ("void at::native::direct_copy_kernel_cuda(at::TensorIteratorBase&)", "copy/cast"),
    ("void at::native::index_elementwise_kernel<128, 4>", "moe routing/indexing"),
    ("void at::native::sbtopk::gatherTopK<float, unsigned int, 2, false>", "moe routing/indexing"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::silu_kernel>", "activation/elementwise"),
    ("Memset (Device)", "memset"),
    ("cudnn::detail::implicit_convolve_sgemm", "conv"),
    ("void at::elementwise_kernel<128, 4, at::gpu_kernel_impl_nocast<at::CUDAFunctor_add<float>>>",
     "activation/elementwise"),
    ("some_unknown_kernel", "other"),
    ("_gate_up_silu_kernel", "gemm"),                 # the harness's routed-expert GEMVs (fast_moe_triton)
    ("_rows_down_weighted_kernel", "gemm"),
    ("_down_kernel", "gemm"),                         # the fused decode step's down projection
    ("_qkv_rope_kernel", "gemm"),                     # its q/k/v GEMV (and gemv_triton's)
    ("_lm_head_argmax_kernel", "gemm"),               # its lm_head GEMV with the greedy token
    ("_split_kernel", "attention"),                   # the split-KV decode attention
    ("_combine_kernel", "attention"),
    ("_rel_bias_fwd", "attention"),                   # SAM's attention with the rel-pos bias inside
    ("_attention_kernel", "attention"),               # the fused step's attention
    ("_align_kernel", "moe routing/indexing"),        # the MoE row alignment
    ("_route_align_kernel", "moe routing/indexing"),  # the router's choice with the alignment
    ("_router_kernel", "moe routing/indexing"),       # the fused step's router
    ("_topk_kernel", "moe routing/indexing"),
    ("_pil_pass", "other"),                           # the device resize: none of these
])
def test_categorize(name, cat):
    assert categorize(name) == cat


def test_gemms_of_the_moe_container_are_the_routed_experts():
    """Grouped MoE launches the experts' GEMVs from the MoE container (its experts' modules are not
    called): those kernels count as moe_routed / matmul, the container's routing kernels stay routing."""
    from harness.measure.kernels import categorize, routed_expert_gemms
    from harness.schema.kernels import KERNEL_COLUMNS

    names = ["_gate_up_silu_kernel", "void at::native::index_elementwise_kernel<128, 4>", "_down_weighted_kernel",
             "gemv_in_a_dense_mlp"]
    groups = ["routing/indexing", "routing/indexing", "routing/indexing", "matmul"]
    families = ["", "", "", "dense_mlp"]
    df = pd.DataFrame([{**dict.fromkeys(KERNEL_COLUMNS), "name": n, "category": categorize(n), "op_group": g,
                        "family": f, "module": "llm.layers.1.mlp"} for n, g, f in zip(names, groups, families)])
    out = routed_expert_gemms(df)
    assert list(out["op_group"]) == ["matmul", "routing/indexing", "matmul", "matmul"]
    assert list(out["family"]) == ["moe_routed", "", "moe_routed", "dense_mlp"]
    assert list(df["op_group"]) == groups                    # the input frame is left as it was


def test_busy_is_union_of_intervals():
    k = pd.DataFrame({"start_ms": [0.0, 0.5, 3.0], "dur_ms": [1.0, 1.0, 0.25]})
    assert busy_ms(k) == pytest.approx(1.75)
    assert busy_ms(k.iloc[:0]) == 0.0


def _ranges():
    rows = [("request", None, None, 0, 100), ("sam", 0, None, 0, 10), ("clip", 0, None, 10, 20),
            ("projector", 0, None, 30, 1), ("prefill", None, None, 31, 19), ("decode", None, None, 50, 50)]
    rows += [("decode_step", None, i, 50 + 10 * i, 10) for i in range(5)]
    return pd.DataFrame([{"range": n, "stage": n, "call": c, "step": s, "host_start_ms": t, "host_ms": d,
                          "gpu_start_ms": t, "gpu_ms": d, "peak_mem_bytes": None,
                          "wall_start_ns": t * 10**6, "wall_end_ns": (t + d) * 10**6} for n, c, s, t, d in rows])


def test_stage_rows_reconcile_and_request_metrics():
    k = pd.DataFrame({"stage": ["sam", "sam", "decode", None], "call": [0, 0, None, None],
                      "start_ms": [0.0, 5.0, 60.0, 99.0], "dur_ms": [4.0, 4.0, 5.0, 1.0]})
    rows = {(r["stage"], r["call"]): r for r in stage_rows(_ranges(), k, batch=2)}
    req = rows[("request", CALL_ALL)]
    assert req["e2e_ms"] == 100 and req["stage_sum_ms"] == 100
    assert req["ttft_ms"] == 50                      # prefill ends at 50 ms
    assert req["tpot_p50_ms"] == 10
    assert req["decode_tok_s"] == pytest.approx(2 * 5 / 0.050)
    assert req["attributed_fraction"] == pytest.approx(13 / 14)
    sam = rows[("sam", CALL_ALL)]
    assert sam["kernels"] == 2 and sam["busy_ms"] == 8 and sam["idle_ms"] == 2
    assert rows[("decode", CALL_ALL)]["launches_per_step"] == pytest.approx(1 / 5)


def test_aggregate_statistics():
    """Mean 12, std (ddof 1) sqrt((4 + 0 + 4) / 2) = 2, cv 2 / 12 over three timed repeats; the
    profiled request (busy 9) gives the mean and median rows idle = 12 - 9 = 3."""
    obs = frame([{"case": "c", "mode": "m", "batch": 1, "stage": "sam", "call": CALL_ALL, "calls": 1, "repeat": r,
                  "profiled": False, "timer": "cuda_event", "gpu_ms": v} for r, v in enumerate([10.0, 12.0, 14.0])]
                + [{"case": "c", "mode": "m", "batch": 1, "stage": "sam", "call": CALL_ALL, "calls": 1, "repeat": 3,
                    "profiled": True, "timer": "cuda_event", "gpu_ms": 30.0, "busy_ms": 9.0, "kernels": 4}])
    agg = summarize(obs).aggregates.set_index("statistic")
    assert agg.loc["mean", "gpu_ms"] == 12.0 and agg.loc["median", "gpu_ms"] == 12.0
    assert agg.loc["std", "gpu_ms"] == pytest.approx(2.0)
    assert agg.loc["cv", "gpu_ms"] == pytest.approx(2.0 / 12.0)
    assert (agg.loc["min", "gpu_ms"], agg.loc["max", "gpu_ms"]) == (10.0, 14.0)
    assert agg.loc["median", "idle_ms"] == 3.0 and agg.loc["mean", "kernels"] == 4
    assert (agg["repeats"] == 3).all() and agg["call"].dtype == "int64"


def test_observations_are_typed():
    obs = frame([{"case": "c", "stage": "sam", "call": CALL_ALL, "repeat": 0, "profiled": False, "gpu_ms": 1.0}])
    assert list(obs.columns) == OBSERVATION_COLUMNS
    assert {c: str(obs[c].dtype) for c in ("repeat", "call", "profiled", "gpu_ms", "busy_ms")} == \
        {"repeat": "int64", "call": "int64", "profiled": "bool", "gpu_ms": "float64", "busy_ms": "float64"}
    assert set(DTYPES) == set(OBSERVATION_COLUMNS)


def _tiny_case(device, tiny_model_cfg, tiny_mode, at=lambda request: None, model_out=None, **measure):
    """measure_case of the tiny model on one synthetic page, 5 decode tokens (``measure``: MeasureConfig
    fields, default no warm-up, 2 timed repeats, kernel capture; ``model_out``: a list the model is
    appended to)."""
    from harness import workload as wl
    from harness.measure.runner import MeasureConfig, measure_case
    from harness.models.build import build_model

    dtype = torch.float32
    model = build_model(tiny_model_cfg, device, dtype, seed=0)
    if model_out is not None:
        model_out.append(model)
    pages = [wl.Page("p", wl.synthetic_page(0, size=(300, 200)), "synthetic:0")]

    def make(i):
        return wl.build_request(pages, tiny_mode, decode_tokens=5).to(device, dtype)

    mcfg = MeasureConfig(**{"warmup": 0, "repeats": 2, "kernels": True, **measure})
    return measure_case(model, make, mcfg, {"case": "t", "mode": "t", "grid": None, "batch": 1},
                        device.type == "cuda", progress=lambda m: None, at=at)


def _check_case(measured, timed_col):
    stages, kernels, routing = measured.observations, measured.kernels, measured.routing
    profiled = stages[stages["profiled"] & (stages["call"] == CALL_ALL)].set_index("stage")
    assert set(["sam", "clip", "projector", "prefill", "decode", "request"]) <= set(profiled.index)
    assert profiled.loc["request", "attributed_fraction"] >= 0.99
    assert len(kernels) and set(kernels["stage"].dropna()) >= {"sam", "clip", "projector", "prefill", "decode"}
    timed = stages[~stages["profiled"]]
    req = timed[timed["stage"] == "request"]
    assert len(req) == 2 and (req[timed_col] > 0).all()
    # observations only: the timed repeats 0 and 1, then the profiled request as repeat 2
    assert set(stages["repeat"]) == {0, 1, 2} and set(stages.loc[stages["profiled"], "repeat"]) == {2}
    assert list(stages.columns) == OBSERVATION_COLUMNS and stages["repeat"].dtype == "int64"
    assert routing["decode"].sum() > 0
    assert len(measured.steps) == 2 * 4 and measured.warmup["warmup_ms"] == []
    # issue 14: kernels attributed to modules, per-step routing, clipped timed idle
    groups = set(kernels["op_group"].dropna())
    assert {"matmul", "norm", "kv_cache", "routing/indexing", "rope"} <= groups, groups
    assert set(kernels.loc[kernels["op_group"] == "norm", "family"]) <= {"layernorm", "layernorm2d", "rmsnorm"}
    assert (kernels.loc[kernels["op_group"] == "kv_cache", "module"].str.endswith(".self_attn.kv_cache")).all()
    assert (routing["decode_steps"].sum(axis=0) == routing["decode"]).all() and routing["decode_steps"].shape[0] == 4
    med = summarize(stages).stages
    assert len(med) and med["busy_ms"].notna().all() and (med["idle_ms"] >= 0).all()


def test_measure_case_cpu(tiny_model_cfg, tiny_mode):
    measured = _tiny_case(torch.device("cpu"), tiny_model_cfg, tiny_mode)
    _check_case(measured, "host_ms")
    assert measured.observations["gpu_ms"].isna().all()


def test_layer_ranges_hook_each_layer_once_per_case_and_range_only_the_timed_repeats(tiny_model_cfg, tiny_mode,
                                                                                    monkeypatch):
    """measure.layer_ranges: the tiny model has 7 layer modules (conf/model/tiny.yaml: 2 SAM blocks, 2
    CLIP layers, 3 decoder layers); over a case of 1 warm-up and 3 timed repeats each gets one pre-hook
    (7 registrations, not 7 per repeat) and none is left after the case. ``layer`` ranges are pushed in
    the timed repeats only, the same sequence in each (the one the hooks registered per repeat gave), every
    one popped."""
    from harness.measure.nvtx_ranges import NvtxRanges

    pytest.importorskip("nvtx")
    registered, pushed, where = [], [], ["set-up"]
    real_register, real_push, real_pop = (torch.nn.Module.register_forward_pre_hook, NvtxRanges.push,
                                          NvtxRanges.pop)
    monkeypatch.setattr(torch.nn.Module, "register_forward_pre_hook",
                        lambda self, *a, **k: registered.append(self) or real_register(self, *a, **k))

    def push(self, name, payload=None):   # returns None, as a hook must to leave the layer's inputs alone
        pushed.append((where[0], name, payload))
        real_push(self, name, payload)

    def pop(self):
        pushed.append((where[0], "pop", None))
        real_pop(self)

    monkeypatch.setattr(NvtxRanges, "push", push)
    monkeypatch.setattr(NvtxRanges, "pop", pop)
    models = []
    _tiny_case(torch.device("cpu"), tiny_model_cfg, tiny_mode, at=lambda request: where.__setitem__(0, request),
               model_out=models, warmup=1, repeats=3, kernels=False, steady_pct=0.0, layer_ranges=True)
    assert len(registered) == 2 + 2 + 3
    assert all(not m._forward_pre_hooks and not m._forward_hooks for m in models[0].modules())
    layer = {}
    for label, name, payload in pushed:
        if name == "layer":
            layer.setdefault(label, []).append(payload)
    assert sorted(layer) == ["repeat=0", "repeat=1", "repeat=2"]
    # per request: SAM's blocks 0, 1 and CLIP's layers 0, 1, each over the page's tiles and its global
    # view (4 passes of [0, 1]), then 5 decoder passes (prefill, 4 decode steps) of layers 0, 1, 2
    assert layer["repeat=0"] == layer["repeat=1"] == layer["repeat=2"] == [0, 1] * 4 + [0, 1, 2] * 5
    pops = sum(name == "pop" for _, name, _ in pushed)
    assert pops == sum(name != "pop" for _, name, _ in pushed)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_measure_case_gpu(tiny_model_cfg, tiny_mode):
    measured = _tiny_case(torch.device("cuda"), tiny_model_cfg, tiny_mode)
    _check_case(measured, "gpu_ms")
    stages = measured.observations
    req = stages[(stages["repeat"] == 0) & (stages["stage"] == "request")].iloc[0]
    assert abs(req["stage_sum_ms"] - req["gpu_ms"]) / req["gpu_ms"] < 0.01


def test_is_steady():
    from harness.measure.runner import is_steady

    assert not is_steady([100.0, 100.0], 2)            # fewer than three
    assert is_steady([300.0, 101.0, 100.0, 99.0], 2)   # only the last three count
    assert not is_steady([100.0, 103.0, 100.0], 2)     # 3% from the median
    assert is_steady([100.0, 102.0, 100.0], 2)


class _ScriptedModel:
    """A model adapter whose every request advances a fake clock by the next scripted duration (s)."""

    cfg, info = None, {}

    def __init__(self, durations):
        self.durations = list(durations)
        self.now = 0.0
        self.calls = 0

    def routing_counter(self):
        from harness.models.routing import RoutingCounter
        return RoutingCounter(1, 1)

    @contextlib.contextmanager
    def running(self, req, max_new_tokens, counter):
        yield types.SimpleNamespace(nbytes=lambda: 0)

    def first_token(self, req, cache, stage, select):
        self.now += self.durations[self.calls]
        self.calls += 1
        return torch.zeros(1, 1, dtype=torch.long)

    def clock(self):
        return self.now


@pytest.mark.parametrize("steady,max_warmup,durations,expect_n,expect_steady", [
    (0.0, 8, [5, 4, 3], 2, None),                       # off: exactly `warmup`
    (2.0, 8, [5, 4, 3, 3, 3, 9], 5, True),              # stops once 3, 3, 3
    (2.0, 4, [5, 4, 3, 2, 1, 1, 1], 4, False),          # capped, never steady
])
def test_warm_up_until_steady(steady, max_warmup, durations, expect_n, expect_steady):
    from harness.measure.runner import MeasureConfig, warm_up

    m = _ScriptedModel(durations)
    cfg = MeasureConfig(warmup=2, steady_pct=steady, max_warmup=max_warmup).resolved(False)
    out = warm_up(m, lambda i: types.SimpleNamespace(decode_tokens=1, pages=[f"p{i}"], input_ids=torch.zeros(1, 1)), cfg, False, lambda msg: None, "c",
                  clock=m.clock)
    assert m.calls == expect_n and out["warmup_ms"] == [d * 1e3 for d in durations[:expect_n]]
    assert out["steady"] is expect_steady


def test_measure_defaults_per_device():
    from harness.measure.runner import MeasureConfig

    gpu, cpu = MeasureConfig().resolved(True), MeasureConfig().resolved(False)
    assert (gpu.warmup, gpu.repeats, gpu.steady_pct) == (2, 5, 0.0)
    assert (cpu.warmup, cpu.repeats, cpu.steady_pct) == (0, 1, 0.0)
    assert MeasureConfig(warmup=4, repeats=9).resolved(True).warmup == 4


def test_recorder_finish_is_kept():
    from harness.measure.recorder import StageRecorder

    rec = StageRecorder(cuda=False)
    with rec("request"):
        with rec("sam", call=0):
            pass
    first = rec.finish()
    assert list(first["range"]) == ["request", "sam"] and rec.finish() is first


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_recorder_reuses_events_across_requests():
    from harness.measure import recorder as rmod

    x = torch.ones(1024, 1024, device="cuda")
    for _ in range(2):
        rec = rmod.StageRecorder(cuda=True)
        with rec("request"):
            for i in range(3):
                with rec("decode_step", step=i):
                    x @ x
        df = rec.finish()
        assert (df["gpu_ms"] > 0).all() and len(df) == 4
        assert len(rmod._EVENTS) >= 8          # 4 ranges x 2 events went back to the pool


def test_kineto_usdt_lines_are_dropped_from_stderr(capfd):
    """torch's kineto prints 'USDT:... profiler_start/stop' on file descriptor 2 at each capture:
    dropped; any other line written there meanwhile still reaches stderr."""
    import os

    from harness.measure.kernels import KernelCapture, usdt_lines_dropped

    capfd.readouterr()
    with usdt_lines_dropped():
        os.write(2, b"USDT:2026-01-01 00:00:00 1:1 SyncActivityProfilerHandler.cpp:52] profiler_start\nkept line\n")
    with KernelCapture(cuda=False):
        torch.ones(3).sum()
    assert capfd.readouterr().err == "kept line\n"


def _Event(name, start, end, thread=1, device="cpu", annotation=False, asynchronous=False):  # noqa: N802
    """A kineto event as ``kernel_sums`` reads it: name, [start, end) in ns, thread, device (its accessors)."""
    kind = torch.autograd.DeviceType.CUDA if device == "cuda" else torch.autograd.DeviceType.CPU
    fields = dict(name=name, start_ns=start, end_ns=end, duration_ns=end - start, start_thread_id=thread,
                  end_thread_id=thread, device_type=kind, is_user_annotation=annotation, is_async=asynchronous)
    return types.SimpleNamespace(**{k: (lambda v=v: v) for k, v in fields.items()})


def _capture(events):
    return types.SimpleNamespace(kineto_results=types.SimpleNamespace(events=lambda: list(events)))


def test_kernel_sums_cpu_operators_by_self_time():
    """Without CUDA: per operator name, calls and self time (duration less the nested operators' on the
    same thread), worked out by hand from the intervals (µs); an operator nested in itself as its only child
    (a redispatch) is one call; annotations, async operators and names of zero self time are left out."""
    from harness.measure.kernels import kernel_sums

    us = 1000
    events = [  # listed out of order: the capture does not promise start order
        _Event("aten::linear", 200 * us, 260 * us),           # children: addmm (40) -> self 20
        _Event("aten::addmm", 210 * us, 250 * us),            # leaf -> 40
        _Event("harness::sam#0", 0, 400 * us, annotation=True),
        _Event("aten::linear", 0, 100 * us),                   # children: t (10), addmm (70) -> self 20
        _Event("aten::t", 5 * us, 15 * us),                    # leaf -> 10
        _Event("aten::addmm", 20 * us, 90 * us),               # one child, itself: one call -> self 10
        _Event("aten::addmm", 25 * us, 85 * us),               # child: copy_ (10) -> self 50
        _Event("aten::copy_", 30 * us, 40 * us),               # leaf -> 10
        _Event("aten::mm", 10 * us, 50 * us, thread=2),        # inside linear's time, another thread -> 40
        _Event("aten::wrapper", 300 * us, 310 * us),           # its one child fills it -> self 0, left out
        _Event("aten::zero_", 300 * us, 310 * us),             # -> 10
        _Event("aten::async_op", 500 * us, 900 * us, asynchronous=True),
    ]
    got = kernel_sums(_capture(events), cuda=False)
    want = {"aten::linear": [2, 0.040], "aten::t": [1, 0.010], "aten::addmm": [2, 0.100],
            "aten::copy_": [1, 0.010], "aten::mm": [1, 0.040], "aten::zero_": [1, 0.010]}
    assert got.keys() == want.keys()
    for name, (n, ms) in want.items():
        assert got[name][0] == n, name
        assert got[name][1] == pytest.approx(ms, abs=1e-12), name


def test_kernel_sums_cuda_kernels_by_duration():
    """On CUDA: every GPU kernel / memcpy / memset summed by name (ms, durations); host events (the launch
    calls) are not kernels."""
    from harness.measure.kernels import kernel_sums

    events = [_Event("k1", 0, 1000, device="cuda"), _Event("cudaLaunchKernel", 0, 200),
              _Event("Memcpy HtoD (Pageable -> Device)", 1500, 2000, device="cuda"),
              _Event("k1", 3000, 6000, device="cuda"), _Event("k2", 7000, 7250, device="cuda")]
    got = kernel_sums(_capture(events), cuda=True)
    assert got == {"k1": [2, pytest.approx(0.004)], "Memcpy HtoD (Pageable -> Device)": [1, pytest.approx(0.0005)],
                   "k2": [1, pytest.approx(0.00025)]}


def test_kernel_sums_agrees_with_torch_profiler_key_averages():
    """On one real CPU capture, ``kernel_sums`` gives what torch.profiler's own event tree gives
    (``key_averages``: count, self CPU time), including the redispatched antialiased resize."""
    from torch.nn import functional as F
    from torch.profiler import ProfilerActivity, profile

    from harness.measure.kernels import kernel_sums

    x, w, b = torch.randn(4, 16), torch.randn(8, 16), torch.randn(8)
    img = torch.randn(1, 3, 32, 32)
    with torch.inference_mode(), profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(3):
            F.linear(x, w, b).relu_()
        F.interpolate(img, size=(12, 12), mode="bicubic", antialias=True)
    want = {e.key: (e.count, e.self_cpu_time_total / 1e3) for e in prof.key_averages() if e.self_cpu_time_total > 0}
    got = kernel_sums(prof.profiler, cuda=False)
    assert got.keys() == want.keys() and got["aten::linear"][0] == 3
    for name, (n, ms) in want.items():
        assert got[name][0] == n, name
        assert got[name][1] == pytest.approx(ms, abs=1e-6), name
