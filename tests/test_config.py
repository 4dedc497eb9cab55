"""Parsing and validation of the env contract and PERSEUS_* variables (no launch)."""

import pytest

from perseus_tf.config import ConfigError, load_config, load_topology


def test_defaults_match_the_documented_ones():
    c = load_config(environ={})
    assert (c.allreduce_dtype, c.gradient_scale, c.streams, c.accumulate_n_steps,
            c.timeout_seconds, c.nancheck, c.perf_check_n_steps) == (0, 10.0, None, 1, 60.0, 0, 0)
    assert c.allreduce_mode is None and c.fusion is None and c.offline_neg is None
    assert c.offline_neg_check_n_steps == 0


def test_streams_are_chosen_from_cpus_per_local_rank_when_unset():
    from perseus_tf.config import auto_streams

    assert auto_streams(local_size=8, cpus=96) == 4  # the documented default
    assert auto_streams(local_size=2, cpus=8) == 4
    assert auto_streams(local_size=2, cpus=6) == 3
    assert auto_streams(local_size=2, cpus=2) == 2
    assert auto_streams(local_size=4, cpus=2) == 2


@pytest.mark.parametrize("variable,value,needle", [
    ("PERSEUS_ALLREDUCE_STREAMS", "13", "an integer from 1 to 12"),
    ("PERSEUS_ALLREDUCE_FUSION", "129", "an integer from 0 to 128"),
    ("PERSEUS_ALLREDUCE_MODE", "2", "one of 0, 1"),
    ("PERSEUS_OFFLINE_NEG", "yes", "one of 0, 1"),
    ("PERSEUS_ALLREDUCE_GRADIENT_SCALE", "0", "(0, 1000000.0]"),
    ("PERSEUS_GRADIENT_MOMENTUM", "1.5", "(0, 1]"),
    ("PERSEUS_ACCUMULATE_N_STEPS", "0", "from 1 to 1024"),
    ("PERSEUS_OFFLINE_NEG_CHECK_N_STEPS", "-1", "an integer from 0 to 1000000000"),
    ("PERSEUS_MALLOC_MMAP_THRESHOLD", "4096", "0 or an integer from 131072 to 33554432"),
    ("PERSEUS_MALLOC_MMAP_THRESHOLD", str(64 << 20), "0 or an integer from 131072 to 33554432"),
])
def test_bad_values_name_variable_and_range(variable, value, needle):
    with pytest.raises(ConfigError) as e:
        load_config(environ={variable: value})
    assert variable in str(e.value) and needle in str(e.value) and repr(value) in str(e.value)


def test_overrides_win_and_unknown_options_are_rejected():
    c = load_config({"streams": 2}, environ={"PERSEUS_ALLREDUCE_STREAMS": "8"})
    assert c.streams == 2
    with pytest.raises(ConfigError, match="unknown option 'stream'"):
        load_config({"stream": 2}, environ={})
    with pytest.raises(ConfigError, match="option streams"):
        load_config({"streams": 99}, environ={})


def test_topology_from_each_launcher():
    assert load_topology({}).size == 1
    t = load_topology({"PERSEUS_RANK": "1", "PERSEUS_SIZE": "4", "PERSEUS_LOCAL_RANK": "1",
                       "PERSEUS_LOCAL_SIZE": "2", "PERSEUS_CROSS_RANK": "0",
                       "PERSEUS_CROSS_SIZE": "2", "PERSEUS_RENDEZVOUS_ADDR": "127.0.0.1",
                       "PERSEUS_RENDEZVOUS_PORT": "5000", "PERSEUS_RENDEZVOUS_SECRET": "abcd",
                       "PERSEUS_HOST_ADDR": "127.0.0.2"})
    assert (t.rank, t.size, t.local_size, t.cross_size, t.secret, t.host_addr) == \
        (1, 4, 2, 2, b"\xab\xcd", "127.0.0.2")
    t = load_topology({"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4",
                       "OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
                       "MASTER_ADDR": "127.0.0.1"})
    assert (t.rank, t.cross_rank, t.cross_size, t.store_port, t.host_store) == (3, 1, 2, 6666, False)
    t = load_topology({"HOROVOD_RANK": "0", "HOROVOD_SIZE": "2", "HOROVOD_LOCAL_RANK": "0",
                       "HOROVOD_LOCAL_SIZE": "2", "PERSEUS_MASTER_ADDR": "127.0.0.1",
                       "PERSEUS_MASTER_PORT": "7000"})
    assert (t.rank, t.size, t.store_port, t.host_store) == (0, 2, 7000, True)


