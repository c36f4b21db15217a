"""tools/split_series.py on a synthetic single series: reorder, author, trailers, conflicts."""

import patch_series  # tools/ is on sys.path: conftest
import split_series
from tests.test_patch_series import LAYER, change_line, git, synthetic_sdist

AUTHOR = f"{patch_series.AUTHOR_NAME} <{patch_series.AUTHOR_EMAIL}>"


def single_series(tmp_path, monkeypatch, cpu_line, upstream_line):
    """An sdist and patches/ of one series: upstream 'a' (line 2), 'cpu' (cpu_line), then
    upstream 'b' (upstream_line); split_series told that 'cpu' is the CPU patch."""
    sdist, repo = synthetic_sdist(tmp_path)
    change_line(repo, 2, "upstream a", "layer: a")
    change_line(repo, cpu_line, "cpu", "layer: cpu")
    change_line(repo, upstream_line, "upstream b", "layer: b")
    monkeypatch.setattr(patch_series, "PATCH_DIR", tmp_path / "patches")
    patch_series.export_series(repo, "base")
    monkeypatch.setattr(split_series, "CPU_SUBJECTS", ("layer: cpu",))
    monkeypatch.setattr(split_series, "LINKS", {"layer: b": ("https://example.org/issues/1",)})
    return sdist


def resolve_line_10_11(ws, line_10):
    """Resolve the conflict on lines 10 and 11 of layer.py: line 10 as given, 'upstream b'."""
    layer = ws / LAYER
    layer.write_text(layer.read_text().split("<<<<<<<")[0] + f"{line_10}\nupstream b\n"
                     + "".join(f"line {i}\n" for i in range(12, 20)))
    git(ws, "add", LAYER)


def test_split_moves_cpu_patches_after_the_upstream_ones(tmp_path, monkeypatch):
    sdist = single_series(tmp_path, monkeypatch, cpu_line=10, upstream_line=16)
    assert split_series.main([str(sdist), str(tmp_path / "ws")]) == 0
    patches = patch_series.PATCH_DIR
    assert (patches / "series").read_text().split() == ["0001-layer-a.diff", "0002-layer-b.diff"]
    assert (patches / "cpu/series").read_text().split() == ["0001-layer-cpu.diff"]
    upstream_b = (patches / "0002-layer-b.diff").read_text()
    assert f"From: {AUTHOR}\n" in upstream_b
    assert "\nLink: https://example.org/issues/1\n---\n" in upstream_b
    assert "\n\nSeries: cpu\n---\n" in (patches / "cpu/0001-layer-cpu.diff").read_text()
    patch_series.check_series(sdist)


def test_split_stops_at_a_conflict_and_continues(tmp_path, monkeypatch, capsys):
    # 'b' changes the line after the CPU patch's: it does not apply without it, nor 'cpu' after it.
    sdist = single_series(tmp_path, monkeypatch, cpu_line=10, upstream_line=11)
    ws = tmp_path / "ws"
    assert split_series.main([str(sdist), str(ws)]) == 1
    assert "'layer: b' (upstream series) does not apply" in capsys.readouterr().err
    resolve_line_10_11(ws, "line 10")
    assert split_series.main([str(sdist), str(ws), "--continue"]) == 1
    assert "'layer: cpu' (CPU series) does not apply" in capsys.readouterr().err
    resolve_line_10_11(ws, "cpu")
    assert split_series.main([str(sdist), str(ws), "--continue"]) == 0
    upstream_b = (patch_series.PATCH_DIR / "0002-layer-b.diff").read_text()
    assert "-line 11\n+upstream b\n" in upstream_b and "cpu" not in upstream_b
    cpu_patch = (patch_series.PATCH_DIR / "cpu/0001-layer-cpu.diff").read_text()
    assert "-line 10\n+cpu\n upstream b\n" in cpu_patch


def test_split_refuses_a_resolution_that_changes_the_tree(tmp_path, monkeypatch, capsys):
    sdist = single_series(tmp_path, monkeypatch, cpu_line=10, upstream_line=11)
    ws = tmp_path / "ws"
    split_series.main([str(sdist), str(ws)])
    resolve_line_10_11(ws, "line 10")
    split_series.main([str(sdist), str(ws), "--continue"])
    resolve_line_10_11(ws, "not what the CPU patch wrote")
    assert split_series.main([str(sdist), str(ws), "--continue"]) == 1
    assert "does not end in the tree the single series did" in capsys.readouterr().err
    assert not (patch_series.PATCH_DIR / "cpu").exists()


def test_split_names_subjects_the_series_lacks(tmp_path, monkeypatch, capsys):
    sdist = single_series(tmp_path, monkeypatch, cpu_line=10, upstream_line=16)
    monkeypatch.setattr(split_series, "CPU_SUBJECTS", ("layer: renamed",))
    assert split_series.main([str(sdist), str(tmp_path / "ws")]) == 1
    assert "['layer: renamed']" in capsys.readouterr().err
