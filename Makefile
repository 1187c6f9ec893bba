.PHONY: reliability

# Full-size reliability checks (about 10 minutes on 2 CPU cores); rewrites RELIABILITY.md.
reliability:
	python3 benchmarks/reliability.py
