"""tools/megatron_lm_series.py on this repository's series (no Megatron-LM checkout needed)."""

import pytest

from tests.support.megatron_lm import _series_tool

tool = _series_tool()


def test_the_series_has_headers_and_touches_the_rl_loop_and_the_engine_ledger():
    files = tool.series_files()
    touched = tool.touched_files(files)
    assert {"megatron/rl/routing_replay.py", "megatron/rl/rl_utils.py", "train_rl.py",
            "megatron/core/inference/inference_request.py"} <= set(touched)
    for path in files:
        assert "Link: https://github.com/NVIDIA/Megatron-LM/issues/4168" in path.read_text()


def test_extract_refuses_a_file_the_series_only_changes(tmp_path):
    with pytest.raises(tool.SeriesError, match="does not create train_rl.py"):
        tool.extract("train_rl.py", tmp_path)


def test_apply_refuses_a_tree_that_is_no_megatron_lm_main_checkout(tmp_path, capsys):
    info = tmp_path / "megatron/core/package_info.py"
    info.parent.mkdir(parents=True)
    info.write_text("MAJOR = 0\nMINOR = 19\nPATCH = 2\n")
    with pytest.raises(tool.SeriesError, match="not a Megatron-LM main checkout"):
        tool.apply_series(tmp_path)
    tool.apply_series(tmp_path, only_main=True)  # make patch on a 0.19 tree: said, not applied
    assert "made on main only, not applied" in capsys.readouterr().out
