"""The search space: parsing, refusals naming the field, enumeration, encoding."""

import numpy as np
import pytest

from autoconfig.space import MAX_SPACE_SIZE, SearchSpace, SpaceError
from tests.helpers.surfaces import shortcuts


def small_space(**overrides) -> dict:
    knobs = {
        "max_batch_size": {"values": [4, 1, 16]},
        "batch_wait_timeout_s": {"values": [0.0, 0.01]},
        "device_share": {"values": [0.5, 1.0]},
        "num_replicas": {"values": [1, 2]},
    }
    knobs.update(overrides)
    return {"knobs": knobs}


def test_yaml_round_trip_and_defaults(tmp_path):
    path = tmp_path / "space.yaml"
    path.write_text(
        "knobs:\n"
        "  max_batch_size: {values: [1, 8]}\n"
        "  batch_wait_timeout_s: {values: [0.0]}\n"
        "  device_share: {values: [1.0]}\n"
        "  num_replicas: {values: [1, 2, 3]}\n"
        "  torch_threads: {values: [1, 2]}\n"
    )
    space = SearchSpace.from_yaml(path)
    assert space.knob_names == (
        "max_batch_size",
        "batch_wait_timeout_s",
        "device_share",
        "num_replicas",
        "torch_threads",
    )
    assert space.size == 12
    assert SearchSpace.parse(space.to_dict()) == space
    assert SearchSpace.default("dlrm").size == 540
    assert SearchSpace.default("diffusion").size == 35


@pytest.mark.parametrize(
    ("space", "message"),
    [
        (small_space(max_batch_size={"values": [1, 2, 0]}), "knobs.max_batch_size.values[2]: "),
        (small_space(max_batch_size={"values": [1.5]}), "knobs.max_batch_size.values[0]: "),
        (small_space(batch_wait_timeout_s={"values": [-0.001]}), "knobs.batch_wait_timeout_s.values[0]: "),
        (small_space(device_share={"values": [0]}), "knobs.device_share.values[0]: "),
        (small_space(num_replicas={"values": [1, 2, 1]}), "knobs.num_replicas.values: duplicate value 1"),
        (small_space(num_replicas={"values": []}), "knobs.num_replicas.values: "),
        (small_space(cpus={"values": [1]}), "knobs.cpus: not a knob; use max_batch_size"),
        (
            {"knobs": {k: v for k, v in small_space()["knobs"].items() if k != "device_share"}},
            "knobs.device_share: Field required",
        ),
        ({**small_space(), "max_total_share": 0.25}, "max_total_share: 0.25 leaves no configuration"),
        (small_space(num_replicas={"values": list(range(1, 10_000))}), f"limit of {MAX_SPACE_SIZE}"),
    ],
)
def test_invalid_space_names_the_field(space, message):
    with pytest.raises(SpaceError, match=r"^space: ") as info:
        SearchSpace.parse(space)
    assert message in str(info.value)


