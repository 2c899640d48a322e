"""The vendor model on ``flash_attention_2`` (issue 36): refused where it cannot run, and its bf16
logits against vendor eager and the reference model on a GPU.

CPU tests (CI): ``flash_attention_2`` on a CPU device is one ``error:`` line, exit 2, before any
model is built; where flash-attn does not import, the line names the set-up step
(``scripts/flash_attn_wheel.py``).

GPU test (markers ``gpu`` and ``vendor``; ``HARNESS_VENDOR_DIR`` and flash-attn installed)::

    HARNESS_VENDOR_DIR=models/deepseek-ocr pytest -q -s tests/test_vendor_flash.py -m gpu

One synthetic base-mode page, bf16, seeded random weights shared by all three models (built one at a
time): the reference model decodes 64 greedy steps; vendor eager and vendor flash_attention_2 are fed
the same tokens (teacher forcing). Printed per pair: max |logit difference| over the prefill's last
position and the 64 steps, the relative error, and the first step whose argmax differs.
"""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from harness.attn_support import FLASH_ATTN_SETUP, check_flash_attn
from harness.errors import HarnessError

STEPS = 64


def test_flash_attention_on_a_cpu_is_refused_before_any_model(tmp_path):
    res = subprocess.run([sys.executable, "-m", "harness", "run", "model=tiny", "device=cpu",
                          "model.attn_implementation=flash_attention_2", f"run.root={tmp_path}"],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 2
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: model.attn_implementation=flash_attention_2")
    assert "device is cpu" in lines[0]
    assert not any(tmp_path.iterdir())      # refused with the config: no run directory, no model


def test_missing_flash_attn_names_the_set_up_step(monkeypatch):
    import builtins

    real = builtins.__import__

    def no_flash(name, *args, **kwargs):
        if name.startswith("flash_attn"):
            raise ImportError(f"No module named '{name}'")
        return real(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_flash)
    with pytest.raises(HarnessError) as exc:
        check_flash_attn("flash_attention_2", "cuda")
    assert "not importable" in exc.value.problem and FLASH_ATTN_SETUP in exc.value.fix
    check_flash_attn("eager", "cpu")          # other implementations are not this check's business
    check_flash_attn("sdpa", "cuda")


def test_set_up_step_exists():
    from pathlib import Path

    script = Path(__file__).resolve().parent.parent / FLASH_ATTN_SETUP.split()[-1]
    assert script.is_file()


# ----------------------------------------------------------------------------------- GPU parity

def _max_abs(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max())


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm())


def _first_divergence(a: list, b: list):
    for i, (x, y) in enumerate(zip(a, b)):
        if not torch.equal(x[:, -1].argmax(-1), y[:, -1].argmax(-1)):
            return i
    return None


@pytest.mark.gpu
@pytest.mark.vendor
@torch.inference_mode()
def test_vendor_flash_attention_bf16_teacher_forced():
    import os

    from harness.models.build import build_model
    from harness.models.llm import KVCache
    from harness.models.vendor import loader as V
    from harness import workload as W

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    raw = os.environ.get("HARNESS_VENDOR_DIR")
    if not raw:
        pytest.skip("HARNESS_VENDOR_DIR is not set")
    check_flash_attn("flash_attention_2", "cuda")
    dev, dt = torch.device("cuda"), torch.bfloat16
    vdir = V.check_vendor_dir(raw)
    req = W.build_request(W.load_pages(None, pages=1, seed=0), "base", decode_tokens=STEPS + 1)

    ref = build_model(V.vendor_reference_config(vdir, "eager", trust_remote_code=True), dev, dt, seed=0)
    img = ref.image_embeddings(req.global_views.to(dev, dt), None, req.grid)
    cache = KVCache(ref.cfg.llm.num_layers)
    logits = [ref.prefill(req.input_ids.to(dev), req.images_seq_mask.to(dev), img, cache)[:, -1:].float().cpu()]
    tokens = [logits[0][:, -1].argmax(-1, keepdim=True).to(dev)]
    for _ in range(STEPS):
        out = ref.decode_step(tokens[-1], cache)
        logits.append(out[:, -1:].float().cpu())
        tokens.append(out[:, -1].argmax(-1, keepdim=True))
    del ref, cache, img
    torch.cuda.empty_cache()

    runs = {"reference": logits}
    for attn in ("eager", "flash_attention_2"):
        vend = V.load_vendor(vdir, dev, dt, attn, seed=0, trust_remote_code=True)
        assert vend.info["attn_implementation"] == attn
        vcache = vend.new_cache()
        out = [vend.prefill(req, vcache)[:, -1:].float().cpu()]
        out += [vend.decode_step(tokens[i], vcache)[:, -1:].float().cpu() for i in range(STEPS)]
        runs[attn] = out
        del vend, vcache
        torch.cuda.empty_cache()

    print(f"\nbf16, base page, prefill last position + {STEPS} teacher-forced steps, {torch.cuda.get_device_name()}")
    pairs = (("flash_attention_2", "eager"), ("flash_attention_2", "reference"), ("eager", "reference"))
    for a, b in pairs:
        A, B = torch.cat(runs[a], 1), torch.cat(runs[b], 1)
        print(f"  vendor {a} vs {b:<10} max |logit diff| {_max_abs(A, B):.4f}  rel err {_rel(A, B):.3e}  "
              f"first greedy divergence: {_first_divergence(runs[a], runs[b])}")
    A, B = torch.cat(runs["flash_attention_2"], 1), torch.cat(runs["eager"], 1)
    assert B.abs().max() > 0 and _rel(A, B) < 5e-2     # bf16 rounding of one attention kernel, not another function


def test_infer_without_a_tokenizer_is_refused_before_any_run_directory(tmp_path):
    """model=vendor model.vendor_entry=infer on a vendor directory without tokenizer.json, on a CPU:
    one `error:` line naming the rebuild step, exit 2, no run directory (so no model either)."""
    from harness.models.vendor.loader import VENDOR_CODE_FILES

    vdir = tmp_path / "vendor"
    vdir.mkdir()
    for f in VENDOR_CODE_FILES:
        (vdir / f).write_text("{}")
    runs = tmp_path / "runs"
    res = subprocess.run([sys.executable, "-m", "harness", "run", "model=vendor", f"model.path={vdir}",
                          "model.trust_remote_code=true", "model.vendor_entry=infer", "device=cpu",
                          f"run.root={runs}"], capture_output=True, text=True, timeout=120)
    assert res.returncode == 2, res.stderr
    lines = [ln for ln in res.stderr.splitlines() if ln.strip() and not ln.startswith("[harness] model=vendor runs")]
    assert len(lines) == 1 and lines[0].startswith("error: model.vendor_entry=infer calls the vendor's infer(), which "
                                                   "needs the snapshot's tokenizer, but there is none")
    assert "python -m harness.models.vendor.tokenizer_rebuild --out" in lines[0]
    assert not runs.exists()
