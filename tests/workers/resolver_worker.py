"""One rank of a job placed by a cluster resolver, not by the environment.

Usage: resolver_worker.py TASK_ID PORT (2 workers on 127.0.0.1; no launcher).

Builds PerseusStrategy(cluster_resolver=SimpleClusterResolver(...)) while
TF_CONFIG in the environment describes another job (the resolver must win),
sums rank + 1 over the ranks through the strategy, and prints one line
`RESULT {json}` with what it saw. tests/test_contracts.py starts two.
"""

import json
import sys

import tensorflow as tf

import perseus_tf as ptf
from perseus_tf import _native


def main():
    task_id, port = int(sys.argv[1]), int(sys.argv[2])
    spec = tf.train.ClusterSpec({"worker": [f"127.0.0.1:{port}", f"127.0.0.1:{port + 1}"]})
    resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
        spec, task_type="worker", task_id=task_id)
    strategy = ptf.PerseusStrategy(cluster_resolver=resolver)
    total = strategy.reduce(
        tf.distribute.ReduceOp.SUM,
        strategy.run(lambda: tf.constant(float(ptf.rank() + 1))), axis=None)
    print("RESULT " + json.dumps({
        "rank": ptf.rank(), "size": ptf.size(), "sum": float(total),
        "source": _native._topology.source, "store_port": _native._topology.store_port,
        "replicas": strategy.num_replicas_in_sync,
        "same_resolver": strategy.cluster_resolver is resolver}), flush=True)


if __name__ == "__main__":
    main()
