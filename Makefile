# `make train`: set up a lean .venv, train the quickstart model, print a sample.  `make test`: set up (with the
# dev extra), run the tests.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
WORKDIR ?= runs/quickstart

.PHONY: train test mutation clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

# `make train` installs what training and sampling need (`pip install -e .`, no test or notebook extras:
# about 800 MB instead of 2.5 GB); an up-to-date dev install (`make test`'s) already has it.
TRAIN_STAMP := $(VENV)/.installed-train
$(TRAIN_STAMP): pyproject.toml
	if [ -f $(STAMP) ] && [ $(STAMP) -nt pyproject.toml ]; then touch $(TRAIN_STAMP); else \
	  (test -x $(PY) || $(PYTHON) -m venv $(VENV)) && $(PY) -m pip install -q --upgrade pip && \
	  $(PY) -m pip install -q -e . && touch $(TRAIN_STAMP); fi

train: $(TRAIN_STAMP)
	$(PY) launch/train.py --config=configs/quickstart.py --workdir=$(WORKDIR)
	$(PY) launch/sample.py --workdir=$(WORKDIR)

# First the docs site (mkdocs.yml; strict: a broken link or anchor, or a page missing from the nav, fails it;
# not --quiet, which would hide the warnings that strict counts), then the suite in TEST_JOBS processes
# (pytest-xdist; 0 = in this process), then the `serial` tests alone.
TEST_JOBS ?= 2
test: $(STAMP)
	$(PY) -m mkdocs build --strict --site-dir $(VENV)/site
	$(PY) -m pytest -q --durations=40 -n $(TEST_JOBS) --dist worksteal -m "not serial" tests
	$(PY) -m pytest -q --durations=10 -m serial tests

# Mutation testing (mutmut; not part of CI): the files and tests named in pyproject.toml [tool.mutmut];
# MUTANTS picks the functions in scope (globs over mutmut's mutant names, `mutmut results --all true`
# lists them). mutation-report.txt: per-module counts, then every mutant not killed.
MUTANTS ?= 'parallax.pipeline.schedule.*' 'parallax.pipeline.validate.*' 'parallax.pipeline.simulate.*' 'parallax.pipeline.program.*' \
	'parallax.data.x__concat__*' 'parallax.data.x__num_windows__*' 'parallax.data.x__pack__*' \
	'parallax.data.x*Dataset*_offset__*' 'parallax.data.x*Dataset*batch__*' 'parallax.data.x*Dataset*epoch__*' \
	'parallax.checkpoint.*' 'parallax.parallel.vocab.*' \
	'parallax.optim.x_lr_schedule__*' 'parallax.optim.x__is_matrix__*' 'parallax.optim.x_decay_mask__*' \
	'parallax.optim.x_muon_dims__*' 'parallax.optim.x_resolve__*' \
	'parallax.corpus.*' 'parallax.tokenizer.*' 'parallax.distributed.x_*' \
	'parallax.generate.x_sample_logits__*' 'parallax.generate.x__pad_prompts__*' 'parallax.generate.x__batch_shards__*' \
	'parallax.parallel.sequence.x_check_sequence_parallel__*' 'parallax.parallel.sequence.x_usp_degree__*' \
	'parallax.parallel.sequence.x_*order__*' 'parallax.parallel.sequence.x_*layout__*' \
	'parallax.parallel.sequence.x_balanced_chunks__*' 'parallax.parallel.sequence.x_attention_work__*' \
	'parallax.prepare.*' 'parallax.data.x_parse_mixture__*' 'parallax.data.x__mixture_slot__*' \
	'parallax.data.x*Dataset*_mixture_row__*' 'parallax.data.x__shard_streams__*' 'parallax.data.x__tail_cut__*' \
	'parallax.data.x*Mixture*' 'parallax.data.x_check_source__*' 'parallax.data.x__pack_row__*' 'parallax.harness.*' \
	'parallax.steps.diloco.x__fit_spec__*' 'parallax.steps.diloco.x*DilocoPath*mean_pseudo_grad__*' \
	'parallax.steps.diloco.x*DilocoPath*sync__*' 'parallax.steps.diloco.x*DilocoPath*_part__*' \
	'parallax.steps.diloco.x*DilocoPath*_merge__*' 'parallax.steps.diloco.x*DilocoPath*_due__*' \
	'parallax.steps.diloco.x*DilocoPath*step_kind__*' 'parallax.chat.*' 'parallax.goodput.*' 'parallax.hang.*' \
	'parallax.estimate.*' 'parallax.search.x_candidates__*' 'parallax.search.x_analytic__*' \
	'parallax.mesh.x_resolve_dcn__*' 'parallax.mesh.x_device_slices__*'
MUTATION_JOBS ?= 2

mutation: $(STAMP)
	$(PY) -m pip install -q mutmut
	rm -rf mutants
	PARALLAX_TEST_CACHE=$(CURDIR)/mutants/.test-cache $(VENV)/bin/mutmut run --max-children $(MUTATION_JOBS) $(MUTANTS) || true
	$(VENV)/bin/mutmut results --all true | grep -v ': not checked' > mutants/all.txt || true
	sed -E 's/^ *([a-z_.]+)\.x.*: (.*)$$/\1 \2/' mutants/all.txt | sort | uniq -c > mutation-report.txt
	grep -v ': killed' mutants/all.txt >> mutation-report.txt || true
	@cat mutation-report.txt | head -40
	@echo "surviving mutants: mutation-report.txt (mutmut show NAME prints one)"

clean:
	rm -rf runs .pytest_cache mutants mutation-report.txt
