"""File formats: round trips, bundled profiles, and validation messages that name the field."""

import json

import pytest

import autopar
from autopar import ClusterSpec, Constraints, LogicalMesh, Plan, PlanError
from autopar.schema.cluster import bundled_clusters


def test_bundled_cluster_loads_with_node_override():
    c = ClusterSpec.load("dgx-a100-80g", num_nodes=4)
    assert c.num_nodes == 4 and c.devices_per_node == 8 and c.num_devices == 32
    assert c.device.peak("bf16") == 312e12
    assert "dgx-a100-80g" in bundled_clusters()


def test_cluster_from_yaml_and_json(tmp_path):
    data = ClusterSpec.load("dgx-a100-80g").model_dump()
    (tmp_path / "c.json").write_text(json.dumps(data))
    import yaml

    (tmp_path / "c.yaml").write_text(yaml.safe_dump(data))
    assert ClusterSpec.load(tmp_path / "c.json") == ClusterSpec.load(str(tmp_path / "c.yaml"))


def test_cluster_constructed_as_in_the_contract():
    c = ClusterSpec(num_nodes=2, devices_per_node=8,
                    device=autopar.DeviceSpec(name="a100-80g", peak_flops={"bf16": 312e12, "fp32": 19.5e12},
                                              memory_bytes=80 * 2**30, memory_bandwidth=2.039e12),
                    intra_node=autopar.LinkSpec(bandwidth=300e9, latency=5e-6),
                    inter_node=autopar.LinkSpec(bandwidth=200e9, latency=10e-6))
    assert c.num_devices == 16
    assert c.link_between(0, 7) is c.intra_node and c.link_between(0, 8) is c.inter_node


@pytest.mark.parametrize("mutate, field", [
    (lambda d: d["device"].update(memory_bytes=-1), "device.memory_bytes"),
    (lambda d: d["intra_node"].update(bandwidth=0), "intra_node.bandwidth"),
    (lambda d: d.update(devices_per_node=0), "devices_per_node"),
    (lambda d: d["device"]["peak_flops"].update(int3=1e12), "device.peak_flops"),
])
def test_invalid_cluster_file_names_the_field(tmp_path, mutate, field):
    d = ClusterSpec.load("dgx-a100-80g").model_dump()
    mutate(d)
    f = tmp_path / "bad.json"
    f.write_text(json.dumps(d))
    with pytest.raises(PlanError, match=f"field '{field}"):
        ClusterSpec.load(f)


def test_multi_node_needs_inter_node_link():
    d = ClusterSpec.load("dgx-a100-80g").model_dump()
    d.update(num_nodes=2, inter_node=None)
    with pytest.raises(Exception, match="inter_node"):
        ClusterSpec.model_validate(d)


def test_unknown_cluster_and_missing_file():
    with pytest.raises(PlanError, match="unknown cluster 'dgx-z9'.*bundled"):
        ClusterSpec.load("dgx-z9")
    with pytest.raises(PlanError, match="does not exist"):
        ClusterSpec.load("/no/such/cluster.yaml")


def test_constraints_validate_each_field():
    assert Constraints(tp=8, pp=2).pinned() == {"tp": 8, "pp": 2}
    for bad in ({"tp": 0}, {"schedule": "zigzag"}, {"zero_stage": 4}, {"recompute": "some"}, {"dpp": 2}):
        with pytest.raises(Exception) as e:
            Constraints(**bad)
        assert list(bad)[0] in str(e.value)


def test_logical_mesh_checks_lengths():
    m = LogicalMesh(shape=(2, 4), alpha=(1e-5, 1e-6), beta=(1 / 25e9, 1 / 300e9))
    assert m.num_devices == 8
    with pytest.raises(Exception, match="one value per mesh axis"):
        LogicalMesh(shape=(2, 4), alpha=(1e-5,), beta=(1e-9, 1e-9))


@pytest.fixture(scope="module")
def tiny_plan() -> Plan:
    return autopar.plan("gpt-tiny", "cpu", global_batch_size=8, dtype="fp32")


