import pytest


def pytest_configure(config: pytest.Config) -> None:
    # megatron-core warns on import when apex / Transformer Engine are absent (GPU-only extras).
    config.addinivalue_line(
        "filterwarnings", "ignore:Transformer Engine and Apex are not installed"
    )
