# Set-up, tests and demo for tf_blocksparse.  `make demo` and `make test` are the entry points.
# The scripts run from the repository root as modules (`python -m launch.train`): launch/,
# models/ and tests/ are folders of the repository, not installed packages.

VENV ?= .venv
PY = $(VENV)/bin/python
STAMP = $(VENV)/.installed
FASHION_DIR ?= /usr/share/datasets/fashion-mnist
# Three test processes (pytest-xdist), each test file in one of them: many tests leave a core
# idle for a while (waits on worker processes, cluster start-up), so on 2 cores three
# processes keep both busy (measured: 9m24s and 10m06s with three, 10m52s with two; 10m03s
# with three and 9m47s with four in a later session).
TEST_WORKERS ?= 3
PYTEST_FLAGS = -q -x -p no:cacheprovider -n $(TEST_WORKERS) --dist loadfile

export TF_CPP_MIN_LOG_LEVEL = 2
# Worker processes that tests and benchmarks start by file path import launch/ and models/ too.
export PYTHONPATH := $(CURDIR)$(if $(PYTHONPATH),:$(PYTHONPATH))

.PHONY: venv kernels data test test-compat test-slow test-notebooks lint demo bench bench-full bench-micro bench-cluster clean

venv: $(STAMP)

# The library (editable) with what the scripts, benchmarks and tests need (see pyproject.toml).
# Re-install only when pyproject.toml changes (or the venv is new).  TensorFlow, Keras and
# NumPy go in first; then the fused kernels compile against them (one core, ~30 s) while pip
# installs the extras on the other (`make venv kernels data` on fresh clones, 2 cores, timed
# in turns: 87-89 s against 119-137 s one after the other).  A build that fails here is
# retried, and reported, by `kernels`.
EXTRAS ?= launch,bench,dev
$(STAMP): pyproject.toml
	@test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q -e .
	@$(PY) tf_blocksparse/kernels/build.py > $(VENV)/kernels-build.log 2>&1 & build=$$!; \
	$(PY) -m pip install -q -e '.[$(EXTRAS)]'; rc=$$?; wait $$build; exit $$rc
	@touch $@

# The notebooks' kernel and client, only for executing the notebooks.
NB_STAMP = $(VENV)/.installed-notebooks
$(NB_STAMP): $(STAMP)
	$(PY) -m pip install -q -e '.[$(EXTRAS),notebooks]'
	@touch $@

# The fused CPU kernels (tf_blocksparse/kernels/blocksparse_ops.cc, g++ and TensorFlow's
# headers).  Never fails the make: without them the library warns once and uses its
# pure-TensorFlow path.
# Run by path, the build answers "up to date" without importing TensorFlow (5 s).
kernels: venv
	@$(PY) tf_blocksparse/kernels/build.py || \
		echo "kernels: NOTE: not built; the pure-TensorFlow path will be used"

# Debian's Fashion-MNIST IDX files; optional (without them the loaders use the digits shipped in
# datasets/digits.npz).
data:
	@if [ -d "$(FASHION_DIR)" ]; then \
		echo "data: Fashion-MNIST found in $(FASHION_DIR)"; \
	elif [ "$$(id -u)" = "0" ]; then \
		echo "data: installing dataset-fashion-mnist"; \
		( apt-get update -qq && apt-get install -y -qq dataset-fashion-mnist ) \
			|| echo "data: NOTE: could not install dataset-fashion-mnist; the digits fallback will be used"; \
	else \
		echo "data: NOTE: $(FASHION_DIR) missing and not root; the digits fallback will be used"; \
	fi

# pytest exits 5 when it collects nothing; treat that as a failure.  The repository's modules
# are byte-compiled first: the suite starts ~200 Python processes, and where
# PYTHONDONTWRITEBYTECODE is set (as in many containers) each would compile them again
# (about 0.3 s of CPU per process).
define run_pytest
	@$(PY) -m compileall -q tf_blocksparse launch models tests > /dev/null
	@rc=0; $(PY) -m pytest $(PYTEST_FLAGS) $(1) || rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "pytest: no tests were collected -- failing" >&2; exit 1; fi; \
	exit $$rc
endef

test: venv kernels data
	$(call run_pytest,)