def test_unreadable_file_and_unknown_kind(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("knobs: [")
    with pytest.raises(SpaceError, match=r"bad\.yaml"):
        SearchSpace.from_yaml(path)
    with pytest.raises(SpaceError, match="known: diffusion, diffusion-joint, dlrm, dlrm-joint"):
        SearchSpace.default("bert")


@pytest.mark.parametrize("kind", ["../spaces/dlrm", "spaces/../dlrm", "/etc/passwd", "dlrm.yaml", ""])
def test_a_kind_that_is_not_a_shipped_space_name_is_refused_even_if_it_resolves_to_one(kind):
    with pytest.raises(SpaceError, match="no default space"):
        SearchSpace.default(kind)


def test_enumeration_is_complete_sorted_and_indexed():
    space = SearchSpace.parse(small_space())
    configs = space.configurations()
    assert len(configs) == len(set(configs)) == 3 * 2 * 2 * 2
    assert configs[0] == shortcuts(1, 0.0, 0.5, 1)
    assert configs[1] == shortcuts(1, 0.0, 0.5, 2)  # the last knob varies fastest
    assert configs[-1] == shortcuts(16, 0.01, 1.0, 2)
    assert [space.index(c) for c in configs] == list(range(space.size))
    with pytest.raises(SpaceError, match="not in the search space"):
        space.index(shortcuts(2, 0.0, 0.5, 1))


def test_max_total_share_leaves_out_oversubscribed_configurations():
    space = SearchSpace.parse({**small_space(), "max_total_share": 1.0})
    assert all(c["num_replicas"] * c["device_share"] <= 1.0 for c in space.configurations())
    assert space.size == 3 * 2 * 3  # (0.5, 1), (0.5, 2), (1.0, 1)


def test_encoding_is_log_scaled_for_batch_and_wait():
    space = SearchSpace.parse(small_space(batch_wait_timeout_s={"values": [0.0, 0.001, 0.003]}))
    encoded = space.encode_all()
    assert encoded.shape == (space.size, 4)
    assert encoded.min() == 0.0 and encoded.max() == 1.0
    np.testing.assert_allclose(space.coordinates("max_batch_size"), [0.0, 0.5, 1.0])  # 1, 4, 16
    np.testing.assert_allclose(space.coordinates("batch_wait_timeout_s"), [0.0, 0.5, 1.0])  # log(v + 1 ms)
    config = shortcuts(4, 0.001, 1.0, 1)
    np.testing.assert_allclose(space.encode(config), [0.5, 0.5, 1.0, 0.0])


def test_single_value_knob_encodes_to_the_middle():
    space = SearchSpace.parse(small_space(num_replicas={"values": [3]}))
    assert set(space.encode_all()[:, 3]) == {0.5}


PATH_SPACE = {
    "knobs": {
        "Model.user_config.mode": {"values": ["fast", "exact"]},
        "Model.num_replicas": {"values": [2, 1]},
        "Model.ray_actor_options.num_cpus": {"values": [0.5, 1.0]},
        "Model.user_config.max_batch_size": {"values": [1, 4, 16]},
    },
}


def test_dotted_path_knobs_enumerate_in_file_order_with_categories_kept_in_order():
    space = SearchSpace.parse(PATH_SPACE)
    assert space.knob_names == tuple(PATH_SPACE["knobs"]) == space.path_knobs and not space.has_shortcuts
    assert space.values("Model.user_config.mode") == ("fast", "exact")  # categories: the file's order
    assert space.values("Model.num_replicas") == (1, 2)  # numbers: ascending
    assert space.size == 2 * 2 * 2 * 3
    assert space.configurations()[0] == {"Model.user_config.mode": "fast", "Model.num_replicas": 1,
                                         "Model.ray_actor_options.num_cpus": 0.5, "Model.user_config.max_batch_size": 1}
    np.testing.assert_allclose(space.coordinates("Model.user_config.mode"), [0.0, 1.0])
    np.testing.assert_allclose(space.coordinates("Model.user_config.max_batch_size"), [0.0, 0.5, 1.0])  # log default
    assert SearchSpace.parse(space.to_dict()) == space


def test_shortcuts_come_first_and_a_dotted_knob_may_join_them():
    space = SearchSpace.parse(small_space(**{"EmbeddingShard_0.num_replicas": {"values": [1, 2]}}))
    assert space.knob_names[:4] == ("max_batch_size", "batch_wait_timeout_s", "device_share", "num_replicas")
    assert space.path_knobs == ("EmbeddingShard_0.num_replicas",) and space.size == 3 * 2 * 2 * 2 * 2


def test_log_scale_is_chosen_per_knob():
    space = SearchSpace.parse({"knobs": {"M.user_config.x": {"values": [1, 10, 100], "scale": "log"},
                                         "M.user_config.y": {"values": [1, 10, 100]}}})
    np.testing.assert_allclose(space.coordinates("M.user_config.x"), [0.0, 0.5, 1.0])
    np.testing.assert_allclose(space.coordinates("M.user_config.y"), [0.0, 9 / 99, 1.0])


@pytest.mark.parametrize(
    ("knobs", "message"),
    [
        ({"M.user_config.x": {"values": [1, "a"]}}, "knobs.M.user_config.x.values: values must be all numbers"),
        ({"M.user_config.x": {"values": [0, 1], "scale": "log"}}, "knobs.M.user_config.x: scale log needs"),
        ({"M.user_config.x": {"values": [[1]]}}, "knobs.M.user_config.x.values[0]"),
        ({"M": {"values": [1]}}, "knobs.M: not a knob"),
        ({"M.9x": {"values": [1]}}, "knobs.M.9x: not a knob"),
        ({"max_batch_size": {"values": [1]}, "M.num_replicas": {"values": [1]}}, "knobs.device_share: Field"),
        ({}, "knobs: at least one knob"),
    ],
)
def test_invalid_dotted_knobs_name_the_field(knobs, message):
    with pytest.raises(SpaceError) as info:
        SearchSpace.parse({"knobs": knobs})
    assert message in str(info.value)


def test_max_total_share_sums_each_deployments_replicas_times_its_cpus():
    space = SearchSpace.parse({**PATH_SPACE, "max_total_share": 1.0})
    assert {(c["Model.num_replicas"], c["Model.ray_actor_options.num_cpus"]) for c in space.configurations()} == {
        (1, 0.5), (1, 1.0), (2, 0.5)}
    assert space.total_share(space.configurations()[0]) == 0.5
    with pytest.raises(SpaceError, match="max_total_share: needs device_share and num_replicas"):
        SearchSpace.parse({"knobs": {"M.num_replicas": {"values": [1]}}, "max_total_share": 1.0})


def test_a_configuration_read_back_is_the_spaces_own_and_a_stray_knob_is_named():
    space = SearchSpace.parse(small_space())
    read_back = space.configuration({"max_batch_size": 4.0, "batch_wait_timeout_s": 0.0, "device_share": 0.5,
                                     "num_replicas": 2.0})
    assert type(read_back["max_batch_size"]) is int and read_back == shortcuts(4, 0.0, 0.5, 2)
    with pytest.raises(SpaceError, match="unknown knob 'cpus'"):
        space.index({**read_back, "cpus": 1})
    with pytest.raises(SpaceError, match="no value for knob 'num_replicas'"):
        space.index({k: v for k, v in read_back.items() if k != "num_replicas"})
    assert hash(read_back) == hash(shortcuts(4, 0.0, 0.5, 2)) and len({read_back, shortcuts(4, 0.0, 0.5, 2)}) == 1


def test_the_batching_timer_is_an_optional_shortcut_the_other_three_are_not():
    """Only the DLRM app reads ``batch_wait_timeout_s``: a diffusion space leaves it out."""
    knobs = {k: v for k, v in small_space()["knobs"].items() if k != "batch_wait_timeout_s"}
    space = SearchSpace.parse({"knobs": knobs})
    assert "batch_wait_timeout_s" not in space.knob_names
    assert all("batch_wait_timeout_s" not in config for config in space.configurations())
    without = {k: v for k, v in knobs.items() if k != "num_replicas"}
    with pytest.raises(SpaceError, match=r"knobs\.num_replicas: Field required \(the shortcuts max_batch_size, "
                                         r"device_share, num_replicas come together\)"):
        SearchSpace.parse({"knobs": without})
