"""The PERSEUS_* settings: Config, the variables that fill it, and ConfigError.

What each setting is (name, variable, type, default, valid range) is the
table in config/spec.py; this module makes Config and the parsers from it.
Every variable is read here, validated, and handed to the native runtime as
plain values. A bad value is an error naming the variable, the value and
what is valid. Constructor arguments (PerseusStrategy, the Horovod shim)
override the environment through `load_config(overrides)`.
"""

import dataclasses
import os
from typing import Optional

from perseus_tf.config import spec as _spec


class ConfigError(ValueError):
    """A PERSEUS_* (or launcher) variable has a value outside its valid range.

    Every part of perseus_tf.config raises it: settings, env contracts,
    addresses and the rendezvous store's secret."""


# Config: the runtime's options, one field a PERSEUS_* variable, made from
# the table in spec.py (name, default).
Config = dataclasses.make_dataclass(
    "Config", [(s.name, Optional[object], dataclasses.field(default=s.default))
               for s in _spec.SETTINGS])
Config.__doc__ = "The runtime's options, one field a PERSEUS_* variable (config/spec.py)."
Config.__module__ = __name__


def _parser(setting):
    """(parse(text) -> value, what is valid in words) for a spec row."""
    kind, *args = setting.valid
    if kind == "range" and setting.kind != "float":
        lo, hi = args

        def parse(text):
            value = int(text)
            if not lo <= value <= hi:
                raise ValueError
            return value
        return parse, f"an integer from {lo} to {hi}"
    if kind in ("range", "above"):
        lo, hi = args

        def parse(text):
            value = float(text)
            if not (lo < value if kind == "above" else lo <= value) or not value <= hi:
                raise ValueError
            return value
        return parse, f"a number in {'(' if kind == 'above' else '['}{lo}, {hi}]"
    if kind == "choice":
        def parse(text):
            value = int(text)
            if value not in args:
                raise ValueError
            return value
        return parse, "one of " + ", ".join(str(v) for v in args)
    if kind == "zero_or_range":
        lo, hi = args

        def parse(text):
            value = int(text)
            if value != 0 and not lo <= value <= hi:
                raise ValueError
            return value
        return parse, f"0 or an integer from {lo} to {hi}"
    if kind == "words":
        def parse(text):
            if text not in args:
                raise ValueError
            return text
        return parse, "one of " + ", ".join(args)
    if kind == "text":
        return str, args[0]
    raise ValueError(f"spec: {setting.name}: unknown kind of valid values {kind!r}")


# field -> (variable, parser, description of the valid range)
VARIABLES = {s.name: (s.variable, *_parser(s)) for s in _spec.SETTINGS}


def _parse(field, text, source):
    variable, parser, valid = VARIABLES[field]
    try:
        return parser(str(text).strip())
    except (TypeError, ValueError):
        raise ConfigError(
            f"{source}={text!r} is invalid: it must be {valid}") from None


def load_config(overrides=None, environ=None) -> Config:
    """Reads every PERSEUS_* variable; `overrides` (field -> value) win."""
    environ = os.environ if environ is None else environ
    config = Config()
    for field, (variable, _, _) in VARIABLES.items():
        text = environ.get(variable)
        if text is not None and text.strip() != "":
            setattr(config, field, _parse(field, text, variable))
    for field, value in (overrides or {}).items():
        if field not in VARIABLES:
            raise ConfigError(
                f"unknown option {field!r}; valid options are: {', '.join(sorted(VARIABLES))}")
        if isinstance(value, bool):  # nancheck=True, shard_optimizer_state=False
            value = int(value)
        if value is not None:
            setattr(config, field, _parse(field, value, f"option {field}"))
    return config


