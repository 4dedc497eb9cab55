"""`hvd.elastic`: elastic training (ranks joining and leaving a running job)
is not supported yet. The module imports, so that a script fails where it
uses elastic training, with an error that says so, not at import."""

_MESSAGE = (
    "perseus_tf.horovod.elastic.{name}: elastic training (Horovod's hvd.elastic, "
    "horovodrun --min-np/--max-np) is not supported by Perseus-TF yet. Run the script "
    "without the elastic wrapper: drop @hvd.elastic.run and the State/commit objects, "
    "and start a fixed number of ranks with perseusrun -np N (BackupAndRestore or "
    "checkpoints let a restarted job resume).")


class ElasticNotSupportedError(NotImplementedError):
    """Raised by every name of hvd.elastic."""


def __getattr__(name):
    if name.startswith("__"):
        raise AttributeError(name)
    raise ElasticNotSupportedError(_MESSAGE.format(name=name))
