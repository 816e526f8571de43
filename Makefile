# The two commands a new user needs: `make demo` and `make test`.
# Both create .venv, install torch==2.13.0 from PyPI (the platform's default wheel) and megazero with its extras.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.megazero-installed
TORCH := torch==2.13.0
PYTEST_ARGS ?=

DEMO_DATA := data/stdlib
NPROC ?= 8

.PHONY: test demo install clean pictures

install: $(STAMP)

$(STAMP): setup.py
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip setuptools wheel
	$(PY) -m pip install -q $(TORCH)
	$(PY) -m pip install -q --no-build-isolation -e '.[test,bench,viz,monitor]' $(TORCH)
	touch $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q -p no:cacheprovider --durations=25 $(PYTEST_ARGS) tests

$(DEMO_DATA).idx: $(STAMP)
	$(PY) tools/preprocess_data.py --python-stdlib --max-bytes 3M --output-prefix $(DEMO_DATA)

demo: $(STAMP) $(DEMO_DATA).idx
	$(VENV)/bin/torchrun --standalone --nproc_per_node=$(NPROC) -m megazero.run.train configs/demo.yaml $(ARGS)

# The schedule pictures of docs/schedule-pictures.md, drawn by the tool (the measured two from the last `make demo`), and 1-bit Adam's curves.
pictures: $(STAMP)
	mkdir -p docs/images
	$(PY) -m megazero.viz --schedule zb-h1 -p 4 -m 8 --costs 1,1,1,0.1 --out docs/images/planned-zb-h1.svg
	$(PY) -m megazero.viz --config configs/gpt3_175b.yaml --world-size 1024 --hardware h100-80gb \
		--out docs/images/predicted-gpt3-175b.png
	$(PY) -m megazero.viz --run runs/demo --out docs/images/measured-demo.svg
	$(PY) -m megazero.viz --run runs/demo --compare --out docs/images/compare-demo.svg
	$(PY) benchmarks/onebit_curves.py --out docs/images/onebit-adam

clean:
	rm -rf $(VENV) build *.egg-info runs
