# Two commands do everything on a fresh machine with Python 3.11 and a C++ compiler:
#   make demo   - set up .venv, build the ops, train a small model on 2 MPI ranks
#   make test   - set up .venv, build the ops, run the whole test suite
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.matex-installed
# scikit-learn (the extra [bench]) lives here, off the virtualenv's path: Keras imports it
# whenever it is importable, 1.2 s of each TensorFlow start-up, and only benchmarks/hpo.py's
# Keras Tuner baseline uses it (that driver puts this folder on its own path)
BENCH_SITE := $(VENV)/bench-site
SCIKIT_LEARN := scikit-learn>=1.5,<1.10

export OMPI_ALLOW_RUN_AS_ROOT := 1
export OMPI_ALLOW_RUN_AS_ROOT_CONFIRM := 1
export TF_CPP_MIN_LOG_LEVEL := 2
export PIP_DISABLE_PIP_VERSION_CHECK := 1
# pytest-xdist workers for `make test` (1: none). On the 2-core machine two workers were
# no faster than one (the suite keeps both cores busy) and a chaos test failed under the
# load, so one is the default; on a bigger machine MATEX_TEST_WORKERS=N shares the modules
MATEX_TEST_WORKERS ?= 1
XDIST := $(if $(filter-out 1,$(MATEX_TEST_WORKERS)),-n $(MATEX_TEST_WORKERS) --dist loadfile --no-loadscope-reorder)

.PHONY: demo test ops venv bench clean docs dist

venv: $(STAMP)

# TensorFlow is an extra ([cpu] here; [and-cuda] or the cluster's own build elsewhere)
$(STAMP): setup.py pyproject.toml matex/_version.py
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e ".[mpi,cpu,hpo,science,test,docs]"
	# the extra [tf-keras] (Keras 2), without its `tensorflow` requirement, which would
	# install the CUDA build over tensorflow-cpu
	$(PY) -m pip install -q --no-deps "tf-keras>=2.21,<2.22"
	# scikit-learn and what it needs beyond the virtualenv, as pip resolves it (a list kept
	# by hand went stale twice), off the path; the import is checked here, not in a benchmark
	$(PY) -m pip install -q --dry-run --report $(VENV)/bench-site.json "$(SCIKIT_LEARN)"
	$(PY) -m pip install -q --no-deps --upgrade --target $(BENCH_SITE) $$($(PY) -c \
		"import json, sys; print(' '.join('%s==%s' % (i['metadata']['name'], \
		i['metadata']['version']) for i in json.load(open(sys.argv[1]))['install']))" \
		$(VENV)/bench-site.json)
	PYTHONPATH=$(BENCH_SITE) $(PY) -c "import sklearn.gaussian_process"
	@touch $(STAMP)

ops: $(STAMP)
	@$(PY) -m matex._build >/dev/null

demo: ops
	$(VENV)/bin/matexrun -n 2 examples/demo.py

test: ops
	$(PY) -m ruff check .
	$(PY) -m pytest -q $(XDIST) --durations=25 tests

# the CLI and environment reference pages are generated from the code first
docs: $(STAMP)
	$(PY) docs/hooks/reference.py
	$(PY) -m mkdocs build --strict --site-dir build/site

# every benchmark of benchmarks/ (hours on a small machine): the drivers launch their own
# mpiexec; the two Horovod-API benchmarks run under matexrun
BENCH_DRIVERS := $(filter-out benchmarks/_% benchmarks/elastic_commit.py \
                   benchmarks/horovod_join.py,$(sort $(wildcard benchmarks/*.py)))
bench: ops
	@set -e; for driver in $(BENCH_DRIVERS); do echo "== $$driver"; $(PY) $$driver; done
	$(VENV)/bin/matexrun --horovod -n 2 benchmarks/horovod_join.py
	$(VENV)/bin/matexrun --horovod -n 2 benchmarks/elastic_commit.py

# an sdist and a wheel in dist/ (the ops are compiled on first use, not here)
dist: $(STAMP)
	rm -rf dist
	$(PY) -m build --no-isolation --outdir dist .

clean:
	rm -rf $(VENV) build dist *.egg-info data .test-reports