# The same suite on the oldest supported pair, TensorFlow 2.19 with Keras 3.10, in a venv of
# its own (the pairs tested are TESTED_PAIRS in tf_blocksparse/_compat.py; the kernels are
# built per TensorFlow version, so both venvs share the checkout).
COMPAT_VENV ?= .venv-tf2.19
# tensorflow-metadata 1.18 and later are generated for protobuf 6, newer than TensorFlow 2.19's.
COMPAT_PINS ?= tensorflow==2.19.* keras==3.10.* tensorboard==2.19.* 'tensorflow-metadata<1.18'
test-compat:
	@test -x $(COMPAT_VENV)/bin/python || python3 -m venv $(COMPAT_VENV)
	$(COMPAT_VENV)/bin/python -m pip install -q -e '.[$(EXTRAS)]' $(COMPAT_PINS)
	@touch $(COMPAT_VENV)/.installed
	$(MAKE) test VENV=$(COMPAT_VENV)

# Two processes: most heavy tests start clusters of two to four TensorFlow processes themselves.
test-slow: venv kernels data
	$(call run_pytest,-m slow -n 2)

# Executes every colab/ notebook headless (CI runs it last).
test-notebooks: venv kernels data $(NB_STAMP)
	$(call run_pytest,-m notebooks tests/test_notebooks.py)

lint: venv
	$(VENV)/bin/ruff check .

demo: venv kernels data
	$(PY) -m launch.demo

# Evidence, quick versions (< 20 min on 2 cores) into benchmarks/results/quick/.
# Time to accuracy needs root (network namespaces + tc); it is skipped with a note otherwise.
BENCH_QUICK = benchmarks/results/quick
bench: venv data
	$(PY) -m launch.project_scaling --out=$(BENCH_QUICK)/scaling.json
	$(PY) -m launch.bench_convergence --models=cnn_small --seeds=0 --epochs=1 \
		--train_samples=6000 --test_samples=2000 --methods=dense,block_default,block_source \
		--out=$(BENCH_QUICK)
	@if [ "$$(id -u)" = "0" ]; then \
		$(PY) -m launch.bench_time_to_accuracy --models=vgg_fc --bandwidths_mbit=100 \
			--methods=dense,block_shared,topk --epochs=4 --steps_per_epoch=10 \
			--sparse_epoch_factor=3 --test_samples=1000 --out=$(BENCH_QUICK); \
	else echo "bench: time to accuracy skipped (needs root for network namespaces)"; fi

# Evidence at the budgets whose results are committed in benchmarks/results/ (many hours on
# 2 cores; every step keeps finished runs, so an interrupted one continues where it stopped).
# Converged accuracy: cosine schedule, full Fashion-MNIST, 4 replicas in one process (the
# same exchange per replica as 4 workers), dense converged by bench_convergence's rule.
BENCH = benchmarks/results
CONVERGE = $(PY) -m launch.bench_convergence --strategy=mirrored --num_workers=4 \
	--lr_schedule=cosine --methods=dense,block_default --model_epochs= --resume --out=$(BENCH)
# The converged curves of every model: vgg_fc's and ResNet-20's from their 20-epoch budgets.
CURVES = $(BENCH)/convergence.json,vgg_fc=$(BENCH)/convergence_vgg_fc_20_epochs.json,$\
	resnet20=$(BENCH)/convergence_resnet20_20_epochs.json
