"""The CLI: JSON output, streaming text, error messages with exit code 2."""
import json

import numpy as np
import pytest
import torch

from dominotree.cli import main
from dominotree.drafters import save_checkpoint
from conftest import random_drafter


def run_cli(capsys, *argv):
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_generate_json_matches_the_api(tiny_llama_dir, tiny_target, capsys):
    import dominotree as dt
    code, out, _ = run_cli(capsys, "generate", "--model", str(tiny_llama_dir), "--dtype", "fp32", "--method", "ar",
                           "--max-new-tokens", "12", "--json", "hello world")
    assert code == 0
    obj = json.loads(out)
    assert set(obj) == {"text", "token_ids", "stats"}
    ref = dt.generate(tiny_target, None, "hello world", method="ar", max_new_tokens=12)
    assert obj["token_ids"] == ref.token_ids and obj["text"] == ref.text


@pytest.fixture(scope="module")
def byte_level_model_dir(tmp_path_factory):
    """A tiny random model whose tokenizer is byte-level, so its answers end rounds inside a character."""
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
    from conftest import _sharpen, tiny_config_kwargs
    from helpers import byte_level_tokenizer
    tok = byte_level_tokenizer()
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**{**tiny_config_kwargs(), "vocab_size": tok.get_vocab_size()}))
    _sharpen(model)
    path = tmp_path_factory.mktemp("byte_level")
    model.save_pretrained(path)
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>").save_pretrained(path)
    return path


