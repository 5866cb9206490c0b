"""The window's state, declared once and saved by name.

Every variable a `GradientAccumulator` keeps (its own, the noise scale's,
AdaScale's, the `AccumBatchNormalization` layers' window moments) is
declared in the tables below, with its name, dtype, aggregation and role,
and created by `WindowState.declare`. Saving, restoring, resetting and the
memory count all read the one `WindowState`:

- `window`: zero when no window is open; zeroed when a window ends.
- `lifetime`: kept across windows (counters, moving averages, the
  accumulators, which the next window's first micro-batch overwrites).
- `setting`: a setting held as a variable so that changing it does not
  retrace; a model restores it from its config, so it is not saved.
- `batch`: a batch on its way into the window (`_contribution`): zero
  between batches, so never saved.

A file holds each saved variable under its name (`save`); `load` matches by
name and refuses a file that lacks an entry this state needs or holds one
it does not know, naming it. Variables of the model (an accumulator, the
flag of whether it received a gradient, a BatchNorm layer's moments) are
named by their index and path, `accumulator/0003/dense_1/kernel`: they load
by index, checked by shape and by the last part of the path, so files load
into a model whose layers Keras named differently (auto-generated names
change between sessions), as Keras itself loads the weights by structure.
Files written before names (accum_model 0.1.0 up to 2026-12-06: keys "0",
"1", ...) load through `_from_position_layout`.

This module knows TensorFlow only.
"""

import collections
import re

import numpy as np
import tensorflow as tf

SUM = tf.VariableAggregation.SUM
FIRST = tf.VariableAggregation.ONLY_FIRST_REPLICA

WINDOW = "window"
LIFETIME = "lifetime"
SETTING = "setting"
BATCH = "batch"

Entry = collections.namedtuple(
    "Entry", ["name", "dtype", "aggregation", "role", "initial"]
)
Entry.__new__.__defaults__ = (0,)
Entry.__doc__ = """One state variable: name, dtype, aggregation, role, initial.

`aggregation`: under a strategy the variables are per-replica, summed on
read (`SUM`, a replica's part of a global sum) or the first replica's
(`FIRST`, equal on every replica).
"""

# The engine's own scalars.
ENGINE = (
    Entry("accum_steps", tf.int64, FIRST, SETTING),
    # The open window's length, latched when it opens, so that a new
    # `accum_steps` takes effect at the next window.
    Entry("micro_step", tf.int64, FIRST, WINDOW),
    Entry("contributed_steps", tf.int64, FIRST, WINDOW),
    Entry("weight_sum", tf.float32, SUM, WINDOW),
    Entry("window_steps", tf.int64, FIRST, LIFETIME),
    Entry("skipped_microbatches", tf.int64, FIRST, LIFETIME),
    Entry("discarded_windows", tf.int64, FIRST, LIFETIME),
)
# One of each per accumulated variable, of its shape (`received`: whether
# it ever received a gradient, one element of a vector over the variables).
ACCUMULATOR = Entry("accumulator", tf.float32, SUM, LIFETIME)
RECEIVED = Entry("received", tf.int64, FIRST, LIFETIME)
# A batch entering the window in slices (`_contribution`). `open`: 1 from
# the first addition of a batch to its end, so a batch cut short by an
# error is seen. `sums`: what its slices added so far (`BATCH_SUMS`), one
# vector written by one operation per slice, after the slice's additions.
# Per replica, like the accumulators.
BATCH_STATE = (
    Entry("open", tf.int64, FIRST, BATCH),
    Entry("sums", tf.float32, SUM, BATCH),
)
BATCH_SUMS = (
    # Rows whose slices are in: added, or left out as not finite.
    "rows",
    # The weight of the added slices, and of all (for the logged loss).
    "weight",
    "loss_weight",
    "weighted_loss",
    # The noise scale's sums of the added slices.
    "squared_norm_sum",
    "micro_batches",
    "added",
    "non_finite",
)
# Per accumulated variable: the row up to which it holds the open batch's
# gradient (a batch that may be run again after an out-of-memory error).
ROWS_ADDED = Entry("rows_added", tf.int64, FIRST, BATCH)
# `_noise_scale.NoiseScaleEstimator`.
NOISE_SCALE = (
    Entry("squared_norm_sum", tf.float32, SUM, WINDOW),
    Entry("micro_batches", tf.float32, SUM, WINDOW),
    Entry("windows", tf.int64, FIRST, LIFETIME),
    Entry("measurements", tf.float32, FIRST, LIFETIME),
    Entry("ema_trace_sigma", tf.float32, FIRST, LIFETIME),
    Entry("ema_grad_sq_norm", tf.float32, FIRST, LIFETIME),
    Entry("ema_window_weight", tf.float32, FIRST, LIFETIME),
    Entry("ema_micro_batch_weight", tf.float32, FIRST, LIFETIME),
    Entry("last_trace_sigma", tf.float32, FIRST, LIFETIME),
    Entry("last_grad_sq_norm", tf.float32, FIRST, LIFETIME),
)
# `_adascale.AdaScaleState`: equal on every replica.
ADASCALE = (
    Entry("tau", tf.float64, FIRST, LIFETIME),
    Entry("gain", tf.float32, FIRST, LIFETIME, 1.0),
    Entry("learning_rate", tf.float32, FIRST, LIFETIME),
)
# `AccumBatchNormalization`'s window moments, per channel, in the dtype
# the layer computes them in (None here).
BATCHNORM = (
    Entry("count", None, FIRST, WINDOW),
    Entry("mean", None, FIRST, WINDOW),
    Entry("variance", None, FIRST, WINDOW),
)


