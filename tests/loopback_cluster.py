"""A MultiWorkerMirroredStrategy cluster on 127.0.0.1, for tests and benchmarks.

Shared by tests/test_distribute.py (which starts tests/distribute_worker.py)
and benchmarks/bench_distributed.py: free ports, each worker's `TF_CONFIG`,
and the coordination service with a heartbeat timeout long enough for
workers on two busy CPU cores.
"""

import json
import os
import socket


def free_ports(count):
    """`count` distinct TCP ports free on 127.0.0.1 right now."""
    sockets = []
    try:
        for _ in range(count):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            sockets.append(s)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def tf_config(ports, index):
    """The `TF_CONFIG` value of worker `index` of a cluster on `ports`."""
    return json.dumps(
        {
            "cluster": {"worker": [f"127.0.0.1:{p}" for p in ports]},
            "task": {"type": "worker", "index": index},
        }
    )


def configure_coordination(heartbeat_timeout_s):
    """What MultiWorkerMirroredStrategy configures itself, with a longer
    heartbeat timeout: workers sharing two busy CPU cores (and, in the
    benchmark, moving 84 MB per all-reduce) can miss the default one and
    abort the cluster. Call it before creating the strategy.

    Args:
        heartbeat_timeout_s: Seconds a worker may go without a heartbeat.
    """
    # Private TensorFlow API: the strategy offers no argument for this.
    # `context` has stayed put across releases; the `CoordinatedJob` proto's
    # module has not (`tensorflow.tsl` in 2.16, `tensorflow.compiler.xla.tsl`
    # later), so the message comes from the public `ConfigProto`, whose
    # `coordination_config` holds a list of them.
    import tensorflow as tf
    from tensorflow.python.eager import context

    workers = len(json.loads(os.environ["TF_CONFIG"])["cluster"]["worker"])
    coordination = tf.compat.v1.ConfigProto().experimental.coordination_config
    job = coordination.coordinated_job_list.add(
        name="worker", num_tasks=workers
    )
    context.context().configure_coordination_service(
        service_type="standalone",
        service_leader="/job:worker/replica:0/task:0",
        heartbeat_timeout_in_ms=int(heartbeat_timeout_s * 1000),
        coordinated_jobs=[job],
    )
