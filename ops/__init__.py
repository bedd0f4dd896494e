"""flare's command line, benchmarks, simulator and training recipe. Nothing imports ops."""
