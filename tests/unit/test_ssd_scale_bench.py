"""``mooncake-span bench --ssd-scale``'s configuration from the environment."""

from __future__ import annotations

import pytest

from mooncake_span_tools.bench import ssd_scale as S


def test_no_variables_keep_the_default_and_quick_runs():
    assert S.config_from_env(False, {}) == S.SsdScaleConfig()
    quick = S.config_from_env(True, {})
    assert (quick.large_objects, quick.small_objects) == (64, 4_000)


def test_large_gb_sets_whole_large_objects_and_zero_small_objects_skip_step_two():
    env = {
        "MOONCAKE_SPAN_SSD_SCALE_LARGE_GB": "20",
        "MOONCAKE_SPAN_SSD_SCALE_SMALL_OBJECTS": "0",
    }
    config = S.config_from_env(False, env)
    assert config.large_objects == 19_073  # 20e9 / 1 MiB, rounded
    assert config.small_objects == 0
    assert config.small_object_bytes == S.SsdScaleConfig().small_object_bytes


def test_small_objects_other_than_zero_still_need_both_offload_runs():
    with pytest.raises(ValueError, match="offloaded_objects"):
        S.config_from_env(False, {"MOONCAKE_SPAN_SSD_SCALE_SMALL_OBJECTS": "100"})


@pytest.mark.parametrize("value", ["0", "-3", "abc", "nan", "inf"])
def test_a_bad_size_names_the_variable(value):
    with pytest.raises(ValueError, match="MOONCAKE_SPAN_SSD_SCALE_LARGE_GB"):
        S.config_from_env(False, {"MOONCAKE_SPAN_SSD_SCALE_LARGE_GB": value})


@pytest.mark.parametrize("value", ["-1", "1e6", "ten"])
def test_a_bad_count_names_the_variable(value):
    with pytest.raises(ValueError, match="MOONCAKE_SPAN_SSD_SCALE_SMALL_OBJECTS"):
        S.config_from_env(False, {"MOONCAKE_SPAN_SSD_SCALE_SMALL_OBJECTS": value})