# The same with ResNet-20's converged 30-epoch budget (its wall-clock files).
CURVES_R20_30 = $(BENCH)/convergence.json,resnet20=$(BENCH)/convergence_resnet20_30_epochs.json
bench-full: venv data
	$(PY) -m launch.project_scaling --out=$(BENCH)/scaling.json
	$(PY) -m launch.demo --out=runs/demo
	cp runs/demo/results.json $(BENCH)/demo.json
	cp runs/demo/accuracy_vs_bytes.png $(BENCH)/demo_accuracy_vs_bytes.png
	$(CONVERGE) --models=cnn_small --epochs=20 --seeds=0,1,2
	$(CONVERGE) --models=cnn_small --epochs=20 --seeds=0,1,2 --methods=block_default_nomask
	$(CONVERGE) --models=cnn_small --epochs=20 --seeds=0,1,2 \
		--methods=block_default_maskcomp,block_default_maskwhole
	$(CONVERGE) --models=cnn_small --epochs=20 --seeds=0,1,2 --methods=block_default_maskvec
	$(CONVERGE) --models=cnn_small --epochs=20 --seeds=0,1,2 --methods=block_default_wholem07
	$(CONVERGE) --models=cnn_bn --epochs=20 --seeds=0,1,2 \
		--methods=dense,block_default,block_default_nomask
	$(CONVERGE) --models=cnn_bn --epochs=20 --seeds=0,1,2 --methods=block_default_maskwhole
	$(CONVERGE) --models=cnn_bn --epochs=20 --seeds=0,1,2 --methods=block_default_masknorm
	$(CONVERGE) --models=cnn_bn --epochs=20 --seeds=0,1,2 --methods=block_default_maskvec
	$(CONVERGE) --models=cnn_bn --epochs=20 --seeds=0,1,2 --methods=block_default_wholem07
	$(CONVERGE) --models=cnn_bn --epochs=20 --seeds=0,1,2 \
		--methods=block_dense_below_512_maskwhole
	$(CONVERGE) --models=cnn_small --epochs=20 --seeds=0,1,2 \
		--methods=block_dense_below_512_maskwhole
	$(CONVERGE) --models=cnn_small --epochs=20 --seeds=0,1,2 --methods=block_shared_maskwhole
	$(CONVERGE) --models=gru_nmt --epochs=20 --seeds=0,1,2
	$(CONVERGE) --models=gru_nmt --epochs=20 --seeds=0,1,2 --methods=block_dense_below_512
	$(CONVERGE) --models=gru_nmt --epochs=20 --seeds=0,1,2 --methods=block_default_maskwhole
	$(CONVERGE) --models=gru_nmt --epochs=20 --seeds=0,1,2 \
		--methods=block_dense_below_512_maskwhole
	$(CONVERGE) --models=gru_nmt --epochs=20 --seeds=0,1,2 --methods=block_default_embed
	$(CONVERGE) --models=lstm_nmt --epochs=20 --seeds=0,1,2
	$(CONVERGE) --models=gru_nmt,lstm_nmt --epochs=20 --seeds=0,1,2 --methods=block_recurrent_whole
	$(CONVERGE) --models=gru_nmt,lstm_nmt --epochs=20 --seeds=0,1,2 \
		--methods=block_recurrent_whole_nomask
	$(CONVERGE) --models=gru_nmt,lstm_nmt --epochs=20 --seeds=0,1,2 \
		--methods=block_recurrent_whole_embed
	$(CONVERGE) --models=resnet20 --epochs=12 --seeds=0,1,2
	$(CONVERGE) --models=vgg_fc --epochs=10 --seeds=0,1,2
	$(CONVERGE) --models=vgg_fc --epochs=10 --seeds=0 --methods=block_allgather --density=0.03
	$(CONVERGE) --models=vgg_fc --epochs=10 --seeds=0 --methods=block_default_dgc_warmup
	$(CONVERGE) --models=vgg_fc --epochs=10 --seeds=0 --methods=block_default --warmup_epochs=1 \
		--out=runs/vgg_lr_warmup
	cp runs/vgg_lr_warmup/convergence.json $(BENCH)/convergence_vgg_fc_lr_warmup.json
	$(CONVERGE) --models=cnn_small --epochs=20 --seeds=0,1,2 --methods=local_dense,local_block
	$(CONVERGE) --models=cnn_small --epochs=20 --seeds=0 --methods=local_block_nesterov
	$(CONVERGE) --models=cnn_small --epochs=20 --seeds=0,1,2 --methods=local_average
	$(CONVERGE) --models=cnn_small --epochs=20 --seeds=0,1,2 --methods=local_block_20pct_nesterov
	$(CONVERGE) --models=cnn_small --epochs=20 --seeds=0,1,2 \
		--methods=local_block_40pct_int4_nesterov
	$(CONVERGE) --models=vgg_fc --epochs=10 --seeds=0 \
		--methods=local_block,local_dense,local_block_nesterov
	$(CONVERGE) --models=vgg_fc --epochs=20 --seeds=0,1,2 --out=runs/vgg_long
	$(CONVERGE) --models=vgg_fc --epochs=20 --seeds=0,1,2 --methods=local_block --out=runs/vgg_long
	$(CONVERGE) --models=vgg_fc --epochs=20 --seeds=0,1,2 --methods=local_dense --out=runs/vgg_long
	$(CONVERGE) --models=vgg_fc --epochs=20 --seeds=0,1,2 --methods=local_block_20pct_nesterov \
		--out=runs/vgg_long
	$(CONVERGE) --models=vgg_fc --epochs=20 --seeds=0,1,2 \
		--methods=local_block_40pct_int4_nesterov --out=runs/vgg_long
	$(CONVERGE) --models=vgg_fc --epochs=20 --seeds=0,1,2 --methods=local_average \
		--out=runs/vgg_long
	$(CONVERGE) --models=vgg_fc --epochs=20 --seeds=0,1,2 --methods=block_default_maskwhole \
		--out=runs/vgg_long
	cp runs/vgg_long/convergence.json $(BENCH)/convergence_vgg_fc_20_epochs.json
	$(CONVERGE) --models=vgg_fc --epochs=20 --seeds=0 --methods=local_block_20pct \
		--out=runs/vgg_local_tuning
	cp runs/vgg_local_tuning/convergence.json $(BENCH)/convergence_vgg_fc_local_tuning.json
	$(CONVERGE) --models=resnet20 --epochs=20 --seeds=0,1,2 --out=runs/r20_long
	$(CONVERGE) --models=resnet20 --epochs=20 --seeds=0,1,2 --methods=local_block --out=runs/r20_long
	$(CONVERGE) --models=resnet20 --epochs=20 --seeds=0,1,2 --methods=local_dense --out=runs/r20_long
	cp runs/r20_long/convergence.json $(BENCH)/convergence_resnet20_20_epochs.json
	$(CONVERGE) --models=resnet20 --epochs=30 --seeds=0,1,2 --out=runs/r20_30ep
	$(CONVERGE) --models=resnet20 --epochs=30 --seeds=0,1,2 --methods=block_default_dgc_warmup \
		--out=runs/r20_30ep
	$(CONVERGE) --models=resnet20 --epochs=30 --seeds=0,1,2,3 --methods=block_default_nomask \
		--out=runs/r20_30ep
	$(CONVERGE) --models=resnet20 --epochs=30 --seeds=0,1,2 --methods=block_default_maskwhole \
		--out=runs/r20_30ep
	$(CONVERGE) --models=resnet20 --epochs=30 --seeds=0,1,2 --methods=block_dense_below_512_maskwhole \
		--out=runs/r20_30ep
	$(CONVERGE) --models=resnet20 --epochs=30 --seeds=3,4 --methods=dense,block_default_maskwhole \
		--out=runs/r20_30ep
	$(CONVERGE) --models=resnet20 --epochs=30 --seeds=0,1,2 --methods=block_default_masknorm \
		--out=runs/r20_30ep
	$(CONVERGE) --models=resnet20 --epochs=30 --seeds=1,2 --methods=block_default_maskvec \
		--out=runs/r20_30ep
	$(CONVERGE) --models=resnet20 --epochs=30 --seeds=0,1 --methods=block_shared_maskwhole \
		--out=runs/r20_30ep
	$(CONVERGE) --models=resnet20 --epochs=30 --seeds=0 --methods=block_default_wholem07 \
		--out=runs/r20_30ep
	cp runs/r20_30ep/convergence.json $(BENCH)/convergence_resnet20_30_epochs.json
	$(CONVERGE) --models=resnet20 --epochs=30 --seeds=0,1,2 --methods=block_default --warmup_epochs=1 \
		--out=runs/r20_30ep_lr_warmup
	cp runs/r20_30ep_lr_warmup/convergence.json $(BENCH)/convergence_resnet20_30_epochs_lr_warmup.json
	$(CONVERGE) --models=resnet20 --epochs=20 --seeds=0 --methods=local_block_40pct_int4_nesterov \
		--out=runs/r20_local_tuning
	cp runs/r20_local_tuning/convergence.json $(BENCH)/convergence_resnet20_local_tuning.json
	@if [ "$$(id -u)" = "0" ]; then \
		$(PY) -m launch.bench_backup --epochs=6 --repeats=3 --out=$(BENCH) && \
		$(PY) -m launch.bench_wall_clock --models=cnn_small,gru_nmt --bandwidths_mbit=100,1000 \
			--methods=dense,block_default,block_auto_default --convergence=$(CURVES) \
			--check=gru_nmt:100:block_default:0 --out=$(BENCH) && \
		$(PY) -m launch.bench_wall_clock --models=gru_nmt,lstm_nmt --bandwidths_mbit=30,300 \
			--methods=dense,block_default,block_auto_default \
			--convergence=$(CURVES) --out=$(BENCH) && \
		$(PY) -m launch.bench_wall_clock --models=gru_nmt,lstm_nmt --bandwidths_mbit=30,300 \
			--methods=dense,block_auto_default --timing_repeats=5 --timing_order=turns \
			--convergence=$(CURVES) --out=runs/wall_rep_rnn && \
		cp runs/wall_rep_rnn/time_to_accuracy.json $(BENCH)/time_to_accuracy_recurrent.json && \
		$(PY) -m launch.bench_wall_clock --models=vgg_fc --bandwidths_mbit=100,1000 \
			--methods=dense,block_default,block_auto_default --out=$(BENCH) \
			--convergence=$(CURVES) && \
		$(PY) -m launch.bench_wall_clock --models=resnet20 --bandwidths_mbit=100,1000 \
			--methods=dense,block_default,block_auto_default --out=$(BENCH) \
			--convergence=$(CURVES) && \
		$(PY) -m launch.bench_wall_clock --models=resnet20 --bandwidths_mbit=100,1000 \
			--methods=dense,block_default,block_auto_default --timing_repeats=3 --timing_order=turns \
			--convergence=$(CURVES) --out=runs/r20_wall_rep && \
		cp runs/r20_wall_rep/time_to_accuracy.json $(BENCH)/time_to_accuracy_resnet20_repeats.json && \
		mkdir -p runs/r20_wall30_rep && \
		cp runs/r20_wall_rep/time_to_accuracy.json runs/r20_wall30_rep/ && \
		$(PY) -m launch.bench_wall_clock --models=resnet20 --bandwidths_mbit=100,1000 \
			--methods=dense,block_default,block_auto_default --timing_repeats=3 --timing_order=turns \
			--convergence=$(CURVES_R20_30) \
			--out=runs/r20_wall30_rep && \
		cp runs/r20_wall30_rep/time_to_accuracy.json $(BENCH)/time_to_accuracy_resnet20_30_epochs.json && \
		$(PY) -m launch.bench_wall_clock --models=cnn_small,gru_nmt,resnet20,vgg_fc \
			--bandwidths_mbit=100,1000 \
			--methods=dense,block_default_maskwhole,block_auto_maskwhole \
			--convergence=$(BENCH)/convergence.json,vgg_fc=$(BENCH)/convergence_vgg_fc_20_epochs.json,resnet20=$(BENCH)/convergence_resnet20_30_epochs.json \
			--check=cnn_small:100:block_default_maskwhole:0 --out=runs/wall_mw && \
		cp runs/wall_mw/time_to_accuracy.json $(BENCH)/time_to_accuracy_maskwhole.json && \
		$(PY) -m launch.bench_wall_clock --models=cnn_small --bandwidths_mbit=100,1000 \
			--methods=dense,block_default_maskwhole,block_auto_maskwhole --timing_steps=234 \
			--convergence=$(BENCH)/convergence.json \
			--check=cnn_small:100:block_default_maskwhole:0 --out=runs/wall_mw_cnn && \
		cp runs/wall_mw_cnn/time_to_accuracy.json $(BENCH)/time_to_accuracy_maskwhole_cnn_small.json && \
		$(PY) -m launch.bench_wall_clock --models=resnet20 --bandwidths_mbit=100,1000 \
			--methods=dense,block_default_maskwhole,block_auto_maskwhole --timing_repeats=3 --timing_order=turns \
			--convergence=$(CURVES_R20_30) \
			--out=runs/wall_mw_r20rep && \
		cp runs/wall_mw_r20rep/time_to_accuracy.json $(BENCH)/time_to_accuracy_maskwhole_resnet20_repeats.json && \
		$(PY) -m launch.bench_wall_clock --models=resnet20 --bandwidths_mbit=100 \
			--methods=dense,block_auto_maskwhole --timing_repeats=4 \
			--convergence=$(CURVES_R20_30) --out=runs/wall_r20_bal && \
		cp runs/wall_r20_bal/time_to_accuracy.json $(BENCH)/time_to_accuracy_maskwhole_resnet20_balanced.json && \
		$(PY) -m launch.bench_wall_clock --models=resnet20 --bandwidths_mbit=100,1000 \
			--methods=dense,block_default_nomask,block_auto_nomask --timing_repeats=3 --timing_order=turns \
			--convergence=$(CURVES_R20_30) \
			--check=resnet20:100:block_default_nomask:0 --out=runs/wall_nomask && \
		cp runs/wall_nomask/time_to_accuracy.json $(BENCH)/time_to_accuracy_nomask_resnet20_repeats.json && \
		$(PY) -m launch.bench_wall_clock --models=gru_nmt --bandwidths_mbit=100,1000 \
			--methods=dense,block_auto_maskwhole --timing_repeats=5 --timing_order=turns \
			--convergence=$(BENCH)/convergence.json --out=runs/wall_gru_rep && \
		cp runs/wall_gru_rep/time_to_accuracy.json $(BENCH)/time_to_accuracy_maskwhole_gru_nmt_repeats.json && \
		$(PY) -m launch.bench_wall_clock --models=gru_nmt --bandwidths_mbit=100,1000 \
			--methods=dense,block_auto_maskwhole --timing_repeats=6 \
			--convergence=$(BENCH)/convergence.json --out=runs/wall_gru_bal && \
		cp runs/wall_gru_bal/time_to_accuracy.json $(BENCH)/time_to_accuracy_maskwhole_gru_nmt_balanced.json && \
		$(PY) -m launch.bench_wall_clock --models=gru_nmt --bandwidths_mbit=100,1000 \
			--methods=dense,block_default_embed,block_auto_embed --timing_repeats=3 --timing_order=turns \
			--convergence=$(BENCH)/convergence.json --out=runs/wall_gru_embed && \
		cp runs/wall_gru_embed/time_to_accuracy.json $(BENCH)/time_to_accuracy_embed_gru_nmt_repeats.json && \
		$(PY) -m launch.bench_wall_clock --models=gru_nmt --bandwidths_mbit=1000 \
			--methods=dense,block_auto_embed --timing_repeats=4 --timing_order=turns \
			--convergence=$(BENCH)/convergence.json --out=runs/wall_gru_inert && \
		cp runs/wall_gru_inert/time_to_accuracy.json $(BENCH)/time_to_accuracy_embed_gru_nmt_1gbit_repeats.json && \
		$(PY) -m launch.bench_wall_clock --models=gru_nmt --bandwidths_mbit=1000 \
			--methods=dense,block_auto_embed --timing_repeats=8 --timing_order=balanced \
			--convergence=$(BENCH)/convergence.json --out=runs/wall_gru_bal8 && \
		cp runs/wall_gru_bal8/time_to_accuracy.json $(BENCH)/time_to_accuracy_embed_gru_nmt_1gbit_balanced.json && \
		$(PY) -m launch.bench_wall_clock --models=resnet20 --bandwidths_mbit=1000 \
			--methods=dense,block_auto_embed --timing_repeats=4 --timing_order=balanced \
			--convergence=$(CURVES_R20_30) --out=runs/wall_r20_bal4 && \
		cp runs/wall_r20_bal4/time_to_accuracy.json $(BENCH)/time_to_accuracy_embed_resnet20_1gbit_balanced.json && \
		$(PY) -m launch.bench_wall_clock --models=cnn_small,gru_nmt --bandwidths_mbit=1000 \
			--methods=dense,block_auto_default --timing_repeats=3 --timing_order=turns \
			--convergence=$(BENCH)/convergence.json --out=runs/wall_rep && \
		cp runs/wall_rep/time_to_accuracy.json $(BENCH)/time_to_accuracy_repeats.json && \
		$(PY) -m launch.bench_wall_clock --models=cnn_small --bandwidths_mbit=100,10 \
			--methods=dense,block_default,local_dense,local_block --target_drop=0.005 \
			--timing_steps=64 --convergence=$(CURVES) --out=runs/local_wall && \
		$(PY) -m launch.bench_wall_clock --models=vgg_fc --bandwidths_mbit=100 \
			--methods=dense,block_default,local_dense,local_block,local_block_20pct_nesterov,local_block_40pct_int4_nesterov \
			--target_drop=0.005 \
			--timing_steps=64 --convergence=$(CURVES) --out=runs/local_wall && \
		$(PY) -m launch.bench_wall_clock --models=resnet20 --bandwidths_mbit=100 \
			--methods=dense,block_default,local_dense,local_block --target_drop=0.005 \
			--timing_steps=64 --convergence=$(CURVES) --out=runs/local_wall && \
		cp runs/local_wall/time_to_accuracy.json $(BENCH)/local_steps_wall_clock.json && \
		$(PY) -m launch.bench_wall_clock --models=cnn_small --bandwidths_mbit=10,100 \
			--methods=dense,local_block,local_auto --target_drop=0.005 --timing_steps=64 \
			--convergence=$(CURVES) --out=runs/local_auto_wall && \
		cp runs/local_auto_wall/time_to_accuracy.json $(BENCH)/local_steps_auto_wall_clock.json && \
		$(PY) -m launch.bench_wall_clock --models=vgg_fc --bandwidths_mbit=10 \
			--methods=dense,block_default,local_dense,local_block,local_block_20pct_nesterov \
			--target_drop=0.005 \
			--timing_steps=32 --timing_epochs=2 --convergence=$(CURVES) --out=runs/local_wall_10 && \
		$(PY) -m launch.bench_wall_clock --models=resnet20 --bandwidths_mbit=10 \
			--methods=dense,block_default,local_dense,local_block --target_drop=0.005 \
			--timing_steps=32 --timing_epochs=2 --convergence=$(CURVES) --out=runs/local_wall_10 && \
		cp runs/local_wall_10/time_to_accuracy.json $(BENCH)/local_steps_wall_clock_10mbit.json && \
		$(PY) -m launch.bench_wall_clock --models=resnet20 --bandwidths_mbit=100 \
			--methods=dense,block_default,local_dense,local_block --target_drop=0.005 \
			--timing_steps=64 --timing_repeats=3 --timing_order=turns --convergence=$(CURVES) --out=runs/r20_local_rep && \
		cp runs/r20_local_rep/time_to_accuracy.json $(BENCH)/local_steps_wall_clock_resnet20_repeats.json; \
	else echo "bench-full: backup and wall-clock benches skipped (need root for network namespaces)"; fi
	$(PY) -m launch.local_steps_report --convergence=$(CURVES) \
		--wall_clock=$(BENCH)/local_steps_wall_clock.json,$(BENCH)/local_steps_wall_clock_10mbit.json,$(BENCH)/local_steps_wall_clock_resnet20_repeats.json
	@echo "bench-full: the early-training groups of time_to_accuracy_early.json and convergence_early.json"
	@echo "have their own commands in docs/results.md"

