"""`hvd.elastic` of the Keras API: not supported yet (see
perseus_tf/horovod/elastic.py); every name raises ElasticNotSupportedError."""

from perseus_tf.horovod.elastic import ElasticNotSupportedError, __getattr__  # noqa: F401
