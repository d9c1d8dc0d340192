"""A quiet console: the upstream log lines known not to apply to a megagrpo job, and what drops
them. A job's console shows megagrpo's own lines, real warnings and errors.

Each entry of KNOWN_NOISE names the logger a library creates the record on, the start of the
message and why it does not apply (docs/upstream-issues.md lists the same). A filter added to a
named logger sees exactly the records created on it, whichever handler prints them, and it
stays through vLLM's logging set-up (dictConfig leaves other loggers' filters alone), so the
filters can be installed before or after the library is imported, as long as it is before the
line is logged. An entry that might matter (`once`) is shown once per job, on rank 0.

    quiet_console()        # at a job's or a tool's start: the filters, and no progress bars off a terminal
    quiet_library_output() # at a training or eval job's start: also vLLM's log level and torch's warnings
    with dropping_known_prints():   # around upstream code that print()s known noise
        ...

Progress bars of model loading and data preparation draw with carriage returns: useful on a
terminal, a garbled line in a log file or a pipe, so they are only drawn on a terminal.
This module imports nothing of megagrpo (layer 0 of tests/test_package.py::LAYERS).
"""
from __future__ import annotations

import contextlib
import io
import logging
import os
import shutil
import sys
import warnings
from dataclasses import dataclass
from typing import Callable, Iterator, Optional


def _called_by_vllm_itself() -> bool:
    """Whether the torch.set_num_threads call being logged comes from vLLM's own code (its
    set_default_torch_num_threads around model loading, set_torch_threads_for_runtime after
    it): the frame that called vLLM's replacement of torch.set_num_threads is in vLLM."""
    frame = sys._getframe()
    while frame is not None and frame.f_code.co_name != "skip_set_num_threads":
        frame = frame.f_back
    caller = frame.f_back if frame is not None else None
    return caller is not None and f"{os.sep}vllm{os.sep}" in caller.f_code.co_filename


@dataclass(frozen=True)
class Noise:
    logger: str                 # the logger the record is created on
    prefix: str                 # the start of the formatted message
    reason: str                 # why it does not apply to a megagrpo job
    once: bool = False          # it might matter: shown once per job, on rank 0
    when: Optional[Callable[[], bool]] = None   # only then (default: always)


