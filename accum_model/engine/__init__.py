"""The engine: `GradientAccumulator`, its state declared and saved by name,
a micro-batch in (`_contribution`) and a window out (`_close`), with the
loss-scale rules, the noise scale and AdaScale.

Imports from `keras` and `core` only.
"""
