"""A case's geometry (preset, heads, page size and layout, page stride, top-k) and the sizes
it may take, checked before anything runs; integers only, no torch (`mxval cases` checks
every case with it)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from harness.run.cases import Case, CaseError
from reference import page_shape as layout
from reference.formats import ModelPreset
from reference.formats import preset as get_preset


@dataclass(frozen=True)
class Geometry:
    preset: ModelPreset
    heads: int
    head_dim: int
    rope_dim: int
    ratio: int
    page_size: int
    shuffle: Optional[list]
    page_stride: int
    topk: int
    fmt: str

    @property
    def weights_scale(self) -> float:
        return self.head_dim ** -0.5 * self.heads ** -0.5


def geometry(case: Case) -> Geometry:
    """Shapes of a case, checked before anything runs (errors are case errors)."""
    p = get_preset(case.preset)
    heads = case.heads or p.index_heads
    ps = case.page_size or p.page_size
    d = p.head_dim
    shuffle = None
    if case.fmt == "mxfp4":
        if case.layout == "shuffled":
            shuffle = layout.choose_shuffle(d, heads).as_list()
        elif case.layout != "natural":
            shuffle = list(case.layout)
        try:
            layout.check_layout(ps, d, layout.as_shuffle(shuffle))
        except ValueError as e:
            raise CaseError(f"{case.file}: case {case.name!r}: {e}") from None
        need = layout.page_bytes(ps, d)
    else:
        need = ps * (d + 4)
    stride = need + case.page_stride_pad
    _check_sizes(case, p.compress_ratio, ps, stride, heads, d)
    return Geometry(p, heads, d, p.rope_dim, p.compress_ratio, ps, shuffle,
                    stride, case.topk or p.topk, case.fmt)


# What one case may allocate, checked before anything runs (a typo must not become an
# allocation that the machine cannot survive).
MAX_POOL_BYTES = 2 ** 32          # the K pool (4 GiB; the largest suite pool is 2.2 GiB)
MAX_Q_ELEMENTS = 2 ** 30          # step tokens x heads x head dim
MAX_LOGITS = 2 ** 31              # one step's tokens x the widest row (fp64 reference logits: 16 GiB;
                                  # the GPU suite's 65537-row top-k call needs just over 2^30)


def page_needs(case: Case, r: int, ps: int) -> list[int]:
    """The K pool pages each sequence needs (at least one)."""
    return [max(1, -(-(s.len // r) // ps)) for s in case.seqs]


def shared_pages(case: Case, r: int, ps: int) -> list[int]:
    """Per sequence, how many of its first block-table pages are the first sequence's (page_order
    "shared"; 0 elsewhere and for the first sequence): its whole pages of history entries, at
    most as many as the first sequence has. Those entries are read, never written, by every
    step (a step's entries lie past its history's)."""
    if case.page_order != "shared":
        return [0] * len(case.seqs)
    whole = [(s.history // r) // ps for s in case.seqs]
    return [0] + [min(w, whole[0]) for w in whole[1:]]


def pool_pages(case: Case, needs: list[int]) -> int:
    """The K pool's pages: `pool_pages`, else what the sequences need plus the spare pages."""
    return case.pool_pages or sum(needs) + case.spare_pages


def step_shape(case: Case, r: int, ps: int) -> tuple[int, int]:
    """(logits columns: the widest row, or the table's width; the most tokens in one step)."""
    width = max(max(s.len for s in case.seqs) // r + 1, (case.table_pages or 0) * ps)
    n_steps = max(len(s.steps()) for s in case.seqs)
    step_rows = max(sum(e - b for s in case.seqs for b, e in s.steps()[i:i + 1]) for i in range(n_steps))
    return width, step_rows


def _check_sizes(case: Case, r: int, ps: int, stride: int, heads: int, d: int) -> None:
    where = f"{case.file}: case {case.name!r}"
    needs = page_needs(case, r, ps)
    pool = pool_pages(case, needs)
    if pool < sum(needs):
        raise CaseError(f"{where}: pool_pages: {pool} < the {sum(needs)} pages the sequences need")
    if pool * stride > MAX_POOL_BYTES:
        raise CaseError(f"{where}: pool_pages: {pool} pages of {stride} bytes exceed the "
                        f"{MAX_POOL_BYTES} bytes a case's pool may take")
    steps = sum(sum(s.chunks) + s.decode for s in case.seqs)
    if steps * heads * d > MAX_Q_ELEMENTS:
        raise CaseError(f"{where}: seqs: {steps} step tokens x {heads} heads x {d} dims exceed the "
                        f"{MAX_Q_ELEMENTS} query elements a case may take")
    if case.table_pages is not None and case.table_pages < max(needs):
        raise CaseError(f"{where}: table_pages: {case.table_pages} < the {max(needs)} pages the longest "
                        f"sequence needs")
    if case.page_order == "shared" and not any(shared_pages(case, r, ps)):
        raise CaseError(f"{where}: page_order: \"shared\" shares no page: the first sequence and another "
                        f"need a whole page ({ps} entries, {ps * r} tokens) of history each")
    width, step_rows = step_shape(case, r, ps)
    if step_rows * width > MAX_LOGITS:
        raise CaseError(f"{where}: seqs: {step_rows} tokens in one step x {width} logits columns exceed "
                        f"the {MAX_LOGITS} logits a step may take")


def footprint(case: Case) -> int:
    """Bytes of a case's largest tensors, estimated from its geometry before anything runs:
    the K pool, the state cache its tokens fill, one step's queries and its logits (fp32
    from the backend, fp64 from the reference). For scheduling (which cases may share a
    GPU with others), not a bound: a case's peak is measured (`memory`)."""
    g = geometry(case)
    pool = pool_pages(case, page_needs(case, g.ratio, g.page_size)) * g.page_stride
    tokens = sum(s.len for s in case.seqs)
    width, step_rows = step_shape(case, g.ratio, g.page_size)
    return pool + tokens * g.head_dim * 16 + step_rows * (g.heads * g.head_dim * 2 + width * 12)