def test_plan_round_trip(tiny_plan, tmp_path):
    assert Plan.from_json(tiny_plan.to_json()) == tiny_plan
    path = tmp_path / "plan.json"
    tiny_plan.save(path)
    assert autopar.load_plan(path) == tiny_plan
    assert [p.name for p in tmp_path.iterdir()] == ["plan.json"]   # no temp file left


def test_plan_future_version_and_truncated(tiny_plan, tmp_path):
    d = json.loads(tiny_plan.to_json())
    d["format_version"] = 99
    with pytest.raises(PlanError, match="format_version 99, newer"):
        Plan.from_json(json.dumps(d))
    with pytest.raises(PlanError, match="not valid JSON"):
        Plan.from_json(tiny_plan.to_json()[:200])
    with pytest.raises(PlanError, match="not a valid plan: field 'global_batch_size'"):
        d["format_version"] = 1
        d["global_batch_size"] = 0
        Plan.from_json(json.dumps(d))


def test_a_format_8_selective_plan_still_loads(tiny_plan):
    """Plans before format 9 name no recomputed ops: a "selective" stage of one loads with its
    modules checkpointed whole (what it ran as), and `autopar show` says so; `recompute_ops`
    under another policy is refused naming the field and the fix."""
    d = json.loads(tiny_plan.to_json())
    d["format_version"] = 8
    st = d["stages"][0]
    st.pop("recompute_ops", None)
    st.update(recompute="selective", recompute_modules=["blocks.0.attn", "blocks.1.attn"])
    old = Plan.from_json(json.dumps(d))
    assert old.stages[0].recompute_ops is None
    assert "stage 0: selective: modules blocks.*.attn (2) checkpointed whole" in old.summary()
    st.update(recompute="full", recompute_modules=["blocks.0", "blocks.1"],
              recompute_ops=["scaled_dot_product_attention"])
    with pytest.raises(PlanError, match="stages.0.*recompute_ops names the ops selective recomputation re-runs.*"
                                        "set recompute to \"selective\""):
        Plan.from_json(json.dumps(d))


def test_an_attention_recompute_plan_round_trips_and_format_9_plans_load(tiny_plan, tmp_path):
    """recompute="attention" (plan format 10): a stage names the modules holding its attention
    cores, checkpointed whole; it round-trips through JSON and a file, `autopar show` prints
    them, and `recompute_ops` beside it is refused. A format-9 plan ("selective" with its
    recomputed ops) still loads as it was."""
    from autopar.schema.plan import PLAN_FORMAT_VERSION

    assert PLAN_FORMAT_VERSION >= 10
    d = json.loads(tiny_plan.to_json())
    st = d["stages"][0]
    st.pop("recompute_ops", None)
    st.update(recompute="attention", recompute_modules=["blocks.0.attn", "blocks.1.attn"])
    p = Plan.from_json(json.dumps(d))
    assert p.format_version == PLAN_FORMAT_VERSION and p.stages[0].recompute == "attention"
    assert Plan.from_json(p.to_json()) == p
    p.save(tmp_path / "plan.json")
    assert autopar.load_plan(tmp_path / "plan.json") == p
    assert "stage 0: attention: modules blocks.*.attn (2) checkpointed whole" in p.summary()
    with pytest.raises(PlanError, match="recompute_ops names the ops selective recomputation re-runs"):
        Plan.from_json(json.dumps({**d, "stages": [{**st, "recompute_ops": ["scaled_dot_product_attention"]}]}))
    st.update(recompute="selective", recompute_ops=["scaled_dot_product_attention", "scaled_dot_product_attention_1"])
    d["format_version"] = 9
    old = Plan.from_json(json.dumps(d))
    assert old.stages[0].recompute_ops == st["recompute_ops"] and old.format_version == 9
    assert "stage 0: selective: ops scaled_dot_product_attention (2)" in old.summary()


