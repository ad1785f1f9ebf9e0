"""machine.py: the CPU facts every benchmark run records (they decide how much a tree verify costs)."""
import pytest
import torch

from dominotree.machine import cpu_facts, default_dtype, describe, has_amx, machine_info, native_bf16

EPYC = ("processor\t: 0\nvendor_id\t: AuthenticAMD\nmodel name\t: AMD EPYC 9R14\n"
        "flags\t\t: fpu sse avx2 avx512f avx512_bf16 avx512_vnni\n\n"
        "processor\t: 1\nmodel name\t: AMD EPYC 9R14\nflags\t\t: fpu amx_bf16\n")
ICE_LAKE = ("processor\t: 0\nmodel name\t: Intel(R) Xeon(R) Processor @ 2.80GHz\n"
            "flags\t\t: fpu avx2 avx512f avx512bw avx512_vnni avx512_bitalg\n")
ARM = "processor\t: 0\nBogoMIPS\t: 2100.00\nFeatures\t: fp asimd bf16\n"
XEON = "processor\t: 0\nmodel name\t: Intel(R) Xeon(R) Platinum 8488C\nflags\t\t: fpu avx512f avx512_bf16 amx_bf16 amx_tile\n"


def test_cpu_facts_reads_the_first_cpu(tmp_path):
    f = tmp_path / "cpuinfo"
    f.write_text(EPYC)
    model, flags = cpu_facts(f)
    assert model == "AMD EPYC 9R14"
    assert {"avx512f", "avx512_bf16"} <= flags and "amx_bf16" not in flags     # the second CPU's line is not read
    assert not has_amx(f)
    f.write_text(XEON)
    assert has_amx(f)


def test_machine_info_and_its_one_line_description(tmp_path):
    f = tmp_path / "cpuinfo"
    f.write_text(XEON)
    info = machine_info(f)
    assert info["cpu"].startswith("Intel(R) Xeon") and info["cpu_flags"] == ["amx_bf16", "avx512_bf16", "avx512f"]
    assert info["cores"] >= 1 and info["torch_threads"] >= 1 and info["torch"]
    line = describe(info)
    assert line.startswith("Intel(R) Xeon(R) Platinum 8488C, ") and ", AMX, torch " in line
    f.write_text(EPYC)
    assert ", avx512_bf16 avx512f, no AMX, " in describe(machine_info(f))


def test_an_unreadable_cpuinfo_is_not_an_error(tmp_path):
    assert cpu_facts(tmp_path / "missing") == ("", set())
    info = machine_info(tmp_path / "missing")
    assert info["cpu_flags"] == [] and "no AVX-512, no AMX" in describe(info)


@pytest.mark.parametrize("text, native, dtype", [
    (EPYC, True, torch.bfloat16), (XEON, True, torch.bfloat16),      # bf16 hardware: bf16
    (ICE_LAKE, False, torch.float32),                                   # AVX-512 without bf16: fp32
    (ARM, None, torch.bfloat16), ("", None, torch.bfloat16)])           # flags unreadable: bf16 as before
def test_default_dtype_follows_the_cpus_bf16_hardware(tmp_path, text, native, dtype):
    f = tmp_path / "cpuinfo"
    f.write_text(text)
    assert native_bf16(f) is native
    assert default_dtype("cpu", f) == dtype
    assert default_dtype("cuda", f) == torch.bfloat16 and default_dtype(torch.device("meta"), f) == torch.bfloat16
