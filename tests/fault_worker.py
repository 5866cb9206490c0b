"""One MultiWorkerMirroredStrategy worker of a preempted or killed run.

Started by tests/test_faults_distribute.py (never imported by it), once per
worker, with `TF_CONFIG` naming a loopback cluster:

    TF_CONFIG=... python tests/fault_worker.py --backup_dir=DIR \
        --output=out.json [--preempt=E,B] [--kill=E,B] [--heartbeat_s=S]

Fits an `AccumModel` (one CPU replica per worker) with
`accum_model.ResumableBackup(DIR/..., save_freq=1)`. `--preempt=E,B` makes
every worker raise after micro-batch B of epoch E, as a preemption of the
whole job would stop it; `--kill=E,B` makes worker 1 SIGKILL itself there,
and the others run on until the strategy notices. The JSON output holds the
final weights and `optimizer.iterations`, where the backup resumed from,
or the error a surviving worker stopped with and how long after the kill.
"""

import json
import os
import signal
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from absl import app  # noqa: E402
from absl import flags  # noqa: E402
from absl import logging  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_string("backup_dir", None, "ResumableBackup's directory.")
flags.DEFINE_string("output", None, "Where to write the JSON result.")
flags.DEFINE_string("preempt", None, "E,B: every worker stops there.")
flags.DEFINE_string("kill", None, "E,B: worker 1 SIGKILLs itself there.")
flags.DEFINE_string(
    "kill_time_file",
    None,
    "Where the killed worker writes when it killed itself.",
)
flags.DEFINE_float(
    "heartbeat_s", 120.0, "Coordination-service heartbeat timeout, seconds."
)

# Per-replica micro-batch 2, 2 workers: global micro-batches of 4; 24
# samples, so 6 micro-batches per epoch; windows of 4 micro-batches (16
# samples) and, at each epoch's end, one of 2 (8 samples).
N, MICRO, STEPS, EPOCHS = 24, 2, 4, 3


class Preempted(Exception):
    pass


def _point(text):
    return tuple(int(v) for v in text.split(",")) if text else None


def main(argv):
    del argv
    logging.set_verbosity(logging.WARNING)
    tf.get_logger().setLevel("ERROR")
    from tests import loopback_cluster

    loopback_cluster.configure_coordination(
        heartbeat_timeout_s=FLAGS.heartbeat_s
    )
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    task_id = strategy.cluster_resolver.task_id

    from accum_model import AccumModel
    from accum_model import ResumableBackup
    from accum_model.keras._adapter import keras
    from tests import testing_utils as tu

    preempt, kill = _point(FLAGS.preempt), _point(FLAGS.kill)
    last_step = [time.time()]

    class Fault(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            self.epoch = epoch

        def on_train_batch_end(self, batch, logs=None):
            last_step[0] = time.time()
            if (self.epoch, batch) == preempt:
                raise Preempted(f"preempted after {preempt}")
            if (self.epoch, batch) == kill and task_id == 1:
                with open(FLAGS.kill_time_file, "w") as f:
                    f.write(repr(time.time()))
                os.kill(os.getpid(), signal.SIGKILL)

    x, y = tu.regression_data(N)
    with strategy.scope():
        model = tu.mlp(AccumModel, accum_steps=STEPS)
        model.compile(optimizer=tu.OPTIMIZERS["adam"](), loss="mse")
    backup = ResumableBackup(FLAGS.backup_dir, save_freq=1)
    result = {}
    try:
        model.fit(
            x,
            y,
            batch_size=MICRO * strategy.num_replicas_in_sync,
            epochs=EPOCHS,
            shuffle=False,
            verbose=0,
            callbacks=[backup, Fault()],
        )
        result["weights"] = [
            np.asarray(w).tolist() for w in model.get_weights()
        ]
        result["iterations"] = int(model.optimizer.iterations.numpy())
    except Preempted:
        result["preempted"] = True
    except (
        tf.errors.UnavailableError,
        tf.errors.DeadlineExceededError,
        tf.errors.CancelledError,
        tf.errors.InternalError,
        tf.errors.AbortedError,
    ) as e:
        result["error"] = type(e).__name__
        result["message"] = str(e).splitlines()[0][:500]
        result["error_time"] = time.time()
        result["last_step_time"] = last_step[0]
    result["resumed_from"] = backup.resumed_from
    with open(FLAGS.output, "w") as f:
        json.dump(result, f)
    sys.stdout.flush()
    # A worker whose peer died can block in the coordination service's
    # shutdown; its result is written, so leave at once.
    os._exit(0)


if __name__ == "__main__":
    flags.mark_flag_as_required("backup_dir")
    flags.mark_flag_as_required("output")
    app.run(main)