_LENGTHS = ("accum_steps", "window_steps")


def declare_engine(state, variables, accum_steps):
    """Declares a `GradientAccumulator`'s own variables in `state`.

    Args:
        state: The engine's `WindowState`.
        variables: The variables whose gradients it accumulates.
        accum_steps: Int, the initial window length.

    Returns:
        `(engine, accumulators, received, batch)`: a dict from `ENGINE`'s
        names to variables, one accumulator per variable, the `received`
        vector, and a dict of the batch state: `BATCH_STATE`'s names, and
        `rows_added`, one per variable.
    """
    engine = {
        e.name: state.declare(
            f"engine/{e.name}",
            e,
            initial=accum_steps if e.name in _LENGTHS else None,
        )
        for e in ENGINE
    }
    paths = [variable_path(v) for v in variables]
    accumulators = [
        state.declare(item_name("accumulator", i, p), ACCUMULATOR, v.shape)
        for i, (v, p) in enumerate(zip(variables, paths))
    ]
    received = state.declare_vector(
        "received",
        RECEIVED,
        [item_name("received", i, p) for i, p in enumerate(paths)],
    )
    batch = {
        e.name: state.declare(
            f"batch/{e.name}",
            e,
            shape=(len(BATCH_SUMS),) if e.name == "sums" else (),
        )
        for e in BATCH_STATE
    }
    batch["rows_added"] = [
        state.declare(item_name("rows_added", i, p), ROWS_ADDED)
        for i, p in enumerate(paths)
    ]
    return engine, accumulators, received, batch


def variable_path(variable):
    """A variable's path in its model: Keras 3's `path`, else its name."""
    path = getattr(variable, "path", None)
    return path if isinstance(path, str) else variable.name.split(":")[0]


def item_name(group, index, path):
    """The name of a model item: `group/0003/path`."""
    return f"{group}/{index:04d}/{path}"


