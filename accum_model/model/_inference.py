"""`evaluate` and `predict` of a batch in slices (`micro_batch_size`).

A model that trains at the batch you mean evaluates and predicts at it
too: each batch of `evaluate` (and of `fit`'s validation) and of `predict`
runs in slices of `micro_batch_size` rows, one at a time, in inference
mode, inside the one compiled step (`_split.stacked_loop`).

- **Evaluate**: each slice updates the compiled metrics; the batch's loss
  is `sum_k w_k L_k / sum_k w_k` over its slices, their losses weighted by
  what each divided by (the normalizer a window weighs them by), or
  `sum_k L_k` for a loss that sums over the batch: the loss of the whole
  batch, tracked as Keras tracks it.
- **Predict**: the slices' outputs, concatenated, row for row. The batch is
  padded with rows of zeros to a whole number of slices, whose outputs are
  dropped: every slice has the same static shape, as XLA needs.

`SlicedInference`, a base of `AccumModel`, routes its `test_step` and
`predict_step` here, and with `"auto"` makes its evaluate and predict
functions `_auto.AutoInferenceFunction`s.
"""

import tensorflow as tf

from accum_model.keras import _adapter
from accum_model.model import _auto
from accum_model.model import _normalizers
from accum_model.model import _settings
from accum_model.model import _split

ADAPTER = _adapter.ADAPTER


class SlicedInference:
    """`evaluate` and `predict` in slices of `micro_batch_size` rows.

    A base of `AccumModel`, before `keras.Model`: with an int
    `micro_batch_size` its steps run a batch in slices; with `"auto"` its
    functions are `_auto`'s, which take the size training chose and halve
    it on an out-of-memory error; with None, as Keras.
    """

    def test_step(self, data):
        size = _settings.micro_batch_setting(self)
        if not isinstance(size, int):
            # None, or "auto", whose test function passes its size.
            return super().test_step(data)
        return self._split_test_step(data, size)

    def _split_test_step(self, data, size):
        """`test_step` of a batch in slices of `size` rows (None: whole)."""
        if size is None:
            return super().test_step(data)
        logs = test_batch(self, data, size, bool(self.jit_compile))
        return ADAPTER.logs_for_replica_reduction(self, logs)

    def predict_step(self, data):
        size = _settings.micro_batch_setting(self)
        if not isinstance(size, int):
            return super().predict_step(data)
        return self._split_predict_step(data, size)

    def _split_predict_step(self, data, size):
        """`predict_step` of a batch in slices of `size` rows (None: whole)."""
        if size is None:
            return super().predict_step(data)
        return predict_batch(self, data, size)

    def make_test_function(self, force=False):
        rebuilt = force or self.test_function is None
        function = super().make_test_function(force=force)
        if rebuilt and _settings.micro_batch_setting(self) == "auto":
            self.test_function = function = _auto.AutoInferenceFunction(
                self, self._split_test_step, "test"
            )
        return function

    def make_predict_function(self, force=False):
        rebuilt = force or self.predict_function is None
        function = super().make_predict_function(force=force)
        if rebuilt and _settings.micro_batch_setting(self) == "auto":
            self.predict_function = function = _auto.AutoInferenceFunction(
                self, self._split_predict_step, "predict"
            )
        return function

    def evaluate(self, *args, **kwargs):
        with _auto.saying_what_to_set(self):
            return super().evaluate(*args, **kwargs)

    def predict(self, *args, **kwargs):
        with _auto.saying_what_to_set(self):
            return super().predict(*args, **kwargs)


def test_batch(model, data, size, xla):
    """`test_step` of a batch in slices of `size` rows.

    Args:
        model: The `AccumModel`.
        data: The batch, as `test_step` receives it.
        size: Python int >= 1, the rows of a slice.
        xla: Bool, whether the step is compiled by XLA.

    Returns:
        The step's logs: the compiled metrics' results, the loss included.
    """
    x, y, sample_weight = ADAPTER.unpack(data)
    rows = tf.cast(_normalizers.batch_size(x, y), tf.int64)
    # Found while a slice is traced, read after the loop.
    summed = []

    def one(part, start, count, carried):
        del start, count
        px, py, psw = part
        y_pred = ADAPTER.forward(model, px, training=False)
        loss = ADAPTER.compute_loss(model, px, py, y_pred, psw, training=False)
        weight = tf.cast(
            model.compute_loss_normalizer(px, py, y_pred, psw), tf.float32
        )
        if not summed:
            summed.append(
                _normalizers.sums_over_batch(ADAPTER, model, py, y_pred, psw)
            )
        ADAPTER.update_metrics(model, px, py, y_pred, psw)
        loss = tf.reduce_sum(tf.cast(loss, tf.float32))
        weight = tf.reduce_sum(weight)
        # A slice of no weight (an empty shard) has a 0/0 mean loss.
        weighted = tf.where(weight > 0.0, weight * loss, 0.0)
        weighted_sum, weight_sum, loss_sum = carried
        return (weighted_sum + weighted, weight_sum + weight, loss_sum + loss)

    zero = tf.constant(0.0)
    weighted_sum, weight_sum, loss_sum = _split.stacked_loop(
        (x, y, sample_weight), rows, size, xla, one, (zero, zero, zero)
    )
    if summed and summed[0]:
        loss = loss_sum
    else:
        loss = tf.math.divide_no_nan(weighted_sum, weight_sum)
    ADAPTER.track_loss(model, loss, _normalizers.batch_size(x, y))
    return model.get_metrics_result()


def predict_batch(model, data, size):
    """`predict_step` of a batch in slices of `size` rows.

    Args:
        model: The `AccumModel`.
        data: The batch, as `predict_step` receives it.
        size: Python int >= 1, the rows of a slice.

    Returns:
        The model's outputs for the batch's rows.
    """
    x, _, _ = ADAPTER.unpack(data)
    rows = tf.cast(_normalizers.batch_size(x), tf.int64)
    slices = (rows + size - 1) // size
    padded = tf.nest.map_structure(lambda t: _pad_rows(t, slices * size), x)
    stacked = tf.nest.map_structure(
        lambda t: _split.stack(t, slices, size, xla=False), padded
    )

    def forward(part):
        return ADAPTER.forward(model, part, training=False)

    outputs = tf.map_fn(
        forward,
        stacked,
        fn_output_signature=_output_spec(forward, stacked),
        parallel_iterations=1,
    )
    return tf.nest.map_structure(
        lambda t: tf.reshape(t, tf.concat([[-1], tf.shape(t)[2:]], 0))[:rows],
        outputs,
    )


def _output_spec(forward, stacked):
    """The structure, dtypes and shapes of `forward` on one slice.

    Traced in a graph of its own, which runs nothing.
    """
    specs = tf.nest.map_structure(
        lambda t: tf.TensorSpec(t.shape[1:], t.dtype), stacked
    )
    trace = tf.function(forward, autograph=False)
    # Made once per trace of the predict step, by design: TensorFlow's
    # warning about frequent retracing would count them.
    trace._omit_frequent_tracing_warning = True
    concrete = trace.get_concrete_function(specs)
    return tf.nest.map_structure(
        lambda t: tf.TensorSpec(t.shape, t.dtype),
        concrete.structured_outputs,
    )


def _pad_rows(t, rows):
    """`t` with rows of zeros after its own, `rows` in all."""
    if t is None:
        return None
    t = tf.convert_to_tensor(t)
    if t.shape.rank == 0:
        return t
    extra = rows - tf.shape(t, out_type=tf.int64)[0]
    return tf.pad(t, [[0, extra]] + [[0, 0]] * (t.shape.rank - 1))