# Pipeline and hybrid training across worker processes on an emulated cluster (root: network
# namespaces, tc, cgroups; ~6 min).  Every plan of a seed is measured in the same run.
bench-cluster: venv data
	@for s in 0 1 2; do \
		$(PY) -m launch.train_pipeline --workers=4 --topology=random --spread=0.8 \
			--bandwidth_mbit=200 --model=vgg_fc --steps=20 --micro_batches=4 --seed=$$s \
			--out=runs/pipeline_cluster_seed$$s \
			--results_file=$(BENCH)/pipeline_cluster.json || exit 1; \
	done
	$(PY) -m launch.train_hybrid --workers=2+1 --model=vgg_fc --dataset=fashion_mnist \
		--fc_units=4096 --steps=5 --batch_size=64 --conv_worker_memory_mib=900 \
		--verify_against_data_parallel --out=$(BENCH)

# Micro-benchmarks of single features (each prints one JSON object).
bench-micro: venv kernels
	$(PY) -m launch.bench_selection
	$(PY) -m launch.bench_fusion
	$(PY) -m launch.bench_clipping
	$(PY) -m launch.bench_pipeline
	$(PY) -m launch.bench_hybrid

clean:
	rm -rf build dist *.egg-info .pytest_cache .ruff_cache .hypothesis runs
	rm -f tf_blocksparse/kernels/*.so
	find . -path ./$(VENV) -prune -o -name __pycache__ -type d -exec rm -rf {} +
