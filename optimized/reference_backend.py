"""The reference as a backend, for self-checks (reference vs reference must be exact)."""
import reference

from . import DECLARED, Backend


def make_backend() -> Backend:
    import torch
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    return Backend("reference", DECLARED["reference"].summary, dict(reference.FUNCTIONS), device=dev,
                   no_graph=NO_GRAPH)


# The reference's ops select rows with boolean masks: shapes that depend on the data, which a
# CUDA/HIP graph cannot capture (a capture would replay the capture's selection at every step).
NO_GRAPH = "the reference selects rows with boolean masks (data-dependent shapes a graph cannot capture)"
