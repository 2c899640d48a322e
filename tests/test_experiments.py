"""Every experiment in conf/experiment composes through Hydra and yields cases that
harness.setup.prepare_cases accepts (pages load, layouts validate; no model is built)."""
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from harness.config import ModelConfig, from_dict, to_config
from harness.errors import HarnessError
from harness.setup import prepare_cases
from harness.layout import get_mode, image_token_count, select_grid, tile_grid_for

CONF = Path(__file__).resolve().parents[1] / "conf"
EXPERIMENTS = sorted(p.stem for p in (CONF / "experiment").glob("*.yaml"))
#: experiments that measure something other than cases (their own test below)
PIPELINES = ("throughput",)


def _compose(overrides, hydra_cfg=False):
    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        return compose("config", overrides=overrides, return_hydra_config=hydra_cfg)


def _cases(name):
    composed = _compose([f"+experiment={name}"])
    plain = OmegaConf.to_container(composed, resolve=True)
    assert plain["experiment_name"] == name and plain["run"]["name"] == name
    cases, _ = prepare_cases(to_config(composed))
    return plain, cases


def test_expected_experiments_exist():
    assert {"crop_mode", "gundam_grids", "batch", "decode_len", "attention"} <= set(EXPERIMENTS)


@pytest.mark.parametrize("name", [e for e in EXPERIMENTS if e not in PIPELINES])
def test_experiment_composes_and_prepares(name):
    plain, cases = _cases(name)
    assert len(cases) == len(plain["cases"]) >= 1
    assert len({c.name for c in cases}) == len(cases)
    for c in cases:
        assert c.case.image_tokens == image_token_count(c.case.mode, c.case.grid)


def test_throughput_composes_and_prepares(tmp_path):
    from harness.throughput.pipeline import prepare

    cfg = to_config(_compose(["+experiment=throughput", "workload.decode_tokens=512"]))
    setup = prepare(cfg, cuda=True, folder=tmp_path)     # the CUDA defaults; no model, no pool, no page drawn
    assert setup.settings.batches == (1, 8, 32, 64) and len(setup.sources) == 256
    assert set(setup.layouts) == {None}                  # base mode: one layout, every page in every batch size
    # base: 273 image tokens + BOS + 12 text tokens; cache = 286 + 512 rounded up to a multiple of 64
    assert setup.layouts[None].seq == 286 and setup.cache_len == 832


def test_gundam_grids_select_the_named_grids():
    plain, cases = _cases("gundam_grids")
    want = [(1, 2), (2, 2), (2, 3), (3, 3), (1, 9)]
    gundam = get_mode("gundam")
    for case, ov, grid in zip(cases, plain["cases"], want):
        w, h = ov["page_size"]
        assert select_grid(w, h, gundam.image_size) == grid
        assert tile_grid_for(w, h, gundam) == grid
        assert case.case.grid == grid and case.name == f"gundam-{grid[0]}x{grid[1]}"
    assert [c.case.image_tokens for c in cases] == [273 + (10 * c + 1) * (10 * r) for c, r in want]


def test_batch_and_decode_len_values():
    _, cases = _cases("batch")
    assert [c.case.batch for c in cases] == [1, 2, 4, 8]
    assert [c.name for c in cases] == ["base", "base-b2", "base-b4", "base-b8"]
    _, cases = _cases("decode_len")
    assert [c.case.decode_tokens for c in cases] == [128, 512, 1024, 2048]
    assert all(c.case.mode.name == "base" for c in cases)


def test_attention_is_a_hydra_sweep():
    cfg = _compose(["+experiment=attention"], hydra_cfg=True)
    values = str(cfg.hydra.sweeper.params["model.attn_implementation"]).split(",")
    assert values == ["eager", "sdpa", "sdpa_flash"]
    for v in values:   # every swept value composes into a valid model config
        c = _compose(["+experiment=attention", f"model.attn_implementation={v}"])
        assert from_dict(ModelConfig, OmegaConf.to_container(c.model, resolve=True)).attn_implementation == v


def test_long_decode_and_vendor_paths():
    _, cases = _cases("decode_len_long")
    assert [(c.name, c.case.decode_tokens) for c in cases] == [("base-d7906", 7906)]   # 286 + 7906 = 8192 positions
    _, cases = _cases("vendor_paths")
    assert [(c.name, c.case.decode_tokens, c.case.mode.name) for c in cases] == [
        ("base-d128", 128, "base"), ("base-d2048", 2048, "base")]
    cfg = _compose(["+experiment=vendor_paths", "model=vendor"], hydra_cfg=True)
    values = str(cfg.hydra.sweeper.params["model.vendor_loop"]).split(",")
    assert values == ["ours", "hf_generate"]
    for v in values:   # the sweep is valid for the vendor model, refused for the reference
        assert to_config(_compose(["+experiment=vendor_paths", "model=vendor", f"model.vendor_loop={v}"])) \
            .model.vendor_loop == v
    with pytest.raises(HarnessError, match="model=vendor only"):
        to_config(_compose(["+experiment=vendor_paths", "model.vendor_loop=hf_generate"]))
