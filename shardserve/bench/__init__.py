"""`shardserve bench`: load an OpenAI-compatible server at several concurrency levels and report what it
sustained.

workload.py  the prompts: random (word or exact token lengths) or from a JSONL dataset, distinct per request
client.py    one streamed request and its timings
metrics.py   per-level figures: throughput, TTFT/TPOT/ITL/end-to-end percentiles, goodput against SLOs
runner.py    the levels, one after another: arrivals, the concurrency gate, the progress bar
report.py    the terminal table, JSON, CSV and the PNG plot
main.py      the command: arguments in, table and files out
"""