def test_multi_rank_without_rendezvous_names_the_variables():
    with pytest.raises(ConfigError, match="PERSEUS_MASTER_ADDR"):
        load_topology({"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "2",
                       "OMPI_COMM_WORLD_LOCAL_RANK": "0", "OMPI_COMM_WORLD_LOCAL_SIZE": "2"})


def test_import_makes_tensorflow_pool_cpu_memory_unless_the_user_chose():
    """`import perseus_tf` before TensorFlow's first op gives TF's pooling
    (BFC) CPU allocator, whose statistics TF reports; TF's default allocator,
    or the user's TF_CPU_ALLOCATOR_USE_BFC=false, has none."""
    import os
    import subprocess
    import sys

    code = ("import sys, tensorflow as tf\n"
            "if sys.argv[1] == 'perseus':\n"
            "    import perseus_tf\n"
            "tf.reduce_sum(tf.ones([1 << 20]))\n"
            "try:\n"
            "    print('POOL', tf.config.experimental.get_memory_info('CPU:0')['peak'] > 0)\n"
            "except ValueError:\n"
            "    print('POOL', None)\n")
    env = {k: v for k, v in os.environ.items() if k != "TF_CPU_ALLOCATOR_USE_BFC"}
    env["TF_CPP_MIN_LOG_LEVEL"] = "2"
    # On CPUs where TF turns its oneDNN ops on by default (AVX-512 VNNI/BF16,
    # AMX: an AMD EPYC here), TF pools CPU memory whatever the variable says,
    # so the difference the import makes shows only with oneDNN off, TF's
    # default on other CPUs.
    env["TF_ENABLE_ONEDNN_OPTS"] = "0"

    def pool(mode, **extra):
        out = subprocess.run([sys.executable, "-c", code, mode], env=dict(env, **extra),
                             capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr[-2000:]
        return [line for line in out.stdout.splitlines() if line.startswith("POOL")][-1]

    assert pool("perseus") == "POOL True"
    assert pool("plain") == "POOL None"
    assert pool("perseus", TF_CPU_ALLOCATOR_USE_BFC="false") == "POOL None"


def test_misspelled_variables_are_named_with_the_closest_known_one():
    import io
    from perseus_tf.config import unknown_variables, warn_unknown_variables
    env = {"PERSEUS_ALLREDUCE_STREAM": "2", "PERSEUS_FUSION_THRESHOLDS": "0",
           "PERSEUS_COMPLETELY_MADE_UP_THING": "1", "PERSEUS_ALLREDUCE_STREAMS": "2",
           "PERSEUS_RANK": "0", "PERSEUS_TEST_PASS": "x", "OTHER": "1"}
    assert unknown_variables(env) == [
        ("PERSEUS_ALLREDUCE_STREAM", "PERSEUS_ALLREDUCE_STREAMS"),
        ("PERSEUS_COMPLETELY_MADE_UP_THING", None),
        ("PERSEUS_FUSION_THRESHOLDS", "PERSEUS_FUSION_THRESHOLD")]
    out = io.StringIO()
    warn_unknown_variables(env, out)
    lines = out.getvalue().splitlines()
    assert len(lines) == 3, lines
    assert lines[0] == ("Perseus-TF: PERSEUS_ALLREDUCE_STREAM is not a Perseus-TF variable and "
                        "is ignored; did you mean PERSEUS_ALLREDUCE_STREAMS?"), lines


def test_every_variable_the_sources_read_is_known():
    # The list the warning compares with is complete: every PERSEUS_* name in
    # the package, the native code and the tools is in it (or a test hook).
    import os
    import re
    from perseus_tf.config import settings
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    known = settings.known_variables()
    missing = {}
    for folder in ("perseus_tf", "cc", "tools"):
        for dirpath, _, files in os.walk(os.path.join(root, folder)):
            for name in files:
                if not name.endswith((".py", ".cc", ".h", ".cu", ".sh")):
                    continue
                path = os.path.join(dirpath, name)
                with open(path, errors="replace") as f:
                    text = f.read()
                for found in re.findall(r"\bPERSEUS_[A-Z0-9_]*[A-Z0-9]\b", text):
                    if found not in known and not found.startswith(settings.TEST_PREFIXES) \
                            and found not in ("PERSEUS_PAUSE", "PERSEUS_NATIVE_SETTINGS",
                                              "PERSEUS_BIND_SETTING",
                                              "PERSEUS_CUDA_KERNELS"):  # C++ macros
                        missing.setdefault(found, os.path.relpath(path, root))
    assert not missing, missing


def test_a_bad_setting_under_another_launcher_is_one_line_from_rank_0():
    """Started by mpirun (its variables), not perseusrun, whose own check
    stops a bad setting before any rank starts: rank 0 prints one line
    naming the variable and its range, the other rank nothing, and both
    exit 1, where every rank once printed a traceback. Any other exception
    keeps its traceback."""
    import os
    import subprocess
    import sys
    procs = []
    for rank in (0, 1):
        env = {k: v for k, v in os.environ.items() if not k.startswith("PERSEUS_")}
        env.update(OMPI_COMM_WORLD_RANK=str(rank), OMPI_COMM_WORLD_SIZE="2",
                   OMPI_COMM_WORLD_LOCAL_RANK=str(rank), OMPI_COMM_WORLD_LOCAL_SIZE="2",
                   PERSEUS_MASTER_ADDR="127.0.0.1", PERSEUS_MASTER_PORT="1",
                   PERSEUS_ALLREDUCE_STREAMS="0")
        procs.append(subprocess.Popen(
            [sys.executable, "-c", "import perseus_tf; perseus_tf.init()"], env=env,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outs = [p.communicate(timeout=120) for p in procs]
    # (TensorFlow's own start-up lines aside.)
    mine = [[l for l in err.splitlines() if l.startswith("perseus-tf") or "Traceback" in l or
             "Error" in l] for _, err in outs]
    assert [p.returncode for p in procs] == [1, 1], outs
    assert mine[0] == ["perseus-tf: PERSEUS_ALLREDUCE_STREAMS='0' is invalid: it must be an "
                       "integer from 1 to 12"], outs[0]
    assert mine[1] == [], outs[1]
    other = subprocess.run([sys.executable, "-c", "import perseus_tf; raise KeyError('x')"],
                           capture_output=True, text=True, timeout=120)
    assert "Traceback" in other.stderr and "KeyError: 'x'" in other.stderr, other.stderr


# One spec for every setting (perseus_tf/config/spec.py): the layers made
# from it must agree with it.

def _gen_settings():
    import importlib.util
    import os
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                        "tools", "gen_settings.py")
    loader = importlib.util.spec_from_file_location("gen_settings", path)
    module = importlib.util.module_from_spec(loader)
    loader.loader.exec_module(module)
    return module


def test_the_runtime_header_and_the_configuration_page_are_made_from_the_spec():
    import os
    gen = _gen_settings()
    with open(os.path.join(gen.ROOT, gen.HEADER)) as f:
        assert f.read() == gen.render(), \
            "cc/runtime/settings.h is out of date: run python tools/gen_settings.py"
    with open(os.path.join(gen.ROOT, gen.PAGE)) as f:
        page = f.read()
    assert gen.page_problems(page) == [], "run python tools/gen_settings.py --docs"
    # The check sees a changed row, a row in the wrong section and a missing one.
    row = next(line for line in page.split("\n")
               if line.startswith("| `PERSEUS_ALLREDUCE_STREAMS` (`streams`)"))
    assert gen.page_problems(page.replace(row, row.replace("1 to 12", "1 to 16")))[0][0] == \
        "streams"
    assert any("no row" in p for _, p in gen.page_problems(page.replace(row + "\n", "")))


def test_every_layer_names_each_setting_as_the_spec_does():
    import dataclasses

    from perseus_tf import _core, _native
    from perseus_tf.config import Config, settings, spec
    names = [s.name for s in spec.SETTINGS]
    assert len(set(names)) == len(names) and \
        len({s.variable for s in spec.SETTINGS}) == len(names)
    assert [f.name for f in dataclasses.fields(Config)] == names
    assert list(settings.VARIABLES) == names
    assert all(settings.VARIABLES[s.name][0] == s.variable for s in spec.SETTINGS)
    # The binding has each native setting under its name, with the spec's
    # default (or the runtime's value for unset), and no other setting.
    options = _core.InitOptions()
    for s in spec.native_settings():
        expected = s.none_as if s.default is None else s.default
        assert getattr(options, s.name) == expected, s.name
    topology = {"rank", "size", "local_rank", "local_size", "cross_rank", "cross_size",
                "store_addr", "store_port", "secret", "job_id", "host_addr"}
    derived = {"settings", "timeline_path", "nccl", "nccl_dirs", "topk_fallback"}
    bound = {n for n in dir(options) if not n.startswith("_")}
    assert bound == topology | derived | {s.name for s in spec.native_settings()}
    # What init() compares and what ranks may differ in come from the spec.
    assert _native._RUNTIME_OPTIONS == {s.name for s in spec.runtime_settings()}
    assert _native._PER_RANK_SETTINGS == {s.name for s in spec.SETTINGS if s.per_rank}
    # Every spec default passes its own parser.
    for s in spec.SETTINGS:
        if s.default is not None:
            assert settings._parse(s.name, s.default, s.variable) == s.default, s.name
