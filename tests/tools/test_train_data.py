"""`train`'s default text: which files `source_files` finds under its roots, in which order."""

from __future__ import annotations

import os

from draftflow.tools.train.data import source_files


def _touch(path, text="x = 1\n"):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def test_source_files_prunes_tests_follows_no_folder_links_and_resolves_file_links(tmp_path):
    """Test folders and test-named files are left out; a linked folder is not entered; a linked file counts as the file
    it links to (once); a broken link and a folder named like a source are skipped; the order is each root's paths
    sorted part by part, roots in the order given, each real path once."""
    tmp_path = tmp_path.resolve()  # expected paths are real paths
    lib, other = tmp_path / "lib", tmp_path / "other"
    b = _touch(lib / "b.py")
    a_sub = _touch(lib / "a" / "z.py")
    dash = _touch(lib / "a-b.py")  # sorts after a/z.py part by part ("a" < "a-b"), before it as a string
    _touch(lib / "tests" / "t.py")
    _touch(lib / "pkg" / "testing" / "helper.py")
    _touch(lib / "test_x.py")
    _touch(lib / "x_test.py")
    _touch(lib / "conftest.py")
    _touch(lib / "notes.txt")
    (lib / "dir.py").mkdir()
    outside = _touch(other / "o.py")
    os.symlink(other, lib / "linked_dir")  # not entered
    os.symlink(outside, lib / "link.py")  # counts as other/o.py
    os.symlink(tmp_path / "missing.py", lib / "broken.py")
    assert source_files([lib]) == [a_sub, dash, b, outside]
    # the second root adds only what the first did not find; suffixes choose the files
    assert source_files([lib, other]) == [a_sub, dash, b, outside]
    assert source_files([lib], suffixes=(".txt",)) == [lib / "notes.txt"]
    assert source_files([b, lib]) == [b, a_sub, dash, outside]  # a file root is taken as given, first
