"""What each micro-batch's mean loss was divided by: its weight in a window.

The large batch's loss is `sum_k w_k * L_k / sum_k w_k`, where `L_k` is
micro-batch k's loss and `w_k` the normalizer that loss divided by. Only the
*ratios* of the `w_k` matter, so a normalizer may be off by a factor that is
the same for every micro-batch. The default (`loss_normalizer`) reads the
rule from the compiled loss, per output:

- reduction "sum_over_batch_size" (Keras' default; also "mean" and tf_keras'
  "auto"): the number of loss elements, that is of values the loss function
  returns before reduction (one per sample for per-sample losses, one per
  token for per-token losses, whatever the sequence length of the
  micro-batch), or, when the output carries a Keras mask (e.g.
  `Embedding(mask_zero=True)` upstream), the number of valid (unmasked)
  elements, which is what Keras divides a masked loss by; sample weights
  multiply the values and do not change the count;
- "mean_with_sample_weight" (Keras 3): the sum of the sample weights (of the
  valid elements, with a mask), as Keras sums them; the number of loss
  elements when there are none;
- "sum" and "none": 1 (a sum has no normalizer: the window applies the mean
  of the micro-batches' summed gradients).

Several outputs with per-output losses and `loss_weights` stay exact when
their normalizers are proportional across micro-batches: all by sample count
(the default), or all the same mask or sample weights. Otherwise no single
weight per micro-batch is exact; the first output's is used, with a warning.
"""

import warnings
import weakref

import tensorflow as tf

# `_loss_values_rank`'s results per loss object, by the specs traced; weak,
# so nothing is kept on (or keeps alive) the user's loss.
_VALUES_RANKS = weakref.WeakKeyDictionary()


def batch_size(x, y=None):
    """Float32 scalar: the number of samples in a micro-batch.

    Args:
        x: The micro-batch's inputs (any nest of tensors).
        y: Its targets, used when `x` holds no tensor.

    Returns:
        The leading dimension of the first tensor found, as float32.

    Raises:
        ValueError: If neither `x` nor `y` holds a tensor.
    """
    for structure in (x, y):
        for leaf in tf.nest.flatten(structure):
            if leaf is not None:
                return tf.cast(tf.shape(leaf)[0], tf.float32)
    raise ValueError(
        "Cannot tell the batch size of a micro-batch with neither inputs nor "
        f"targets. Received: x={x!r}, y={y!r}"
    )


def _expand_to_rank(tensor, rank):
    # Keras broadcasts per-sample weights over a per-element mask by adding
    # trailing axes (`squeeze_or_expand_to_same_rank`).
    while len(tensor.shape) < rank:
        tensor = tf.expand_dims(tensor, -1)
    return tensor


def _static_spec(tensor):
    return tf.TensorSpec(tensor.shape, tensor.dtype)


def _loss_values_rank(loss_fn, y_true, y_pred):
    """The rank of `loss_fn`'s unreduced values, or None if unknown.

    Found by tracing the loss's `call` on symbolic inputs of the same static
    shapes (in a graph of its own, which runs nothing), so a loss that
    reduces other axes than the last (e.g. CTC, per sample) is counted as
    it reduces.
    """
    call = getattr(loss_fn, "call", None)
    if call is None or y_true is None:
        return None
    specs = (_static_spec(y_true), _static_spec(y_pred))
    # Once per loss and shapes: an eager step must not trace every time.
    if any(s.shape.rank is None for s in specs):
        return None
    try:
        cache = _VALUES_RANKS.setdefault(loss_fn, {})
    except TypeError:  # Not weakly referenceable: traced at every call.
        cache = {}
    key = tuple((tuple(s.shape.as_list()), s.dtype.name) for s in specs)
    if key not in cache:
        try:
            concrete = tf.function(call, autograph=False).get_concrete_function(
                *specs
            )
            cache[key] = concrete.structured_outputs.shape.rank
        except Exception:  # noqa: BLE001 (untraceable alone: last axis)
            cache[key] = None
    return cache[key]


