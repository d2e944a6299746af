"""Run planning: compile the real step for a mesh of simulated devices and project it.

hardware.py    accelerators: memory, peak FLOP/s, link bandwidths
program.py     the compiled train step and its per-device memory
collectives.py collectives per step parsed from the compiled HLO
step_time.py   projected step time and MFU bound per token layout and per strategy
plan.py        one plan from a config, a mesh, a sequence length and a hardware
report.py      Markdown and JSON output
cli.py         the command line of scripts/plan.py

The fused attention kernels compiled for accelerators not owned (scripts/gpu_compile.py):
kernel_export.py  one ring round of the fused kernels, built as training builds it
gpu_kernels.py    Triton IR from a CUDA export, compiled for sm_80 / sm_90: registers, spills, smem
tpu_kernels.py    Mosaic lowering for a TPU and the VMEM of the kernels' blocks
tile_sweep.py     the search behind parallel/kernels/pallas_gpu.py's default tiles
"""
