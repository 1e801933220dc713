"""Run cases: build the inputs, run each stage of the chain through the backend and the
reference on the same inputs, diff every stage, and compare the whole chain.

Each later stage is fed the BACKEND's upstream output, both on the backend and on the
reference side (NUMERICS.md §1), so a 1-ulp pooling difference shows up as a pooling
difference and not as K-writer bytes. The whole-chain comparison (reference pooling ->
reference writer -> ... against the backend's chain) is reported under `chain.*` with
its own budget. The runner never looks at which backend it drives.

A case yields one row (a dict) of raw metrics; `budgets` turn rows into pass/fail.
"""
from __future__ import annotations

import dataclasses
import multiprocessing as mp
import os
import signal
import threading
import time
import traceback
from collections import deque
from multiprocessing.connection import wait
from typing import Callable, Optional

import torch

import reference
from harness.diff import aggregate, diff_op, invariants
from harness.diff.metrics import CHAIN, chain_key
from harness.diff.scores import recall_points, recall_rows, row_blocks
from harness.run import graph, memory, stagetime
from harness.run.cases import Case
from harness.run.geometry import footprint
from harness.run.inputs import CaseInputs, build, filled_on_device
from harness.run.record import ROW_FINDINGS_PER_STAGE, case_row, jsonable
from optimized import Backend, BackendUnavailable, get_backend
from reference import fp8 as ref_fp8
from reference import layout
from reference.checks import NonFiniteInput
from reference.ops import OPS, op_of

# Scorers are judged against the op table's fp64 scores: the diff compares the backend's fp32
# logits to the true scores of the quantized operands, not to another fp32 rounding of them.
MAX_MAP_POINTS = 4000
MAP_CHUNK_BYTES = 1 << 24
MAX_RECALL_POINTS = 1500
# The history written before a case's first step goes through the reference in blocks of
# tokens (`_written_history`): its intermediates take about HISTORY_TOKEN_BYTES a pooled
# token (measured on an H200: the window gather, the fp64 softmax, the K writer).
HISTORY_TOKEN_BYTES = 8 << 10
HISTORY_MIN_TOKENS = 256


class StageError(Exception):
    def __init__(self, stage: str, step: int, message: str):
        self.stage, self.step = stage, step
        super().__init__(f"{stage} (step {step}): {message}")


class NotJudged(Exception):
    """A stage whose inputs (a backend's upstream output) the reference cannot take and no
    reference substitute exists: this stage and the rest of the case are not judged."""

    def __init__(self, stage: str, step: int, message: str):
        self.stage, self.step = stage, step
        super().__init__(f"{stage} (step {step}): {message}")


class NonFiniteStage(Exception):
    def __init__(self, stage: str, step: int, err: NonFiniteInput):
        self.stage, self.step, self.err = stage, step, err
        super().__init__(f"{stage} (step {step}): {err}")


class _Collector:
    """Per-stage reports of one case, across steps."""

    def __init__(self):
        self.metrics: dict[str, list] = {}
        self.findings: list[dict] = []
        self.summaries: dict[str, list[str]] = {}
        self.per_stage_findings: dict[str, int] = {}

    def add(self, stage: str, step: int, report) -> None:
        for k, v in report.metrics.items():
            if isinstance(v, bool):
                v = int(v)
            if isinstance(v, (int, float)):
                self.metrics.setdefault(f"{stage}.{k}", []).append(v)
        try:
            text = report.summary()
        except Exception as e:  # a summary must never lose the metrics
            text = f"(no summary: {e})"
        self.summaries.setdefault(stage, []).append(f"step {step}: {text}")
        for f in list(report.findings):
            n = self.per_stage_findings.get(stage, 0)
            self.per_stage_findings[stage] = n + 1
            if n < ROW_FINDINGS_PER_STAGE:
                d = jsonable(f)
                d = d if isinstance(d, dict) else {"text": d}
                self.findings.append({"stage": stage, "step": step, **d})

    def case_metrics(self) -> dict[str, float]:
        return {k: aggregate(k, v) for k, v in self.metrics.items()}


# --- plot details: small, JSON-able summaries the HTML report draws ---------------------