def loss_elements(loss_fn, y_true, y_pred, samples):
    """How many values a loss term's reduction averages.

    What Keras' `"sum_over_batch_size"` divides by: the number of elements
    of the loss function's unreduced output (one per sample for per-sample
    losses, one per token for per-token losses). Those are the leading axes
    of `y_pred` that the loss keeps; when the loss cannot be traced alone,
    every axis but the last, as Keras' built-in losses reduce it. A loss
    that returns a scalar has averaged over the samples itself.

    Args:
        loss_fn: The term's Keras `Loss` (anything with `call(y_true,
            y_pred)`), or None.
        y_true: The term's targets, or None when unknown.
        y_pred: The term's prediction.
        samples: Float32 scalar, the micro-batch's number of samples.

    Returns:
        `(key, count)`: `count` a float32 scalar tensor, and `key` equal for
        counts proportional to the number of samples.
    """
    rank = _loss_values_rank(loss_fn, y_true, y_pred)
    if rank is None:
        rank = max((y_pred.shape.rank or 1) - 1, 0)
    # Keras broadcasts a (batch,) target against a (batch, 1) prediction;
    # the values keep at most the prediction's rank.
    rank = min(rank, y_pred.shape.rank or 0)
    if rank <= 1:
        return ("samples",), samples
    inner = y_pred.shape[1:rank]
    if inner.is_fully_defined():
        # A fixed number of elements per sample: proportional to samples.
        return ("samples",), samples * float(inner.num_elements())
    return (
        ("elements", id(y_pred)),
        tf.cast(tf.reduce_prod(tf.shape(y_pred)[:rank]), tf.float32),
    )


def term_normalizer(
    reduction, y_true, y_pred, sample_weight, mask, loss_fn, samples
):
    """One compiled loss term's normalizer and a key for what it counts.

    Args:
        reduction: "sum_over_batch_size", "mean_with_sample_weight", "sum" or
            "none".
        y_true: The term's targets, or None when unknown.
        y_pred: The term's prediction.
        sample_weight: The term's sample weights, or None.
        mask: The Keras mask `y_pred` carries, or None.
        loss_fn: The term's Keras `Loss`, or None.
        samples: Float32 scalar, the micro-batch's number of samples.

    Returns:
        `(key, normalizer)`: `normalizer` a float32 scalar tensor; two terms
        whose keys are equal have proportional normalizers in every
        micro-batch.
    """
    if reduction in ("sum", "none"):
        return ("one",), tf.constant(1.0)
    weights = None
    if reduction == "mean_with_sample_weight" and sample_weight is not None:
        weights = tf.cast(sample_weight, tf.float32)
    if mask is not None:
        valid = tf.cast(mask, tf.float32)
        if weights is None:
            return ("valid", id(mask)), tf.reduce_sum(valid)
        weights = _expand_to_rank(weights, len(valid.shape))
        return (
            ("weights", id(sample_weight), id(mask)),
            tf.reduce_sum(valid * weights),
        )
    if weights is not None:
        return ("weights", id(sample_weight)), tf.reduce_sum(weights)
    return loss_elements(loss_fn, y_true, y_pred, samples)


def default(method):
    """Marks `compute_loss_normalizer`'s default (`sums_over_batch` asks)."""
    method.reads_compiled_loss = True
    return method


def weighted_objective(adapter, model, data, y_pred, loss, scale):
    """What a micro-batch's gradients are taken of, and its weight.

    The weight (the normalizer: what the loss divided by) goes into the
    loss, one scalar multiply instead of one per gradient element; under
    loss scaling the scale goes in instead (the weight could push float16
    gradients into overflow), and the accumulator multiplies the weight in
    float32 as it unscales. Call it inside the tape.

    Args:
        adapter: `_adapter.ADAPTER`.
        model: The model, whose `compute_loss_normalizer` gives the weight.
        data: `(x, y, sample_weight)` of the micro-batch.
        y_pred: Its predictions.
        loss: Its loss.
        scale: None, or the loss scale (float32 scalar).

    Returns:
        `(objective, weight)`: the loss to differentiate, and the float32
        weight (no gradient flows through it).
    """
    x, y, sample_weight = data
    weight = tf.stop_gradient(
        tf.cast(
            model.compute_loss_normalizer(x, y, y_pred, sample_weight),
            tf.float32,
        )
    )
    objective = adapter.unscale_loss_for_distribution(loss)
    objective = objective * tf.cast(
        weight if scale is None else scale, objective.dtype
    )
    return objective, weight


