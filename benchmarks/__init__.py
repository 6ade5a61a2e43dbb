"""The benchmark scripts, by what they measure (docs/benchmarks.md, "Layout"); their shared set-up
is benchmarks/common.py. A package so that `benchmarks.*` imports find this folder first."""
