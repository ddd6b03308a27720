# Dedup layer benchmark (Bloom vs bit array); include from the Makefile.
.PHONY: bench-dedup
bench-dedup: venv
	$(PY) bench/dedup_layers.py 1000000
