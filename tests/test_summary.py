"""The one summarizer (``harness.measure.summary``) on checked-in observations, every expected value
derived by hand below; the old stages.csv layout (aggregate rows beside the repeats) converted on
read (``harness.schema.stages.typed``), checked on the fixture runs."""
import json
from pathlib import Path

import pandas as pd
import pytest

from harness.schema.stages import (CALL_ALL, LEGACY_AGGREGATES, NotObservations, OBSERVATION_COLUMNS, read_observations,
                                   typed)
from harness.measure.summary import MEASURED_COLUMNS, summarize
from harness.schema.headline import HEADLINE_COLUMNS, SUMMARY_COLUMNS
from harness.rundir import load_run

DATA = Path(__file__).resolve().parent / "data"


@pytest.fixture
def obs():
    """tests/data/observations/stages.csv: case c, batch 2, five timed repeats and the profiled one.

    repeat:           0     1     2     3     4   | profiled (repeat 5)
    request e2e ms:  50    40    60    45    55   | 95 (busy 20)
    sam GPU ms:       5     6     4     7     8   |  9 (busy 3)
    decode GPU ms:   30    20    40    25    35   | 70 (busy 12, 900 kernels, 1 sync per step)
    decode tok/s:   100    90    80    95    85
    """
    return read_observations(DATA / "observations" / "stages.csv")


def test_observations_file_is_typed(obs):
    assert list(obs.columns) == OBSERVATION_COLUMNS and len(obs) == 18
    assert obs["repeat"].dtype == "int64" and obs["call"].dtype == "int64" and obs["profiled"].dtype == bool
    assert sorted(set(obs["repeat"])) == [0, 1, 2, 3, 4, 5] and set(obs.loc[obs["profiled"], "repeat"]) == {5}
    assert (obs["call"] == CALL_ALL).all()


def test_median_request_interval_and_idle_by_hand(obs):
    s = summarize(obs, {"c": 2})
    # e2e sorted 40 45 50 55 60: the median (odd count: the middle) is 50, taken by repeat 0
    assert s.median_repeat == {"c": 0}
    h = s.headline.set_index("case").loc["c"]
    assert list(s.headline.columns) == HEADLINE_COLUMNS
    assert h["repeat"] == 0 and h["repeats"] == 5 and h["warmup"] == 2 and h["timer"] == "cuda_event"
    assert h["e2e_ms"] == 50.0 and h["e2e_ms_min"] == 40.0 and h["e2e_ms_max"] == 60.0
    # every headline value is repeat 0's, not a per-column median: sam 5 (its own median is 6),
    # decode 30, tok/s 100 (median 90); pages/s = batch 2 x 1000 / 50 ms
    assert h["sam_ms"] == 5.0 and h["decode_ms"] == 30.0 and h["decode_tok_s"] == 100.0
    assert h["pages_s"] == 2 * 1000 / 50.0 and h["pages_s_min"] == 2000 / 60.0 and h["pages_s_max"] == 2000 / 40.0
    assert h["stage_sum_ms"] == 5.0 + 30.0 and h["ttft_stage_sum_ms"] == 5.0
    # bootstrap 95% interval of the median of 5: a resample's median (its 3rd smallest of 5 draws) is
    # the smallest value when at least 3 draws are: C(5,3)(1/5)^3(4/5)^2 + C(5,4)(1/5)^4(4/5) + (1/5)^5
    # = 0.0512 + 0.0064 + 0.00032 = 5.8% > 2.5%, so the lower end is the min, the upper the max
    tail = 10 * (1 / 5) ** 3 * (4 / 5) ** 2 + 5 * (1 / 5) ** 4 * (4 / 5) + (1 / 5) ** 5
    assert tail == pytest.approx(0.05792) and tail > 0.025
    assert (h["e2e_ms_ci_lo"], h["e2e_ms_ci_hi"]) == (40.0, 60.0)
    st = s.stages.set_index("stage")
    assert list(s.stages.columns) == MEASURED_COLUMNS
    # per stage: the median span of the timed repeats, busy from the profiled request, idle paired:
    # decode spans sorted 20 25 30 35 40 -> 30; busy 12 -> idle 18 = 60% of the span
    d = st.loc["decode"]
    assert (d["time_ms"], d["busy_ms"], d["idle_ms"], d["idle_fraction"]) == (30.0, 12.0, 18.0, 0.6)
    assert d["kernels"] == 900 and d["launches_per_step"] == 100 and d["syncs_per_step"] == 1.0
    assert (d["time_min_ms"], d["time_max_ms"], d["time_ci_lo_ms"], d["time_ci_hi_ms"]) == (20.0, 40.0, 20.0, 40.0)
    assert d["idle_basis"] == "median span of 5 timed repeats - kernel busy of the profiled request"
    # sam: spans 4 5 6 7 8 -> 6, busy 3 -> idle 3; its host span 5 6 7 8 9 -> 7
    assert (st.loc["sam", "time_ms"], st.loc["sam", "idle_ms"], st.loc["sam", "host_ms"]) == (6.0, 3.0, 7.0)
    # the profiled request's own stretched spans (decode 70) never enter: idle is not 70 - 12
    rq = st.loc["request"]
    assert rq["median_repeat"] == 0 and rq["decode_tok_s"] == 100.0 and rq["e2e_ms"] == 50.0
    assert rq["time_ms"] == 50.0 and rq["idle_ms"] == 50.0 - 20.0 and rq["attributed_fraction"] == 0.975
    # cv of decode: mean 30, sample std sqrt((100 + 25 + 0 + 25 + 100) / 4) = sqrt(62.5)
    assert d["cv"] == pytest.approx(62.5 ** 0.5 / 30)


