"""Writes `tests/data/soap_reference.npz`: the authors' PyTorch SOAP in float64 on the problems of
`tests/test_soap.py` (`PROBLEM`, `CONFIGS`), the parameters after every step.

It needs torch (`.venv/bin/pip install torch==2.13.0`, the CPU wheel) and the authors' `soap.py`, which is not in
this repository (its licence is not optim's): fetch https://github.com/nikhilvyas/SOAP (the file at commit
a1e553530fde97d0e6b307d7c82ac6d38b072340 made the stored fixture) and give its path:

    .venv/bin/python tests/data/make_soap_reference.py path/to/soap.py [tests/data/soap_reference.npz]

The reference casts its factors to float32 for `eigh` and `qr`; here `Tensor.float` is made the identity while
those two methods run, so it computes in float64 throughout (torch's default dtype is set to float64, so its
zeros and identities are float64 too).
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from soap_problem import CONFIGS, NSTEPS, gradient, initial  # noqa: E402


def float64_soap(path: str):
    """The reference's SOAP class, subclassed so that its eigh and qr run in float64."""
    import torch

    spec = importlib.util.spec_from_file_location("authors_soap", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)

    @contextlib.contextmanager
    def no_float_cast():
        cast = torch.Tensor.float
        torch.Tensor.float = lambda self, *a, **k: self
        try:
            yield
        finally:
            torch.Tensor.float = cast

    class SOAP64(mod.SOAP):
        def get_orthogonal_matrix(self, mat):
            with no_float_cast():
                return super().get_orthogonal_matrix(mat)

        def get_orthogonal_matrix_QR(self, *args, **kwargs):
            with no_float_cast():
                return super().get_orthogonal_matrix_QR(*args, **kwargs)

    return SOAP64


def run(soap_cls, config: dict) -> dict:
    """The parameters after each of `NSTEPS` steps (`{name: array (NSTEPS, *shape)}`)."""
    import torch

    params = {k: torch.tensor(v, dtype=torch.float64, requires_grad=True) for k, v in initial().items()}
    kw = dict(config)
    kw["betas"] = kw.pop("beta")
    kw["shampoo_beta"] = -1 if kw.get("shampoo_beta") is None else kw["shampoo_beta"]
    opt = soap_cls(list(params.values()), **kw)
    out = {k: [] for k in params}
    for t in range(NSTEPS):
        g = gradient({k: p.detach().numpy() for k, p in params.items()}, t)
        for k, p in params.items():
            p.grad = torch.tensor(g[k], dtype=torch.float64)
        opt.step()
        for k, p in params.items():
            out[k].append(p.detach().numpy().copy())
    return {k: np.stack(v) for k, v in out.items()}


def main(argv: list[str]) -> None:
    import torch

    torch.set_default_dtype(torch.float64)
    soap_cls = float64_soap(argv[1])
    dest = argv[2] if len(argv) > 2 else os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                      "soap_reference.npz")
    arrays = {}
    for name, config in CONFIGS.items():
        for k, v in run(soap_cls, config).items():
            arrays[f"{name}/{k}"] = v
    np.savez_compressed(dest, **arrays)
    print(f"wrote {dest}: {len(arrays)} arrays")


if __name__ == "__main__":
    main(sys.argv)
