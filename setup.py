"""c2: a JAX/TPU reproduction of the Composer 2 training system (Kimi-K2.5 MoE + MTP)."""
from setuptools import find_packages, setup

CORE = [
    "jax==0.10.2",
    "flax==0.12.8",
    "optax==0.2.8",
    "orbax-checkpoint==0.12.8",
    "grain==0.2.18",
    "ml-collections==1.1.0",
    "tensorboard==2.21.0",
    "tensorboardX==2.6.5",  # text + hparams summaries without TensorFlow
    "tokenizers==0.23.3",
    "tiktoken==0.14.0",
    "safetensors==0.8.0",
    "pyarrow",  # Parquet sources
    "tqdm",
    "numpy",
    "absl-py",
]

# The RL system's Ray backend (c2/rl/ray_backend.py); the tests run it, so `test` has it too.
RAY = "ray==2.60.0"
# Evaluation figures (c2/evals/plots.py); the tests draw them, so `test` has it too.
MATPLOTLIB = "matplotlib==3.11.2"

setup(
    name="c2",
    version="0.1.0",
    description="Composer-2 training system in JAX: Kimi-K2.5 MoE with MTP, pretraining to agentic RL.",
    python_requires=">=3.11",
    packages=find_packages(include=["c2", "c2.*", "pallas_kernels", "pallas_kernels.*",
                                    "experiments"]),
    install_requires=CORE,
    extras_require={
        "test": ["pytest", "pytest-xdist", "hypothesis", "openai==3.60.0", RAY, MATPLOTLIB],
        # Engines and environment workers as Ray actors (rl.backend = "ray").
        "rl": [RAY],
        # `python -m c2.eval` figures (PNG/SVG) and train.eval_suites.
        "evals": [MATPLOTLIB],
        # Test-time numerics references and Hugging Face checkpoint import/export.
        # compressed-tensors: transformers reads INT4 (pack-quantized) exports through it.
        "hf": ["torch==2.13.0", "transformers==5.24.0", "safetensors==0.8.0",
               "compressed-tensors==0.20.1"],
        # libtpu for TPU runs and for AOT compilation to TPU topologies from a CPU host.
        "tpu": ["jax[tpu]==0.10.2"],
        # gs:// data paths through etils.epath.
        "gcs": ["gcsfs"],
    },
)
