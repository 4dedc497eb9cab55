"""The ``perseusrun`` launcher and the rendezvous store it serves to the ranks.

Standard library only: ``python -m perseus_tf.runner`` must start without
importing TensorFlow.
"""

from perseus_tf.runner.launcher import main
from perseus_tf.runner.store import StoreClient, StoreServer

__all__ = ["main", "StoreClient", "StoreServer"]
