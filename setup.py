"""del-megatron: Digit Entropy Loss for Megatron-Core, vocab-parallel."""

from setuptools import find_packages, setup

setup(
    name="del-megatron",
    version="0.2.0",
    description="Digit Entropy Loss (DEL) and its peer losses for Megatron-Core pretraining",
    long_description=(
        "The Digit Entropy Loss (DEL, arXiv 2605.20369) for Megatron-Core: a place-weighted term "
        "on digit tokens added to cross-entropy, vocab-parallel, with the peer losses NTL-WAS, "
        "NTL-MSE and DIST2Loss. One flag in Megatron-LM (`--numerical-loss del`, through the "
        "patch or the drop-in script in the repository), one call in Megatron-Bridge and NeMo. "
        "Tested on CPU; not yet run on a GPU. Documentation: README.md and docs/ in the "
        "repository."
    ),
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    packages=find_packages(include=["del_megatron", "del_megatron.*"]),
    # The CPU runtime's start-up hook (a folder for PYTHONPATH, not a package).
    package_data={"del_megatron.cpu": ["site/sitecustomize.py"]},
    python_requires=">=3.11,<3.13",
    # torch is not pinned here: NGC images bring their own CUDA build, and a bare `torch`
    # requirement on a fresh machine pulls a multi-GB CUDA wheel. The CPU pins live in
    # tests/requirements-cpu.txt, installed by tests/run.sh.
    install_requires=["torch>=2.1"],
    entry_points={"console_scripts": ["del-megatron=del_megatron.cli:main"]},
    extras_require={
        "megatron": ["megatron-core>=0.16"],
        "test": ["pytest>=8", "hypothesis>=6.100", "ruff>=0.6", "numpy"],
        "demo": [
            "megatron-core>=0.16",
            "sentencepiece",
            "tiktoken",
            "tokenizers",
            "tqdm",
            "matplotlib",
        ],
        # No Transformer Engine extra: del-megatron does not import it, and a PyPI build pulled in
        # by `pip install del-megatron[...]` would replace the one NGC images (or docker/Dockerfile)
        # build against their own torch. Megatron-LM's environment brings it (docker/README.md).
    },
    classifiers=[
        "Programming Language :: Python :: 3.11",
        "Programming Language :: Python :: 3.12",
    ],
)