_CPU_WORKER = "vllm.v1.worker.cpu_worker"
KNOWN_NOISE = (
    Noise("DeepSpeed", "Setting accelerator to CPU. If you have GPU or other accelerator",
          "the machine has no GPU (no nvidia-smi), so CPU is right. It is logged while deepspeed is imported, so only "
          "where these filters come first (tools); launch/quickstart.sh sets DS_ACCELERATOR=cpu instead, "
          "which the launcher's processes and the ranks inherit", when=lambda: shutil.which("nvidia-smi") is None),
    Noise("vllm.engine.arg_utils", "The global random seed is set to",
          "the engine runs inside the rank on purpose (VLLM_ENABLE_V1_MULTIPROCESSING=0); it seeds the rank's global "
          "RNGs with its seed (the job's seed + dp rank), so they stay a function of the job's seed; sampling "
          "seeds are per prompt and the data order has its own generator"),
    Noise("vllm.engine.arg_utils", "This model does not officially support disabling chunked prefill",
          "megagrpo turns chunked prefill off on CPU, where a chunked seeded prefill crashes the engine; "
          "tests/test_rollout_weight_sync.py holds the engine's log-probs to the trainer's"),
    Noise("vllm.config.vllm", "Enforce eager set, disabling torch.compile",
          "eager mode is megagrpo's choice on CPU (no CUDA graphs there; compilation would slow the start)"),
    Noise("vllm.config.vllm", "Inductor compilation was disabled by user settings",
          "follows from eager mode on CPU (above)"),
    Noise("vllm.config.vllm", "Model Runner V2 requires Triton; using the V1 model runner",
          "the CPU stack has no Triton CPU backend; the V1 runner is the one megagrpo is tested with"),
    Noise("vllm.platforms.cpu", "Triton is not installed. triton-cpu is expected on x86 CPUs",
          "triton-cpu is not published on PyPI; vLLM's CPU kernels run without it"),
    Noise("vllm.triton_utils.importing", "Triton is installed, but doesn't include CPU backend",
          "torch's Triton has no CPU backend; vLLM disables it on CPU, as above"),
    Noise("vllm.platforms.cpu", "Reset SSM cache type to float32 for accelerated GDN mamba backend 'none'",
          "backend 'none': the model has no SSM state, so the setting changes nothing (a Mamba model's line shows)"),
    Noise("vllm.model_executor.models.utils", "Attempted to load weight",
          "a float32 checkpoint (tools/get_model.py's default) loaded into a bfloat16 engine: each weight is rounded "
          "to bfloat16, exactly as the trainer rounds it when model.dtype is bfloat16, so both hold the same values"),
    Noise("transformers.configuration_utils", "Model config: pad_token_id must be `None` or an integer within the "
          "vocabulary (between 0 and 31999), got 128002", "transformers builds Idefics3's default config (a "
          "32,000-token Llama text config beside Idefics3's pad id 128002) to compare a real one with, when it saves "
          "or loads it; the model's own config holds its own ids"),
    Noise("transformers.utils.import_utils",
          "`Idefics3ImageProcessor` requires torchvision (not installed); falling back",
          "the CPU stack has no torchvision (launch/install.sh); the PIL image processor is the one megagrpo uses and "
          "tests there (docs/multimodal.md)"),
    Noise("vllm.config.model", "Model does not support mm_device_do_normalize, forcing mm_device_do_normalize = False",
          "vLLM's default asks to normalise images on the device; Idefics3's processor normalises them, as the "
          "trainer's does (tests/test_multimodal.py holds vLLM's log-probs to the trainer's)"),
    Noise(_CPU_WORKER, "libtcmalloc is not found in LD_PRELOAD",
          "a speed hint for CPU inference that does not hold for a trainer sharing the process: measured, "
          "tcmalloc was not faster and kept more memory (docs/cpu-stack.md, Allocator)"),
    Noise(_CPU_WORKER, "libiomp is not found in LD_PRELOAD", "as libtcmalloc"),
    Noise(_CPU_WORKER, "CPU backend doesn't allow to use `torch.set_num_threads` after the thread binding",
          "vLLM's own calls (set_default_torch_num_threads, set_torch_threads_for_runtime: about ten per rank "
          "while it builds the engine); the threads stay as its binding set them", when=_called_by_vllm_itself),
    Noise(_CPU_WORKER, "CPU backend doesn't allow to use `torch.set_num_threads` after the thread binding",
          "called by other code (a reward function, a library): vLLM replaced torch.set_num_threads in this "
          "process, so the call does nothing; said once", once=True),
)


# lines upstream code print()s (no logger to filter): (start of the line, why it does not apply)
KNOWN_PRINTS = (
    ("DeepSpeed deepspeed.ops.comm.deepspeed_shm_comm_op built successfully",
     "printed by every rank whenever DeepSpeed loads its CPU all-reduce op, also when it only loads the op "
     "launch/install.sh built (a build that does happen prints the compiler's lines first)"),
)


def launch_rank() -> int:
    """This process's rank as the launcher set it (0 outside a launch), before or after the
    process group starts: for lines that one rank says for all."""
    return int(os.environ.get("RANK", os.environ.get("OMPI_COMM_WORLD_RANK", "0")))


class KnownNoise(logging.Filter):
    """Drops the records of one logger that KNOWN_NOISE lists for it (or shows a `once` entry's
    first record, on rank 0)."""

    def __init__(self, entries: list[Noise]):
        super().__init__()
        self.entries = entries
        self.shown: set[Noise] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        for entry in self.entries:
            if not message.startswith(entry.prefix) or (entry.when is not None and not entry.when()):
                continue
            if entry.once and entry not in self.shown and launch_rank() == 0:
                self.shown.add(entry)
                return True
            return False
        return True