class WindowState(tf.Module):
    """Every variable of one engine's state, by name, in declaration order.

    Args:
        name: Name of the module.
    """

    def __init__(self, name="state"):
        super().__init__(name=name)
        self._variables = {}
        self._roles = {}
        # For the per-variable `received` vector: the names of its elements.
        self._vector_items = {}
        self._items = {}
        # Declared by layers (`declare_item`): written by their forward
        # pass.
        self._item_variables = []

    def declare(self, name, entry, shape=(), dtype=None, initial=None):
        """Creates the variable `name` of `entry`, eagerly.

        Args:
            name: Str, unique in this state (`group/entry` by convention).
            entry: Its `Entry`.
            shape: Its shape.
            dtype: Its dtype, where `entry.dtype` is None.
            initial: Its initial value, where not `entry.initial`.

        Returns:
            The `tf.Variable`.

        Raises:
            ValueError: If `name` is declared already.
        """
        if name in self._variables:
            raise ValueError(f"State variable {name!r} is declared twice.")
        dtype = entry.dtype or dtype
        with tf.init_scope():
            variable = tf.Variable(
                tf.fill(
                    shape,
                    tf.constant(
                        entry.initial if initial is None else initial, dtype
                    ),
                ),
                trainable=False,
                name=name.replace("/", "_"),
                synchronization=tf.VariableSynchronization.ON_READ,
                aggregation=entry.aggregation,
            )
        self._variables[name] = variable
        self._roles[name] = entry.role
        return variable

    def declare_group(self, group, entries, shape=(), dtype=None):
        """Declares `group/<entry name>` for each of `entries`.

        Returns:
            A dict from entry name to variable.
        """
        return {
            e.name: self.declare(f"{group}/{e.name}", e, shape, dtype)
            for e in entries
        }

    def declare_item(self, group, path, entries, shape, dtype):
        """Declares `entries` for the next item of `group` (a layer).

        Named `group/<index>/path/<entry>`, the index counting the items of
        `group` in the order they are declared.

        Returns:
            A dict from entry name to variable.
        """
        self._items[group] = index = self._items.get(group, -1) + 1
        declared = self.declare_group(
            item_name(group, index, path), entries, shape, dtype
        )
        self._item_variables.extend(declared.values())
        return declared

    def declare_vector(self, name, entry, item_names):
        """Declares a vector with one element per item, saved per item.

        Args:
            name: The vector's name.
            entry: Its `Entry`.
            item_names: One name per element (saved as `name` of each).

        Returns:
            The `tf.Variable`.
        """
        variable = self.declare(name, entry, shape=(len(item_names),))
        self._vector_items[name] = list(item_names)
        return variable

    @property
    def variables(self):
        """Every variable, in declaration order."""
        return list(self._variables.values())

    def names(self, role=None):
        """The names of the variables (of `role`), in declaration order."""
        return [
            n for n in self._variables if role is None or self._roles[n] == role
        ]

    def get(self, name):
        """The variable `name`."""
        return self._variables[name]

    def item_variables(self):
        """The variables layers declared, which their forward pass writes."""
        return list(self._item_variables)

    def window_variables(self):
        """The variables zeroed when a window ends."""
        return [self._variables[n] for n in self.names(WINDOW)]

    def batch_variables(self):
        """The variables of a batch in progress, zero between batches."""
        return [self._variables[n] for n in self.names(BATCH)]

    def saved_variables(self):
        """The variables a checkpoint holds: neither settings nor batches."""
        return [v for _, v in self._saved()]

    # Files

    def save(self, store):
        """Writes every saved variable into the dict-like `store`, by name."""
        for name, variable in self._saved():
            for key, value in self._split(name, variable.numpy()).items():
                store[key] = value

    def load(self, store):
        """Assigns every saved variable from `store`, matched by name.

        Nothing is assigned unless every entry matches.

        Raises:
            ValueError: If `store` lacks an entry this state saves, holds one
                it does not know, or holds one of another shape.
        """
        keys = list(store.keys())
        if keys and all(k.isdigit() for k in keys):
            store = _from_position_layout(self, store, keys)
            keys = list(store.keys())
        shapes = {}
        for name, variable in self._saved():
            if name in self._vector_items:
                shapes.update({k: () for k in self._keys(name)})
            else:
                shapes[file_key(name)] = tuple(variable.shape)
        found = _match(shapes, store, keys)
        for name, variable in self._saved():
            if name in self._vector_items:
                value = [found[k] for k in self._keys(name)]
            else:
                value = found[file_key(name)]
            variable.assign(
                np.asarray(value, dtype=variable.dtype.as_numpy_dtype)
            )

    def _saved(self):
        return [
            (n, v)
            for n, v in self._variables.items()
            if self._roles[n] not in (SETTING, BATCH)
        ]

    def _keys(self, name):
        """The file keys of `name`: its own, or one per vector element."""
        items = self._vector_items.get(name)
        return [file_key(n) for n in ([name] if items is None else items)]

    def _split(self, name, value):
        """`{file key: array}` of variable `name` holding `value`."""
        if name in self._vector_items:
            return dict(zip(self._keys(name), value))
        return {file_key(name): value}


