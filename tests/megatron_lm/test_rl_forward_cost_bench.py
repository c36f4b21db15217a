"""bench/rl_forward_cost.py on CPU: a bin whose every token has a route replays through the routers'
precomputed-indices path (a gather instead of each layer's top-k), on the model's own routes."""

import pytest
from megatron.core.transformer.moe.router_replay import RouterReplay


@pytest.fixture()
def restore_router_replays():
    saved = list(RouterReplay.global_router_replay_instances)
    yield
    RouterReplay.global_router_replay_instances[:] = saved


def test_replay_takes_a_gather_for_each_layers_top_k(rr, tmp_path, restore_router_replays):
    from bench.rl_forward_cost import main

    out = tmp_path / "cost.md"
    main(["--routing-replay", rr.__file__, "--device", "cpu", "--tokens", "16", "--num-layers", "2",
          "--hidden-size", "64", "--moe-ffn-hidden-size", "16", "--forwards", "2", "--out", str(out)])
    report = out.read_text()
    for mode in ("without grad", "with grad and backward"):
        line = next(line for line in report.splitlines() if line.startswith(f"- {mode}: "))
        assert "aten::gather x2" in line.split("; removes ")[0]  # the scores gathered at the replayed ids
        assert "aten::topk x2" in line.split("; removes ")[1]  # no live top-k in either layer
    assert "| without grad | " in report and "Building the bin's `MoERouting`: median" in report


def test_the_series_module_must_be_found(tmp_path, monkeypatch):
    from bench.rl_forward_cost import main

    monkeypatch.delenv("MEGATRON", raising=False)
    with pytest.raises(SystemExit):
        main(["--device", "cpu"])
    with pytest.raises(SystemExit):
        main(["--routing-replay", str(tmp_path / "missing.py"), "--device", "cpu"])


def test_host_syncs_are_counted_by_the_line_that_makes_them_and_compared():
    import warnings

    from bench.rl_forward_cost import count_sync_warnings, difference

    def a_sync():
        warnings.warn("called a synchronizing CUDA operation")

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            a_sync()
        warnings.warn("an unrelated warning")
    sites = count_sync_warnings(caught)
    (site, count), = sites.items()
    assert count == 2 and site.startswith("megatron_lm/test_rl_forward_cost_bench.py:")
    assert difference(sites, sites) == "replay adds nothing; removes nothing"
    assert difference(sites, sites + sites) == f"replay adds {site} x2; removes nothing"