def auto_streams(local_size, cpus=None):
    """PERSEUS_ALLREDUCE_STREAMS when unset: 4 (the documented default) when
    each local rank has 4 or more CPUs, down to 2 on small machines, where
    more stream threads compete with the ranks for cores."""
    cpus = cpus or os.cpu_count() or 1
    return max(2, min(4, cpus // max(1, local_size)))


def env_int(environ, name, lo, hi):
    """The integer variable `name` of environ, from lo to hi (ConfigError if not)."""
    text = environ.get(name)
    try:
        value = int(text)
    except (TypeError, ValueError):
        raise ConfigError(f"{name}={text!r} is invalid: it must be an integer") from None
    if not lo <= value <= hi:
        raise ConfigError(f"{name}={value} is out of range: it must be from {lo} to {hi}")
    return value



# PERSEUS_* variables read outside Config: the launch contract perseusrun
# (or a user) sets for each rank, the rendezvous store, elastic jobs, the
# native libraries' locations, perseusrun's own and the build's. With
# VARIABLES, every name Perseus-TF reads (tests/test_config.py checks the
# sources against this list).
OTHER_VARIABLES = frozenset({
    "PERSEUS_RANK", "PERSEUS_SIZE", "PERSEUS_LOCAL_RANK", "PERSEUS_LOCAL_SIZE",
    "PERSEUS_CROSS_RANK", "PERSEUS_CROSS_SIZE", "PERSEUS_HOST_ADDR", "PERSEUS_JOB_ID",
    "PERSEUS_MASTER_ADDR", "PERSEUS_MASTER_PORT", "PERSEUS_RENDEZVOUS_ADDR",
    "PERSEUS_RENDEZVOUS_PORT", "PERSEUS_RENDEZVOUS_SECRET", "PERSEUS_RENDEZVOUS_SECRET_FILE",
    "PERSEUS_ELASTIC_WORKER", "PERSEUS_ELASTIC_KEY", "PERSEUS_ELASTIC_TIMEOUT",
    "PERSEUS_LAUNCHER_PID", "PERSEUS_FAILURE_RECORD", "PERSEUS_TF_LOGS",
    "PERSEUS_NCCL_LIBRARY", "PERSEUS_CUDA_LIBRARY", "PERSEUS_CUDA_DRIVER", "PERSEUS_NVRTC_LIBRARY",
    "PERSEUS_KERNEL_CACHE", "PERSEUS_REQUIRE_CUDA_WHEELS",
    "PERSEUS_TF_INCLUDE", "PERSEUS_TF_LIBDIR", "PERSEUS_TF_FRAMEWORK_LIB", "PERSEUS_TF_DEFINES",
    "PERSEUS_PYTHON_INCLUDE", "PERSEUS_PYBIND11_INCLUDE",
})
# The test suite's hooks (tests/, and the runtime's fault injection).
TEST_PREFIXES = ("PERSEUS_TEST_", "PERSEUS_CHECK")


def known_variables():
    return {variable for variable, *_ in VARIABLES.values()} | OTHER_VARIABLES


def unknown_variables(environ=None):
    """[(name, closest known name or None)] of the PERSEUS_* variables in
    environ that Perseus-TF does not read: a misspelled one would otherwise
    be ignored in silence."""
    import difflib
    environ = os.environ if environ is None else environ
    known = known_variables()
    found = []
    for name in sorted(environ):
        if name.startswith("PERSEUS_") and name not in known and \
                not name.startswith(TEST_PREFIXES):
            close = difflib.get_close_matches(name, sorted(known), n=1, cutoff=0.75)
            found.append((name, close[0] if close else None))
    return found


def warn_unknown_variables(environ=None, stream=None):
    """Writes one line per PERSEUS_* variable nobody reads, naming the closest
    known one."""
    import sys
    stream = stream or sys.stderr
    for name, close in unknown_variables(environ):
        hint = f"; did you mean {close}?" if close else " (docs/configuration.md lists them)"
        stream.write(f"Perseus-TF: {name} is not a Perseus-TF variable and is ignored{hint}\n")
    stream.flush()