def _mismatch_map(before: torch.Tensor, actual: torch.Tensor, expected: torch.Tensor,
                  geo, stage: str) -> list[list[int]]:
    """[[page, entry, mismatched bytes], ...] of the first MAX_MAP_POINTS (page, entry)
    pairs; entry -1 for padding bytes. Compared on the device, MAP_CHUNK_BYTES of pages at a
    time: a pool of GiBs costs no pool-sized mask."""
    if actual.shape != expected.shape:
        return []
    expected = expected.to(actual.device)
    ps, d = geo.page_size, geo.head_dim
    inv = torch.full((actual.shape[1],), -1, dtype=torch.long)
    t = torch.arange(ps)
    if geo.fmt == "mxfp4":
        inv[layout.value_offsets(t, ps, d, geo.shuffle).flatten()] = t.repeat_interleave(d // 2)
        inv[layout.scale_offsets(t, ps, d, geo.shuffle).flatten()] = t.repeat_interleave(d // 32)
    else:
        inv[:ps * d] = t.repeat_interleave(d)
        inv[ps * d:ps * (d + 4)] = t.repeat_interleave(4)
    rows = max(1, MAP_CHUNK_BYTES // max(1, actual.shape[1]))
    parts, n = [], 0
    for p0 in range(0, actual.shape[0], rows):
        diff = actual[p0:p0 + rows] != expected[p0:p0 + rows]
        if not bool(diff.any()):
            continue
        page, off = (x.cpu() for x in diff.nonzero(as_tuple=True))
        pairs, counts = torch.stack((page + p0, inv[off]), 1).unique(dim=0, return_counts=True)
        parts.append(torch.cat((pairs, counts[:, None]), 1))
        n += len(pairs)
        if n >= MAX_MAP_POINTS:          # later pages sort after these
            break
    return torch.cat(parts)[:MAX_MAP_POINTS].tolist() if parts else []


def _ulp_hist(actual: torch.Tensor, expected: torch.Tensor, rows: torch.Tensor) -> dict:
    """bf16 ulp distances of the compared pooled values: {"0": n, "1": n, ...}."""
    if actual.shape != expected.shape or actual.dtype != torch.bfloat16:
        return {}
    a = actual[rows].float().cpu()
    e = expected[rows].float().cpu()

    def ordered(x):
        b = x.to(torch.bfloat16).view(torch.int16).to(torch.int32)
        return torch.where(b < 0, -(b & 0x7FFF), b)

    fin = torch.isfinite(a) & torch.isfinite(e)
    dist = (ordered(a) - ordered(e)).abs()[fin]
    out = {str(k): int((dist == k).sum()) for k in range(4)}
    out[">3"] = int((dist > 3).sum())
    out["nonfinite"] = int((~fin).sum())
    return out


def _logit_errors(actual: torch.Tensor, expected: torch.Tensor, row_ends: torch.Tensor) -> list[float]:
    """log10 of |actual - expected| / max|expected| over each row's valid region (a
    histogram's worth, subsampled). On `expected`'s device, a block of rows at a time: a pass
    for the scale, one for the count (past a subsample's worth), one for the picked entries."""
    if actual.dim() != 2 or actual.shape[0] != expected.shape[0]:
        return []
    dev = expected.device
    w = min(actual.shape[1], expected.shape[1])
    ends = row_ends.to(dev).long()
    cols = torch.arange(w, device=dev)
    blocks = row_blocks(actual.shape[0], w)
    n_valid = int(ends.clamp(0, w).sum()) if ends.numel() else 0
    if not n_valid:
        return []

    def valid(r0, r1):
        return cols[None, :] < ends[r0:r1, None]

    def errs(r0, r1, scale):
        """|a - e| / scale of the block's valid entries, and where it is finite (full-size)."""
        e = expected[r0:r1, :w].double()
        err = (actual[r0:r1, :w].to(dev, torch.float64) - e).abs() / scale
        return err, valid(r0, r1) & torch.isfinite(err)

    tops, n_fin = [], []
    for r0, r1 in blocks:
        e = expected[r0:r1, :w].double()
        ok = valid(r0, r1) & torch.isfinite(e)
        tops.append(torch.where(ok, e.abs(), 0.0).amax() if e.numel() else e.new_zeros(()))
        n_fin.append(ok.sum())
    # max |expected| over the finite valid entries (1 where there is none)
    scale = torch.stack(tops).amax().clamp_min(1e-300) if int(torch.stack(n_fin).sum()) else 1.0
    picks, counts = None, [0] * len(blocks)          # at most 4000 valid entries: every finite error
    if n_valid > 4000:
        counts = [int(errs(r0, r1, scale)[1].sum()) for r0, r1 in blocks]
        total = sum(counts)
        picks = torch.linspace(0, total - 1, 4000).long() if total > 4000 else None
    out, start = [], 0
    for (r0, r1), n in zip(blocks, counts):
        if picks is None or bool(((picks >= start) & (picks < start + n)).any()):
            err, m = errs(r0, r1, scale)
            got = err[m]
            out.append(got if picks is None else got[(picks[(picks >= start) & (picks < start + n)] - start).to(dev)])
        start += n
    err = torch.cat(out) if out else torch.zeros(0, dtype=torch.float64)
    err = torch.log10(err.clamp_min(1e-20))
    return [round(float(x), 3) for x in err.cpu()]


def _recall_rows(actual: torch.Tensor, scores: torch.Tensor, lengths: torch.Tensor, k: int) -> list[list]:
    """The backend's top-k against the reference chain's scores, per row (`recall_rows`)."""
    try:
        out = recall_rows(actual, scores, lengths, k)
    except ValueError:           # a misshapen output: its stage's report says so
        return []
    return _thin(out)


def _thin(out: list[list]) -> list[list]:
    """At most MAX_RECALL_POINTS of the recall plot's rows, evenly spaced."""
    if len(out) > MAX_RECALL_POINTS:
        step = len(out) / MAX_RECALL_POINTS
        out = [out[int(i * step)] for i in range(MAX_RECALL_POINTS)]
    return out


# --- the chain --------------------------------------------------------------------------

# Without `clean_logits` the columns at and past a row's end are unspecified (NUMERICS.md §6):
# a scorer may leave anything there, and vLLM's do. Top-k's input holds this value there, above
# every valid logit, so that a top-k reading one column past a row's end selects it.
PAST_END_LOGIT = torch.finfo(torch.float32).max


def past_ends_outrank(logits: torch.Tensor, row_ends: torch.Tensor) -> None:
    """Write PAST_END_LOGIT at and past each row's end, in place, a block of rows at a time
    (the columns are unspecified: the scorer's comparisons read only the valid region)."""
    cols = torch.arange(logits.shape[1], device=logits.device)
    ends = row_ends.to(logits.device).long()
    for r0, r1 in row_blocks(logits.shape[0], logits.shape[1], 1):
        logits[r0:r1].masked_fill_(cols[None, :] >= ends[r0:r1, None], PAST_END_LOGIT)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """A tensor's bytes, flat (uint8), where the tensor is."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def _flat_bytes(a: torch.Tensor, b: torch.Tensor):
    """The bytes of two same-shaped tensors, MAP_CHUNK_BYTES at a time: (a's, b's) pairs."""
    x, y = _bytes(a), _bytes(b)
    for i in range(0, x.numel(), MAP_CHUNK_BYTES):
        yield x[i:i + MAP_CHUNK_BYTES], y[i:i + MAP_CHUNK_BYTES]


def _valid_bytes(a: torch.Tensor, b: torch.Tensor, row_ends: torch.Tensor):
    """The bytes of two logits buffers [R, W] in each row's valid columns (< row_ends), in
    order, a block of rows at a time: (a's, b's) pairs."""
    cols = torch.arange(a.shape[1], device=a.device)
    ends = row_ends.to(a.device).long()
    for r0, r1 in row_blocks(a.shape[0], a.shape[1], a.element_size()):
        valid = cols[None, :] < ends[r0:r1, None]
        yield _bytes(a[r0:r1][valid]), _bytes(b[r0:r1][valid])


def _ops(inp: CaseInputs):
    """The K stage (the writer on the rocm path, the fused pool+K op on the cuda path), Q
    quant and scorer of the case's chain, from the op table."""
    path = inp.case.path
    return tuple(op_of(inp.geo.fmt, stage, path)
                 for stage in ("k_writer" if path == "rocm" else "pool_k", "q_quant", "scorer"))


def _cat(xs: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat(xs) if xs else torch.zeros(0)


class _FusedPool:
    """A backend's pooling and K writer as one launch (`Backend.fused_pool`), seen by the
    runner as the two stages it judges, so each is compared as the split path's is: the
    pooling stage's call launches it (its pooled rows are what the launch stored) and keeps
    the pages; the K stage's first call returns those pages, which the launch wrote from the
    same rows the K stage's reference is given as `k`; each repeat of either launches again."""

    def __init__(self, fn: Callable, write_ins: dict, write_scalars: dict):
        self.fn, self.write_ins, self.write_scalars = fn, write_ins, write_scalars
        self.pool_kw: Optional[dict] = None
        self.pages = None

    def _launch(self) -> dict:
        ins = {k: v.clone() for k, v in self.write_ins.items()}
        return self.fn(**{**self.write_scalars, **ins, **self.pool_kw})

    def pool(self, **pool_kw) -> dict:
        """The pooling stage's call: its inputs and scalars, as compress_pool takes them."""
        self.pool_kw = pool_kw
        out = self._launch()
        if self.pages is None:
            self.pages = out["kv_cache"]
        return {"pooled": out["pooled"]}

    def write(self, **_) -> dict:
        """The K stage's call (its inputs are the pooling stage's and the launch's rows)."""
        pages, self.pages = self.pages, None
        return {"kv_cache": pages if pages is not None else self._launch()["kv_cache"]}


class ChainRun:
    """Runs one case's chain; `recorder(step, op, inputs, scalars, outputs)` sees every
    stage the backend ran (for `mxval dump`). With CHAIN false (a subclass's choice) the
    reference-only chain and its comparisons are left out: only the stages run."""
    CHAIN = True

    def __init__(self, case: Case, backend: Backend, inputs: CaseInputs,
                 recorder: Optional[Callable] = None, clock: Optional[stagetime.StageClock] = None):
        self.case, self.be, self.inp = case, backend, inputs
        self.recorder = recorder
        self.step_tensors: dict[int, memory.StorageSet] = {}    # step -> the case's inputs and what its comparisons read
        self.col = _Collector()
        self.details: dict = {"mismatch_map": [], "pooled_ulp": {}, "logit_log10_err": [],
                              "recall_rows": []}
        self.diff_op = diff_op                 # tests replace it to prove a check's teeth
        self.clock = clock or stagetime.StageClock(backend.device)
        self.nondeterministic: list[dict] = []     # runs of an op that did not repeat its bytes
        self.first_refusal: Optional[NonFiniteStage] = None    # planted: the first stage the reference refused
        self.chain_broken = False                  # planted: the reference-only chain refused its inputs
        self.graphs = graph.Graphs(backend, inputs) if case.graph else None     # graph mode (harness/run/graph.py)

    def call(self, op: str, step: int, ins: dict, scalars: dict, fn: Optional[Callable] = None) -> dict:
        """The backend's outputs of `op` on clones of `ins` (a kernel that writes its pool in
        place must not change `before`): `fn`'s when given (a fused launch, run eagerly), in
        graph mode replayed from the op's graph."""
        if fn is not None:
            return fn(**{k: v.clone() for k, v in ins.items()}, **scalars)
        if self.graphs is not None:
            return self.graphs.call(self, op, step, ins, scalars)
        return getattr(self.be, op)(**{k: v.clone() for k, v in ins.items()}, **scalars)

    def scalars(self, op: str) -> dict:
        """The case's scalars of `op`, with the reference options the backend declares for it
        (`Backend.numerics`: what it computes where the reference offers a choice)."""
        return {**self.inp.scalars(op), **self.be.numerics.get(op, {})}

    def _stage(self, op: str, step: int, ins: dict, *,
               fallback: Optional[Callable[[], dict]] = None, call: Optional[Callable] = None) -> dict:
        """Reference and backend on `ins`; invariants and diff; the backend's outputs. Ops
        outside the case's chain run through the reference only (they feed the ops under test).

        A backend's upstream output the reference cannot take (NaN/inf where the reference's
        own is finite: that upstream stage already failed, with its findings) does not end
        the case: with `fallback` (the same inputs with the reference's upstream output)
        this stage runs and is judged on those, and `details["substituted"]` says so;
        without one, NotJudged: this stage and the rest are not judged, and the case's
        verdict is a failure (budgets.verdict). `call` runs the backend's side in place of
        its op (a fused launch, `_FusedPool`); a fallback runs the backend's op itself.

        In a case that plants non-finite inputs, a stage whose reference refuses its inputs
        still runs the backend on them: its outputs are judged by the invariants alone
        (harness/diff/invariants.py) and feed the next stage, and so is every stage after it;
        the first refusal is the case's `nonfinite_input` reason (`_refused`)."""
        scalars = self.scalars(op)
        try:
            with self.clock("reference"):
                if reference.OPS[op].fp64 and op in self.case.ops:
                    expected = {"logits": reference.OPS[op].fp64(**ins, **scalars)}
                else:
                    expected = reference.OPS[op].fn(**ins, **scalars)
        except NonFiniteInput as e:
            if self.inp.planted:
                return self._refused(op, step, ins, scalars, e, call)
            if fallback is not None:
                self.details.setdefault("substituted", []).append(
                    f"{op} (step {step}): run on the reference's upstream output where the backend's "
                    f"was rejected ({e})")
                return self._stage(op, step, fallback())
            raise NotJudged(op, step, f"not judged: the reference cannot take the backend's upstream "
                                      f"output ({e})") from None
        except ValueError as e:
            raise StageError(op, step, f"the reference rejects the inputs: {e}") from None
        if op not in self.case.ops:
            return expected
        actual, inv = self._backend(op, step, ins, scalars, expected, call)
        if self.first_refusal is not None:
            # downstream of a refused stage the inputs are the backend's outputs on non-finite
            # inputs (a kernel's garbage, which only the invariants judge): so is this stage
            self.col.add(op, step, inv)
            return actual
        try:
            with self.clock("diff"):
                report = self._diff(step, op, ins, scalars, actual, expected)
        except ValueError as e:
            raise StageError(op, step, f"cannot compare the backend's output: {e}") from None
        if report.metrics.get("nonfinite_inputs") and self.inp.planted:
            # the scores the differ judges by are non-finite: the invariants judge alone
            self.col.add(op, step, inv)
            self._refuse(op, step, NonFiniteInput(op, int(report.metrics["nonfinite_inputs"]), []))
            return actual
        self.col.add(op, step, invariants.merge(report, inv))
        if self.recorder:
            self.recorder(step, op, ins, scalars, actual)
        with self.clock("plots"):
            self._details(op, ins, actual, expected)
        return actual

    def _backend(self, op: str, step: int, ins: dict, scalars: dict, expected: Optional[dict],
                 call: Optional[Callable] = None):
        """The backend's outputs of `op` on `ins` (each run `case.repeat` times, every run's
        bytes compared with the first's) and their invariants' report. `expected` None: the
        reference refused the inputs, and so may the backend (NonFiniteInput passes through);
        the op table's outputs are the ones required then."""
        try:
            with self.clock("backend"):
                actual = self.call(op, step, ins, scalars, call)
        except BackendUnavailable:
            raise
        except Exception as e:
            if expected is None and isinstance(e, NonFiniteInput):
                raise
            raise StageError(op, step, f"backend {self.be.name} raised {type(e).__name__}: "
                                       f"{str(e).strip().splitlines()[0] if str(e).strip() else ''}") from None
        need = set(expected) if expected is not None else set(OPS[op].fields.outputs)
        if not isinstance(actual, dict) or need - set(actual):
            raise StageError(op, step, f"backend {self.be.name} returned {type(actual).__name__} "
                                       f"without {sorted(need - set(actual if isinstance(actual, dict) else {}))}")
        for run in range(2, self.case.repeat + 1):
            with self.clock("backend_repeats"):
                again = self.call(op, step, ins, scalars, call)
            with self.clock("repeat_compare"):
                self._same_bytes(op, step, run, actual, again, ins, scalars)
            del again
        # every backend output, whatever the reference says of it (the one place they are checked)
        with self.clock("diff"):
            inv = invariants.check(op, ins, scalars, actual, declared_nonfinite=bool(self.inp.planted))
        return actual, inv

    def _refused(self, op: str, step: int, ins: dict, scalars: dict, err: NonFiniteInput,
                 call: Optional[Callable] = None) -> dict:
        """A stage whose reference refuses the planted case's non-finite inputs: the backend
        runs on them and only the invariants judge its outputs, which feed the next stage. An
        op outside the case's chain (the reference stands in for it), or a backend that
        refuses the inputs too, ends the case here."""
        if op not in self.case.ops:
            raise self.first_refusal or NonFiniteStage(op, step, err)
        try:
            actual, inv = self._backend(op, step, ins, scalars, None, call)
        except NonFiniteInput:
            raise (self.first_refusal or NonFiniteStage(op, step, err)) from None
        self.col.add(op, step, inv)
        self._refuse(op, step, err)
        return actual

    def _refuse(self, op: str, step: int, err: NonFiniteInput) -> None:
        if self.first_refusal is None:
            self.first_refusal = NonFiniteStage(op, step, err)
        self.details.setdefault("refused", []).append(
            f"{op} (step {step}): the reference refuses the inputs ({err}); the backend's outputs are "
            "judged by the invariants alone")

    def _chain_ref(self, fn: Callable):
        """A computation of the reference-only chain. In a case that plants non-finite inputs,
        one the reference refuses ends the whole-chain comparison: None from then on."""
        if self.chain_broken:
            return None
        try:
            with self.clock("reference"):
                return fn()
        except NonFiniteInput:
            if not self.inp.planted:
                raise
            self.chain_broken = True
            return None

    def _diff(self, step: int, op: str, ins: dict, scalars: dict, actual: dict, expected: dict):
        """`diff_op` of a stage (or of the chain); the tensors it reads are the step's."""
        if step not in self.step_tensors:
            self.step_tensors[step] = memory.StorageSet(self.inp)
        self.step_tensors[step].add(ins, actual, expected)
        return self.diff_op(op, ins, scalars, actual, expected)

    def tensor_bytes(self) -> int:
        """The case's tensors: its inputs and the tensors one step's comparisons read (each
        stage's inputs and both sides' outputs, the chain's too), the largest step's,
        counted once per storage."""
        return max((s.bytes() for s in self.step_tensors.values()), default=memory.tensor_bytes(self.inp))

    def _same_bytes(self, op: str, step: int, run: int, first: dict, again, ins: dict, scalars: dict) -> None:
        """Run `run` of a backend op on the same inputs must repeat the first run's bytes;
        each output that does not is a `nondeterministic` finding with the bytes that changed.
        Logits columns past a row's end are unspecified without `clean_logits` (NUMERICS.md
        §6): only the valid region is compared there."""
        for name, a in first.items():
            b = again.get(name) if isinstance(again, dict) else None
            if not isinstance(a, torch.Tensor):
                continue
            if not isinstance(b, torch.Tensor) or b.shape != a.shape or b.dtype != a.dtype:
                changed, where = a.numel() * a.element_size(), "a different shape or dtype"
            elif torch.equal(_bytes(a), _bytes(b.to(a.device))):
                continue                    # every byte repeated: the valid region too
            else:
                b = b.to(a.device)
                valid_only = name == "logits" and not scalars.get("clean_logits") and a.dim() == 2
                changed, total, first = 0, 0, None
                # compared where the outputs are, a block at a time: only counts and the first
                # changed byte are read back
                for x, y in (_valid_bytes(a, b, ins["row_ends"]) if valid_only else _flat_bytes(a, b)):
                    ne = x != y
                    n = int(ne.sum())
                    if n and first is None:
                        i = int(ne.nonzero()[0])
                        first = (total + i, int(x[i]), int(y[i]))
                    changed, total = changed + n, total + x.numel()
                if not changed:
                    continue
                where = (f"{changed} of {total} bytes changed, first at byte {first[0]}: "
                         f"0x{first[1]:02x} in run 1, 0x{first[2]:02x} in run {run}")
            self.nondeterministic.append({"stage": op, "step": step, "class": "nondeterministic", "output": name,
                                          "run": run, "bytes_changed": changed,
                                          "where": f"{op} (step {step}) output {name}: {where}"})

    def _finite_logits(self, sc: str, step: int, logits_b, sins: dict, ref_sins: dict, row_ends):
        """The backend's logits for top-k: NaN/inf inside a row's valid columns (the scorer
        stage fails on them, with their findings) replaced by the reference's logits of the
        same inputs, so that top-k is still judged."""
        if self.inp.planted or sc not in self.case.ops:
            return logits_b
        cols = torch.arange(logits_b.shape[1], device=logits_b.device)
        ends = row_ends.to(logits_b.device).long()

        def bad_of(r0, r1):
            return (cols[None, :] < ends[r0:r1, None]) & ~torch.isfinite(logits_b[r0:r1])
        # looked for a block of rows at a time (one read-back); the full-size mask only when found
        blocks = row_blocks(logits_b.shape[0], logits_b.shape[1], 1)
        if not blocks or not bool(torch.stack([bad_of(r0, r1).any() for r0, r1 in blocks]).any()):
            return logits_b
        bad = bad_of(0, logits_b.shape[0])
        try:
            ref = reference.OPS[sc].fn(**sins, **self.scalars(sc))["logits"]
        except (NonFiniteInput, ValueError):
            ref = reference.OPS[sc].fn(**ref_sins, **self.scalars(sc))["logits"]
        self.details.setdefault("substituted", []).append(
            f"topk (step {step}): {int(bad.sum())} non-finite logit(s) of the backend inside row ends "
            f"replaced by the reference's (the scorer fails on them)")
        return torch.where(bad, ref.to(logits_b.dtype), logits_b)

    def _details(self, op, ins, actual, expected):
        geo = self.inp.geo
        stage = OPS[op].diffed_as
        try:
            if stage == "k_writer":
                self.details["mismatch_map"] += _mismatch_map(ins["kv_cache"], actual["kv_cache"],
                                                              expected["kv_cache"], geo, op)
            elif stage == "pooling":
                rows = ((ins["positions"] + 1) % geo.ratio == 0) & (ins["kv_slot_mapping"] >= 0)
                h = _ulp_hist(actual["pooled"], expected["pooled"], rows)
                for k, v in h.items():
                    self.details["pooled_ulp"][k] = self.details["pooled_ulp"].get(k, 0) + v
            elif stage == "scorer":
                self.details["logit_log10_err"] += _logit_errors(actual["logits"], expected["logits"],
                                                                 ins["row_ends"])
        except Exception as e:   # plots are a convenience; the metrics are the verdict, but say so
            self.details.setdefault("plot_errors", []).append(f"{op}: {type(e).__name__}: {e}")

    def _fused_ins(self, toks, pool) -> dict:
        inp = self.inp
        return dict(state_cache=inp.state_cache, block_table=inp.state_block_table,
                    positions=toks.positions, req_index=toks.req_index, kv_slot_mapping=toks.slot_mapping,
                    cos_sin_cache=inp.cos_sin_cache, norm_weight=inp.norm_weight, kv_cache=pool)

    def run(self) -> None:
        """Every step of the case through the chain: each stage on the backend's upstream
        output, the reference chain alongside, then the whole chain's pool."""
        ops = self.case.ops
        kw, qq, sc = _ops(self.inp)
        need_logits = sc in ops or "topk" in ops
        need_k = kw in ops or need_logits
        self.fused = bool(OPS[kw].fuses)
        self.pool_b = self._history(kw) if need_k else self.inp.kv_cache
        self.inp, self.pool_b = self.inp.after_history(self.pool_b)     # plants the history does not see
        self.pool_start = self.chain_pool = self.pool_b
        self.chain_k, self.chain_pos, self.chain_slot = [], [], []
        for i, st in enumerate(self.inp.steps):
            self._k_step(kw, i, st, need_k)
            if qq in ops or need_logits:
                qins = dict(q=st.q, positions=st.positions, cos_sin_cache=self.inp.cos_sin_cache,
                            weights=st.weights)
                q_b = self._stage(qq, i, qins)
                if need_logits:
                    self._score_step(qq, sc, i, st, qins, q_b)
        if kw in ops and self.chain_k and self.CHAIN and not self.chain_broken:
            self._chain_pool(kw)
        if self.first_refusal is not None:       # every stage ran; the case's outcome is nonfinite_input
            raise self.first_refusal

    def _history(self, kw: str):
        """The pool with each sequence's history written by the reference."""
        with self.clock("inputs"):
            return self._written_history(kw)

    def _written_history(self, kw: str):
        """The history in blocks of tokens: the reference's intermediates (about 8 KiB a
        pooled token) stay within half the case's inputs, never under HISTORY_MIN_TOKENS a
        block. Each token's entry depends on its own window only: the same bytes as one call."""
        inp, h = self.inp, self.inp.history
        if h is None:
            return inp.kv_cache
        pool = inp.kv_cache
        step = max(HISTORY_MIN_TOKENS, memory.tensor_bytes(inp) // (2 * HISTORY_TOKEN_BYTES))
        for a in range(0, h.n, step):
            s = slice(a, a + step)
            part = dataclasses.replace(h, positions=h.positions[s], req_index=h.req_index[s],
                                       slot_mapping=h.slot_mapping[s], k=None if h.k is None else h.k[s])
            pool = self._history_block(kw, part, pool)        # (only the per-token fields are sliced)
        return pool

    def _history_block(self, kw: str, h, pool):
        inp = self.inp
        if self.fused and h.k is None:
            return reference.OPS[kw].fn(**self._fused_ins(h, pool), **self.scalars(kw))["kv_cache"]
        # direct history (h.k given): entries from K rows, no pooling; written by the rocm
        # path's writer on the cuda path too (history is only the pool the steps find)
        wk = op_of(inp.geo.fmt, "k_writer", "rocm") if self.fused else kw
        pooled = h.k if h.k is not None else reference.compress_pool(
            state_cache=inp.state_cache, block_table=inp.state_block_table, positions=h.positions,
            req_index=h.req_index, kv_slot_mapping=h.slot_mapping, **self.scalars("compress_pool"))["pooled"]
        return reference.OPS[wk].fn(k=pooled, positions=h.positions, cos_sin_cache=inp.cos_sin_cache,
                                    norm_weight=inp.norm_weight, slot_mapping=h.slot_mapping,
                                    kv_cache=pool, **self.scalars(wk))["kv_cache"]

    def _k_step(self, kw: str, i: int, st, need_k: bool) -> None:
        """Pooling and the K writer of step i (or the fused pool+K op) on the backend's pool;
        the reference chain writes its own pool from the reference's pooled rows."""
        inp = self.inp
        fused = self._fused_pool(kw, need_k)
        if self.fused:
            if need_k:
                ins = self._fused_ins(st, self.pool_b)
                self.pool_b = self._stage(kw, i, ins)["kv_cache"]
                self.chain_pool = self._chain_ref(lambda: reference.OPS[kw].fn(
                    **{**ins, "kv_cache": self.chain_pool}, **self.scalars(kw))["kv_cache"])
                self._chain_entries(st.req_index, st)
            return
        if "compress_pool" in self.case.ops:          # its inputs do not depend on the backend
            ins = dict(state_cache=inp.state_cache, block_table=inp.state_block_table,
                       positions=st.positions, req_index=st.req_index, kv_slot_mapping=st.slot_mapping)
            pooled_b = self._stage("compress_pool", i, ins, call=fused and fused.pool)["pooled"]
            pooled_ref = self._chain_ref(lambda: reference.compress_pool(**ins, **self.scalars("compress_pool"))["pooled"])
        else:
            pooled_b = pooled_ref = st.k
        if need_k:
            ins = dict(k=pooled_b, positions=st.positions, cos_sin_cache=inp.cos_sin_cache,
                       norm_weight=inp.norm_weight, slot_mapping=st.slot_mapping, kv_cache=self.pool_b)
            self.pool_b = self._stage(kw, i, ins, fallback=lambda: dict(ins, k=pooled_ref),
                                      call=fused and fused.write)["kv_cache"]
            self.chain_pool = self._chain_ref(lambda: reference.OPS[kw].fn(
                **{**ins, "k": pooled_ref, "kv_cache": self.chain_pool}, **self.scalars(kw))["kv_cache"])
            self._chain_entries(pooled_ref, st)

    def _fused_pool(self, kw: str, need_k: bool) -> Optional[_FusedPool]:
        """The backend's one launch of the split path's pooling and K writer, when it offers
        one and the case judges both (docs/paths.md); else None (the two ops run)."""
        fn = self.be.fused_pool.get(kw)
        if fn is None or self.fused or not need_k or not {"compress_pool", kw} <= set(self.case.ops):
            return None
        return _FusedPool(fn, dict(cos_sin_cache=self.inp.cos_sin_cache, norm_weight=self.inp.norm_weight,
                                   kv_cache=self.pool_b), self.scalars(kw))

    def _chain_entries(self, k, st) -> None:
        self.chain_k.append(k)
        self.chain_pos.append(st.positions)
        self.chain_slot.append(st.slot_mapping)

    def _score_step(self, qq: str, sc: str, i: int, st, qins: dict, q_b: dict) -> None:
        """Scoring on the backend's q and pool, top-k of the backend's logits; the reference
        chain scores the reference's q and pool, and both are compared with it."""
        inp, ops = self.inp, self.case.ops
        geo_ins = dict(query_start_loc=st.query_start_loc, context_lens=st.context_lens,
                       block_table=st.block_table, row_ends=st.row_ends)
        qk = ("q_fp8",) if inp.geo.fmt == "fp8" else ("q_fp4", "q_scale")
        sins = dict({n: q_b[n] for n in qk}, weights=q_b["weights"], kv_cache=self.pool_b, **geo_ins)
        q_ref = self._chain_ref(lambda: reference.OPS[qq].fn(**qins, **self.scalars(qq)))
        ref_sins = None if q_ref is None else dict({n: q_ref[n] for n in qk}, weights=q_ref["weights"],
                                                   kv_cache=self.chain_pool, **geo_ins)
        logits_raw = self._stage(sc, i, sins, fallback=lambda: ref_sins)["logits"]
        with self.clock("diff"):
            logits_b = self._finite_logits(sc, i, logits_raw, sins, ref_sins, st.row_ends)
        logits_b = inp.plant_logits(i, logits_b)          # top-k's input plants (scorer not under test)
        if "topk" in ops and not self.scalars(sc).get("clean_logits") and not inp.planted:
            past_ends_outrank(logits_b, st.row_ends)
        idx_b = self._stage("topk", i, dict(logits=logits_b, lengths=st.row_ends))["indices"]
        if not self.CHAIN:
            return
        # after the top-k stage: its reference's fp64 copy of the logits and these never coexist
        chain_logits = self._chain_ref(lambda: reference.OPS[sc].fp64(**ref_sins, **self.scalars(sc)))
        if chain_logits is None:        # planted: the reference-only chain refused its inputs
            return
        if sc in ops:
            with self.clock("diff"):
                self.col.add(CHAIN, i, self._diff(i, sc, sins, self.scalars(sc), {"logits": logits_raw},
                                                    {"logits": chain_logits}))
        if "topk" in ops:
            with self.clock("reference"):
                chain_idx = reference.topk(logits=chain_logits, lengths=st.row_ends, k=inp.geo.topk)["indices"]
            topk_scalars = self.scalars("topk")
            with self.clock("diff"):
                rep = self._diff(i, "topk", dict(logits=chain_logits, lengths=st.row_ends),
                                   topk_scalars, {"indices": idx_b}, {"indices": chain_idx})
            self.col.add(CHAIN, i, rep)
            # the recall plot's rows come with that diff (the same comparison: not run twice)
            rows = getattr(rep, "rows", None)
            if rows is not None and topk_scalars.get("k") == inp.geo.topk:
                self.details["recall_rows"] += _thin(recall_points(rows))
            else:
                self.details["recall_rows"] += _recall_rows(idx_b, chain_logits, st.row_ends, inp.geo.topk)

    def _chain_pool(self, kw: str) -> None:
        """The whole chain's pool against the reference chain's, and the mismatched share
        of the owned K bytes."""
        inp = self.inp
        if self.fused:
            ins = dict(state_cache=inp.state_cache, block_table=inp.state_block_table,
                       positions=_cat(self.chain_pos), req_index=_cat(self.chain_k),
                       kv_slot_mapping=_cat(self.chain_slot), cos_sin_cache=inp.cos_sin_cache,
                       norm_weight=inp.norm_weight, kv_cache=self.pool_start)
        else:
            ins = dict(k=_cat(self.chain_k), positions=_cat(self.chain_pos), cos_sin_cache=inp.cos_sin_cache,
                       norm_weight=inp.norm_weight, slot_mapping=_cat(self.chain_slot), kv_cache=self.pool_start)
        with self.clock("diff"):
            rep = self._diff(len(inp.steps) - 1, kw, ins, self.scalars(kw), {"kv_cache": self.pool_b},
                             {"kv_cache": self.chain_pool})
        self.col.add(CHAIN, len(inp.steps) - 1, rep)
        slots = ins["kv_slot_mapping" if self.fused else "slot_mapping"]
        written = slots[((ins["positions"] + 1) % inp.geo.ratio == 0) & (slots >= 0)]
        d = inp.geo.head_dim
        owned = int(written.unique().numel()) * (layout.entry_bytes(d) if inp.geo.fmt == "mxfp4"
                                                 else ref_fp8.entry_bytes(d))
        mism = rep.metrics.get("page_bytes_mismatched")
        if mism is not None and owned:
            self.col.metrics.setdefault(chain_key("page_bytes_mismatched_frac"), []).append(float(mism) / owned)


def run_case(case: Case, backend_name: str, *, recorder: Optional[Callable] = None,
             inputs: Optional[CaseInputs] = None) -> dict:
    """One row of raw results: outcome in ok | error | nonfinite_input | skipped."""
    t0 = time.time()
    row = case_row(case, backend_name)
    try:
        be = get_backend(backend_name)
    except BackendUnavailable as e:
        row.update(outcome="error", reason=str(e))
        return row
    row["backend"] = be.name
    if case.requires == "gpu" and (str(be.device) == "cpu" or not torch.cuda.is_available()):
        row.update(outcome="skipped", reason=f"needs a GPU (backend {be.name} runs on {be.device})")
        return row
    if case.graph and be.no_graph:
        row.update(outcome="skipped", reason=f"backend {be.name} cannot be replayed from a graph: {be.no_graph}")
        return row
    missing = [op for op in case.ops if not be.supports(op)]
    if missing:
        row.update(outcome="skipped", reason=f"backend {be.name} does not implement {', '.join(missing)}")
        return row
    run = inp = None
    clock = stagetime.StageClock(be.device)
    peak = memory.Peak(be.device).start()
    try:
        with clock("inputs"):
            inp = inputs.to(be.device) if inputs is not None else build(case, be.device)
        row["planted"] = list(inp.planted)
        why = next((w for w in (be.cannot(op, inp.scalars(op)) for op in case.ops) if w), None)
        if why:
            row.update(outcome="skipped", reason=f"backend {be.name}: {why}")
            row["seconds"] = round(time.time() - t0, 3)
            return row
        run = ChainRun(case, be, inp, recorder, clock)
        run.run()
    except NonFiniteStage as e:
        row.update(outcome="nonfinite_input", reason=str(e))
    except NotJudged as e:
        row["not_judged"] = str(e)             # a failure, named by budgets.verdict
    except StageError as e:
        row.update(outcome="error", reason=str(e))
    except (BackendUnavailable, ValueError) as e:
        row.update(outcome="error", reason=str(e).splitlines()[0] if str(e) else type(e).__name__)
    except Exception as e:  # a harness bug must still give a row, with where it happened
        tb = traceback.extract_tb(e.__traceback__)[-1]
        row.update(outcome="error", reason=f"internal error {type(e).__name__}: {e} "
                                           f"({os.path.basename(tb.filename)}:{tb.lineno})")
    with clock("row"):
        if run is not None:
            row["metrics"] = run.col.case_metrics()
            row["findings"] = run.nondeterministic[:ROW_FINDINGS_PER_STAGE] + run.col.findings
            if run.nondeterministic:
                row["nondeterministic"] = [f["where"] for f in run.nondeterministic]
            row["summaries"] = {k: v for k, v in run.col.summaries.items()}
            row["details"] = run.details
    peak.stop()
    if inp is not None:
        row["tensor_bytes"] = run.tensor_bytes() if run else memory.tensor_bytes(inp)
        run = inp = None                 # the case's tensors released: what stays allocated is the process's
        row["gpu_peak_bytes"] = peak.own()
        if peak.kept:
            row["details"]["gpu_kept_bytes"] = peak.kept
    if clock.on:
        row["details"]["stage_seconds"] = clock.record()
        if clock.cuda:
            row["details"]["stage_peak_bytes"] = dict(clock.peaks)
    row["seconds"] = round(time.time() - t0, 3)
    return row


# --- many cases: mxval's own worker pool -----------------------------------------------------
#
# One task at a time per worker, over a pipe: the parent always knows which case each
# worker runs, so a worker that dies (os._exit, SIGKILL, the OOM killer, a device fault that
# takes the process down) costs exactly its case, reported as an error row; the other
# workers finish, a replacement worker takes the dead one's GPU, no case runs twice and
# none is lost. Workers ignore SIGINT: Ctrl-C reaches the parent, which cancels the
# queued cases, terminates the workers and raises RunInterrupted with the finished rows.

# Test hook (tests/test_pool.py): the worker given this case dies before running it,
# `NAME` by os._exit, `NAME:kill` by SIGKILL. Read only inside pool workers.
DIE_ENV = "MXVAL_TEST_WORKER_DIE"
STOP_GRACE_S = 2.0              # SIGTERM, then SIGKILL after this long


class RunInterrupted(KeyboardInterrupt):
    """SIGINT during `run_cases`: `rows` are the finished cases' rows (in case order),
    `cancelled` the names of the cases that did not finish (queued or running)."""

    def __init__(self, rows: list[dict], cancelled: list[str], done: Optional[list[int]] = None):
        super().__init__(f"interrupted: {len(rows)} case(s) finished, {len(cancelled)} cancelled")
        self.rows, self.cancelled = rows, cancelled
        self.done = list(range(len(rows))) if done is None else done     # indices of `rows` in the cases


def _visible_gpus() -> tuple[str, list[str]]:
    """(the variable that names the visible GPUs, their ids). HIP_VISIBLE_DEVICES wins on
    ROCm when both are set, CUDA_VISIBLE_DEVICES elsewhere; neither set: every device."""
    hip = bool(getattr(torch.version, "hip", None))
    order = ("HIP_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES") if hip else ("CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES")
    for var in order:
        env = os.environ.get(var)
        if env:
            return var, [d.strip() for d in env.split(",") if d.strip()]
    return order[0], [str(i) for i in range(torch.cuda.device_count())]


def worker_env(slot: int, var: str, devices: list[str]) -> dict[str, Optional[str]]:
    """The environment changes of worker `slot`: one GPU each, round-robin over `devices`
    (None: unset the variable). No devices (the CPU): no change."""
    if not devices:
        return {}
    other = "CUDA_VISIBLE_DEVICES" if var == "HIP_VISIBLE_DEVICES" else "HIP_VISIBLE_DEVICES"
    return {var: devices[slot % len(devices)], other: None}


def _maybe_die(case_name: str) -> None:
    spec = os.environ.get(DIE_ENV)
    if not spec:
        return
    name, _, how = spec.partition(":")
    if name != case_name:
        return
    if how == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if how == "hang":                    # a hung kernel: only --case-timeout ends it
        while True:
            time.sleep(60)
    os._exit(71)


def cpus() -> int:
    """The CPUs this process may run on."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _worker_main(conn, env: dict, threads: int) -> None:
    """A pool worker: pinned to its GPU before CUDA initializes (and capped at its share of
    it, `memory.FRACTION_ENV`, before any case allocates), then one case per message until
    it gets None (or the parent goes away)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if hasattr(signal, "SIGHUP"):                      # a closed terminal reaches the group: the parent stops us
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)      # the parent's stop (a forked child inherits its handler)
    for k, v in env.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    if env and memory.fraction() and torch.cuda.is_available():     # a GPU worker (env pins its GPU)
        memory.apply_fraction("cuda")
    torch.set_num_threads(max(1, threads))
    parent = os.getppid()
    while True:
        try:
            while not conn.poll(1.0):
                if os.getppid() != parent:       # the parent died without telling us
                    return
            msg = conn.recv()
        except (EOFError, OSError):
            return
        if msg is None:
            return
        i, case, backend_name = msg
        _maybe_die(case.name)
        try:
            row = run_case(case, backend_name)
        except Exception as e:     # run_case catches its own; this is a last line
            row = _error_row(case, backend_name, f"worker failed: {type(e).__name__}: {e}")
        conn.send((i, row))


def _error_row(c: Case, backend_name: str, reason: str) -> dict:
    return case_row(c, backend_name, outcome="error", reason=reason)


def _death(proc) -> str:
    code = proc.exitcode
    if code is not None and code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"killed by {name}" + (" (out of memory?)" if -code == signal.SIGKILL else "")
    return f"exited with code {code}"


class _Worker:
    def __init__(self, ctx, slot: int, env: dict, threads: int):
        self.slot, self.env = slot, env
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_worker_main, args=(child, env, threads), daemon=True,
                                name=f"mxval-worker-{slot}")
        self.proc.start()
        child.close()
        self.busy: Optional[int] = None
        self.started = 0.0                   # when it got its case
        self.timed_out: Optional[float] = None

    def where(self) -> str:
        gpu = next((v for v in self.env.values() if v is not None), None)
        return f"worker {self.slot} (pid {self.proc.pid}{', GPU ' + gpu if gpu else ''})"


def _stop(workers: list, *, grace: float = STOP_GRACE_S) -> None:
    for w in workers:
        if w.proc.is_alive():
            w.proc.terminate()
    deadline = time.time() + grace
    for w in workers:
        w.proc.join(max(0.0, deadline - time.time()))
        if w.proc.is_alive():
            w.proc.kill()
            w.proc.join(1.0)
        w.conn.close()


# A case whose `geometry.footprint` is at most this shares a GPU with the other workers'
# (8 workers of such cases peak at about 8 GiB together, at 4x their tensors); a larger one
# runs in the parent process, one at a time, with the GPU's memory to itself but for them.
SMALL_CASE_BYTES = 256 << 20


def run_cases(cases: list[Case], backend_name: str, *, jobs: int = 1,
              progress: Optional[Callable[[dict], None]] = None, start_method: Optional[str] = None,
              case_timeout: Optional[float] = None, prefetch: Optional[bool] = None,
              local: Optional[list[int]] = None) -> list[dict]:
    """Rows of every case, in case order. `jobs > 1` runs cases in mxval's worker pool:
    forked on the CPU (so backends registered at run time are inherited), spawned on GPUs
    with each worker pinned to one visible device, round-robin (`start_method` overrides
    fork/spawn: the tests run the GPU path's spawn on the CPU). On a GPU without
    `memory.FRACTION_ENV`, the workers share the GPU and take only the small cases
    (`SMALL_CASE_BYTES`); this process runs the others meanwhile, one at a time (`local`,
    indices of `cases`, overrides that choice). `case_timeout` (seconds): a case still
    running after it has its worker killed and is an error row (a hung kernel costs one
    case, not the run); it runs every case in the pool, even at `jobs = 1`.
    `prefetch` (default: on a GPU backend): the next case this process runs has its inputs
    built on the CPU in a thread while the current one runs (`_prebuild`).
    Ctrl-C: RunInterrupted."""
    be = get_backend(backend_name)
    if case_timeout is not None and not case_timeout > 0:
        raise ValueError(f"case_timeout: expected a positive number of seconds, got {case_timeout}")
    prefetch = _on_gpu(be) if prefetch is None else prefetch
    if (jobs <= 1 or len(cases) <= 1) and case_timeout is None:
        return _run_in_turn(cases, be, backend_name, progress, prefetch)
    if local is None:
        local = _large_cases(cases) if _on_gpu(be) and memory.fraction() is None and case_timeout is None else []
    if len(local) == len(cases):
        return _run_in_turn(cases, be, backend_name, progress, prefetch)
    return _Pool(cases, be, backend_name, jobs=jobs, progress=progress, start_method=start_method,
                 case_timeout=case_timeout, local=local, prefetch=prefetch).run()


def _large_cases(cases: list[Case]) -> list[int]:
    """Indices of the cases too large to share a GPU with the pool's workers."""
    out = []
    for i, c in enumerate(cases):
        try:
            big = footprint(c) > SMALL_CASE_BYTES
        except Exception:          # a case error: run_case reports it, wherever it runs
            big = False
        if big:
            out.append(i)
    return out


def _on_gpu(be: Backend) -> bool:
    return str(be.device) != "cpu" and torch.cuda.is_available()


def _prebuild(case: Case, be: Backend) -> Optional[CaseInputs]:
    """The case's inputs built on the CPU, the same bytes `build(case, be.device)` gives
    (run_case moves them to the device); None where only run_case can build them: a pool
    filled on the device, a case run_case skips, or an input error (run_case reports it)."""
    try:
        if (filled_on_device(case) or not all(be.supports(op) for op in case.ops)
                or (case.requires == "gpu" and not _on_gpu(be))):
            return None
        return build(case, "cpu")
    except Exception:
        return None


class _Background:
    """`fn(*args)` on a daemon thread; `result()` waits for it (re-raising its exception).

    The wait is a `join` with a timeout, which a signal interrupts: Ctrl-C or SIGTERM reach
    the main thread at once even while the case is inside one long native call (a kernel, a
    host op over GiBs), where a call on the main thread would hold the signal's handler
    until it returns. A thread left running when the run stops is `abandoned()`."""

    def __init__(self, fn: Callable, *args, **kw):
        self._box: dict = {}

        def target():
            try:
                self._box["value"] = fn(*args, **kw)
            except BaseException as e:       # handed to the waiting thread
                self._box["error"] = e
        self.thread = threading.Thread(target=target, daemon=True, name="mxval-case")
        self.thread.start()

    def result(self):
        try:
            while self.thread.is_alive():
                self.thread.join(0.5)
        except BaseException:
            _LEFT.append(self.thread)
            raise
        if "error" in self._box:
            raise self._box["error"]
        return self._box["value"]

    def leave(self) -> None:
        """Not waited for: the run stopped before its result was needed."""
        _LEFT.append(self.thread)


_LEFT: list[threading.Thread] = []


def abandoned() -> bool:
    """Whether a stopped run left a case (or a case's inputs) on a thread it did not wait
    for: the process should then end with os._exit once its report is written, neither
    waiting for that case nor tearing torch down under it (a normal exit after a thread
    left mid-case aborts in torch's C++ teardown, even once the thread has ended)."""
    return bool(_LEFT)


def _run_in_turn(cases: list[Case], be: Backend, backend_name: str, progress, prefetch: bool) -> list[dict]:
    """Each case in this process, in order, on a worker thread the main thread waits for (a
    signal is handled at once: `_Background`); with `prefetch`, the next case's inputs are
    built on another thread meanwhile (input generation is CPU work; the case's is mostly
    the GPU's)."""
    rows: list[dict] = []
    each = _with_inputs(cases, be, prefetch)
    try:
        for c, inputs in each:
            rows.append(_Background(run_case, c, backend_name, inputs=inputs).result())
            if progress:
                progress(rows[-1])
    except KeyboardInterrupt:
        each.close()
        raise RunInterrupted(rows, [c.name for c in cases[len(rows):]]) from None
    return rows


def _with_inputs(cases: list[Case], be: Backend, prefetch: bool):
    """(case, its inputs) in order: with `prefetch` the inputs are built on a thread
    (`_prebuild`) while the case before runs, else None (run_case builds them). Closed
    early, it leaves the build in progress (`_Background.leave`)."""
    nxt = _Background(_prebuild, cases[0], be) if prefetch and cases else None
    try:
        for i, c in enumerate(cases):
            inputs = nxt.result() if nxt else None
            nxt = _Background(_prebuild, cases[i + 1], be) if prefetch and i + 1 < len(cases) else None
            yield c, inputs
    finally:
        if nxt is not None:
            nxt.leave()


class _Local:
    """This process as one more lane of the pool: `indices` of `cases` run one at a time on a
    thread (each case's inputs prebuilt on another while the one before runs, with
    `prefetch`), each row sent down a pipe the pool waits on like a worker's."""

    def __init__(self, cases: list[Case], indices: list[int], be: Backend, backend_name: str, prefetch: bool):
        self.cases, self.indices, self.be, self.backend_name, self.prefetch = cases, indices, be, backend_name, prefetch
        self.conn, self._send = mp.Pipe(duplex=False)
        self.left = len(indices)
        self.thread = threading.Thread(target=self._loop, daemon=True, name="mxval-local")
        self.thread.start()

    def _loop(self) -> None:
        each = _with_inputs([self.cases[i] for i in self.indices], self.be, self.prefetch)
        for i, (case, inputs) in zip(self.indices, each):
            try:
                row = run_case(case, self.backend_name, inputs=inputs)
            except Exception as e:     # run_case catches its own; this is a last line
                row = _error_row(case, self.backend_name, f"failed: {type(e).__name__}: {e}")
            self._send.send((i, row))

    def receive(self) -> tuple[int, dict]:
        self.left -= 1
        return self.conn.recv()

    def leave(self) -> None:
        """Not waited for: the run stopped (see `abandoned`)."""
        if self.thread.is_alive():
            _LEFT.append(self.thread)


class _Pool:
    """mxval's worker pool over one list of cases (see above): `run()` -> the rows in case order."""

    def __init__(self, cases: list[Case], be: Backend, backend_name: str, *, jobs: int,
                 progress: Optional[Callable[[dict], None]], start_method: Optional[str],
                 case_timeout: Optional[float], local: list[int], prefetch: bool):
        self.cases, self.be, self.backend_name = cases, be, backend_name
        self.progress, self.case_timeout = progress, case_timeout
        gpu = _on_gpu(be)
        # spawned beside a local lane too: a fork while its thread runs torch could copy a held lock
        self.ctx = mp.get_context(start_method or ("spawn" if gpu or local else "fork"))
        self.var, self.devices = _visible_gpus() if gpu else ("", [])
        self.local_indices, self.prefetch = sorted(local), prefetch
        self.local: Optional[_Local] = None
        self.n = min(jobs, len(cases) - len(local))
        # A forked worker stays on one intra-op thread: the parent's OpenMP pool does not survive
        # fork (libgomp), and the child's first parallel region would hang (seen in CI with two
        # threads per worker). Spawned workers start clean.
        forked = self.ctx.get_start_method() == "fork"
        self.threads = 1 if gpu or forked else max(1, cpus() // self.n)
        self.queue = deque(sorted(set(range(len(cases))) - set(local)))
        self.out: dict[int, dict] = {}
        self.workers: list = []

    def finished(self, i: int, row: dict) -> None:
        self.out[i] = row
        if self.progress:
            self.progress(row)

    def feed(self, w: _Worker) -> None:
        while self.queue:
            i = self.queue.popleft()
            try:
                w.conn.send((i, self.cases[i], self.backend_name))
            except (BrokenPipeError, OSError):
                self.queue.appendleft(i)          # never received: it runs elsewhere
                return
            w.busy = i
            w.started = time.time()
            return
        w.busy = None

    def run(self) -> list[dict]:
        try:
            for slot in range(self.n):
                self.workers.append(_Worker(self.ctx, slot, worker_env(slot, self.var, self.devices), self.threads))
                self.feed(self.workers[-1])
            if self.local_indices:              # after the workers started: they import while it runs
                self.local = _Local(self.cases, self.local_indices, self.be, self.backend_name, self.prefetch)
            while len(self.out) < len(self.cases):
                self._turn()
        except KeyboardInterrupt:
            if self.local is not None:
                self.local.leave()
            _stop([w for w in self.workers if not isinstance(w, _Dead)])
            done = sorted(self.out)
            raise RunInterrupted([self.out[i] for i in done],
                                 [c.name for i, c in enumerate(self.cases) if i not in self.out], done) from None
        except BaseException:
            if self.local is not None:
                self.local.leave()
            _stop([w for w in self.workers if not isinstance(w, _Dead)])
            raise
        self._close()
        return [self.out[i] for i in range(len(self.cases))]

    def _turn(self) -> None:
        """Wait up to a second; kill the workers past --case-timeout, read finished rows,
        reap dead workers (an error row for the case each held) and replace them."""
        live = [w for w in self.workers if w.proc is not None]
        lane = [self.local.conn] if self.local is not None and self.local.left else []
        ready = set(wait([w.conn for w in live] + [w.proc.sentinel for w in live] + lane, timeout=1.0))
        if lane and lane[0] in ready:
            self.finished(*self.local.receive())
        now = time.time()
        for w in live:
            # a worker whose row is already in its pipe finished in time: read, not killed
            if (self.case_timeout is not None and w.busy is not None and w.timed_out is None
                    and now - w.started > self.case_timeout and w.proc.is_alive() and not _has_row(w.conn)):
                w.timed_out = self.case_timeout
                w.proc.kill()
                w.proc.join(5.0)
        for w in live:
            if w.conn in ready and w.timed_out is None:
                try:
                    i, row = w.conn.recv()
                except (EOFError, OSError):
                    pass                         # gone: reaped below once it has exited
                else:
                    w.busy = None
                    self.finished(i, row)
                    self.feed(w)
                    if w.busy is not None:
                        continue
            if not w.proc.is_alive():
                self._reap(w)

    def _reap(self, w: _Worker) -> None:
        w.proc.join()
        if w.busy is not None:
            c = self.cases[w.busy]
            why = (f"still running after --case-timeout {w.timed_out:g} s: its worker was killed"
                   if w.timed_out is not None else f"died while running this case: {_death(w.proc)}")
            self.finished(w.busy, _error_row(c, self.be.name, f"{w.where()} {why}"))
            w.busy = None
        w.conn.close()
        if self.queue:
            nw = _Worker(self.ctx, w.slot, w.env, self.threads)
            self.workers[self.workers.index(w)] = nw
            self.feed(nw)
        else:
            self.workers[self.workers.index(w)] = _Dead(w)

    def _close(self) -> None:
        live = [w for w in self.workers if not isinstance(w, _Dead)]
        for w in live:
            try:
                w.conn.send(None)
            except (BrokenPipeError, OSError):
                pass
        deadline = time.time() + 5.0
        for w in live:
            w.proc.join(max(0.0, deadline - time.time()))
        _stop(live)


def _has_row(conn) -> bool:
    try:
        return conn.poll()
    except (EOFError, OSError):
        return False


class _Dead:
    """A slot whose worker died when nothing was left to run."""

    def __init__(self, w: _Worker):
        self.slot, self.env, self.proc, self.busy = w.slot, w.env, None, None
