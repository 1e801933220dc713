"""The reference as a backend, for self-checks (reference vs reference must be exact)."""
import reference

from . import DECLARED, Backend


def make_backend() -> Backend:
    import torch
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    return Backend("reference", DECLARED["reference"].summary, dict(reference.FUNCTIONS), device=dev)