def test_streamed_text_is_the_answer_even_where_rounds_split_characters(byte_level_model_dir, capsys):
    """The streamed text once stopped at the first round that ended inside a character (a Chinese
    answer printed one replacement character and nothing more)."""
    base = ["generate", "--model", str(byte_level_model_dir), "--dtype", "fp32", "--method", "ar", "--raw",
            "--max-new-tokens", "60"]
    for prompt in ["你好", "Grüße", "🙂"]:
        code, out, _ = run_cli(capsys, *base, "--json", prompt)
        answer = json.loads(out)["text"]
        assert code == 0 and "\ufffd" in answer     # bytes that end mid-character now and then
        code, streamed, err = run_cli(capsys, *base, prompt)
        assert code == 0 and streamed == answer, err
        stop = answer[len(answer) // 2:][:2]
        code, streamed, _ = run_cli(capsys, *base, "--stop", stop, prompt)
        assert code == 0 and streamed == answer[:answer.find(stop)]


def test_a_reader_that_goes_away_ends_the_command_quietly(tiny_llama_dir):
    """`dominotree generate ... | head -c 1` printed 'error: [Errno 32] Broken pipe' and exited 2."""
    import subprocess
    import sys
    proc = subprocess.Popen([sys.executable, "-m", "dominotree.cli", "generate", "--model", str(tiny_llama_dir),
                             "--dtype", "fp32", "--method", "ar", "--max-new-tokens", "200", "hello world"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.read(1)
    proc.stdout.close()                      # as `head -c 1` does, long before 200 tokens are out
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 141, err
    assert "Broken pipe" not in err and "Traceback" not in err and "Exception ignored" not in err, err


def test_no_pack_and_no_gqa_flags_load_the_plain_paths(tiny_llama_dir, capsys, monkeypatch):
    import dominotree as dt
    seen = []
    real = dt.load_target
    monkeypatch.setattr(dt, "load_target", lambda *a, **k: seen.append(real(*a, **k)) or seen[-1])
    outs = []
    for extra in ([], ["--no-pack"], ["--no-gqa"]):
        code, out, _ = run_cli(capsys, "generate", "--model", str(tiny_llama_dir), "--dtype", "bf16", "--method", "ar",
                               "--max-new-tokens", "12", "--json", *extra, "hello world")
        assert code == 0
        outs.append(json.loads(out)["token_ids"])
    from dominotree.packed import packing_available
    assert [t.packed for t in seen] == [packing_available(), False, packing_available()]
    assert [t.gqa_attention for t in seen] == [True, True, False]
    assert outs[0] == outs[1] == outs[2]


def test_generate_with_a_lookup_branch(tiny_llama_dir, tiny_target, tmp_path, capsys):
    import dominotree as dt
    path = tmp_path / "d"
    save_checkpoint(random_drafter(False), path, dtype=torch.float32)
    code, out, _ = run_cli(capsys, "generate", "--model", str(tiny_llama_dir), "--dtype", "fp32", "--drafter",
                           str(path), "--method", "ddtree", "--lookup", "5", "--max-new-tokens", "12", "--json", "hi hi")
    assert code == 0
    obj = json.loads(out)
    assert obj["stats"]["lookup_accepted"] >= 0
    assert obj["token_ids"] == dt.generate(tiny_target, None, "hi hi", method="ar", max_new_tokens=12).token_ids
    for extra, match in [(["--lookup-store", "train-data"], "needs lookup=N > 0"),
                         (["--lookup", "4", "--lookup-store", str(tmp_path / "none")], "not a directory of training shards")]:
        code, _, err = run_cli(capsys, "generate", "--model", str(tiny_llama_dir), "--dtype", "fp32", "--drafter",
                               str(path), "--method", "ddtree", *extra, "hi")
        assert code == 2 and match in err and "Traceback" not in err


def test_generate_with_a_draft_vocabulary(tiny_llama_dir, tiny_target, tmp_path, capsys):
    import dominotree as dt
    from dominotree.train.data import Sequence, write_shard
    path, source = tmp_path / "d", tmp_path / "s"
    save_checkpoint(random_drafter(True), path, dtype=torch.float32)
    source.mkdir()
    write_shard(source / "shard_00000.npz", [Sequence(np.arange(1, 90), 1, "test")])
    code, out, _ = run_cli(capsys, "generate", "--model", str(tiny_llama_dir), "--dtype", "fp32", "--drafter",
                           str(path), "--method", "dominotree", "--draft-vocab", "64", "--draft-vocab-source",
                           str(source), "--max-new-tokens", "12", "--json", "hi hi")
    assert code == 0
    assert json.loads(out)["token_ids"] == dt.generate(tiny_target, None, "hi hi", method="ar",
                                                       max_new_tokens=12).token_ids
    code, _, err = run_cli(capsys, "generate", "--model", str(tiny_llama_dir), "--dtype", "fp32", "--drafter",
                           str(path), "--method", "dominotree", "--draft-vocab", "16", "hi")
    assert code == 2 and "smaller than the 64 candidates" in err and "Traceback" not in err


def test_generate_with_a_drafter_dir_streams_text(tiny_llama_dir, tmp_path, capsys):
    path = tmp_path / "d"
    save_checkpoint(random_drafter(True), path, dtype=torch.float32)
    code, out, err = run_cli(capsys, "generate", "--model", str(tiny_llama_dir), "--dtype", "fp32", "--drafter",
                             str(path), "--method", "dominotree", "--max-new-tokens", "10", "hello")
    assert code == 0 and out.strip()
    assert "tau" in err and "[dominotree]" in err


@pytest.mark.parametrize("argv, match", [
    (["generate", "--model", "no-such-model", "hi"], "unknown model"),
    (["generate", "--model", "{tiny}", "--dtype", "fp32", "--method", "ar", ""], "empty prompt"),
    (["generate", "--model", "{tiny}", "--dtype", "fp32", "--method", "ar", "--max-new-tokens", "0", "hi"], "max_new_tokens"),
    (["generate", "--model", "{tiny}", "--dtype", "fp32", "--method", "dominotree", "--drafter", "/nonexistent", "hi"], "unknown drafter"),
    (["generate", "--model", "{tiny}", "--dtype", "fp32", "--method", "ar", "--lookup", "4", "hi"], "method 'ar'"),
])
def test_errors_exit_2_with_one_line(tiny_llama_dir, capsys, argv, match):
    argv = [a.replace("{tiny}", str(tiny_llama_dir)) for a in argv]
    code, out, err = run_cli(capsys, *argv)
    assert code == 2
    assert match in err and "Traceback" not in err and err.startswith("dominotree: error:")


@pytest.mark.parametrize("argv, match", [
    (["train", "dflash", "--steps", "0"], "steps must be an integer >= 1"),
    (["train", "domino", "--anchors-per-seq", "0"], "anchors_per_seq"),
    (["train", "dflash", "--layers", "1,x"], "--layers must be comma-separated integers, got"),
    (["train", "data", "--num-prompts", "-5"], "num_prompts must be an integer >= 1"),
    (["train", "features", "--layers", "1,x"], "--layers must be comma-separated integers, got"),
    (["profile", "--contexts", "128,x"], "--contexts must be comma-separated integers, got"),
    (["generate", "--budget", "0", "hi"], "budget must be an integer >= 1"),       # took ~9 s of loading
    (["generate", "--method", "ar", "--temperature", "-1", "hi"], "temperature must be"),
    (["generate", "--lookup-store", "train-data", "hi"], "needs lookup=N > 0"),
    (["serve", "--port", "0", "--lookup", "-1"], "lookup must be"),
    (["serve", "--port", "0", "--draft-vocab", "-3"], "draft_vocab must be"),
])
def test_bad_flags_exit_2_before_the_target_loads(capsys, monkeypatch, tmp_path, argv, match):
    import dominotree as dt

    def no_load(*a, **k):
        raise AssertionError("the target loaded before the flags were checked")
    monkeypatch.setattr(dt, "load_target", no_load)
    code, _, err = run_cli(capsys, *argv, *(["--workdir", str(tmp_path)] if argv[0] == "train" else []))
    assert code == 2 and match in err and "Traceback" not in err


@pytest.mark.parametrize("argv, module, extra", [
    (["bench", "--methods", "ar", "--out", "unused"], "matplotlib", "bench"),
    (["bench", "--report-only", "unused"], "matplotlib", "bench"),
    (["serve", "--method", "ar"], "fastapi", "serve"),
    (["serve", "--method", "ar"], "uvicorn", "serve"),
])
def test_a_missing_extra_is_named_before_the_command_runs(capsys, monkeypatch, argv, module, extra):
    import sys
    import dominotree as dt
    monkeypatch.setitem(sys.modules, module, None)       # as if the extra were not installed
    monkeypatch.setattr(dt, "load_target", lambda *a, **k: pytest.fail("the model loaded"))
    code, _, err = run_cli(capsys, *argv)
    assert code == 2 and f"needs {module}: pip install 'dominotree[{extra}]'" in err and "Traceback" not in err


def test_unknown_method_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as e:
        main(["generate", "--method", "beam", "hi"])
    assert e.value.code == 2


def test_version(capsys):
    import importlib.metadata
    import dominotree
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.strip() == f"dominotree {dominotree.__version__}"
    # the package's metadata (pyproject.toml) and the module say the same
    assert importlib.metadata.version("dominotree") == dominotree.__version__


def test_models_lists_named_models(capsys):
    code, out, _ = run_cli(capsys, "models", "--json")
    names = {r["name"] for r in json.loads(out)}
    assert {"smollm2-135m", "smollm2-135m-dflash", "smollm2-135m-domino"} <= names


def test_train_stages_from_the_cli(tiny_llama_dir, tiny_target, tmp_path, capsys):
    import dominotree as dt
    work = str(tmp_path / "w")
    base = ["--model", str(tiny_llama_dir), "--workdir", work]
    assert main(["train", "data", *base, "--num-prompts", "12", "--max-new-tokens", "16"]) == 0
    assert main(["train", "features", *base, "--layers", "1,2", "--time-limit", "600"]) == 0
    assert main(["train", "dflash", *base, "--steps", "3", "--num-layers", "1", "--seqs-per-step", "2",
                 "--anchors-per-seq", "2", "--vocab-min-count", "2", "--vocab-top", "64"]) == 0
    drafter = dt.load_drafter(f"{work}/dflash/model", target=tiny_target)
    assert drafter.config.target_layer_ids == [1, 2] and drafter.config.shift_label
    config = json.loads(open(f"{work}/dflash/train_config.json").read())
    assert (config["vocab_min_count"], config["vocab_top"]) == (2, 64)
    # a head alone on that backbone, kept fixed, with its own batch order
    assert main(["train", "domino", *base, "--steps", "2", "--num-layers", "1", "--seqs-per-step", "2",
                 "--anchors-per-seq", "2", "--init-from", f"{work}/dflash/model", "--freeze-backbone",
                 "--seed", "3", "--out", f"{work}/head", "--prefix-len", "0"]) == 0
    head = dt.load_drafter(f"{work}/head/model", target=tiny_target)
    assert hasattr(head, "head") and torch.equal(head.backbone.fc.weight, drafter.backbone.fc.weight)
    assert head.prefix_len == 0                     # the head corrects depth 1 too
    cfg = json.loads(open(f"{work}/head/train_config.json").read())
    assert cfg["seed"] == 3 and cfg["freeze_backbone"] and cfg["pure_draft_prefix_len"] == 0
    code, _, err = run_cli(capsys, "train", "dflash", *base[:2], "--workdir", str(tmp_path / "empty"))
    assert code == 2 and "no feature store" in err and "Traceback" not in err
    # held-out tau on a slice of the training prompts, one per mix group
    assert main(["train", "eval", *base[:2], "--drafters", f"{work}/dflash/model", "--training-prompts", "0:40",
                 "--max-samples", "1", "--max-new-tokens", "6", "--out", f"{work}/eval.json"]) == 0
    rows = json.loads(open(f"{work}/eval.json").read())["rows"]
    assert {r["dataset"]: r["prompts"] for r in rows} == {"train-instruction": 1, "train-code": 1,
                                                          "train-math": 1, "all": 3}
    # ... drafting from the 64 tokens the workdir's responses hold most (a bad size is a clear error)
    assert main(["train", "eval", *base[:2], "--drafters", f"{work}/dflash/model", "--training-prompts", "0:40",
                 "--max-samples", "1", "--max-new-tokens", "6", "--draft-vocab", "64",
                 "--draft-vocab-source", f"{work}/data", "--out", f"{work}/eval_dv.json"]) == 0
    assert len(json.loads(open(f"{work}/eval_dv.json").read())["rows"]) == 4
    code, _, err = run_cli(capsys, "train", "eval", *base[:2], "--drafters", f"{work}/dflash/model",
                           "--training-prompts", "0:40", "--draft-vocab", "100000", "--draft-vocab-source", f"{work}/data")
    assert code == 2 and "draft_vocab must be an integer in 1..96" in err
    code, _, err = run_cli(capsys, "train", "eval", *base[:2], "--drafters", f"{work}/dflash/model",
                           "--training-prompts", "9:3")
    assert code == 2 and "START < END" in err
