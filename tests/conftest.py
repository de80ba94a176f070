import os

# Must precede any import of kernels: Triton decorates them at import time.
os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
from hydra import compose, initialize_config_dir  # noqa: E402

CONF_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "conf")


def compose_train(overrides: list[str] | None = None):
    """The same config `python -m training.run <overrides>` would see."""
    with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
        return compose(config_name="train", overrides=overrides or [])


def chi2_pvalue(observed: torch.Tensor, expected: torch.Tensor) -> float:
    """Chi-square goodness of fit; cells the target gives zero mass must stay empty."""
    keep = expected > 0
    assert observed[~keep].sum() == 0, "a token with zero target probability was emitted"
    o, e = observed[keep].double(), expected[keep].double()
    stat, dof = ((o - e) ** 2 / e).sum(), int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0, dtype=torch.float64), stat / 2))


@pytest.fixture(scope="session")
def tiny_target():
    from drafters.target import load_target

    torch.manual_seed(0)
    return load_target(compose_train(["target=tiny_llama"]).target)


@pytest.fixture(scope="session")
def smollm2_target():
    from drafters.target import load_target

    return load_target(compose_train(["target=llama"]).target)