def test_a_norm_act_plan_round_trips_and_format_14_plans_load(tiny_plan, tmp_path):
    """recompute="norm_act" (plan format 15, issue 17): a stage names its norm modules
    (`recompute_modules`) and the experts modules whose activation it recomputes
    (`recompute_acts`); it round-trips through JSON and a file, `autopar show` prints both, and
    the fields are checked against the policy with messages naming the fix. A format-14 plan
    still loads as it was."""
    from autopar.schema.plan import PLAN_FORMAT_VERSION

    assert PLAN_FORMAT_VERSION == 15
    d = json.loads(tiny_plan.to_json())
    st = d["stages"][0]
    st.pop("recompute_ops", None)
    st.update(recompute="norm_act", recompute_modules=["blocks.0.ln1", "blocks.0.ln2", "blocks.1.ln1", "blocks.1.ln2"],
              recompute_acts=["blocks.0.mlp.experts", "blocks.1.mlp.experts"])
    p = Plan.from_json(json.dumps(d))
    assert p.stages[0].recompute == "norm_act" and p.stages[0].recompute_acts == st["recompute_acts"]
    assert Plan.from_json(p.to_json()) == p
    p.save(tmp_path / "plan.json")
    assert autopar.load_plan(tmp_path / "plan.json") == p
    assert ("stage 0: norm_act: outputs discarded and re-made: norms blocks.*.ln1 (2), blocks.*.ln2 (2); "
            "activations in blocks.*.mlp.experts (2)") in p.summary()
    with pytest.raises(PlanError, match="norm_act.*needs recompute_acts"):
        Plan.from_json(json.dumps({**d, "stages": [{**st, "recompute_acts": None}]}))
    with pytest.raises(PlanError, match="recompute_acts names the experts modules.*recompute is 'full'"):
        Plan.from_json(json.dumps({**d, "stages": [{**st, "recompute": "full"}]}))
    with pytest.raises(PlanError, match="recompute"):
        Plan.from_json(json.dumps({**d, "stages": [{**st, "recompute": "norm_and_act"}]}))
    st.update(recompute="full", recompute_modules=["blocks.0", "blocks.1"])
    st.pop("recompute_acts")
    d["format_version"] = 14
    old = Plan.from_json(json.dumps(d))
    assert old.format_version == 14 and old.stages[0].recompute == "full" and old.stages[0].recompute_acts is None


def test_plan_batch_arithmetic_is_checked(tiny_plan):
    d = json.loads(tiny_plan.to_json())
    d["num_microbatches"] += 1
    with pytest.raises(PlanError, match="must equal global_batch_size"):
        Plan.from_json(json.dumps(d))


def test_a_placement_is_validated_where_the_plan_is_read(tiny_plan):
    """Placements are one validated type (`schema.placement.Placement`): a hand-edited "S(one)"
    or "shard" is refused when the plan is read, naming the field and the forms allowed."""
    from autopar.schema.placement import is_shard, shard, shard_dim

    assert shard_dim(shard(2)) == 2 and shard_dim("R") is None and not is_shard("P")
    d = json.loads(tiny_plan.to_json())
    st = d["stages"][0]
    name = next(iter(st["placements"]))
    for bad in ("S(one)", "shard", "S(-1)"):
        st["placements"][name] = [bad] * len(st["mesh_shape"])
        with pytest.raises(PlanError, match=rf"field 'stages.0.placements.{name}.0'.*'S\(d\)'"):
            Plan.from_json(json.dumps(d))


def test_plan_schema_is_json_schema(tiny_plan):
    s = Plan.json_schema()
    assert s["type"] == "object" and "stages" in s["properties"] and "predicted" in s["properties"]


def test_plan_summary_folds_runs_of_equal_stages():
    """A deep pipeline's summary says what its stages share once per run of equal stages (a
    64-stage plan's 62 equal middle stages are one line, not 62)."""
    from autopar.schema.plan import _stage_runs

    items = [(0, "a"), (1, "b"), (2, "b"), (3, "b"), (5, "b"), (6, "c")]
    assert _stage_runs(items) == ["stage 0: a", "stages 1-3: b", "stage 5: b", "stage 6: c"]
    assert _stage_runs(items[:2], fmt="{stages} ({text})") == ["stage 0 (a)", "stage 1 (b)"]
    assert _stage_runs([]) == []
