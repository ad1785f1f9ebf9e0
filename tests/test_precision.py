"""`--precision auto` follows the CPU: bf16 where it has AMX, fp32 where bf16 matmuls are slow."""
import pytest

from dominotree.train.precision import has_amx, resolve_precision

AMX = "processor\t: 0\nflags\t\t: fpu sse avx512f avx512_bf16 amx_bf16 amx_tile amx_int8\n"
NO_AMX = "processor\t: 0\nflags\t\t: fpu sse avx512f avx512_bf16 avx512_vnni\n"


@pytest.mark.parametrize("flags, amx, auto", [(AMX, True, "bf16"), (NO_AMX, False, "fp32")])
def test_auto_picks_bf16_only_with_amx(tmp_path, flags, amx, auto):
    info = tmp_path / "cpuinfo"
    info.write_text(flags)
    assert has_amx(info) is amx
    assert resolve_precision("auto", info) == auto
    assert resolve_precision("bf16", info) == "bf16" and resolve_precision("fp32", info) == "fp32"


def test_no_cpuinfo_means_no_amx_and_a_bad_name_is_an_error(tmp_path):
    assert not has_amx(tmp_path / "missing")
    assert resolve_precision("auto", tmp_path / "missing") == "fp32"
    with pytest.raises(ValueError, match="precision must be one of auto, bf16, fp32"):
        resolve_precision("fp16")
