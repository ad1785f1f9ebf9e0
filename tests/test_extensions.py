"""The compile-once loader both C++ extensions use: where a build lands, and the reason a failed
one reports (the builds themselves: tests/test_native.py, tests/test_tree_attention.py)."""
import torch

from dominotree import extensions


def test_the_build_directory_is_keyed_by_code_flags_and_torch(tmp_path, monkeypatch):
    monkeypatch.setenv("DOMINOTREE_CACHE", str(tmp_path / "cache"))
    src, head = tmp_path / "a.cpp", tmp_path / "a.h"
    src.write_text("int f() { return 1; }")
    head.write_text("// header")
    first = extensions.build_dir("thing", [src], [head], ["-O3"])
    assert first.parent == tmp_path / "cache" / "thing"
    assert extensions.build_dir("thing", [src], [head], ["-O3"]) == first          # stable
    assert extensions.build_dir("thing", [src], [head], ["-O2"]) != first          # flags
    head.write_text("// header, edited")
    assert extensions.build_dir("thing", [src], [head], ["-O3"]) != first          # a header
    head.write_text("// header")
    monkeypatch.setattr(torch, "__version__", "0.0.0-other")
    assert extensions.build_dir("thing", [src], [head], ["-O3"]) != first          # torch


def test_a_failed_build_reports_its_last_line():
    exc = RuntimeError("Error building extension 'x'\n  lots of log\nerror: unrecognized option '-mavx512bf16'\n")
    assert extensions.failure_reason(exc) == "RuntimeError: error: unrecognized option '-mavx512bf16'"
    assert extensions.failure_reason(OSError()) == "OSError: no message"


def test_a_first_build_says_so_and_a_reused_one_is_silent(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("DOMINOTREE_CACHE", str(tmp_path / "cache"))
    src = tmp_path / "tiny_ext.cpp"
    src.write_text("extern \"C\" int dominotree_tiny_ext() { return 7; }\n")
    extensions.compile_extension("dominotree_tiny_ext", "tiny", [src], is_python_module=False)
    first = capsys.readouterr().err
    assert "compiling dominotree_tiny_ext" in first and str(tmp_path / "cache" / "tiny") in first
    assert list(extensions.build_dir("tiny", [src], (), ["-O3"]).glob("dominotree_tiny_ext*.so"))
    extensions.compile_extension("dominotree_tiny_ext", "tiny", [src], is_python_module=False)
    assert "compiling" not in capsys.readouterr().err
