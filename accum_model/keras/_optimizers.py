"""An optimizer's slots, created where Keras would create them.

Keras creates an optimizer's variables eagerly before the step is traced
(Keras 3) or at its first apply (tf_keras). The engine applies inside a
conditional, where neither may happen: these build them first, for both
the way into a window (`_contribution`, a loss-scaled micro-batch) and the
way out (`_close`).
"""

import tensorflow as tf

from accum_model.core import _control_flow
from accum_model.keras import _adapter

ADAPTER = _adapter.ADAPTER


def build_optimizer(optimizer, variables):
    """Creates `optimizer`'s slots for `variables` unless it has them.

    Eagerly: lifted out of any function being traced, as Keras builds its
    own optimizers.
    """
    if variables and not ADAPTER.optimizer_built(optimizer):
        with tf.init_scope():
            ADAPTER.build_optimizer(optimizer, variables)


def build_optimizer_in_cross_replica_context(optimizer, variables):
    """`build_optimizer`, before a close is traced.

    Keras optimizers create their slots on their first apply. Here that is
    inside the branch that closes a window, and under a strategy that
    branch runs in `merge_call`, where a traced function cannot lift new
    variables out of the conditional ("You must feed a value for
    placeholder"). So they are built first, in cross-replica context.
    """
    if not ADAPTER.optimizer_built(optimizer):
        _control_flow.call_in_cross_replica_context(
            lambda: build_optimizer(optimizer, variables)
        )
