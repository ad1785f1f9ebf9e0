"""`--precision auto` follows the CPU: bf16 with AMX; elsewhere bf16 only where a timed product
says it is clearly faster (CPUs with the same flags differ: a Xeon without AMX was slower in bf16,
an AMD EPYC twice as fast)."""
import pytest

from dominotree.train import precision
from dominotree.train.precision import MARGIN, bf16_speedup, has_amx, resolve_precision

AMX = "processor\t: 0\nflags\t\t: fpu sse avx512f avx512_bf16 amx_bf16 amx_tile amx_int8\n"
NO_AMX = "processor\t: 0\nflags\t\t: fpu sse avx512f avx512_bf16 avx512_vnni\n"


def never(*_):
    raise AssertionError("AMX needs no measurement")


@pytest.mark.parametrize("flags, speedup, auto", [(AMX, never, "bf16"),
                                                  (NO_AMX, lambda: 2.0, "bf16"),
                                                  (NO_AMX, lambda: MARGIN - 0.01, "fp32"),
                                                  (NO_AMX, lambda: 0.7, "fp32")])
def test_auto_takes_bf16_with_amx_or_where_it_measures_clearly_faster(tmp_path, flags, speedup, auto):
    info = tmp_path / "cpuinfo"
    info.write_text(flags)
    assert has_amx(info) is (flags == AMX)
    assert resolve_precision("auto", info, speedup) == auto
    assert resolve_precision("bf16", info, never) == "bf16" and resolve_precision("fp32", info, never) == "fp32"


def test_the_measurement_runs_once_per_process(monkeypatch):
    first = bf16_speedup()
    assert first > 0
    monkeypatch.setattr(precision.time, "perf_counter", never)     # a second call must not time again
    assert bf16_speedup() == first


def test_no_cpuinfo_means_no_amx_and_a_bad_name_is_an_error(tmp_path):
    assert not has_amx(tmp_path / "missing")
    assert resolve_precision("auto", tmp_path / "missing", lambda: 1.0) == "fp32"
    with pytest.raises(ValueError, match="precision must be one of auto, bf16, fp32"):
        resolve_precision("fp16")
