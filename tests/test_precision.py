"""`--precision auto` follows the CPU: training in bf16 only with AMX; the feature pass (the packed
bf16 target) in bf16 wherever the CPU has bf16 dot products."""
import pytest

from dominotree.train.precision import has_amx, resolve_precision

AMX = "processor\t: 0\nflags\t\t: fpu sse avx512f avx512_bf16 amx_bf16 amx_tile amx_int8\n"
BF16_NO_AMX = "processor\t: 0\nflags\t\t: fpu sse avx512f avx512_bf16 avx512_vnni\n"
NO_BF16 = "processor\t: 0\nflags\t\t: fpu sse avx2 avx512f\n"


@pytest.mark.parametrize("flags, amx, train, inference", [(AMX, True, "bf16", "bf16"),
                                                          (BF16_NO_AMX, False, "fp32", "bf16"),
                                                          (NO_BF16, False, "fp32", "fp32")])
def test_auto_picks_by_the_cpu_and_the_stage(tmp_path, flags, amx, train, inference):
    info = tmp_path / "cpuinfo"
    info.write_text(flags)
    assert has_amx(info) is amx
    assert resolve_precision("auto", info) == train
    assert resolve_precision("auto", info, inference=True) == inference
    for stage in (False, True):
        assert resolve_precision("bf16", info, stage) == "bf16" and resolve_precision("fp32", info, stage) == "fp32"


def test_no_cpuinfo_means_fp32_and_a_bad_name_is_an_error(tmp_path):
    assert not has_amx(tmp_path / "missing")
    assert resolve_precision("auto", tmp_path / "missing") == "fp32"
    assert resolve_precision("auto", tmp_path / "missing", inference=True) == "fp32"
    with pytest.raises(ValueError, match="precision must be one of auto, bf16, fp32"):
        resolve_precision("fp16")
