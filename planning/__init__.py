"""Run planning: compile the real step for a mesh of simulated devices and project it.

hardware.py    accelerators: memory, peak FLOP/s, link bandwidths
program.py     the compiled train step and its per-device memory
collectives.py collectives per step parsed from the compiled HLO
step_time.py   projected step time and MFU bound per token layout and per strategy
plan.py        one plan from a config, a mesh, a sequence length and a hardware
report.py      Markdown and JSON output
cli.py         the command line of scripts/plan.py
"""
