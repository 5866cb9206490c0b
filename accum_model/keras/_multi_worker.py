"""`MultiWorkerFitWorkarounds`: Keras 3.15's `fit` under MultiWorkerMirrored."""

from accum_model.keras import _adapter

ADAPTER = _adapter.ADAPTER


class MultiWorkerFitWorkarounds:
    """Makes Keras 3.15's `fit` run under MultiWorkerMirroredStrategy.

    A mixin for a `keras.Model` (put it first among the bases). Keras' `fit`
    fails there on CPU for any model: see
    `Keras3Adapter.symbolic_build_arguments` and
    `logs_for_replica_reduction`, both no-ops elsewhere and under tf_keras.
    `AccumModel` has it, and reshapes the logs of its own `train_step`
    itself; tests put it on the plain `keras.Model` they compare with, so
    that both run under the strategy.
    """

    def test_step(self, data):
        return ADAPTER.logs_for_replica_reduction(self, super().test_step(data))

    def _maybe_symbolic_build(self, iterator=None, data_batch=None):
        # Keras 3 only (tf_keras never calls it).
        iterator, data_batch = ADAPTER.symbolic_build_arguments(
            self, iterator, data_batch
        )
        return super()._maybe_symbolic_build(
            iterator=iterator, data_batch=data_batch
        )
