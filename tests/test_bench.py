"""The benchmark harness: method specs, statistics, the T=0 equality check, files, report-only."""
import csv
import json
import shutil

import numpy as np
import pytest
import torch

import dominotree.engine
import dominotree.bench.equality as equality
from dominotree.bench.equality import first_divergence
from dominotree.bench.methods import PRESETS, expand_methods, parse_method
from dominotree import fp32_linear
from dominotree.bench.metrics import bootstrap_ci, paired_ratio_ci, wilcoxon_p
from dominotree.cli import main as cli_main
from dominotree.drafters import save_checkpoint
from dominotree.machine import describe

from conftest import random_drafter

FIELDS = {"question_id", "category", "dataset", "method", "temperature", "new_tokens", "wall_time",
          "accept_lengths", "token_ids", "tau", "stage_ms", "budgets"}
REPORTS = ["summary.md", "summary.csv", "speedup.png", "acceptance.png"]


@pytest.fixture(scope="module")
def bench_env(tiny_llama_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("bench_env")
    for domino in (False, True):
        save_checkpoint(random_drafter(domino), root / ("domino" if domino else "dflash"), dtype=torch.float32)
    prompts = [{"dataset": "chat", "question_id": "c1", "text": "hello world the w10 w11"},
               {"dataset": "chat", "question_id": "c2", "text": "w20 w21 w22 the world"},
               {"dataset": "code", "question_id": "k1", "category": "coding", "text": "w40 w41 w40 w41 w40"}]
    (root / "prompts.jsonl").write_text("".join(json.dumps(p) + "\n" for p in prompts))
    return root


def bench(env, model_dir, out, methods, *extra):
    return cli_main(["bench", "--model", str(model_dir), "--dtype", "fp32",
                     "--prompts-file", str(env / "prompts.jsonl"), "--dflash-drafter", str(env / "dflash"),
                     "--domino-drafter", str(env / "domino"),
                     "--methods", methods, "--out", str(out), "--max-new-tokens", "12", *extra])


def read_jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_full_run_writes_files_passes_equality_and_report_only_reproduces(bench_env, tiny_llama_dir, tmp_path):
    out = tmp_path / "run"
    methods = ("ar,dflash,domino,ddtree,caddtree,dominotree,condadaptive,hf-ar,hf-prompt-lookup,"
               "ddtree:drafter=domino,dominotree:budget=4,dominotree:lookup=4")
    rc = bench(bench_env, tiny_llama_dir, out, methods, "--temperatures", "0,1.0", "--max-samples", "2")
    assert rc == 0
    for name in REPORTS + ["results.jsonl", "run.json", "cost_model.json", "tau_vs_budget.png"]:
        assert (out / name).is_file(), name
    recs = read_jsonl(out / "results.jsonl")
    labels = ["ar", "dflash", "domino", "ddtree", "caddtree", "dominotree", "condadaptive", "hf-ar",
              "hf-prompt-lookup", "ddtree:drafter=domino", "dominotree:budget=4", "dominotree:lookup=4"]
    assert len(recs) == 3 * 2 * len(labels)
    assert [r["method"] for r in recs[:len(labels)]] == labels          # interleaved per prompt, ar first
    for r in recs:
        assert FIELDS <= set(r), FIELDS - set(r)
        assert r["new_tokens"] == len(r["token_ids"]) > 0 and r["wall_time"] > 0
        if r["base_method"] not in ("ar", "hf-ar", "hf-prompt-lookup"):
            assert r["tau"] >= 1 and sum(r["accept_lengths"]) + 1 >= r["new_tokens"]
        if r["temperature"] == 0 and r["method"] != "ar":
            assert r["equality"]["match"] in ("exact", "tie")
    assert any(r["budgets"] for r in recs if r["method"] == "condadaptive")
    assert recs[0]["config"] == {} and recs[1]["config"]["budget"] == 16
    assert next(r for r in recs if r["method"].startswith("dominotree:"))["config"] == {"budget": 4}
    for r in recs:   # only the lookup spec records how many of its tokens the branch alone proposed
        assert (r["lookup_accepted"] is not None) == (r["method"] == "dominotree:lookup=4")
        assert r["lookup_accepted"] is None or 0 <= r["lookup_accepted"] < r["new_tokens"]
    md = (out / "summary.md").read_text()
    assert "dominotree bench --methods ar,dflash," in md and "| all | dominotree |" in md and "FAILED" not in md
    info = json.loads((out / "run.json").read_text())
    assert ("Exact steps: on" in md) == info["exact_steps"] and ("Exact steps: off" in md) != info["exact_steps"]
    if info["exact_steps"]:     # a bf16 target on the kernel: our methods give ar's tokens bit for bit
        assert all(r["equality"]["match"] == "exact" for r in recs
                   if r["temperature"] == 0 and r["base_method"] not in ("ar", "hf-ar", "hf-prompt-lookup"))
    assert info["dtype"] == "float32" and "- dtype: `float32`" in md      # the tiny target's, as loaded
    assert info["fp32_linear"] == fp32_linear.status() and info["fp32_linear"].startswith(("on", "off ("))
    machine = info["machine"]      # speedups depend on the CPU
    assert machine["cores"] >= 1 and machine["torch_threads"] >= 1 and f"- machine: {describe(machine)}" in md

    again = tmp_path / "again"
    again.mkdir()
    for name in ("results.jsonl", "run.json"):
        shutil.copy(out / name, again / name)
    assert cli_main(["bench", "--report-only", str(again)]) == 0
    for name in REPORTS + ["tau_vs_budget.png"]:
        assert (again / name).read_bytes() == (out / name).read_bytes(), name


def test_a_lossy_method_fails_the_equality_check(bench_env, tiny_llama_dir, tmp_path, monkeypatch, capsys):
    def accept_everything(tree, logits, temperature=0.0, top_k=0, top_p=1.0, generator=None):
        kids, path = tree.children(), [0]
        while kids[path[-1]]:
            path.append(kids[path[-1]][0])
        return path, int(logits[path[-1]].argmax())
    monkeypatch.setattr(dominotree.engine, "accept", accept_everything)
    out = tmp_path / "broken"
    rc = bench(bench_env, tiny_llama_dir, out, "ar,dflash", "--max-samples", "1", "--warmup", "0", "--tie-tol", "0")
    assert rc == 1
    assert "LOSSLESSNESS CHECK FAILED" in capsys.readouterr().err
    recs = read_jsonl(out / "results.jsonl")
    assert any(r["equality"] and r["equality"]["match"] == "diverged" for r in recs)
    assert "FAILED" in (out / "summary.md").read_text()
    (out / "tau_vs_budget.png").write_bytes(b"an earlier run's budget sweep")
    assert cli_main(["bench", "--report-only", str(out)]) == 1     # the verdict survives a re-derivation
    assert not (out / "tau_vs_budget.png").exists()                # no sweep in this run: no stale plot
    # ... and a second opinion: a lossy method stays diverged in plain decoding's own steps
    assert cli_main(["bench", "--report-only", str(out), "--recheck"]) == 1
    again = [r["equality"] for r in read_jsonl(out / "results.jsonl") if r["equality"]]
    assert any(e["match"] == "diverged" and e["step_gap"] > 0 for e in again)


def test_a_run_stopped_mid_write_still_reports_its_finished_records(bench_env, tiny_llama_dir, tmp_path, capsys):
    out = tmp_path / "cut"
    assert bench(bench_env, tiny_llama_dir, out, "ar,dflash", "--warmup", "0") == 0
    text = (out / "results.jsonl").read_text()
    whole = text.splitlines()
    (out / "results.jsonl").write_text(text[:len(text) - len(whole[-1]) // 2 - 1])     # the last record half written
    capsys.readouterr()
    assert cli_main(["bench", "--report-only", str(out)]) == 0
    assert "partial record" in capsys.readouterr().err
    assert "| all | dflash |" in (out / "summary.md").read_text()
    (out / "results.jsonl").write_text("{not json\n" + text)       # a bad line elsewhere is an error, named
    assert cli_main(["bench", "--report-only", str(out)]) == 2
    assert "results.jsonl:1: not a JSON record" in capsys.readouterr().err


def test_step_gap_is_plain_decodings_gap_at_the_divergence(tiny_target):
    import dominotree as dt
    prompt = [1, 5, 6, 7, 8]
    ar = dt.generate(tiny_target, None, prompt, method="ar", max_new_tokens=8).token_ids
    gaps = [equality.step_gap(tiny_target, prompt, ar[:i]) for i in range(6)]
    for i, g in enumerate(gaps):           # float32: the steps and one plain forward agree closely
        assert g == pytest.approx(equality.top2_gap(tiny_target, prompt, ar[:i]), abs=1e-3)
    assert len(set(round(g, 3) for g in gaps)) > 1      # the gap of each position, not one position's


def test_a_full_forward_gap_over_the_tolerance_gets_a_second_opinion(tiny_target, monkeypatch):
    import dominotree as dt
    prompt = [1, 5, 6, 7, 8]
    ar = dt.generate(tiny_target, None, prompt, method="ar", max_new_tokens=8).token_ids
    other = ar[:3] + [(ar[3] + 1) % 90]
    real = equality.step_gap(tiny_target, prompt, ar[:3])
    monkeypatch.setattr(equality, "top2_gap", lambda *a: real + 10.0)   # a full forward that drifted
    tie = equality.check(tiny_target, prompt, ar, other, tie_tol=real + 1.0)
    assert tie["match"] == "tie" and tie["step_gap"] == pytest.approx(real) and tie["index"] == 3
    bad = equality.check(tiny_target, prompt, ar, other, tie_tol=real / 2)
    assert bad["match"] == "diverged"
    assert "step_gap" not in equality.check(tiny_target, prompt, ar, other, tie_tol=real + 20.0)
    assert cli_main(["bench", "--recheck", "--out", "x"]) == 2         # only with --report-only


def test_a_gap_over_the_tolerance_in_the_steps_too_gets_the_verifies_opinion(tiny_target, monkeypatch):
    import dominotree as dt
    prompt = [1, 5, 6, 7, 8]
    ar = dt.generate(tiny_target, None, prompt, method="ar", max_new_tokens=20).token_ids
    i = 17
    chains = equality.chain_gap(tiny_target, prompt, ar[:i])
    assert chains == pytest.approx(equality.step_gap(tiny_target, prompt, ar[:i]), abs=1e-3)   # float32: agree
    other = ar[:i] + [(ar[i] + 1) % 90]
    calls = []
    real_chain_gap = equality.chain_gap
    monkeypatch.setattr(equality, "chain_gap", lambda *a: calls.append(a[2]) or real_chain_gap(*a))
    monkeypatch.setattr(equality, "top2_gap", lambda *a: chains + 10.0)    # a drifted full forward ...
    monkeypatch.setattr(equality, "step_gap", lambda *a: chains + 5.0)     # ... and drifted steps
    tie = equality.check(tiny_target, prompt, ar, other, tie_tol=chains + 1.0)
    assert tie["match"] == "tie" and tie["chain_gap"] == pytest.approx(chains) and calls == [ar[:i]]
    assert equality.check(tiny_target, prompt, ar, other, tie_tol=chains / 2)["match"] == "diverged"
    assert "chain_gap" not in equality.check(tiny_target, prompt, ar, other, tie_tol=chains + 6.0)
    # the target is left clean: plain decoding after the check gives the same tokens
    assert dt.generate(tiny_target, None, prompt, method="ar", max_new_tokens=20).token_ids == ar


def test_reference_sets_the_paired_tests_and_survives_report_only(bench_env, tiny_llama_dir, tmp_path, capsys):
    out = tmp_path / "ref"
    assert bench(bench_env, tiny_llama_dir, out, "ar,dflash,dominotree,dominotree:budget=4", "--max-samples", "2",
                 "--warmup", "0", "--reference", "dominotree:budget=4") == 0
    info = json.loads((out / "run.json").read_text())
    assert info["reference"] == "dominotree:budget=4" and "--reference dominotree:budget=4" in info["command"]
    md = (out / "summary.md").read_text()
    assert "p vs dominotree:budget=4 |" in md and "against `dominotree:budget=4`" in md
    recs = read_jsonl(out / "results.jsonl")
    tpt = lambda m: [r["wall_time"] / r["new_tokens"] for r in recs if r["method"] == m]   # noqa: E731
    rows = {r["method"]: r for r in csv.DictReader((out / "summary.csv").open()) if r["dataset"] == "all"}
    assert rows["dominotree:budget=4"]["p_vs_ref"] == ""                     # the reference itself
    assert float(rows["dflash"]["p_vs_ref"]) == pytest.approx(wilcoxon_p(tpt("dominotree:budget=4"), tpt("dflash")))

    before = (out / "summary.md").read_bytes()
    assert cli_main(["bench", "--report-only", str(out)]) == 0               # kept in run.json: same tests
    assert (out / "summary.md").read_bytes() == before
    assert cli_main(["bench", "--report-only", str(out), "--reference", "dflash"]) == 0
    assert "p vs dflash |" in (out / "summary.md").read_text()
    assert json.loads((out / "run.json").read_text())["reference"] == "dflash"

    assert cli_main(["bench", "--report-only", str(out), "--reference", "ddtree"]) == 2    # not in this run
    assert json.loads((out / "run.json").read_text())["reference"] == "dflash"             # left as it was
    assert bench(bench_env, tiny_llama_dir, tmp_path / "bad", "ar,dflash", "--reference", "dominotree") == 2
    assert not (tmp_path / "bad").exists()                                                 # failed before running
    err = capsys.readouterr().err
    assert "--reference 'ddtree' is not a method of this run" in err and "Traceback" not in err


def test_bootstrap_ci_contains_the_mean_and_is_deterministic():
    x = np.random.default_rng(1).lognormal(0.5, 0.4, size=30)
    lo, hi = bootstrap_ci(x)
    assert lo < x.mean() < hi
    assert bootstrap_ci(x) == (lo, hi)
    assert bootstrap_ci([2.0]) == (2.0, 2.0)


def test_paired_ratio_ci_cancels_what_the_pairs_share():
    rng = np.random.default_rng(2)
    a = rng.lognormal(0.7, 0.5, size=40)              # prompts that differ a lot in difficulty
    b = 1.1 * a * rng.normal(1, 0.02, size=40)         # the same prompts, 10% easier for b
    ratio, lo, hi = paired_ratio_ci(a, b)
    assert ratio == pytest.approx(b.mean() / a.mean())
    assert 1.08 < lo < ratio < hi < 1.12               # paired: the difficulty spread cancels
    assert paired_ratio_ci(a, b) == (ratio, lo, hi)    # seeded
    # negative control: the same values with the pairing broken give a CI as wide as the spread
    _, lo_u, hi_u = paired_ratio_ci(a, rng.permutation(b))
    assert hi_u - lo_u > 5 * (hi - lo)
    assert paired_ratio_ci([2.0], [3.0]) == (1.5, 1.5, 1.5)
    with pytest.raises(ValueError, match="paired"):
        paired_ratio_ci([1.0, 2.0], [1.0])


def test_wilcoxon_separates_clearly_different_samples():
    rng = np.random.default_rng(0)
    a = rng.normal(10, 1, size=20)
    assert wilcoxon_p(a, a + 2 + rng.normal(0, 0.1, size=20)) < 1e-3
    assert wilcoxon_p(a, a + rng.normal(0, 1, size=20)) > 0.01
    assert wilcoxon_p(a, a) is None and wilcoxon_p([1.0], [2.0]) is None


def test_method_specs_and_presets():
    m = parse_method("dominotree:budget=32,corr_topm=0,normalization=exact")
    assert (m.method, m.drafter, m.options) == ("dominotree", "domino",
                                                {"budget": 32, "corr_topm": None, "normalization": "exact"})
    assert parse_method("ddtree").drafter == "dflash" and parse_method("ddtree:drafter=domino").drafter == "domino"
    assert parse_method("hf-ar").is_peer and parse_method("caddtree").needs_cost_model
    labels = [s.label for s in expand_methods("dominotree:budget=32,corr_topm=16,ddtree", None)]
    assert labels == ["ar", "dominotree:budget=32,corr_topm=16", "ddtree"]
    assert [s.label for s in expand_methods(None, "ladder")] == ["ar"] + PRESETS["ladder"]
    assert len(expand_methods(None, "budget")) == 11 and len(expand_methods("ar,ddtree", "norm")) == 4
    assert parse_method("dominotree:lookup=8").options == {"lookup": 8}
    assert parse_method("dominotree:lookup=8,lookup_store=train-data").options == {"lookup": 8, "lookup_store": "train-data"}
    assert "dominotree:lookup=8" in PRESETS["lookup"] and "dominotree" in PRESETS["lookup"]
    assert not parse_method("ar:pack=0").packed and parse_method("dominotree:pack=1,budget=8").packed
    assert parse_method("dominotree:pack=0,budget=8").options == {"budget": 8}
    assert not parse_method("ar:gqa=0").gqa and parse_method("ar:gqa=0").packed and parse_method("ar").gqa
    assert not parse_method("ar:tree_attention=0").tree_attention and parse_method("ar").tree_attention
    for bad in ("nope", "dominotree:budgett=3", "dominotree:budget=0", "domino:drafter=dflash", "hf-ar:x=1",
                "dominotree:conditioning=weird", "dominotree:budget", "dominotree:lookup=-2", "ar:budget=4",
                "hf-ar:pack=0", "dominotree:pack=2", "ar:gqa=yes", "hf-ar:gqa=0"):
        with pytest.raises(ValueError):
            parse_method(bad)


def test_pack_0_specs_run_on_the_plain_path(bench_env, tiny_llama_dir, tmp_path, monkeypatch):
    import dominotree.bench.runner as runner
    real, seen = runner.packing, []

    def spy(module, enabled):
        seen.append((type(module).__name__, enabled))
        return real(module, enabled)
    monkeypatch.setattr(runner, "packing", spy)
    out = tmp_path / "pack"
    rc = cli_main(["bench", "--model", str(tiny_llama_dir), "--dtype", "bf16", "--prompts-file",
                   str(bench_env / "prompts.jsonl"), "--domino-drafter", str(bench_env / "domino"), "--methods",
                   "ar:pack=0,dominotree,dominotree:pack=0", "--out", str(out), "--max-new-tokens", "8",
                   "--max-samples", "1", "--warmup", "0"])
    assert rc == 0
    recs = read_jsonl(out / "results.jsonl")
    assert [r["method"] for r in recs[:4]] == ["ar", "ar:pack=0", "dominotree", "dominotree:pack=0"]
    assert all(r["equality"]["match"] in ("exact", "tie") for r in recs if r["method"] != "ar")
    # per prompt: ar:pack=0 switches the target off, dominotree:pack=0 the target, backbone and head
    n = len(recs) // 4
    assert seen.count(("LlamaForCausalLM", False)) == 2 * n and seen.count(("DFlashBackbone", False)) == n
    assert seen.count(("DominoHead", False)) == n and all(not enabled for _, enabled in seen)
    from dominotree.packed import packing_available
    info = json.loads((out / "run.json").read_text())
    assert info["packed"] == packing_available()
    from dominotree.tree_attention import enabled
    assert info["exact_steps"] == (packing_available() and enabled())     # a bf16 GQA target on the kernel
    if info["exact_steps"]:
        assert all(r["equality"]["match"] == "exact" for r in recs if r["method"] == "dominotree")


def test_gqa_0_specs_run_on_transformers_sdpa(bench_env, tiny_llama_dir, tmp_path, monkeypatch):
    import dominotree.bench.runner as runner
    real, seen = runner.stock_attention, []

    def spy(model):
        seen.append(model.config._attn_implementation)
        return real(model)
    monkeypatch.setattr(runner, "stock_attention", spy)
    out = tmp_path / "gqa"
    rc = cli_main(["bench", "--model", str(tiny_llama_dir), "--prompts-file", str(bench_env / "prompts.jsonl"),
                   "--domino-drafter", str(bench_env / "domino"), "--methods", "ar:gqa=0,dominotree,dominotree:gqa=0",
                   "--out", str(out), "--max-new-tokens", "8", "--max-samples", "1", "--warmup", "0"])
    assert rc == 0
    recs = read_jsonl(out / "results.jsonl")
    assert [r["method"] for r in recs[:4]] == ["ar", "ar:gqa=0", "dominotree", "dominotree:gqa=0"]
    assert all(r["equality"]["match"] == "exact" for r in recs if r["method"] != "ar")
    assert seen == ["dominotree_gqa"] * (len(recs) // 2)      # the gqa=0 runs, on a switched target
    assert json.loads((out / "run.json").read_text())["gqa_attention"] is True


def test_bad_flags_exit_2_without_a_traceback(capsys):
    assert cli_main(["bench", "--methods", "nope", "--out", "x"]) == 2
    assert cli_main(["bench", "--preset", "ladder", "--temperatures", "-1", "--out", "x"]) == 2
    assert cli_main(["bench"]) == 2
    err = capsys.readouterr().err
    assert "unknown method 'nope'" in err and "Traceback" not in err
    # refused before the model loads, not at the warm-up
    assert cli_main(["bench", "--temperatures", "0,nan", "--model", "no-such-model", "--out", "x"]) == 2
    assert "finite temperatures" in capsys.readouterr().err


def test_an_unusable_out_or_no_method_fails_before_the_model_loads(capsys, tmp_path):
    (tmp_path / "a-file").write_text("")
    for out in (tmp_path / "a-file", tmp_path / "a-file" / "sub"):
        assert cli_main(["bench", "--model", "no-such-model", "--max-samples", "1", "--out", str(out)]) == 2
        err = capsys.readouterr().err
        assert "a-file is a file, not a directory" in err and "unknown model" not in err
    assert cli_main(["bench", "--methods", ",", "--out", str(tmp_path / "x")]) == 2
    assert "names no method" in capsys.readouterr().err
    # train eval and profile write one file: a directory there is refused before any work, not after it
    for argv in (["train", "eval", "--drafters", "smollm2-135m-dflash"], ["profile"]):
        assert cli_main([*argv, "--model", "no-such-model", "--out", str(tmp_path)]) == 2
        err = capsys.readouterr().err
        assert "is a directory; give a file name" in err and "unknown model" not in err


@pytest.mark.parametrize("lines, match", [
    ('{"text": "hi"}\nnot json\n', ":2: not a JSON line"), ('{"question_id": 1}\n', ':1: every line needs'),
    ('{"text": "  "}\n', ":1: every line needs"), ("[1, 2]\n", ":1: every line needs"), ("\n", "holds no prompts"),
])
def test_a_bad_prompts_file_names_its_line_before_the_model_loads(capsys, tmp_path, lines, match):
    (tmp_path / "p.jsonl").write_text(lines)
    assert cli_main(["bench", "--model", "no-such-model", "--prompts-file", str(tmp_path / "p.jsonl"),
                     "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert match in err and "Traceback" not in err and "unknown model" not in err


def test_first_divergence():
    assert first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert first_divergence([1, 2, 3], [1, 5, 3]) == 1
    assert first_divergence([1, 2], [1, 2, 3]) == 2


def test_per_position_acceptance_is_the_pooled_survival_function():
    from dominotree.bench.metrics import survival
    assert survival([0, 2, 1, 3]) == [0.75, 0.5, 0.25]
    assert survival([]) == [] and survival([0, 0]) == []


def test_build_time_times_the_builders_on_recorded_rounds(bench_env, tiny_llama_dir, tmp_path, capsys):
    out = tmp_path / "build"
    rc = cli_main(["bench", "--build-time", "--model", str(tiny_llama_dir), "--dtype", "fp32",
                   "--prompts-file", str(bench_env / "prompts.jsonl"), "--domino-drafter", str(bench_env / "domino"),
                   "--out", str(out), "--max-new-tokens", "12", "--budget", "6"])
    assert rc == 0
    res = json.loads((out / "build_time.json").read_text())
    # every round of the 3 generations was recorded (the drafts' `depths` passed through) and rebuilt identically
    assert res["rounds"] >= 3 and res["budget"] == 6 and res["reference_ms"] > 0 and res["fast_ms"] > 0
    from dominotree.trees import native
    assert (res["native_ms"] > 0) if native.load() else res["native"].startswith("fast (")
    assert "identical trees" in capsys.readouterr().out


def test_build_time_times_the_domino_chains_on_recorded_rounds(bench_env, tiny_llama_dir, tmp_path, capsys,
                                                               monkeypatch):
    from dominotree.bench import build_time
    depths = []   # the depth each timed chain ran to
    inner = build_time.domino_chain
    monkeypatch.setattr(build_time, "domino_chain", lambda d, draft, root, tgt, depth, **kw: depths.append(depth)
                        or inner(d, draft, root, tgt, depth, **kw))
    out = tmp_path / "chain"
    rc = cli_main(["bench", "--build-time", "--methods", "domino", "--model", str(tiny_llama_dir), "--dtype", "fp32",
                   "--prompts-file", str(bench_env / "prompts.jsonl"), "--domino-drafter", str(bench_env / "domino"),
                   "--out", str(out), "--max-new-tokens", "12"])
    assert rc == 0
    res = json.loads((out / "build_time.json").read_text())
    assert res["method"] == "domino" and res["timed"] == "Domino chain" and res["rounds"] >= 3
    assert res["reference_ms"] > 0 and res["fast_ms"] > 0 and "budget" not in res
    # reference (unpruned) and fast (pruned) chains, 3 repeats each, every round to its drafted depths
    assert len(depths) == 2 * 3 * res["rounds"] and min(depths) >= 1
    from dominotree.trees import native
    assert (res["native_ms"] > 0) if native.load() else res["native"].startswith("fast (")
    assert "Domino chain per round" in capsys.readouterr().out


def test_build_time_takes_a_dominotree_spec_and_rejects_other_methods(bench_env, tiny_llama_dir, tmp_path,
                                                                       capsys, monkeypatch):
    from conftest import VOCAB
    from dominotree.bench import build_time
    from dominotree.train.data import Sequence, write_shard
    source = tmp_path / "shards"
    source.mkdir()
    write_shard(source / "shard_00000.npz", [Sequence(np.array([1, 2] + list(range(4, VOCAB)) * 2), 2, "t")])
    seen = []   # the (compact) score rows each timed build scanned
    inner = build_time.build_dominotree_fast
    monkeypatch.setattr(build_time, "build_dominotree_fast",
                        lambda logits, *a, **kw: seen.append((logits.shape[-1], kw["vocab_ids"])) or inner(logits, *a, **kw))
    out = tmp_path / "build"
    args = ["bench", "--build-time", "--model", str(tiny_llama_dir), "--dtype", "fp32",
            "--prompts-file", str(bench_env / "prompts.jsonl"), "--domino-drafter", str(bench_env / "domino"),
            "--out", str(out), "--max-new-tokens", "12", "--budget", "6"]
    spec = f"dominotree:budget=5,draft_vocab=48,draft_vocab_source={source},corr_topm=16"
    assert cli_main(args + ["--methods", spec]) == 0
    res = json.loads((out / "build_time.json").read_text())
    assert res["budget"] == 5 and res["options"]["draft_vocab"] == 48 and res["rounds"] >= 3
    # the 48 ranked ids plus the EOS a draft vocabulary always keeps, never the whole vocabulary
    assert seen and all(ids is not None and width == len(ids) == 49 for width, ids in seen)
    assert "identical trees" in capsys.readouterr().out
    for bad in ("ddtree:budget=5", "dominotree,dominotree:budget=4", "dominotree:conditioning=greedy",
                "domino:builder=fast"):
        assert cli_main(args + ["--methods", bad]) == 2
        assert "--build-time" in capsys.readouterr().err
    assert cli_main(args + ["--preset", "topm"]) == 2 and "--preset" in capsys.readouterr().err


def test_tree_attention_0_specs_attend_on_sdpa_in_steps_and_verifies(bench_env, tiny_llama_dir, tmp_path, monkeypatch):
    import dominotree.tree_attention as ta
    if not ta.enabled():
        pytest.skip(f"no tree-attention kernel here: {ta.status()}")
    import dominotree.bench.runner as runner
    calls, current = {}, {"label": None}
    real_kernel, real_run = ta._state["module"].tree_attention, runner.run_one
    monkeypatch.setattr(ta._state["module"], "tree_attention",
                        lambda *a: calls.__setitem__(current["label"], calls.get(current["label"], 0) + 1) or real_kernel(*a))

    def run_one(target, drafters, spec, *rest, **kw):
        current["label"] = spec.label
        return real_run(target, drafters, spec, *rest, **kw)
    monkeypatch.setattr(runner, "run_one", run_one)
    rc = cli_main(["bench", "--model", str(tiny_llama_dir), "--dtype", "bf16", "--prompts-file",
                   str(bench_env / "prompts.jsonl"), "--domino-drafter", str(bench_env / "domino"), "--methods",
                   "ar,ar:tree_attention=0,dominotree,dominotree:tree_attention=0", "--out", str(tmp_path / "ta"),
                   "--max-new-tokens", "8", "--max-samples", "1", "--warmup", "0"])
    assert rc == 0
    assert calls.get("ar") and calls.get("dominotree")
    assert "ar:tree_attention=0" not in calls and "dominotree:tree_attention=0" not in calls
