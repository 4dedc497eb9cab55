"""The ``perseusrun`` launcher. The rendezvous store it serves to the ranks
is perseus_tf.common.store (the library uses it too).

Standard library only: ``python -m perseus_tf.runner`` must start without
importing TensorFlow.
"""

from perseus_tf.runner.launcher import main

__all__ = ["main"]
