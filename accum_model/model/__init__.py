"""The model side: `AccumModel`, `accumulate` and what a model's `fit`,
`evaluate` and `predict` need around the engine (the split, `"auto"`, the
epoch end, resuming, the warm-up, `AccumBatchNormalization`).

Imports from `engine`, `keras` and `core`.
"""
