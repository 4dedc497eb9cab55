"""The supported Keras range (perseus_tf/_keras.py) and Horovod's module
paths, in one process: which Keras a process trains with, one clear line for
a Keras outside the range at PerseusStrategy() and hvd.init() (before the
runtime starts), a warning for one newer than the newest tested, what a
feature an old Keras lacks says, and `perseus_tf.horovod.tensorflow[.keras]`
as the shim's own modules. The releases themselves train in
tests/test_keras_versions.py."""

import types
import warnings

import pytest

from perseus_tf import _keras
from tiers import second_pass


def _fake(name, version):
    return _keras.Flavour(types.SimpleNamespace(__name__=name, __version__=version))


def test_versions_parse_with_suffixes():
    assert _fake("keras", "3.0.5").version == (3, 0, 5)
    assert _fake("keras", "3.13.0.dev2025112900").version == (3, 13, 0)
    assert _fake("keras", "3.12.0rc1").version == (3, 12, 0)
    flavour = _fake("tf_keras", "2.21.0")
    assert (flavour.major, flavour.at_least(2, 15), flavour.at_least(2, 22)) == (2, True, False)


def test_the_keras_in_use_is_found():
    import keras
    found = _keras.in_use()
    assert found[0].package is keras
    assert found[0].major == (2 if second_pass() else 3)
    assert (_keras.keras3() is None) == second_pass()


@pytest.mark.parametrize("name,version,needle", [
    ("keras", "2.14.0", "older than Perseus-TF supports"),
    ("tf_keras", "2.14.1", "older than Perseus-TF supports"),
    ("keras", "1.2.2", "is not supported"),
])
def test_a_keras_outside_the_range_is_one_line_before_the_runtime_starts(
        monkeypatch, name, version, needle):
    monkeypatch.setattr(_keras, "in_use", lambda imported_only=False: [_fake(name, version)])
    import perseus_tf
    from perseus_tf import ops
    import perseus_tf.horovod as hvd
    for start, where in ((perseus_tf.PerseusStrategy, "PerseusStrategy()"),
                         (hvd.init, "hvd.init()")):
        with pytest.raises(_keras.KerasVersionError) as raised:
            start()
        text = str(raised.value)
        assert "\n" not in text, text
        for part in (where, needle, f"{name} {version}", _keras.SUPPORTED):
            assert part in text, text
        assert not ops.is_initialized()


def test_a_keras_newer_than_tested_warns_once(monkeypatch):
    newer = f"{_keras.KERAS3_NEWEST_TESTED[0]}.{_keras.KERAS3_NEWEST_TESTED[1] + 1}.0"
    monkeypatch.setattr(_keras, "in_use", lambda imported_only=False: [_fake("keras", newer)])
    monkeypatch.setattr(_keras, "_warned", set())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _keras.check_supported("PerseusStrategy()")
        _keras.check_supported("PerseusStrategy()")
    said = [str(w.message) for w in caught]
    assert len(said) == 1 and f"keras {newer} is newer" in said[0], said
    newest = _fake("keras", "%d.%d.9" % _keras.KERAS3_NEWEST_TESTED)
    monkeypatch.setattr(_keras, "in_use", lambda imported_only=False: [newest])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _keras.check_supported("PerseusStrategy()")
    assert not caught


def test_a_feature_an_old_keras_lacks_names_the_release_that_has_it():
    with pytest.raises(_keras.KerasVersionError,
                       match=r"BackupAndRestore \(x\) needs Keras 3.1 or newer; this process "
                             r"has keras 3.0.5\. Upgrade it \(pip install 'keras>=3.1'\)"):
        _keras.require(_fake("keras", "3.0.5"), (3, 1), "BackupAndRestore (x)")
    _keras.require(_fake("keras", "3.1.0"), (3, 1), "BackupAndRestore (x)")


def test_every_tf_release_accepts_a_supported_keras():
    for tf_release, oldest in _keras.OLDEST_KERAS3_FOR_TF.items():
        assert _keras.KERAS3_OLDEST <= oldest <= _keras.KERAS3_NEWEST_TESTED, tf_release


def test_horovod_module_paths_are_the_shim_itself():
    import perseus_tf.horovod as shim
    import perseus_tf.horovod.keras as shim_keras
    import perseus_tf.horovod.tensorflow as hvd
    import perseus_tf.horovod.tensorflow.keras as hvd_keras
    from perseus_tf.horovod.tensorflow.keras.callbacks import BroadcastGlobalVariablesCallback
    import perseus_tf.horovod.tensorflow.elastic as elastic
    import perseus_tf.horovod.tensorflow.keras.elastic as keras_elastic

    assert hvd_keras is shim_keras and hvd.keras is shim_keras
    assert BroadcastGlobalVariablesCallback is shim_keras.callbacks.BroadcastGlobalVariablesCallback
    assert elastic is shim.elastic and keras_elastic is shim_keras.elastic
    for name in shim.__all__:
        assert getattr(hvd, name) is getattr(shim, name), name
    assert hvd.DistributedOptimizer is shim.DistributedOptimizer