def quiet_upstream_logs(noise: tuple[Noise, ...] = KNOWN_NOISE) -> None:
    """One KnownNoise filter on each logger named in `noise` (once per process)."""
    for name in dict.fromkeys(entry.logger for entry in noise):
        logger = logging.getLogger(name)
        if not any(isinstance(f, KnownNoise) for f in logger.filters):
            logger.addFilter(KnownNoise([entry for entry in noise if entry.logger == name]))


class _DropKnownPrints(io.TextIOBase):
    """A stdout that passes every line on except those KNOWN_PRINTS starts."""

    def __init__(self, stream):
        super().__init__()
        self.stream, self.pending = stream, ""
        self.prefixes = tuple(prefix for prefix, _ in KNOWN_PRINTS)

    def write(self, text: str) -> int:
        *lines, self.pending = (self.pending + text).split("\n")
        for line in lines:
            if not line.startswith(self.prefixes):
                self.stream.write(line + "\n")
        return len(text)

    def flush(self) -> None:
        self.stream.flush()

    def isatty(self) -> bool:
        return self.stream.isatty()

    def fileno(self) -> int:
        return self.stream.fileno()

    def finish(self) -> None:
        if self.pending and not self.pending.startswith(self.prefixes):
            self.stream.write(self.pending)
        self.pending = ""
        self.stream.flush()


@contextlib.contextmanager
def dropping_known_prints() -> Iterator[None]:
    """Inside the block, lines print()ed to stdout that KNOWN_PRINTS lists are dropped; every
    other line passes (loggers keep the stream they were given)."""
    writer = _DropKnownPrints(sys.stdout)
    try:
        with contextlib.redirect_stdout(writer):
            yield
    finally:
        writer.finish()


def on_terminal() -> bool:
    """Whether a person watches this console: stdout and stderr (where bars draw) are terminals."""
    return all(stream is not None and hasattr(stream, "isatty") and stream.isatty()
               for stream in (sys.stdout, sys.stderr))


def quiet_progress_bars() -> None:
    """Off a terminal, no progress bars from transformers (`Loading weights`, `Writing model
    shards`), huggingface_hub or datasets (`Generating train split`); an explicit setting of
    HF_HUB_DISABLE_PROGRESS_BARS or HF_DATASETS_DISABLE_PROGRESS_BARS is left as it is. vLLM's
    loading bar is the engine's `use_tqdm_on_load` (rollout/generators.py)."""
    if on_terminal():
        return
    hub_set = "HF_HUB_DISABLE_PROGRESS_BARS" in os.environ
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")          # read when they are imported
    os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
    if "transformers" in sys.modules and not hub_set:                    # already imported
        from transformers.utils import logging as transformers_logging
        transformers_logging.disable_progress_bar()
    if "datasets" in sys.modules and os.environ["HF_DATASETS_DISABLE_PROGRESS_BARS"] == "1":
        import datasets
        datasets.disable_progress_bars()


def quiet_console() -> None:
    """Known upstream noise filtered, and progress bars only on a terminal."""
    quiet_upstream_logs()
    quiet_progress_bars()


def quiet_library_output() -> None:
    """A run's console shows megagrpo's lines, the progress bar and real warnings. vLLM logs
    INFO lines on every step and rank (prefix-cache resets, reload timings): its level is
    WARNING unless VLLM_LOGGING_LEVEL says otherwise. The upstream warnings known not to apply
    to a megagrpo job are filtered, and progress bars of model loading and data preparation
    are drawn on a terminal only (quiet_console, docs/upstream-issues.md). DeepSpeed and
    vLLM call collectives that torch marks deprecated (FutureWarning on every first use per
    rank): nothing a user can act on, so those are not shown; nor is torch's warning that a
    barrier uses the current CUDA device, which in a world of one DeepSpeed leaves unbound and
    init_distributed sets to the rank's GPU (docs/upstream-issues.md)."""
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    quiet_console()
    warnings.filterwarnings("ignore", message=r"`torch\.distributed\.\w+` is deprecated", category=FutureWarning)
    warnings.filterwarnings("ignore", message=r"barrier\(\): using the device under current context",
                            category=UserWarning)
