"""The wheel stage's checks in the fresh environment (tests/wheel/run.sh), run from outside the
checkout with `python -I`: python smoke.py CHECKOUT VENV.

The package, its metadata, its console script and its data file come from VENV's site-packages
(not from the checkout, not from .venv's editable install); every module of the checkout's
del_megatron/ is in the wheel; and one DEL loss, forward and backward, agrees with the fp64
reference.
"""

import importlib.metadata
import importlib.util
import sys
import sysconfig
from pathlib import Path


def main(checkout: Path, venv: Path) -> None:
    site = Path(sysconfig.get_paths()["purelib"]).resolve()
    assert site.is_relative_to(venv.resolve()), f"not the fresh environment's Python: {site}"
    # the one folder on the path with a del_megatron in it is this environment's site-packages
    # (.venv's, behind it, has only the editable install's metadata and finder, not run here)
    homes = [p for p in sys.path if (Path(p or ".") / "del_megatron").exists()]
    assert [Path(p).resolve() for p in homes] == [site], f"del_megatron on the path in: {homes}"
    assert str(checkout) not in sys.path and "" not in sys.path, sys.path

    import del_megatron as dm

    package = Path(dm.__file__).resolve().parent
    assert package == site / "del_megatron", f"del_megatron imported from {package}, not {site}"
    import del_megatron.tools.cli

    assert Path(del_megatron.tools.cli.__file__).resolve().is_relative_to(package)

    # every module of the checkout's package is in the wheel, and the CPU runtime's start-up hook
    def modules(folder: Path):
        return {
            str(p.relative_to(folder)) for p in folder.rglob("*.py") if "__pycache__" not in p.parts
        }

    missing = modules(checkout / "del_megatron") - modules(package)
    assert not missing, f"not in the wheel: {sorted(missing)}"
    assert (package / "cpu" / "site" / "sitecustomize.py").is_file(), "package data missing"

    dist = importlib.metadata.distribution("del-megatron")
    assert Path(dist.locate_file("")).resolve() == site, f"metadata from {dist.locate_file('')}"
    assert dist.version == dm.__version__, (dist.version, dm.__version__)
    scripts = {e.name: e.value for e in dist.entry_points if e.group == "console_scripts"}
    assert scripts == {"del-megatron": "del_megatron.tools.cli:main"}, scripts
    script = venv / "bin" / "del-megatron"
    shebang = script.read_text().splitlines()[0]
    assert shebang == f"#!{venv / 'bin' / 'python'}", f"{script}: {shebang}"
    assert dist.metadata["Requires-Python"] == "<3.13,>=3.11", dist.metadata["Requires-Python"]
    assert dist.metadata["License-Expression"] == "Apache-2.0", dist.metadata["License-Expression"]

    import torch

    from del_megatron.reference import reference_lm_loss

    torch.manual_seed(0)
    b, s, v, alpha = 2, 16, 32, 0.1
    vocab = dm.DigitVocab(digit_ids=range(10), decimal_point_ids=[10])
    labels = torch.randint(11, v, (b, s))
    labels[0, 2:6] = torch.tensor([3, 1, 4, 1])  # 3141
    labels[1, 5:9] = torch.tensor([2, 10, 7, 1])  # 2.71
    logits = torch.randn(s, b, v, requires_grad=True)  # [s, b, V], as Megatron-Core passes them
    cfg = dm.NumericalLossConfig(loss="del", alpha=alpha, vocab=vocab)
    loss = dm.numerical_lm_loss(labels, logits, cfg)
    assert loss.shape == (b, s) and loss.dtype == torch.float32, (loss.shape, loss.dtype)
    parts = dm.loss_parts(labels, logits, cfg)
    assert int(parts.n_digits) == 7 and int(parts.n_tokens) == b * s
    ce, term = reference_lm_loss(labels, logits.detach(), vocab, loss="del", alpha=alpha)
    torch.testing.assert_close(parts.ce.double(), ce, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(parts.term.double(), term, rtol=1e-5, atol=1e-5)
    mean = loss.sum() / parts.n_tokens
    expected = ce.mean() + alpha * term.sum() / parts.n_digits
    torch.testing.assert_close(mean.double().detach(), expected, rtol=1e-5, atol=1e-6)
    mean.backward()
    assert logits.grad is not None and bool(torch.isfinite(logits.grad).all())

    print(f"del_megatron {dm.__version__} from {package}")
    print(f"torch {torch.__version__} from {Path(torch.__file__).parent}")
    core = importlib.util.find_spec("megatron.core")  # found, not imported (its import warns)
    assert core is not None and core.origin, "megatron-core is not on the path"
    core_version = importlib.metadata.version("megatron-core")
    print(f"megatron-core {core_version} at {Path(core.origin).parent}")
    print(
        f"DEL loss (alpha {alpha}, {int(parts.n_digits)} digit targets of {b * s}): "
        f"{mean.item():.6f}, the fp64 reference {expected.item():.6f}; gradient finite"
    )


if __name__ == "__main__":
    main(Path(sys.argv[1]).resolve(), Path(sys.argv[2]).absolute())