def sums_over_batch(adapter, model, y, y_pred, sample_weight):
    """Whether the model's loss is a sum over the batch's rows.

    True when every compiled loss term reduces by "sum" (or "none") and the
    model's normalizer is the default, which reads them: a batch's loss is
    then the sum of its slices' losses, and its weight in a window 1.

    Args:
        adapter: The Keras-generation adapter (`_adapter.ADAPTER`).
        model: The `AccumModel`.
        y, y_pred, sample_weight: A slice, as in `compute_loss`.

    Returns:
        A Python bool (read while the step is traced).
    """
    if not getattr(model.compute_loss_normalizer, "reads_compiled_loss", False):
        return False
    terms = adapter.compiled_loss_terms(model, y, y_pred, sample_weight)
    summed = bool(terms) and all(t[0] in ("sum", "none") for t in terms)
    if summed and model.losses:
        warnings.warn(
            "The compiled loss uses reduction='sum', and the model has losses "
            "of its own (`add_loss`, weight or activity regularizers): each "
            "slice of a batch (`micro_batch_size`) adds them once, so the "
            "batch's update counts them once per slice, not once. Give them "
            "to the loss, or use a mean reduction, for the whole batch's "
            "update.",
            stacklevel=3,
        )
    return summed


def loss_normalizer(adapter, model, x, y, y_pred, sample_weight):
    """The default `AccumModel.compute_loss_normalizer` (rules above).

    Args:
        adapter: The Keras-generation adapter (`_adapter.ADAPTER`).
        model: The `AccumModel`.
        x, y, y_pred, sample_weight: The micro-batch, as in `compute_loss`.

    Returns:
        A float32 scalar tensor.
    """
    samples = batch_size(x, y)
    terms = adapter.compiled_loss_terms(model, y, y_pred, sample_weight)
    if not terms:
        # No compiled loss (e.g. only `add_loss` losses): Keras' loss tracker
        # weights such a loss by the number of samples too.
        return samples
    normalizers = [term_normalizer(*term, samples) for term in terms]
    keys = {key for key, _ in normalizers}
    if keys == {("one",)} and model.accum_steps > 1:
        # Not silently different math: say what the window applies.
        warnings.warn(
            "The compiled loss uses reduction='sum': its gradient has no "
            "normalizer, and an update applies the mean of the window's "
            "micro-batch gradients, 1/accum_steps of the large batch's "
            "summed gradient (for full windows). Multiply the learning rate "
            "by accum_steps for large-batch training with a summed loss.",
            stacklevel=3,
        )
    if (
        len(keys) == 1
        and keys.isdisjoint({("samples",), ("one",)})
        and (model.losses)
    ):
        warnings.warn(
            "The compiled loss divides by something other than samples "
            f"({sorted(k[0] for k in keys)[0]}), and the model has losses "
            "of its own (`add_loss`, weight or activity regularizers), which "
            "Keras adds to it unweighted: a micro-batch's weight then "
            "weighs them too, so the update is not exactly the large "
            "batch's for them (exact for the compiled loss).",
            stacklevel=3,
        )
    if len(keys) > 1:
        warnings.warn(
            "The outputs' losses of this model divide by different "
            f"quantities ({sorted(k[0] for k in keys)}), so no single weight "
            "per micro-batch makes the accumulated gradient exactly the large "
            "batch's; the first output's normalizer is used. Override "
            "`AccumModel.compute_loss_normalizer` to choose another.",
            stacklevel=3,
        )
    return normalizers[0][1]
