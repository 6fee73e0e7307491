"""Where `draftflow train` writes: whole files or none, and never into its inputs."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from draftflow.core.errors import DraftflowError
from draftflow.tools.train.output import check_outputs, write_files


def test_a_crash_mid_write_keeps_the_previous_files(tmp_path):
    """A writer that fails leaves the earlier drafter's files as they were and no temporary file behind."""
    (tmp_path / "model.safetensors").write_text("old weights")
    (tmp_path / "config.json").write_text("old config")

    def crash(tmp):
        tmp.write_text("half a conf")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        write_files(tmp_path, {"model.safetensors": lambda tmp: tmp.write_text("new weights"), "config.json": crash})
    assert (tmp_path / "model.safetensors").read_text() == "old weights"
    assert (tmp_path / "config.json").read_text() == "old config"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "model.safetensors"]


def test_files_are_renamed_into_place(tmp_path):
    """Every file appears under its name once all were written."""
    write_files(tmp_path / "new", {"a.bin": lambda tmp: tmp.write_bytes(b"x"), "config.json": lambda tmp: tmp.write_text("{}")})
    assert sorted(p.name for p in (tmp_path / "new").iterdir()) == ["a.bin", "config.json"]


def _args(tmp_path, **kw):
    base = dict(recipe="dflash", target=str(tmp_path / "target"), out=str(tmp_path / "out"), init_from=None, data=None,
                checkpoint=None, gguf=None, summary=None, overwrite=False)
    return SimpleNamespace(**{**base, **kw})


def test_out_may_not_be_the_target_even_with_overwrite(tmp_path):
    """--overwrite allows a foreign folder, never the target."""
    (tmp_path / "target").mkdir()
    (tmp_path / "target" / "config.json").write_text("{}")
    with pytest.raises(DraftflowError, match="is the --target folder"):
        check_outputs(_args(tmp_path, out=str(tmp_path / "target"), overwrite=True), [])
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "notes.txt").write_text("mine")
    with pytest.raises(DraftflowError, match="pass --overwrite"):
        check_outputs(_args(tmp_path), [])
    check_outputs(_args(tmp_path, overwrite=True), [])


def test_an_earlier_runs_regenerated_pool_is_not_a_foreign_file(tmp_path):
    """A second run into the same --out finds the first run's files, the kept label pool included: no --overwrite."""
    out = tmp_path / "out"
    out.mkdir()
    for name in ("model.safetensors", "checkpoint.pt", "checkpoint.pt.regen.pt"):
        (out / name).write_bytes(b"x")
    (out / "config.json").write_text('{"architectures": ["DFlashDraftModel"], "block_size": 16}')
    check_outputs(_args(tmp_path), [])
    (out / "notes.txt").write_text("mine")
    with pytest.raises(DraftflowError, match=r"does not write \(notes\.txt\)"):
        check_outputs(_args(tmp_path), [])