def test_even_count_takes_the_lower_middle(obs):
    four = obs[obs["repeat"] != 4]                    # e2e 50 40 60 45 -> sorted 40 45 50 60: lower middle 45
    s = summarize(four)
    assert s.median_repeat == {"c": 3}
    assert s.headline.iloc[0]["e2e_ms"] == 45.0 and s.headline.iloc[0]["decode_ms"] == 25.0
    assert s.stages.set_index("stage").loc["decode", "time_ms"] == 25.0     # 20 25 30 40 -> 25


def test_aggregates_are_their_own_typed_table(obs):
    agg = summarize(obs).aggregates
    assert list(agg.columns) == SUMMARY_COLUMNS and agg["call"].dtype == "int64"
    dec = agg[agg["stage"] == "decode"].set_index("statistic")
    assert dec.loc["mean", "gpu_ms"] == 30.0 and dec.loc["median", "gpu_ms"] == 30.0
    assert dec.loc["median", "idle_ms"] == 18.0 and dec.loc["mean", "busy_ms"] == 12.0
    assert (dec["repeats"] == 5).all() and dec.loc["min", "gpu_ms"] == 20.0


def test_values_for_intervals(obs):
    assert summarize(obs).values("c", "request", "decode_tok_s").tolist() == [100.0, 90.0, 80.0, 95.0, 85.0]


@pytest.mark.parametrize("name", ["cpu_tiny", "gpu_tiny_a", "gpu_tiny_b", "h100_crop_mode"])
def test_old_layout_converted_on_read(name):
    """The fixture runs hold the old layout: repeats, 'profiled', aggregate rows; call 'all'."""
    raw = pd.read_csv(DATA / "runs" / name / "stages.csv", dtype=str)
    obs = load_run(DATA / "runs" / name).stages
    assert list(obs.columns) == OBSERVATION_COLUMNS
    kept = raw[~raw["repeat"].isin(LEGACY_AGGREGATES)]
    assert len(obs) == len(kept) and not set(raw["repeat"]).isdisjoint(LEGACY_AGGREGATES)
    assert (obs["profiled"] == (kept["repeat"] == "profiled").to_numpy()).all()
    assert ((obs["call"] == CALL_ALL) == (kept["call"] == "all").to_numpy()).all()
    n = {c: int(g["repeat"].astype(int).max()) + 1 for c, g in kept[kept["repeat"] != "profiled"].groupby("case")}
    prof = obs[obs["profiled"]]
    assert (prof["repeat"] == prof["case"].map(n)).all()          # the profiled request follows the timed ones
    assert (obs["gpu_ms"].fillna(-1).to_numpy() == pd.to_numeric(kept["gpu_ms"]).fillna(-1).to_numpy()).all()
    # the old median rows agree with the summary of the converted repeats
    old = raw[(raw["repeat"] == "median") & (raw["call"] == "all")].set_index(["case", "stage"])
    span = "host_ms" if name == "cpu_tiny" else "gpu_ms"
    new = summarize(obs).stages.set_index(["case", "stage"])
    for key, r in old.iterrows():
        assert new.loc[key, "time_ms"] == pytest.approx(float(r[span])), key


def test_missing_columns_refused():
    with pytest.raises(NotObservations, match=r"lacks the column\(s\) repeat, call, gpu_ms or host_ms a run writes"):
        typed(pd.DataFrame({"case": ["x"], "stage": ["sam"]}))


def test_written_then_read_back_is_the_same(obs, tmp_path):
    obs.to_csv(tmp_path / "stages.csv", index=False)
    back = read_observations(tmp_path / "stages.csv")
    pd.testing.assert_frame_equal(back, obs)
    (tmp_path / "manifest.json").write_text(json.dumps({"cases": []}))
    pd.testing.assert_frame_equal(load_run(tmp_path).stages, obs)
