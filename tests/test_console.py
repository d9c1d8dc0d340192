"""megagrpo/console.py: known upstream noise is dropped from the logger it is created on, through
a logging set-up like vLLM's (a handler on the `vllm` logger, dictConfig); everything else shows.
The quickstart's whole console is held to its list of lines in tests/test_train_quickstart.py."""
import io
import logging
import logging.config

from megagrpo import console
from megagrpo.console import KNOWN_NOISE, Noise, dropping_known_prints, quiet_upstream_logs


def configure_like_vllm(stream):
    """The shape of vLLM's own logging set-up (vllm/logger.py, DEFAULT_LOGGING_CONFIG), which it
    applies when an engine is built, after megagrpo installed its filters; on a logger tree of
    its own (`fakevllm`), so that vLLM engines of later tests keep their handler."""
    logging.config.dictConfig({
        "version": 1, "disable_existing_loggers": False,
        "formatters": {"vllm": {"format": "%(levelname)s [%(name)s] %(message)s"}},
        "handlers": {"vllm": {"class": "logging.StreamHandler", "formatter": "vllm", "level": "WARNING",
                              "stream": stream}},
        "loggers": {"fakevllm": {"handlers": ["vllm"], "level": "WARNING", "propagate": False}},
    })


def test_known_noise_is_dropped_and_other_warnings_show(monkeypatch):
    monkeypatch.setenv("RANK", "0")
    noise = (Noise("fakevllm.worker", "libtcmalloc is not found", "test"),
             Noise("fakevllm.worker", "might matter", "test", once=True))
    quiet_upstream_logs(noise)
    quiet_upstream_logs(noise)  # a second call adds nothing
    out = io.StringIO()
    configure_like_vllm(out)
    worker = logging.getLogger("fakevllm.worker")
    assert sum(isinstance(f, console.KnownNoise) for f in worker.filters) == 1
    worker.warning("libtcmalloc is not found in LD_PRELOAD. For best performance ...")
    worker.warning("%s is not found in LD_PRELOAD", "libtcmalloc")  # matched after formatting
    worker.warning("a warning nobody listed")
    logging.getLogger("fakevllm.other").warning("libtcmalloc is not found (another logger)")
    for _ in range(3):
        worker.warning("might matter: shown once")
    assert out.getvalue().splitlines() == [
        "WARNING [fakevllm.worker] a warning nobody listed",
        "WARNING [fakevllm.other] libtcmalloc is not found (another logger)",
        "WARNING [fakevllm.worker] might matter: shown once",
    ]


def test_a_once_entry_is_not_shown_on_other_ranks(monkeypatch):
    monkeypatch.setenv("RANK", "1")
    quiet_upstream_logs((Noise("fakevllm.rank1", "might matter", "test", once=True),))
    out = io.StringIO()
    configure_like_vllm(out)
    logging.getLogger("fakevllm.rank1").warning("might matter")
    assert out.getvalue() == ""


def test_every_entry_has_a_reason_and_vllms_own_thread_calls_are_told_apart():
    assert all(entry.reason and entry.prefix and entry.logger for entry in KNOWN_NOISE)
    threads = [e for e in KNOWN_NOISE if "set_num_threads" in e.prefix]
    assert [e.once for e in threads] == [False, True] and not console._called_by_vllm_itself()


def test_known_prints_are_dropped_and_other_lines_pass(capsys):
    with dropping_known_prints():
        print("DeepSpeed deepspeed.ops.comm.deepspeed_shm_comm_op built successfully")
        print("a line of its own")
        print("no newline at the end", end="")
    assert capsys.readouterr().out == "a line of its own\nno newline at the end"


def test_a_runs_warning_filters_drop_the_known_torch_warnings_only(monkeypatch):
    """quiet_library_output's warnings filters: torch's barrier-device warning (a world of one
    on a GPU, seen on the first H200 run) and the deprecated-collective FutureWarning go; a
    barrier warning of another kind still shows."""
    import warnings

    from megagrpo.console import quiet_library_output

    monkeypatch.setenv("VLLM_LOGGING_LEVEL", "WARNING")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        quiet_library_output()
        warnings.warn("barrier(): using the device under current context. You can specify `device_id` in "
                      "`init_process_group` to mute this warning.", UserWarning)
        warnings.warn("`torch.distributed._all_gather_base` is deprecated", FutureWarning)
        warnings.warn("barrier(): something else", UserWarning)
    assert [str(w.message) for w in seen] == ["barrier(): something else"]
