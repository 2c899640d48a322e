"""harness.setup: what cannot run here is refused before anything is allocated (issue 15)."""
from __future__ import annotations

import dataclasses
import types

import pytest
import torch

from harness import setup
from harness.config import ModelConfig
from harness.errors import HarnessError


def test_cuda_index_beyond_the_visible_gpus_is_refused(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(HarnessError) as exc:
        setup.resolve_device("cuda:7")
    assert str(exc.value) == "device cuda:7 does not exist (1 GPU(s) visible); fix: pick an index below 1"
    assert setup.resolve_device("cuda:0") == torch.device("cuda:0")


def test_device_info_reports_the_gpu_index(monkeypatch):
    """device=cuda:7 is recorded as GPU 7 of the visible ones, not as plain 'cuda'."""
    props = types.SimpleNamespace(total_memory=80 << 30, major=9, minor=0, multi_processor_count=132)
    asked = []
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: asked.append(i) or props)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i: f"GPU {i}")
    monkeypatch.setattr(setup.shutil, "which", lambda name: None)
    info = setup.device_info(torch.device("cuda:7"))
    assert (info["type"], info["index"], info["torch_device"], info["name"]) == ("cuda", 7, "cuda:7", "GPU 7")
    assert asked == [7]


@pytest.fixture
def ckpt_missing_one(tmp_path, tiny_cfg):
    """A tiny-model model.safetensors with one tensor removed."""
    from safetensors.torch import load_file, save_file

    from harness.models.build import build_model, save_weights

    f = save_weights(build_model(tiny_cfg, seed=0), tmp_path)
    sd = load_file(str(f))
    del sd["model.layers.1.self_attn.q_proj.weight"]
    save_file(sd, str(f))
    return tmp_path


@pytest.fixture
def builds(monkeypatch):
    """The devices ``build_model`` is asked to build on, in order (the full-size model is never
    really built here: that would take 13 GB)."""
    from harness.models import build

    devices, real = [], build.build_model

    def spy(cfg, device="cpu", *args, **kwargs):
        devices.append(str(device))
        if str(device) != "meta" and cfg.llm.hidden_size == ModelConfig().llm.hidden_size:
            raise AssertionError(f"the full model was allocated on {device}")
        return real(cfg, device, *args, **kwargs)

    monkeypatch.setattr(build, "build_model", spy)
    return devices


def test_bad_checkpoint_counts_the_models_own_tensors(tiny_cfg, ckpt_missing_one, builds):
    mcfg = dataclasses.replace(tiny_cfg, weights="path", path=str(ckpt_missing_one))
    with pytest.raises(HarnessError) as exc:
        setup.load_adapter(mcfg, torch.device("cpu"), torch.float32, 0)
    assert exc.value.problem == (f"checkpoint in {ckpt_missing_one} does not match the model: "
                                 "1 missing (model.layers.1.self_attn.q_proj.weight)")
    assert exc.value.fix == "point model.path at a checkpoint of this model (152 tensors)"
    assert builds == ["meta"]


def test_bad_checkpoint_on_the_full_model_is_found_before_allocating_it(ckpt_missing_one, builds):
    """The full model (3.3 B parameters, 13 GB in fp32) is only ever built on meta here."""
    mcfg = ModelConfig(weights="path", path=str(ckpt_missing_one))
    with pytest.raises(HarnessError) as exc:
        setup.load_adapter(mcfg, torch.device("cpu"), torch.float32, 0)
    assert exc.value.fix == "point model.path at a checkpoint of this model (2,710 tensors)"
    assert builds == ["meta"]