def file_key(name):
    """The key of `name` in a file (Keras' stores take no `/` in a key)."""
    return name.replace("/", ".")


_ITEM = re.compile(r"^([a-z_]+)\.(\d{4})\.(.*)$")


def _match(expected, store, keys):
    """`{expected key: saved array}`, or a `ValueError` naming a mismatch.

    `expected`: `{key: shape}` of the entries this state saves.

    Items of the model (`group.0003.path`) match the saved item of the same
    group and index whose path ends the same way (`kernel`, `mean`).
    """
    found = {}
    by_index = {}
    for key in keys:
        m = _ITEM.match(key)
        if m:
            by_index[(m.group(1), m.group(2))] = key
    used = set()
    for key, shape in expected.items():
        saved = key if key in keys else None
        m = _ITEM.match(key)
        if saved is None and m:
            candidate = by_index.get((m.group(1), m.group(2)))
            if candidate is not None and _same_last_part(candidate, key):
                saved = candidate
        if saved is None:
            raise ValueError(
                "The saved accumulation state lacks the entry "
                f"{key!r}, which this model needs"
                + _item_hint(key, m, by_index)
                + ". It was saved by a model with other accumulation "
                "settings (`noise_scale`, `adascale`, AccumBatchNormalization "
                "layers) or other trainable variables. Received entries: "
                f"{sorted(keys)}"
            )
        array = np.asarray(store[saved])
        if array.shape != shape:
            raise ValueError(
                f"The saved accumulation state entry {saved!r} has shape "
                f"{array.shape}, but this model's {key!r} has shape {shape}."
            )
        found[key] = array
        used.add(saved)
    unknown = sorted(set(keys) - used)
    if unknown:
        raise ValueError(
            "The saved accumulation state holds entries this model does not "
            f"know: {unknown}. It was saved by a model with other "
            "accumulation settings (`noise_scale`, `adascale`, "
            "AccumBatchNormalization layers) or other trainable variables."
        )
    return found


def _same_last_part(a, b):
    return a.rsplit(".", 1)[-1] == b.rsplit(".", 1)[-1]


def _item_hint(key, m, by_index):
    if not m:
        return ""
    candidate = by_index.get((m.group(1), m.group(2)))
    if candidate is None:
        return ""
    return f" (the file's {candidate!r} has the same index but another name)"


def _from_position_layout(state, store, keys):
    """A file of the position layout (keys "0", "1", ...), by name.

    accum_model 0.1.0 up to 2026-12-06 saved the state as a list, in the
    order below. Its length fixes which features were on; a count that fits
    no order of this state is refused.
    """
    names = _position_layout_order(state)
    if len(keys) != len(names):
        raise ValueError(
            "The saved accumulation state (written by accum_model before "
            "2026-12-06, by position) does not match this model: expected "
            f"{len(names)} variables, received {len(keys)}."
        )
    converted = {}
    for i, name in enumerate(names):
        converted.update(state._split(name, np.asarray(store[str(i)])))
    return converted


def _position_layout_order(state):
    """The state's names in the order of the position layout."""
    names = state.names()
    window = set(state.names(WINDOW))

    def group(prefix):
        return [n for n in names if n.startswith(prefix)]

    noise = group("noise_scale/")
    noise_window = [n for n in noise if n in window]
    return (
        ["engine/micro_step", "engine/contributed_steps", "engine/weight_sum"]
        + noise_window
        + group("batchnorm/")
        + ["engine/window_steps"]
        + group("accumulator/")
        + [
            "engine/skipped_microbatches",
            "engine/discarded_windows",
            "received",
        ]
        + [n for n in noise if n not in window]
        + group("adascale/")
    )
